"""Which settings file a resume continues with (llamarl.run_files.resume_file)."""

from llamarl.run_files import resume_file, step_dirs


def test_resume_file_prefers_the_run_then_the_checkpoint_then_the_newest_checkpoint(tmp_path):
    run = tmp_path / "run"
    for step, text in ((2, "at 2"), (10, "at 10")):
        d = run / "checkpoints" / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / "config.yaml").write_text(text)
    (run / "checkpoints" / "step_000011").mkdir()  # newest, without the file
    (run / "checkpoints" / "step_12").mkdir()  # not a checkpoint name llamarl writes
    assert [s for s, _ in step_dirs(run)] == [2, 10, 11]
    assert resume_file(run).read_text() == "at 10"  # only checkpoints/ was copied: the newest that has it
    assert resume_file(run / "checkpoints" / "step_000002").read_text() == "at 2"  # the checkpoint's own copy
    (run / "config.yaml").write_text("the run's")
    assert resume_file(run).read_text() == resume_file(run / "checkpoints" / "step_000002").read_text() == "the run's"
    assert resume_file(tmp_path / "elsewhere") is None
