"""A separate held-out file (``data.eval_dataset``, veRL's ``data.val_files``): the held-out split is drawn from it,
and no prompt of it is ever trained on, shown as a few-shot example, or counted twice."""

import json
import re

import pytest

from llamarl.config import ConfigError, DataConfig
from llamarl.config_cli import load_config
from llamarl.models import CharTokenizer
from llamarl.train import main
from llamarl.train_data import EvalDataError, TrainData


def _write(path, questions):
    path.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in questions), encoding="utf-8")
    return path


@pytest.fixture
def files(tmp_path):
    train = _write(tmp_path / "train.jsonl", [f"{i}+1=" for i in range(40)])
    # 20 prompts, 10 of them also in the training file, one written twice
    evals = _write(tmp_path / "eval.jsonl", [f"{i}+1=" for i in range(30, 50)] + ["31+1="])
    return train, evals


def test_the_held_out_split_comes_from_the_eval_file_and_its_prompts_are_never_trained_on(files):
    train, evals = files
    cfg = DataConfig(dataset=str(train), eval_dataset=str(evals), eval_size=8, few_shot=2)
    data = TrainData(cfg, CharTokenizer(), seed=3)
    eval_prompts = {f"{i}+1=" for i in range(30, 50)}
    assert len(data.heldout) == 8 and len({s.prompt for s in data.heldout}) == 8
    assert {s.prompt for s in data.heldout} <= eval_prompts and all(s.id.startswith("eval-") for s in data.heldout)
    assert data.excluded == 10  # 30..39 are in both files
    shots = {s.prompt for s in data.formatter.shots}
    trained = {s.prompt for s in data.next(300)}  # several epochs of the pool
    assert len(shots) == 2 and not shots & eval_prompts and not shots & trained
    assert trained == {f"{i}+1=" for i in range(30)} - shots
    assert data.longest_prompt == max(len(p) for p in data.encode(data.samples))
    # the same seed draws the same split; a file with fewer prompts than eval_size is held out whole
    assert TrainData(cfg, CharTokenizer(), seed=3).heldout == data.heldout
    for size in (64, 0):  # more than it has, or 0: all of them
        whole = TrainData(DataConfig(dataset=str(train), eval_dataset=str(evals), eval_size=size), CharTokenizer())
        assert sorted(s.prompt for s in whole.heldout) == sorted(eval_prompts)


def test_the_synthetic_stream_skips_the_eval_files_prompts(tmp_path):
    evals = _write(tmp_path / "eval.jsonl", [f"{a}+{b}=" for a in range(10) for b in range(5)])
    cfg = DataConfig(dataset="synthetic:arithmetic:digits=1", eval_dataset=str(evals), eval_size=20, few_shot=2)
    data = TrainData(cfg, CharTokenizer())
    eval_prompts = {f"{a}+{b}=" for a in range(10) for b in range(5)}
    stream = data.next(2000)
    assert {s.prompt for s in data.heldout} <= eval_prompts and len(data.heldout) == 20
    assert not eval_prompts & ({s.prompt for s in stream} | {s.prompt for s in data.formatter.shots})
    assert max(len(p) for p in data.encode(data.heldout + stream)) <= data.longest_prompt
    assert TrainData(cfg, CharTokenizer(), cursor=data.cursor - 5).next(5) == stream[-5:]


def test_an_eval_file_of_the_synthetic_tasks_own_problems(tmp_path, capsys):
    """Found by a review helper: an eval file holding every training problem of the task made the endless
    stream search forever (the run hung after the warm start); one holding the first ones left no few-shot
    examples; and the fields a reward function asks for were checked against the eval records only."""
    from llamarl.data import ArithmeticTask

    task = ArithmeticTask(digits=1)
    every = _write(tmp_path / "every.jsonl", [f"{a}+{b}=" for a in range(10) for b in range(10)])
    with pytest.raises(EvalDataError, match="holds every one of the first 10000 training problems of synthetic:"):
        TrainData(DataConfig(dataset="synthetic:arithmetic:digits=1", eval_dataset=str(every)), CharTokenizer())
    assert main(["--preset", "smoke", "--dataset", "synthetic:arithmetic:digits=1", "--eval-dataset", str(every),
                 "--out", str(tmp_path / "run")]) == 2
    assert re.search(r"data.eval_dataset: \S*every.jsonl holds every one of the first", capsys.readouterr().err)
    first = _write(tmp_path / "first.jsonl", [s.prompt for s in task.train_samples(30)])
    cfg = DataConfig(dataset="synthetic:arithmetic:digits=1", eval_dataset=str(first), few_shot=2)
    data = TrainData(cfg, CharTokenizer())
    shots = {s.prompt for s in data.formatter.shots}
    assert len(shots) == 2 and not shots & {s.prompt for s in task.train_samples(30)}
    # all but one training problem held out: accepted, and the stream keeps finding that one (it gave up mid-run)
    spec = "synthetic:arithmetic:digits=1,ops=+-"
    problems = sorted({s.prompt for s in ArithmeticTask(digits=1, ops="+-").train_samples(5000)})
    most = _write(tmp_path / "most.jsonl", problems[1:])
    stream = TrainData(DataConfig(dataset=spec, eval_dataset=str(most)), CharTokenizer()).next(400)
    assert {s.prompt for s in stream} == {problems[0]}
    rows = [{"question": p, "answer": "1", "level": 3} for p in ("1+1=", "2+2=")]
    (tmp_path / "level.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(dataset="synthetic:arithmetic:digits=1", eval_dataset=str(tmp_path / "level.jsonl"))
    assert "level" not in TrainData(cfg, CharTokenizer()).info_fields  # the training problems have no level
    (tmp_path / "rw.py").write_text("def score(completion, answer, level):\n    return 1.0\n")
    assert main(["--preset", "smoke", "--dataset", "synthetic:arithmetic:digits=1", "--eval-dataset",
                 str(tmp_path / "level.jsonl"), "--reward", f"{tmp_path / 'rw.py'}:score",
                 "--out", str(tmp_path / "run2")]) == 2
    assert "needs the keyword argument(s) ['level'], which not every sample has" in capsys.readouterr().err


def test_the_stream_id_depends_on_the_eval_file(files, tmp_path):
    train, evals = files
    plain = TrainData(DataConfig(dataset=str(train), eval_size=8), CharTokenizer())
    held = TrainData(DataConfig(dataset=str(train), eval_dataset=str(evals), eval_size=8), CharTokenizer())
    other = _write(tmp_path / "other.jsonl", [f"{i}+1=" for i in range(30, 50)] + ["99+1="])
    changed = TrainData(DataConfig(dataset=str(train), eval_dataset=str(other), eval_size=8), CharTokenizer())
    assert len({plain.stream_id, held.stream_id, changed.stream_id}) == 3


def test_a_moved_eval_file_keeps_the_stream_and_an_edited_one_is_named(files, tmp_path, capsys):
    """A resume may find its files moved (accepted, as for data.dataset): the eval file's held-out samples are
    hashed by content, not by their positional ids, which carry the file's name. An edited eval file is refused,
    and the message names it."""
    train, evals = files
    moved = tmp_path / "moved" / "renamed.jsonl"
    moved.parent.mkdir()
    moved.write_bytes(evals.read_bytes())
    ids = [TrainData(DataConfig(dataset=str(train), eval_dataset=str(path), eval_size=8), CharTokenizer()).stream_id
           for path in (evals, moved)]
    assert ids[0] == ids[1]
    run = tmp_path / "run"
    assert main(["--preset", "smoke", "--dataset", str(train), "--eval-dataset", str(moved), "--max-steps", "2",
                 "--set", "run.checkpoint_every=2", "--out", str(run)]) == 0
    moved.write_text(moved.read_text().replace('"answer": "1"', '"answer": "2"', 1))
    assert main(["--resume", str(run), "--max-steps", "3"]) == 2
    assert f"data stream of {train} with the held-out file {moved} is not the one" in capsys.readouterr().err


def test_unusable_eval_files_are_refused(files, tmp_path, capsys):
    train, evals = files
    with pytest.raises(ValueError, match="also occurs in data.eval_dataset .* nothing would be left to train on"):
        TrainData(DataConfig(dataset=str(evals), eval_dataset=str(evals)), CharTokenizer())
    long = _write(tmp_path / "long.jsonl", ["123456+1=", "654321+1="])
    with pytest.raises(EvalDataError, match="every one of its 2 prompts is longer than 6 tokens"):
        TrainData(DataConfig(dataset=str(train), eval_dataset=str(long)), CharTokenizer(), max_prompt_tokens=6)
    with pytest.raises(ConfigError, match="data.eval_dataset: must be a .jsonl or .parquet file"):
        DataConfig(eval_dataset="synthetic:arithmetic")
    with pytest.raises(ConfigError, match=r"data.eval_size: must be > 0 \(0 means every prompt of data.eval_dataset"):
        DataConfig(eval_size=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1="}\n')
    for path, message in [(tmp_path / "missing.jsonl", "data.eval_dataset: no such file"),
                          (bad, "data.eval_dataset: .*bad.jsonl line 1: missing field 'question'")]:
        assert main(["--preset", "smoke", "--dataset", str(train), "--set", f"data.eval_dataset={path}",
                     "--out", str(tmp_path / "run")]) == 2
        assert re.search(message, capsys.readouterr().err)


def test_a_run_evaluates_on_the_eval_file_and_a_resume_keeps_it(files, tmp_path, capsys):
    train, evals = files
    run = tmp_path / "run"
    assert main(["--preset", "smoke", "--dataset", str(train), "--eval-dataset", str(evals), "--max-steps", "2",
                 "--out", str(run)]) == 0
    assert ("8 held-out prompts drawn from data.eval_dataset, whose prompts never reach training (10 training samples "
            "with one of them dropped)") in capsys.readouterr().err
    assert json.loads((run / "summary.json").read_text())["eval_size"] == 8
    assert load_config(["--resume", str(run), "--max-steps", "3"]).data.eval_dataset == str(evals.resolve())
    with pytest.raises(ConfigError, match="^data.eval_dataset: the resumed run started with"):
        load_config(["--resume", str(run), "--max-steps", "3", "--set", f"data.eval_dataset={train}"])
