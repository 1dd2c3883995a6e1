"""benchmarks.harness.measure on the CPU: the peak memory a call adds is seen after the warm-up calls
(it read 0 for every repeatable call while it was the growth of ru_maxrss, the process's high-water mark)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import measure  # noqa: E402

MIB = 2**20


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="the CPU sampler reads /proc/self/statm")
def test_cpu_peak_memory_counts_what_each_call_allocates():
    def holds_64_mib():
        x = torch.ones(16 * MIB)  # 64 MiB of fp32, touched
        for _ in range(20):  # held for ~20 sampling intervals
            x.add_(1.0)
        return x.sum()

    assert 48 * MIB <= measure(holds_64_mib, warmup=2, iters=3, device="cpu").peak_mem_bytes <= 80 * MIB
    assert measure(lambda: torch.ones(8).sum(), warmup=2, iters=3, device="cpu").peak_mem_bytes < 8 * MIB


def test_train_step_benchmark_runs_and_its_variants_agree(tmp_path, monkeypatch):
    """benchmarks.train_step on the tiny model: every variant runs, cut micro-batches run fewer positions,
    and one step of each moves the weights as the padded step does (up to summation order)."""
    import json

    from benchmarks import train_step

    monkeypatch.setenv("OUT", str(tmp_path))
    train_step.main(["--model", "tiny", "--iters", "1", "--prompts", "2", "--prompt-len", "16",
                     "--max-new-tokens", "32", "--median-new-tokens", "6", "--flat"])
    rows = {r["variant"].split()[0]: r for r in json.loads((tmp_path / "train_step.json").read_text())["rows"]}
    assert set(rows) == {"padded", "trimmed", "grouped", "budget"}
    assert rows["padded"]["positions"] > rows["trimmed"]["positions"] >= rows["grouped"]["positions"]
    assert all(r["max_weight_diff"] < 1e-5 for r in rows.values())


def test_reward_model_benchmark_runs_and_its_variants_agree(tmp_path, monkeypatch):
    """benchmarks.reward_model on the tiny trunk: sorted batches run no more positions than batches in the
    given order, one sequence at a time runs exactly the real tokens, and every variant's scores are the
    one-at-a-time ones up to summation order (the padding never reaches a row's last real token)."""
    import json

    from benchmarks import reward_model

    monkeypatch.setenv("OUT", str(tmp_path))
    args = ["--model", "tiny", "--iters", "1", "--sequences", "12", "--batch-size", "4", "--prompt-len", "16",
            "--max-new-tokens", "48", "--median-new-tokens", "8"]
    reward_model.main(args)
    rows = {r["variant"]: r for r in json.loads((tmp_path / "reward_model.json").read_text())["rows"]}
    assert set(rows) == {"single", "ordered", "sorted"}
    lengths = [len(s) for s in reward_model.make_sequences(reward_model.argparse.Namespace(
        seed=0, sequences=12, prompt_len=16, max_new_tokens=48, median_new_tokens=8), 100)]
    assert rows["single"]["positions"] == sum(lengths) and rows["single"]["real_frac"] == 1.0
    assert rows["ordered"]["positions"] >= rows["sorted"]["positions"] >= sum(lengths)
    assert all(r["max_abs_diff_vs_single"] < 1e-5 for r in rows.values())
