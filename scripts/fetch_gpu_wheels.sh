#!/usr/bin/env bash
# Downloads, on a machine with network, the wheels the offline GPU machine (Python 3.12, x86_64) lacks,
# into .wheels/ (git-ignored; carried to the GPU machine with the device tool's `carry`).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .wheels
python3 -m pip download -d .wheels --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --implementation cp \
  safetensors tokenizers transformers huggingface_hub math-verify latex2sympy2_extended antlr4-python3-runtime==4.13.2 \
  pyyaml tqdm hypothesis sortedcontainers regex filelock packaging typer typing_extensions liger-kernel \
  pytest pluggy iniconfig jinja2 markupsafe numpy matplotlib contourpy cycler fonttools kiwisolver pillow \
  pyparsing python-dateutil six
du -sh .wheels
