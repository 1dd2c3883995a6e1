"""Training prompts (llamarl.train_data). Few-shot (``data.few_shot``): the examples come from the training
side, are never held out or trained on, and every prompt of the run (training, warm start probe, held-out)
carries them. Conversational datasets: rendered by the chat template, refused without it."""

import json

import pytest

from llamarl.config import DataConfig
from llamarl.models import CharTokenizer
from llamarl.train import main
from llamarl.train_data import TrainData


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_file_shots_are_neither_held_out_nor_trained_on(tmp_path):
    rows = [{"question": f"{i}+{i}=", "answer": str(2 * i)} for i in range(30)]
    rows += [{"question": "3+3=", "answer": "6"}]  # a duplicate prompt: if it is a shot, both copies go
    path = _write(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(dataset=str(path), eval_size=5, few_shot=3, template="Q: {prompt}\nA: ")
    data = TrainData(cfg, CharTokenizer(), seed=7)
    shots = data.formatter.shots
    assert len(shots) == 3 and len({s.prompt for s in shots}) == 3
    shot_prompts = {s.prompt for s in shots}
    trained = data.next(200)  # several epochs of the pool
    assert not shot_prompts & {s.prompt for s in data.heldout + trained}
    assert {s.prompt for s in data.heldout + trained} | shot_prompts == {r["question"] for r in rows}
    text = data.formatter.render(data.heldout[0])
    expected = "".join(f"Q: {s.prompt}\nA: {s.answer}\n" for s in shots) + f"Q: {data.heldout[0].prompt}\nA: "
    assert text == expected
    assert data.encode(data.heldout[:1]) == [CharTokenizer().encode(expected, add_bos=True)]
    assert data.longest_prompt == max(len(p) for p in data.encode(data.heldout + trained))
    # the same seed draws the same examples (a resumed run prompts exactly as before), another seed others
    assert TrainData(cfg, CharTokenizer(), seed=7).formatter.shots == shots
    assert any(TrainData(cfg, CharTokenizer(), seed=s).formatter.shots != shots for s in range(3))


def test_synthetic_stream_skips_the_shot_problems():
    # one-digit addition has 100 problems, so the endless train stream repeats the shots' problems often
    cfg = DataConfig(dataset="synthetic:arithmetic:digits=1", eval_size=4, few_shot=4)
    data = TrainData(cfg, CharTokenizer())
    shot_prompts = {s.prompt for s in data.formatter.shots}
    assert len(shot_prompts) == 4
    stream = data.next(3000)
    assert len(stream) == 3000 and not shot_prompts & {s.prompt for s in stream}
    assert max(len(p) for p in data.encode(data.heldout + stream)) <= data.longest_prompt
    for s in data.formatter.shots:
        assert f"{s.prompt}{s.answer}\n" in data.formatter.render(data.heldout[0])
    # the position survives a restart: a new instance sought to the cursor continues the same stream
    again = TrainData(cfg, CharTokenizer(), cursor=data.cursor - 10)
    assert again.next(10) == stream[-10:]


def test_too_many_shots_is_a_config_error(tmp_path, capsys):
    path = _write(tmp_path / "d.jsonl", [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(6)])
    with pytest.raises(ValueError, match=r"data.few_shot=6: .* has only 6 distinct prompts"):
        TrainData(DataConfig(dataset=str(path), eval_size=1, few_shot=6), CharTokenizer())
    assert main(["--preset", "smoke", "--dataset", str(path), "--set", "data.eval_size=1",
                 "--set", "data.few_shot=6", "--out", str(tmp_path / "run")]) == 2
    assert "lower data.few_shot" in capsys.readouterr().err


def test_a_few_shot_run_trains_and_evaluates_with_the_examples(tmp_path):
    out = tmp_path / "run"
    assert main(["--preset", "smoke", "--set", "data.few_shot=2", "--max-steps", "2", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert rows and all(r["prompt"].count("=") == 3 for r in rows)  # two solved examples, then the problem
    assert json.loads((out / "summary.json").read_text())["accuracy_after"] is not None


def test_a_conversational_dataset_trains_with_chat_formatting(tmp_path, capsys):
    rows = [{"prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{i}+{i}="}],
             "answer": str(2 * i)} for i in range(40)]
    path = _write(tmp_path / "conv.jsonl", rows)
    args = ["--preset", "smoke", "--dataset", str(path), "--set", "data.prompt_field=prompt", "--max-steps", "2"]
    assert main(args + ["--out", str(tmp_path / "raw")]) == 2
    assert "is a conversation (a list of messages), which only a chat template can render" in capsys.readouterr().err
    assert main(args + ["--set", "data.chat=true", "--out", str(tmp_path / "chat")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "chat" / "samples.jsonl").read_text().splitlines()]
    tok = CharTokenizer()
    for r in rows:  # the decoded prompt is the chat template's rendering of the conversation
        question = r["prompt"].split("Q: ")[1].split("\n")[0]
        assert r["prompt"] == tok.apply_chat_template([{"role": "system", "content": "Add."},
                                                       {"role": "user", "content": question}])


def test_the_stream_id_names_the_stream_not_a_rendering(tmp_path):
    """Checkpoints record ``stream_id``; a resume compares it. A chat template may print the date (Llama
    3.2/3.3 Instruct's "Today Date"), so the id hashes the format's settings and examples, not a rendered
    prompt: the same data on another day has the same id. What the stream depends on changes it: the
    seed, the examples, a record of the file; an example with an empty prompt does not break it."""
    class DatedTokenizer(CharTokenizer):
        day = 1

        def apply_chat_template(self, messages, add_generation_prompt=True):
            return f"day {DatedTokenizer.day}\n" + super().apply_chat_template(messages, add_generation_prompt)

    rows = [{"question": f"{i}+{i}=", "answer": str(2 * i)} for i in range(30)] + [{"question": "", "answer": "0"}]
    path = _write(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(dataset=str(path), eval_size=5, few_shot=2, chat=True)
    first = TrainData(cfg, DatedTokenizer(), seed=3)
    day1_prompt, day1_id = first.formatter.render(first.heldout[0]), first.stream_id
    DatedTokenizer.day = 2
    second = TrainData(cfg, DatedTokenizer(), seed=3)
    assert second.formatter.render(first.heldout[0]) != day1_prompt  # the prompts really differ by day ...
    assert second.stream_id == day1_id  # ... the stream does not
    assert TrainData(cfg, DatedTokenizer(), seed=4).stream_id != first.stream_id
    assert TrainData(DataConfig(dataset=str(path), eval_size=5, few_shot=3, chat=True), DatedTokenizer(),
                     seed=3).stream_id != first.stream_id
    rows[7]["answer"] = "15"
    _write(path, rows)
    assert TrainData(cfg, DatedTokenizer(), seed=3).stream_id != first.stream_id
    # a seed whose examples include the empty prompt: the id is still computed
    empty_shot = next(s for s in range(200) if any(not x.prompt for x in TrainData(
        DataConfig(dataset=str(path), eval_size=5, few_shot=4), CharTokenizer(), seed=s).formatter.shots))
    assert TrainData(DataConfig(dataset=str(path), eval_size=5, few_shot=4), CharTokenizer(),
                     seed=empty_shot).stream_id


def test_a_repeated_prompt_is_held_out_with_every_copy_and_each_epoch_has_its_own_order(tmp_path):
    """A file that holds every prompt twice: no held-out prompt is in the training pool (through another copy);
    the stream's epochs are each a fresh seeded permutation of the pool."""
    rows = [{"question": f"{i}+{i}=", "answer": str(2 * i)} for i in range(20)] * 2
    _write(tmp_path / "d.jsonl", rows)
    data = TrainData(DataConfig(dataset=str(tmp_path / "d.jsonl"), eval_size=4), CharTokenizer(), seed=7)
    held = {s.prompt for s in data.heldout}
    assert len(held) == 4 and not held & {s.prompt for s in data.next(len(data._pool) * 3)}
    data = TrainData(DataConfig(dataset=str(tmp_path / "d.jsonl"), eval_size=4), CharTokenizer(), seed=7)
    pool = sorted(s.id for s in data._pool)
    epochs = [[s.id for s in data.next(len(pool))] for _ in range(3)]
    assert all(sorted(e) == pool for e in epochs) and len({tuple(e) for e in epochs}) == 3
