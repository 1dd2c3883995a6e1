"""llamarl.checkpoint: round trips, RNG restore, atomicity under crashes (raise, SIGKILL mid-write, crash
between rename and pointer update), torn directories, pruning and linear history."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llamarl import checkpoint as ckpt_mod
from llamarl.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    capture_rng_state,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    restore_rng_state,
    save_checkpoint,
)

REPO = Path(__file__).resolve().parents[1]


def hf_writer(weights: dict[str, torch.Tensor]):
    """A stand-in for ``model.save_pretrained``: config.json + model.safetensors."""

    def write(directory: Path) -> None:
        (directory / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4}))
        save_file(weights, str(directory / "model.safetensors"))

    return write


def adamw_state() -> dict:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3, 5))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95))
    p.grad = torch.randn(3, 5)
    opt.step()
    return opt.state_dict()


def save(run_dir: Path, step: int, **kwargs) -> Path:
    defaults = dict(policy_state=hf_writer({"w": torch.full((2, 2), float(step))}), policy_version=step,
                    data_cursor={"epoch": 0, "index": step * 10})
    return save_checkpoint(run_dir, step, **{**defaults, **kwargs})


def entries(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_round_trip(tmp_path):
    weights = {"w": torch.randn(4, 3), "b": torch.arange(5, dtype=torch.bfloat16)}
    opt = adamw_state()
    path = save_checkpoint(tmp_path, 123, policy_state=hf_writer(weights), optimizer_state=opt, policy_version=7,
                           data_cursor={"epoch": 1, "index": 42}, extra={"reward_mean": 0.25})
    assert path == tmp_path / "checkpoints" / "step_000123"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000123\n"
    assert entries(tmp_path) == ["latest", "step_000123"]  # no temp dirs left

    ck = load_latest(tmp_path)
    assert (ck.step, ck.policy_version, ck.data_cursor, ck.extra) == (123, 7, {"epoch": 1, "index": 42},
                                                                      {"reward_mean": 0.25})
    loaded = load_file(str(ck.policy_dir / "model.safetensors"))
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    assert json.loads((ck.policy_dir / "config.json").read_text())["model_type"] == "llama"
    got = ck.optimizer_state()
    assert got["param_groups"] == opt["param_groups"]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(got["state"][0][key], opt["state"][0][key])
    manifest = json.loads((path / "MANIFEST.json").read_text())
    assert set(manifest["files"]) == {"policy/config.json", "policy/model.safetensors", "optimizer.pt", "rng.pt",
                                      "state.json"}


def test_rng_states_are_restored(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # leave a cached Gaussian in NumPy's legacy state
    save(tmp_path, 1)  # captures this process's RNG state by default
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3))
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    restore_rng_state(load_latest(tmp_path).rng_state)
    again = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2])
    state = capture_rng_state()
    with pytest.raises(CheckpointError, match="lacks"):
        restore_rng_state({"python": state["python"]})


def test_exception_mid_write_keeps_previous_checkpoint(tmp_path):
    save(tmp_path, 1)

    def broken_writer(directory: Path) -> None:
        (directory / "config.json").write_text("{}")
        (directory / "model.safetensors").write_bytes(b"\0" * 1000)
        raise OSError("disk full")

    with pytest.raises(CheckpointError, match=r"checkpoint step 2 .* failed \(OSError: disk full\).* MiB free there; "
                                              r"the earlier checkpoints are intact"):
        save(tmp_path, 2, policy_state=broken_writer)
    assert entries(tmp_path) == ["latest", "step_000001"]
    ck = load_latest(tmp_path)
    assert (ck.step, ck.policy_version) == (1, 1)
    assert torch.equal(load_file(str(ck.policy_dir / "model.safetensors"))["w"], torch.full((2, 2), 1.0))


def test_killed_writer_leaves_previous_checkpoint_and_torn_temp_is_cleaned(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, json, torch
        from llamarl.checkpoint import save_checkpoint
        run = {str(tmp_path)!r}
        def writer(w):
            def write(d):
                (d / "config.json").write_text("{{}}")
                torch.save(torch.full((64, 64), float(w)), d / "weights.pt")
            return write
        save_checkpoint(run, 1, policy_state=writer(1), policy_version=1, data_cursor=10)
        def dying(d):
            writer(2)(d)
            with open(d / "big.bin", "wb") as f:
                f.write(b"x" * 100000)
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        save_checkpoint(run, 2, policy_state=dying, policy_version=2, data_cursor=20)
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    names = entries(tmp_path)
    torn = [n for n in names if n.startswith(".tmp-step_000002")]
    assert len(torn) == 1 and "step_000002" not in names  # the crash left a temp dir, never a step dir
    ck = load_latest(tmp_path)
    assert (ck.step, ck.policy_version, ck.data_cursor) == (1, 1, 10)
    assert torch.equal(torch.load(ck.policy_dir / "weights.pt"), torch.full((64, 64), 1.0))
    assert entries(tmp_path) == ["latest", "step_000001"]  # the dead writer's temp dir was cleaned


def test_crash_between_rename_and_pointer_update_resumes_from_newest(tmp_path, monkeypatch):
    save(tmp_path, 1)
    real = ckpt_mod._write_atomic

    def crash_on_pointer(path, text):
        if path.name == "latest":
            raise KeyboardInterrupt("power cut")
        real(path, text)

    monkeypatch.setattr(ckpt_mod, "_write_atomic", crash_on_pointer)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 2)
    monkeypatch.undo()
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000001\n"
    assert load_latest(tmp_path).step == 2  # complete by its manifest, so it wins over the stale pointer


def test_re_saving_a_step_never_loses_it(tmp_path, monkeypatch):
    """The old copy of a re-saved step steps aside for the rename: put back if the rename fails, and by the next
    load if the writer dies between the two renames (a subprocess killed right there)."""
    save(tmp_path, 1)
    save(tmp_path, 2)
    real = os.replace

    def failing_second_rename(src, dst):
        if Path(src).name.startswith(".tmp-step_000002"):
            raise OSError("I/O error")
        real(src, dst)

    monkeypatch.setattr(ckpt_mod.os, "replace", failing_second_rename)
    with pytest.raises(CheckpointError, match="the earlier checkpoints are intact"):
        save(tmp_path, 2, policy_version=7)
    monkeypatch.undo()
    assert entries(tmp_path) == ["latest", "step_000001", "step_000002"]
    assert load_latest(tmp_path).policy_version == 2

    script = textwrap.dedent(f"""
        import os
        from pathlib import Path
        import torch
        from llamarl import checkpoint
        real = os.replace
        def dying(src, dst):
            if Path(src).name.startswith(".tmp-step_000002"):
                os._exit(9)  # the old copy is aside, the new one not yet in place
            real(src, dst)
        checkpoint.os.replace = dying
        checkpoint.save_checkpoint({str(tmp_path)!r}, 2, policy_state=None, policy_version=7, data_cursor=0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    names = entries(tmp_path)
    assert "step_000002" not in names and any(n.startswith(".old-step_000002") for n in names), names
    ck = load_latest(tmp_path)
    assert (ck.step, ck.policy_version) == (2, 2)  # put back, and the dead writer's temp dir cleaned
    assert entries(tmp_path) == ["latest", "step_000001", "step_000002"]


def test_torn_or_tampered_step_dirs_are_ignored(tmp_path):
    save(tmp_path, 1)
    root = tmp_path / "checkpoints"
    (root / "step_000005").mkdir()  # no manifest: a non-atomic copy that was interrupted
    (root / "step_000005" / "state.json").write_text("{}")
    good = save(tmp_path, 3)
    with open(good / "policy" / "model.safetensors", "ab") as f:  # a file truncated/extended after the fact
        f.write(b"junk")
    with pytest.warns(UserWarning) as caught:  # skipped, each with what is wrong with it
        ck = load_latest(tmp_path)
    assert ck.step == 1
    assert [str(w.message).split("checkpoints/")[1] for w in caught] == [
        "step_000005 is not usable: no MANIFEST.json (the write did not finish); falling back to an older checkpoint",
        "step_000003 is not usable: file policy/model.safetensors has 92 bytes, manifest says 88; falling back to an "
        "older checkpoint"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    with pytest.raises(CheckpointError, match=r"step_000003 is not usable: file policy/model.safetensors has"):
        load_checkpoint(good)
    with pytest.raises(CheckpointError, match=r"no MANIFEST.json"):
        load_checkpoint(root / "step_000005")
    assert load_latest(tmp_path / "elsewhere") is None


def test_keep_last_k_and_linear_history(tmp_path):
    for step in range(1, 6):
        save(tmp_path, step, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert entries(tmp_path) == ["latest", "step_000004", "step_000005"]
    # resuming from step 4 and saving step 5 again replaces the abandoned step 5 ...
    save(tmp_path, 5, keep=2, policy_version=55)
    assert load_latest(tmp_path).policy_version == 55
    # ... and saving step 2 (a continuation from an even older state) drops the higher steps
    save(tmp_path, 2, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002\n"


def test_writer_for_sharded_state_and_bad_input(tmp_path):
    with CheckpointWriter(tmp_path, 10) as w:
        for rank in range(2):  # e.g. what each FSDP rank would write from its own process
            torch.save({"rank": rank, "shard": torch.arange(3) + rank}, w.path / f"optimizer.rank{rank}.pt")
        w.write_state(policy_version=4, rng_state={"custom": torch.tensor([1, 2])})
    ck = load_latest(tmp_path)
    assert ck.policy_dir is None and torch.equal(ck.rng_state["custom"], torch.tensor([1, 2]))
    assert torch.equal(ck.optimizer_state("optimizer.rank1.pt")["shard"], torch.tensor([1, 2, 3]))
    with pytest.raises(CheckpointError, match="has no 'optimizer.pt'"):
        ck.optimizer_state()

    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        save(tmp_path, 11, data_cursor={"sampler": object()})
    with pytest.raises(CheckpointError, match="left no config.json"):
        save(tmp_path, 12, policy_state=lambda d: None)
    with pytest.raises(CheckpointError, match="call write_state"):
        CheckpointWriter(tmp_path, 13).commit()
    with pytest.raises(CheckpointError, match="step must be an integer >= 0"):
        CheckpointWriter(tmp_path, -1)
    with pytest.raises(CheckpointError, match="policy_version must be an integer"):
        save(tmp_path, 14, policy_version=-2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10]


def _flip_a_byte(path: Path, offset: int = -3) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_bytes_corrupted_in_place_are_caught_by_the_checksums(tmp_path):
    """Same size, other bytes: the manifest's SHA-256 refuses the file; load_latest falls back with a warning."""
    save(tmp_path, 1)
    two = save(tmp_path, 2, optimizer_state=adamw_state())
    _flip_a_byte(two / "policy" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"policy/model.safetensors does not match its SHA-256"):
        load_checkpoint(two)
    with pytest.warns(UserWarning, match="falling back to an older checkpoint"):
        assert load_latest(tmp_path).step == 1
    three = save(tmp_path, 3, optimizer_state=adamw_state())
    _flip_a_byte(three / "optimizer.pt", offset=len((three / "optimizer.pt").read_bytes()) // 2)
    with pytest.warns(UserWarning) as caught:  # step 3's optimizer state, then step 2's weights (as above)
        assert load_latest(tmp_path).step == 1
    messages = [str(w.message) for w in caught]
    assert any("optimizer.pt does not match" in m for m in messages)
    assert any("model.safetensors does not match" in m for m in messages)


def test_a_state_that_does_not_parse_is_not_usable(tmp_path):
    """Manifests of format 1 without checksums (older checkpoints) still load; a garbled state.json of the
    right size is then caught when it is parsed, and the older checkpoint is used."""
    save(tmp_path, 1)
    two = save(tmp_path, 2)
    manifest = json.loads((two / "MANIFEST.json").read_text())
    manifest["files"] = {rel: entry["bytes"] for rel, entry in manifest["files"].items()}  # sizes only
    (two / "MANIFEST.json").write_text(json.dumps(manifest))
    assert load_checkpoint(two).step == 2
    state = (two / "state.json").read_text()
    (two / "state.json").write_text("x" * len(state))
    with pytest.raises(CheckpointError, match=r"state.json or rng.pt does not parse"):
        load_checkpoint(two)
    with pytest.warns(UserWarning, match="falling back"):
        assert load_latest(tmp_path).step == 1
    del manifest["files"]["state.json"]
    (two / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"the manifest lists no state.json"):
        load_checkpoint(two)


def test_a_failed_commit_leaves_no_temp_dir_and_a_late_failure_is_only_a_warning(tmp_path, monkeypatch):
    save(tmp_path, 1)
    real = ckpt_mod._write_atomic

    def full_disk_on(name):
        def write(path, text):
            if path.name == name:
                raise OSError(28, "No space left on device")
            real(path, text)
        return write

    monkeypatch.setattr(ckpt_mod, "_write_atomic", full_disk_on("MANIFEST.json"))
    with pytest.raises(CheckpointError, match="No space left on device"):
        save(tmp_path, 2)
    assert entries(tmp_path) == ["latest", "step_000001"]  # no .tmp-* left behind
    monkeypatch.setattr(ckpt_mod, "_write_atomic", full_disk_on("latest"))
    with pytest.warns(UserWarning, match="step_000003 is committed, but updating 'latest'"):
        path = save(tmp_path, 3)
    monkeypatch.undo()
    assert load_latest(tmp_path).step == 3 and path.name == "step_000003"


def test_an_abandoned_continuation_is_gone_before_the_new_step_appears(tmp_path, monkeypatch):
    """Resumed from step 3 of a run that had reached 5: saving step 4 removes 4 and 5 of the abandoned
    continuation before its rename, so a crash right after the rename still resumes from the new step 4."""
    for step in range(1, 6):
        save(tmp_path, step, keep=5)
    monkeypatch.setattr(ckpt_mod.CheckpointWriter, "_prune", lambda self, final: (_ for _ in ()).throw(
        KeyboardInterrupt("killed after the rename")))
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 4, keep=5, policy_version=44)
    monkeypatch.undo()
    assert load_latest(tmp_path).policy_version == 44
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2, 3, 4]


@pytest.mark.parametrize("entry", [[70, "abc"], "70", None, {"bytes": "70"}, True])
def test_a_malformed_manifest_entry_is_a_corrupt_checkpoint(tmp_path, entry):
    """Valid JSON of the wrong shape (a hand edit, another writer) is not usable, like a checksum failure:
    load_latest falls back to the older checkpoint with a warning instead of raising."""
    save(tmp_path, 1)
    two = save(tmp_path, 2)
    manifest = json.loads((two / "MANIFEST.json").read_text())
    manifest["files"]["state.json"] = entry
    (two / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"step_000002 is not usable: the manifest entry for 'state.json' is "
                                              r"malformed"):
        load_checkpoint(two)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    with pytest.warns(UserWarning, match=r"step_000002 is not usable: .*; falling back to an older checkpoint"):
        assert load_latest(tmp_path).step == 1


@pytest.mark.parametrize("rel", ["../outside.txt", "/etc/hostname", "policy/../../x", ""])
def test_a_manifest_may_name_only_files_inside_its_checkpoint(tmp_path, rel):
    save(tmp_path, 1)
    two = save(tmp_path, 2)
    (tmp_path / "checkpoints" / "outside.txt").write_text("x")
    manifest = json.loads((two / "MANIFEST.json").read_text())
    manifest["files"][rel] = {"bytes": 1, "sha256": None}
    (two / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError,
                       match=r"step_000002 is not usable: the manifest names .*, not a file inside the checkpoint"):
        load_checkpoint(two)
    with pytest.warns(UserWarning, match="falling back"):
        assert load_latest(tmp_path).step == 1


def test_discarding_an_abandoned_continuation_up_front(tmp_path):
    """What a run resumed from an older checkpoint does at its start (before it logs anything): the newer
    checkpoints are set aside (kept, but no resume finds them), ``latest`` names the resumed one, and the
    older ones stay; the run's first commit deletes the set-aside ones."""
    for step in range(1, 5):
        save(tmp_path, step, keep=5)
    gone = ckpt_mod.discard_newer(tmp_path, 2, set_aside=True)
    assert [p.name for p in gone] == ["step_000003", "step_000004"]
    assert entries(tmp_path) == ["abandoned-step_000003", "abandoned-step_000004", "latest", "step_000001",
                                 "step_000002"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002\n"
    assert load_latest(tmp_path).step == 2
    assert ckpt_mod.discard_newer(tmp_path, 2, set_aside=True) == []
    assert ckpt_mod.discard_newer(tmp_path / "none", 0) == []
    save(tmp_path, 3, keep=5)  # the resumed run's first checkpoint
    assert entries(tmp_path) == ["latest", "step_000001", "step_000002", "step_000003"]
