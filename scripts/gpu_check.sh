#!/usr/bin/env bash
# The GPU check: how every GPU claim of llamarl gets verified on the project's H200 (offline).
#
#   OUT=/some/dir [BENCHES="weight_sync aipo_loss ..."] [TRAIN=0] bash scripts/gpu_check.sh [--quick]
#
# --quick: build + gpu tests only. BENCHES picks benchmarks (default: all GPU ones); TRAIN=0 skips the
# training-loop run. A device command may run 10 minutes at most: pick a subset that fits.
#
# 1. installs the Python dependencies the GPU machine lacks from a carried wheelhouse (.wheels/, made
#    here with `bash scripts/fetch_gpu_wheels.sh`; no network on the GPU machine),
# 2. builds llamarl._C in place with nvcc (sm_80/sm_90 + PTX), offline,
# 3. runs the `gpu`-marked tests, then the GPU benchmarks,
# 4. writes at most a handful of files under $OUT (the device tool returns <= 8):
#    build.log, tests.log, benchmarks.md (all benchmark tables), benchmarks.json, summary.txt,
#    train_summary.json (the training loop on the GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
QUICK=${1:-}
export PYTHONUNBUFFERED=1
BENCH_TMP=$(mktemp -d)
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"

summary "date: $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee -a "$OUT/summary.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a "$OUT/summary.txt"

if [ -d .wheels ]; then
  python3 -m pip install --no-index --find-links .wheels --no-deps .wheels/*.whl > "$OUT/build.log" 2>&1 \
    || summary "wheelhouse install FAILED (see build.log)"
fi
if python3 -m pip install --no-build-isolation --no-deps -e . >> "$OUT/build.log" 2>&1; then
  summary "build: ok $(python3 -c 'import llamarl._C as C; print(C.build_info())')"
else
  summary "build: FAILED (see build.log)"; exit 1
fi

timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests > "$OUT/tests.log" 2>&1
summary "gpu tests: exit $? — $(tail -n 1 "$OUT/tests.log")"

run_bench() {  # name, timeout seconds, args...
  local name=$1 t=$2; shift 2
  if OUT="$BENCH_TMP" timeout "$t" python3 -m "benchmarks.$name" "$@" > "$BENCH_TMP/$name.log" 2>&1; then
    summary "bench $name: ok"
  else
    summary "bench $name: FAILED (exit $?), last lines:"; tail -n 15 "$BENCH_TMP/$name.log" | tee -a "$OUT/summary.txt"
  fi
}
if [ "$QUICK" != "--quick" ]; then
  # each benchmark's default mode is its full, GPU-sized one
  declare -A LIMIT=([weight_sync]=120 [aipo_loss]=150 [quant_matmul]=90 [generation]=150 [quant_quality]=90)
  for name in ${BENCHES:-weight_sync aipo_loss quant_matmul generation quant_quality}; do
    run_bench "$name" "${LIMIT[$name]:-120}"
  done

  # the training loop on the GPU: trainer and generator processes sharing the card, weights via CUDA IPC
  if [ "${TRAIN:-1}" = "0" ]; then
    summary "train on cuda: skipped (TRAIN=0)"
  elif timeout 240 python3 -m llamarl.train --out "$BENCH_TMP/train" --max-steps 100 --set run.device=cuda \
       > "$BENCH_TMP/train.log" 2>&1; then
    summary "train on cuda: ok"; cp "$BENCH_TMP/train/summary.json" "$OUT/train_summary.json"
  else
    summary "train on cuda: FAILED, last lines:"; tail -n 15 "$BENCH_TMP/train.log" | tee -a "$OUT/summary.txt"
  fi
fi

cat "$BENCH_TMP"/*.md > "$OUT/benchmarks.md" 2>/dev/null || true
python3 - "$BENCH_TMP" "$OUT/benchmarks.json" <<'PY'
import json, pathlib, sys
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
dst.write_text(json.dumps({p.stem: json.loads(p.read_text()) for p in sorted(src.glob("*.json"))}, indent=1))
PY
echo "results in $OUT"
