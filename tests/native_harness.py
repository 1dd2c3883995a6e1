"""Helpers shared by the tests of the native CPU ops: run test code in a process whose instruction set is
capped (``LLAMARL_CPU_ISA``, read once when llamarl._C loads), and count the calls a model makes to an
op module."""

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
