"""Helpers shared by the tests of the native ops and kernels: run test code in a process whose instruction
set is capped (``LLAMARL_CPU_ISA``, read once when llamarl._C loads), count the calls a model makes to an
op module, and compile Triton kernels for sm_90 without a GPU (``run_sm90_compile``)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_with_cpu_isa(code: str, isa: str) -> str:
    """Run ``code`` (Python, from the repository root) with LLAMARL_CPU_ISA=isa; returns the last line it
    printed, which callers make ``native().linear_cpu_isa()`` to show which path ran."""
    path = os.pathsep.join(p for p in (os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, LLAMARL_CPU_ISA=isa, PYTHONPATH=path)  # test modules import this one by name
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def count_calls(monkeypatch, module, names) -> dict[str, int]:
    """Wrap ``module.<name>`` for each name so that calls are counted (in the returned dict) and passed on."""
    calls = {name: 0 for name in names}
    for name in names:
        def counted(*args, _f=getattr(module, name), _n=name, **kw):
            calls[_n] += 1
            return _f(*args, **kw)
        monkeypatch.setattr(module, name, counted)
    return calls


# Prepended to the scripts of run_sm90_compile: build(fn, signature, constexprs, 16-byte-aligned args, **options)
# compiles one specialisation of a @triton.jit function for sm_90 (H100/H200) and returns its PTX.
SM90_PRELUDE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

target = GPUTarget("cuda", 90, 32)
aligned = lambda fn, names: {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}

def build(fn, sig, consts, aligned_args, **opts):
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=aligned(fn, aligned_args))
    return triton.compile(src, target=target, options=opts).asm["ptx"]

def loops(ptx):
    # the PTX of each loop, in order: from its header label to the branch back to it
    lines = ptx.split("\n")
    out = []
    for head, line in enumerate(lines):
        if "Loop Header" in line:
            label = lines[head if lines[head].startswith("$L__BB") else head - 1].split(":")[0]
            end = next(i for i in range(head, len(lines)) if "bra" in lines[i] and label in lines[i])
            out.append("\n".join(lines[head:end]))
    return out
"""


def run_sm90_compile(script: str, tmp_path) -> None:
    """Run ``SM90_PRELUDE + script`` in a fresh process without TRITON_INTERPRET (the interpreter does not
    type-check GPU lowering: bitcast widths, fp8 casts, dot operand types); the script must print "ok"
    last. Skips when this Triton build has no NVIDIA backend."""
    import pytest

    triton = pytest.importorskip("triton")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", SM90_PRELUDE + script], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), f"triton {triton.__version__}:\n{r.stderr[-3000:]}"
