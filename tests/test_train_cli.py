"""The ``python -m llamarl.train`` entry stays light until the run starts (so the executors' fork server
imports torch alongside the controller), and its API loads llamarl.training on first use."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from llamarl.config_cli import load_config


def test_the_entry_imports_no_torch_until_its_api_is_used():
    script = ("import sys\nimport llamarl.train as t\nprint('torch' in sys.modules)\n"
              "from llamarl.train import train\nimport llamarl.training\n"
              "print('torch' in sys.modules, train is llamarl.training.train)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["False", "True True"]


def test_an_unknown_name_is_an_attribute_error():
    import llamarl.train

    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        llamarl.train.nope


@pytest.mark.parametrize("device, visible, driver, expected", [
    ("cpu", None, True, False),
    ("cuda", None, False, True),
    ("auto", None, True, True),
    ("auto", None, False, False),
    ("auto", "", True, False),     # CUDA_VISIBLE_DEVICES hides every GPU
    ("auto", "-1", True, False),
])
def test_the_early_fork_server_guess(monkeypatch, device, visible, driver, expected):
    from llamarl import train

    cfg = load_config(["--preset", "smoke"])
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, device=device))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(train.os.path, "exists", lambda path: driver and path in ("/dev/nvidiactl", "/dev/kfd"))
    assert train._may_use_a_gpu(cfg) is expected


def test_a_bad_start_method_is_a_configuration_error(tmp_path, capsys, monkeypatch):
    """An unknown ``LLAMARL_START_METHOD`` is refused with the configuration errors (exit 2), before the fork
    server or anything else starts, not as a traceback from the launcher."""
    from llamarl.train import main

    monkeypatch.setenv("LLAMARL_START_METHOD", "fork")
    assert main(["--preset", "smoke", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration: environment: LLAMARL_START_METHOD='fork': use 'spawn'" in err
    assert not (tmp_path / "r").exists()
