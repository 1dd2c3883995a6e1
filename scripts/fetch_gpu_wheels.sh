#!/usr/bin/env bash
# Downloads, on a machine with network, the few pure-Python wheels that the offline GPU machine
# (Python 3.12, x86_64) lacks, into .wheels/ (git-ignored; carry it with the device tool's `carry`).
# Its image already has torch, triton, transformers, safetensors, tokenizers, numpy, pytest,
# hypothesis, matplotlib, pyyaml, tqdm and jinja2; --no-deps on purpose, so that nothing carried can
# replace that stack. liger-kernel is only the baseline of benchmarks/aipo_loss.py.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .wheels
rm -f .wheels/*.whl  # one version per package: two make the offline install refuse them all
python3 -m pip download -q -d .wheels --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --implementation cp \
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 liger-kernel==0.8.5
du -sh .wheels
