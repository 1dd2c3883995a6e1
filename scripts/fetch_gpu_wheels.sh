#!/usr/bin/env bash
# Downloads, on a machine with network, the pure-Python and small wheels that the offline GPU machine
# (Python 3.12, x86_64; it already has torch, triton, numpy and pybind11) lacks, into .wheels/
# (git-ignored; carry it to the GPU machine with the device tool's `carry`). --no-deps on purpose: the
# list is closed by hand so that nothing here can replace the GPU machine's torch/CUDA stack.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .wheels
python3 -m pip download -q -d .wheels --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --implementation cp \
  safetensors tokenizers transformers huggingface_hub hf-xet fsspec httpx2 httpcore2 h11 anyio idna \
  truststore typer click rich shellingham markdown-it-py mdurl pygments annotated-doc pydantic pydantic-core \
  annotated-types typing-inspection regex tqdm pyyaml packaging \
  math-verify latex2sympy2_extended antlr4-python3-runtime==4.13.2 \
  hypothesis sortedcontainers pytest pluggy iniconfig jinja2 markupsafe \
  matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil six liger-kernel
du -sh .wheels
