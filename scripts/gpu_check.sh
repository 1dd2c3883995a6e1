#!/usr/bin/env bash
# The GPU check: how every GPU claim of llamarl gets verified on the project's H200 (offline).
#
#   OUT=/some/dir [BUDGET=540] [TESTS=1] [BENCHES="weight_sync aipo_loss ..."] [TRAIN=1] \
#     bash scripts/gpu_check.sh
#
# BENCHES picks benchmarks (default: all GPU ones; "none" for none); TESTS=0 skips the gpu tests and
# TESTS_K="expr" selects some of them (pytest -k); TRAIN=0 skips the training loop, SCALEOUT=0 the
# sharded trainer + TP generator run on one GPU;
# BENCH_ARGS_<name>="..." passes arguments to one benchmark and
# LIMIT_<name> (tests, train, a benchmark) overrides a stage's timeout in seconds. BUDGET is the
# wall-clock budget in seconds: every stage's timeout is cut to what is left of it, and stages that would
# start with under 20 s left are skipped, so that the files under $OUT are always complete when a device
# command's limit (10 minutes) ends it.
#
# 1. installs the few Python wheels the GPU machine lacks from a carried wheelhouse (.wheels/, made
#    here with `bash scripts/fetch_gpu_wheels.sh`; the GPU machine has no network),
# 2. builds llamarl._C in place with nvcc (sm_90 SASS + PTX by default), offline,
# 3. runs the `gpu`-marked tests, the GPU benchmarks and the training loop on CUDA,
# 4. writes at most eight files under $OUT, appended as each stage ends: summary.txt, build.log,
#    tests.log, benchmarks.md (every benchmark's table), benchmarks.json, logs.txt (benchmark/train
#    output), plus train_summary.json and scaleout_summary.json.
#
# PLAN=kernels / PLAN=loops: the two device calls that together fit one session's 15 minutes of device
# time (start-up, ~1 min, and the transfers included); each only sets defaults, so any variable above
# still overrides it. Give each call timeout_s = BUDGET + 40, issue the loops call AT ONCE after the
# kernels call returns (the machine stays warm only ~30 s after a call: a fresh one costs another start-up,
# and the loops call would then spend its budget rebuilding _C), and give the machine back after it.
#   kernels: build, gpu tests (IPC/graph tests first, the compile-heavy quant grid last),
#            quant_matmul (quantize table, then the launch-config sweep), generation   (BUDGET 400 s)
#   loops:   weight_sync (no baselines: measured 11-30), quant_quality, aipo_loss at N=16384 and 4096
#            (ours, floor, eager), the training loop and the scale-out run on CUDA      (BUDGET 280 s)
# Before the FIRST device call, warm the cache here (`bash scripts/gpu_check.sh warm-cache`, CPU, 1-2 min on
# 2 cores) and carry .wheels and .cache in both calls: the training loop then skips its warm start (the cache
# key does not depend on the device).
set -uo pipefail
cd "$(dirname "$0")/.."
export LLAMARL_CACHE_DIR=${LLAMARL_CACHE_DIR:-$PWD/.cache}
if [ "${1:-}" = "warm-cache" ]; then  # on the CPU host: the warm start the loops plan's runs start from
  for args in "--max-steps 1" "--preset smoke --max-steps 1"; do
    # shellcheck disable=SC2086
    python3 -m llamarl.train $args --set run.device=cpu --out "$(mktemp -d)/run" > /dev/null || exit 1
  done
  echo "warm start cached under $LLAMARL_CACHE_DIR (carry .cache)"; exit 0
fi
case "${PLAN:-}" in
  kernels)
    : "${BUDGET:=400}" "${LIMIT_tests:=110}" "${BENCHES:=quant_matmul generation}" "${TRAIN:=0}" "${SCALEOUT:=0}"
    : "${BENCH_ARGS_quant_matmul:=--sweep}" "${LIMIT_quant_matmul:=140}" "${LIMIT_generation:=110}" ;;
  loops)
    : "${BUDGET:=280}" "${TESTS:=0}" "${BENCHES:=weight_sync quant_quality aipo_loss}" "${LIMIT_weight_sync:=40}"
    : "${BENCH_ARGS_weight_sync:=--no-baselines}" "${LIMIT_quant_quality:=60}"
    : "${BENCH_ARGS_aipo_loss:=--sizes 16384 4096 --no-compile --no-liger}"
    : "${LIMIT_aipo_loss:=60}" "${TRAIN_STEPS:=30}" "${LIMIT_train:=50}" "${LIMIT_scaleout:=60}" ;;
  "") ;;
  *) echo "gpu_check.sh: unknown PLAN=$PLAN (kernels or loops)" >&2; exit 2 ;;
esac
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
# LLAMARL_BUILD_CUDA=1: a missing nvcc fails the build instead of silently building a CPU-only _C
export PYTHONUNBUFFERED=1 LLAMARL_CUDA_ARCHS=${LLAMARL_CUDA_ARCHS:-90} LLAMARL_BUILD_CUDA=${LLAMARL_BUILD_CUDA:-1}
START=$SECONDS
BUDGET=${BUDGET:-540}
BENCH_TMP=$(mktemp -d)
summary() { echo "[$((SECONDS - START))s] $*" | tee -a "$OUT/summary.txt"; }
left() { echo $((BUDGET - (SECONDS - START))); }
limit() {  # the stage limit $1 cut to the budget left; empty when under 20 s are left
  local l; l=$(left); [ "$l" -lt 20 ] && return 1; [ "$1" -lt "$l" ] && echo "$1" || echo "$l"
}
: > "$OUT/summary.txt"; : > "$OUT/logs.txt"; : > "$OUT/benchmarks.md"

summary "date: $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee -a "$OUT/summary.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a "$OUT/summary.txt"

if [ -d .wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir .wheels/*.whl > "$OUT/build.log" 2>&1 \
    || summary "wheelhouse install FAILED (see build.log)"
fi
# a warm machine keeps the in-place build (ignored files stay): rebuild only when the sources changed
STAMP=build/.gpu_check_stamp
SRC_HASH=$(cat setup.py csrc/* | sha256sum | cut -d' ' -f1)
cuda_build() { python3 -c 'import llamarl._C as C, sys; sys.exit(0 if C.build_info().get("cuda") else 1)' 2>/dev/null; }
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SRC_HASH" ] && cuda_build; then
  summary "build: kept (sources unchanged) $(python3 -c 'import llamarl._C as C; print(C.build_info())')"
elif python3 -m pip install --no-build-isolation --no-deps -e . >> "$OUT/build.log" 2>&1 && cuda_build; then
  mkdir -p build && echo "$SRC_HASH" > "$STAMP"
  summary "build: ok $(python3 -c 'import llamarl._C as C; print(C.build_info())')"
else
  summary "build: FAILED or without CUDA (see build.log)"; tail -n 30 "$OUT/build.log"; exit 1
fi

if [ "${TESTS:-1}" != "0" ] && t=$(limit "${LIMIT_tests:-150}"); then
  # SIGINT first: pytest then still prints its failures and summary (SIGTERM would lose them); -v names
  # every test as it ends, so a stage cut off by its limit still says how far it got
  # files in this order: the CUDA IPC / graph / engine tests first, the compile-heavy quant grid last
  gpu_files=()
  for f in tests/test_weight_sync_buckets.py tests/test_weight_sync_multiproc.py tests/test_native.py \
           tests/test_generation.py $(grep -l "mark.gpu" tests/test_*.py); do
    [ "$f" = tests/test_quant.py ] && continue
    case " ${gpu_files[*]} " in *" $f "*) ;; *) gpu_files+=("$f") ;; esac
  done
  gpu_files+=(tests/test_quant.py)
  per_test=(); python3 -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout 60)  # (if the plugin is there)
  timeout -s INT -k 20 "$t" python3 -m pytest -m gpu ${TESTS_K:+-k "$TESTS_K"} -v -p no:cacheprovider -o addopts="" \
    ${per_test[@]+"${per_test[@]}"} -rfE --durations=10 "${gpu_files[@]}" > "$OUT/tests.log" 2>&1
  summary "gpu tests: exit $? — $(grep -v '^[[:space:]]*$' "$OUT/tests.log" | tail -n 1)"
elif [ "${TESTS:-1}" != "0" ]; then
  summary "gpu tests: skipped (budget)"
fi

run_bench() {  # name, timeout seconds
  local name=$1 t args_var="BENCH_ARGS_$1"
  if ! t=$(limit "$2"); then summary "bench $name: skipped (budget)"; return; fi
  # shellcheck disable=SC2086
  if OUT="$BENCH_TMP" timeout -k 10 "$t" python3 -m "benchmarks.$name" ${!args_var:-} > "$BENCH_TMP/$name.log" 2>&1; then
    summary "bench $name: ok"
  else
    summary "bench $name: FAILED (exit $?), last lines:"; tail -n 15 "$BENCH_TMP/$name.log" | tee -a "$OUT/summary.txt"
  fi
  { echo "===== $name"; cat "$BENCH_TMP/$name.log"; } >> "$OUT/logs.txt"
  cat "$BENCH_TMP"/*.md > "$OUT/benchmarks.md" 2>/dev/null
  python3 - "$BENCH_TMP" "$OUT/benchmarks.json" <<'PY'
import json, pathlib, sys
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
dst.write_text(json.dumps({p.stem: json.loads(p.read_text()) for p in sorted(src.glob("*.json"))}, indent=1))
PY
}
# each benchmark's default mode is its full, GPU-sized one
declare -A LIMIT=([weight_sync]=90 [aipo_loss]=150 [quant_matmul]=60 [generation]=120 [quant_quality]=60)
BENCHES=${BENCHES:-weight_sync quant_matmul aipo_loss generation quant_quality}
[ "$BENCHES" = "none" ] && BENCHES=""
for name in $BENCHES; do l="LIMIT_$name"; run_bench "$name" "${!l:-${LIMIT[$name]:-90}}"; done

# the training loop on the GPU: trainer and generator processes sharing the card, weights via CUDA IPC
if [ "${TRAIN:-1}" = "0" ]; then
  summary "train on cuda: skipped (TRAIN=0)"
elif ! t=$(limit "${LIMIT_train:-150}"); then
  summary "train on cuda: skipped (budget)"
elif timeout -k 15 "$t" python3 -m llamarl.train --out "$BENCH_TMP/train" --max-steps "${TRAIN_STEPS:-100}" \
     --set run.device=cuda > "$BENCH_TMP/train.log" 2>&1; then
  summary "train on cuda: ok"; cp "$BENCH_TMP/train/summary.json" "$OUT/train_summary.json"
  { echo "===== train"; tail -n 40 "$BENCH_TMP/train.log"; } >> "$OUT/logs.txt"
else
  summary "train on cuda: FAILED, last lines:"; tail -n 15 "$BENCH_TMP/train.log" | tee -a "$OUT/summary.txt"
  { echo "===== train"; tail -n 80 "$BENCH_TMP/train.log"; } >> "$OUT/logs.txt"
fi
# issue #5 on one GPU: a 2-rank FSDP trainer and a 2-rank TP generator share the card (their groups run
# over gloo: NCCL needs one GPU per rank), weights resharded straight into the generator's CUDA IPC buckets
if [ "${SCALEOUT:-1}" = "0" ]; then
  summary "scale-out on one gpu: skipped (SCALEOUT=0)"
elif ! t=$(limit "${LIMIT_scaleout:-120}"); then
  summary "scale-out on one gpu: skipped (budget)"
elif timeout -k 15 "$t" python3 -m llamarl.train --preset smoke --out "$BENCH_TMP/scaleout" --max-steps 20 \
     --set run.device=cuda --set trainer.ranks=2 --set generator.tp=2 > "$BENCH_TMP/scaleout.log" 2>&1; then
  summary "scale-out on one gpu: ok"; cp "$BENCH_TMP/scaleout/summary.json" "$OUT/scaleout_summary.json"
  { echo "===== scaleout"; tail -n 40 "$BENCH_TMP/scaleout.log"; } >> "$OUT/logs.txt"
else
  summary "scale-out on one gpu: FAILED, last lines:"; tail -n 15 "$BENCH_TMP/scaleout.log" | tee -a "$OUT/summary.txt"
  { echo "===== scaleout"; tail -n 80 "$BENCH_TMP/scaleout.log"; } >> "$OUT/logs.txt"
fi
summary "done; results in $OUT"
