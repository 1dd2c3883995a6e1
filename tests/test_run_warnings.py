"""Warnings at a run's start (llamarl.run_warnings): a resume that moves the learning-rate schedule (the rate
of the first resumed step, on the run's saved settings and on the resume's) or evaluates otherwise, and a token
budget too small for one full-length sequence."""

from __future__ import annotations

import dataclasses

import pytest

from llamarl.config_cli import load_config
from llamarl.algorithms import lr_at
from llamarl.run_warnings import resume_warnings

# a run of 10 steps on a linear schedule with 2 warm-up steps
RUN = ["--preset", "smoke", "--max-steps", "10", "--set", "trainer.lr_schedule=linear",
       "--set", "trainer.lr_warmup_steps=2"]


@pytest.fixture
def run_dir(tmp_path):
    """The run's directory, with the config.yaml it records."""
    cfg = load_config(RUN + ["--out", str(tmp_path / "run")])
    cfg.save(cfg.run.out)
    return tmp_path / "run"


def resumed(run_dir, *args: str):
    """The config of a resume of the run with ``args`` changed (the checkpoint itself is not needed)."""
    cfg = load_config(RUN + ["--out", str(run_dir), *args])
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=str(run_dir)))


def test_a_longer_resume_is_warned_with_the_jump_it_makes(run_dir):
    cfg = resumed(run_dir, "--max-steps", "20")
    warning, = resume_warnings(cfg, 6)
    trainer = dataclasses.asdict(cfg.trainer)
    before, after = lr_at(6, trainer, 10), lr_at(6, trainer, 20)
    assert after > before  # the decay is stretched: the rate goes back up
    assert warning.startswith(f"the learning rate of step 7 moves from {before:.4g} (the schedule the run was on) "
                              f"to {after:.4g} on this resume (run.max_steps 10 -> 20)")


def test_a_changed_schedule_setting_is_named(run_dir):
    warning, = resume_warnings(resumed(run_dir, "--set", "trainer.min_lr_ratio=0.5"), 6)
    assert "(trainer.min_lr_ratio 0.0 -> 0.5)" in warning


def test_a_resume_that_evaluates_otherwise_is_warned(run_dir):
    warning, = resume_warnings(resumed(run_dir, "--set", "run.eval_samples=4", "--set", "run.eval_temperature=0.6"), 6)
    assert warning.startswith("this resume evaluates otherwise than the run did (run.eval_samples 1 -> 4, "
                              "run.eval_temperature 0.0 -> 0.6): its accuracies are not comparable")


@pytest.mark.parametrize("args, step", [
    ([], 6),                                            # the same settings
    (["--max-steps", "20"], 1),                         # still warming up: the warm-up ignores the horizon
])
def test_a_resume_that_keeps_the_rate_says_nothing(run_dir, args, step):
    assert resume_warnings(resumed(run_dir, *args), step) == []


def test_a_checkpoint_outside_its_run_says_nothing(run_dir):
    cfg = resumed(run_dir, "--max-steps", "20")
    (run_dir / "config.yaml").unlink()
    assert resume_warnings(cfg, 6) == []


def test_a_token_budget_below_one_full_length_sequence_is_warned():
    from llamarl.run_warnings import config_warnings

    def warned(budget: int) -> list[str]:
        cfg = load_config(RUN + ["--set", f"trainer.micro_batch_tokens={budget}", "--set",
                                 "generator.max_new_tokens=64"])
        return [w for w in config_warnings(cfg) if w.startswith("trainer.micro_batch_tokens")]

    assert warned(64) == ["trainer.micro_batch_tokens=64 is not above generator.max_new_tokens=64: a sequence near "
                          "the length limit does not fit the budget with its prompt, so it runs alone, over budget; "
                          "give the budget room for several full-length sequences"]
    assert warned(0) == [] and warned(4096) == []


def test_a_rate_written_as_yaml_1_1_reads_it_is_compared_as_a_number(run_dir):
    """``lr: 3e-4`` is a string to YAML 1.1 and a number to the config loader: the resume must read it as the
    loader does (it crashed with a TypeError from math.isclose, or silently said nothing)."""
    text = (run_dir / "config.yaml").read_text()
    lr = resumed(run_dir).trainer.lr
    (run_dir / "config.yaml").write_text(text.replace(f"lr: {lr}", "lr: 3e-4", 1))
    assert "lr: 3e-4" in (run_dir / "config.yaml").read_text()
    warning, = resume_warnings(resumed(run_dir, "--set", "trainer.lr=1e-3"), 6)
    assert "(trainer.lr 0.0003 -> 0.001)" in warning
    assert resume_warnings(resumed(run_dir, "--set", "trainer.lr=3e-4"), 6) == []
