"""Datasets (JSONL/Parquet loading and its error messages), prompt rendering (templates, few-shot, chat
templates, token ids), PromptDataset, and the synthetic ArithmeticTask with its exact verifier."""

from __future__ import annotations

import json
import re
from fractions import Fraction

import pytest

from llamarl.data import (
    ArithmeticTask,
    PromptDataset,
    PromptFormat,
    PromptFormatter,
    Sample,
    load_dataset,
    reduce_answer,
    select_shots,
    write_jsonl,
)
from llamarl.models import CharTokenizer
from llamarl.rewards import exact_reward, format_reward, gsm8k_reward, load_reward

GSM8K_ROWS = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
     "answer": "In May she sold 48/2 = 24.\nIn total 48+24 = 72.\n#### 72"},
    {"question": "What is 2+2?", "answer": "#### 4"},
    {"question": "A number question", "answer": 1000},
]


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


# ------------------------------------------------------------------------------------ load_dataset
def test_load_jsonl_reduces_gsm8k_answers(tmp_path):
    p = _write_lines(tmp_path / "gsm.jsonl", [json.dumps(r) for r in GSM8K_ROWS] + [""])  # trailing blank ok
    samples = load_dataset(p)
    assert [s.answer for s in samples] == ["72", "4", "1000"]
    assert [s.id for s in samples] == ["gsm-0", "gsm-1", "gsm-2"]
    assert samples[0].prompt == GSM8K_ROWS[0]["question"]
    raw = load_dataset(p, reduce_answers=False)
    assert raw[0].answer == GSM8K_ROWS[0]["answer"]
    assert len(load_dataset(p, limit=2)) == 2


def test_custom_fields_and_ids(tmp_path):
    rows = [{"uid": "a", "problem": "p1", "solution": "\\frac12"}, {"uid": "b", "problem": "p2", "solution": "3"}]
    p = _write_lines(tmp_path / "math.jsonl", [json.dumps(r) for r in rows])
    samples = load_dataset(p, prompt_field="problem", answer_field="solution", id_field="uid")
    assert samples == [Sample("a", "p1", "\\frac12"), Sample("b", "p2", "3")]


def test_parquet_roundtrip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"question": ["q1", "q2"], "answer": ["sol #### 5", "7"], "id": ["x1", "x2"]})
    pq.write_table(table, tmp_path / "d.parquet")
    assert load_dataset(tmp_path / "d.parquet") == [Sample("x1", "q1", "5"), Sample("x2", "q2", "7")]
    expected = r"row 0: missing field 'problem'; fields present: \['answer', 'id', 'question'\]"
    with pytest.raises(ValueError, match=expected):
        load_dataset(tmp_path / "d.parquet", prompt_field="problem")


@pytest.mark.parametrize(
    "lines,kwargs,message",
    [
        (['{"question": "a", "answer": "1"}', '{"question": "b", "answer": '], {}, r"bad\.jsonl:2: not valid JSON"),
        (['{"question": "a", "answer": "1"}', "[1, 2]"], {}, r"bad\.jsonl:2: expected a JSON object"),
        (['{"q": "a", "answer": "1"}'], {}, r"line 1: missing field 'question'; fields present: \['answer', 'q'\]"),
        (['{"question": "a", "answer": "1"}'], {"answer_field": "solution"}, r"missing field 'solution'"),
        (['{"question": 5, "answer": "1"}'], {}, r"field 'question' must be a string"),
        (['{"question": "a", "answer": null}'], {}, r"field 'answer' must be a string or number"),
        (['{"id": "x", "question": "a", "answer": "1"}', '{"id": "x", "question": "b", "answer": "2"}'], {},
         r"line 2: duplicate id 'x' \(first seen at line 1\)"),
        (["", "  "], {}, r"holds no records"),
        (['{"question": "a", "answer": NaN}'], {}, r"line 1: field 'answer' is nan; an answer must be a finite"),
        (['{"question": "a", "answer": "Solution: 3 + 4. ####  "}'], {},
         r"line 1: field 'answer' is empty after the final '####'"),
        (['{"question": "a", "answer": ""}'], {}, r"line 1: field 'answer' is empty; every sample needs"),
    ],
)
def test_load_errors_name_the_problem(tmp_path, lines, kwargs, message):
    p = _write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=message):
        load_dataset(p, **kwargs)


def test_numeric_answers_become_the_text_a_verifier_compares(tmp_path):
    p = _write_lines(tmp_path / "n.jsonl", [json.dumps({"question": f"q{i}", "answer": a})
                                            for i, a in enumerate([72.0, 72, -3.0, 2.5, 1e21, 1e300, 0.1, 1e-05,
                                                                   1.2345678901234566e25, 9.5e15, 2.0**53])])
    assert [s.answer for s in load_dataset(p)] == ["72", "72", "-3", "2.5", "1" + "0" * 21, "1" + "0" * 300, "0.1",
                                                   "0.00001", "12345678901234566000000000", "9500000000000000",
                                                   "9007199254740992"]  # whole numbers never end in ".0"
    assert gsm8k_reward("#### 0.00001", "0.00001") == 1.0 and gsm8k_reward("#### 1", "0.00001") == 0.0


def test_missing_file_and_bad_extension(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_dataset(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"unsupported extension '\.csv'"):
        load_dataset(tmp_path / "d.csv")


def test_write_jsonl_roundtrip(tmp_path):
    samples = [Sample("a", "1+1=", "2"), Sample("b", 'quote " and \\boxed{x}', "-3")]
    write_jsonl(samples, tmp_path / "out.jsonl")
    assert load_dataset(tmp_path / "out.jsonl") == samples


@pytest.mark.parametrize(
    "answer,expected", [("sol\n#### 72", "72"), ("#### 1 #### 2", "2"), (" 5 ", "5"), ("\\frac12", "\\frac12")]
)
def test_reduce_answer(answer, expected):
    assert reduce_answer(answer) == expected


# ------------------------------------------------------------------------------------ prompts
SHOTS = [Sample("s1", "1+2=", "3"), Sample("s2", "4+4=", "8")]
TARGET = Sample("t", "12+30=", "42")


def test_raw_template_with_few_shot():
    f = PromptFormatter(PromptFormat(template="Q: {prompt}"), shots=SHOTS)
    assert f.render(TARGET) == "Q: 1+2=3\nQ: 4+4=8\nQ: 12+30="
    g = PromptFormatter(PromptFormat(template="Solve {prompt} and put it in \\boxed{}."))
    assert g.render(TARGET) == "Solve 12+30= and put it in \\boxed{}."  # braces need no escaping
    fmt = PromptFormat(template="Q: {prompt}", shot_answer_template=" A: {answer}", shot_separator="\n\n")
    h = PromptFormatter(fmt, shots=SHOTS)
    assert h.render(TARGET) == "Q: 1+2= A: 3\n\nQ: 4+4= A: 8\n\nQ: 12+30="


def test_chat_template_via_tokenizer():
    tok = CharTokenizer()  # its template: "Q: <user>\nA: <assistant>\n" ... "A:"
    f = PromptFormatter(PromptFormat(chat=True, system="Be brief."), shots=SHOTS[:1], tokenizer=tok)
    assert f.messages(TARGET) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "12+30="},
    ]
    assert f.render(TARGET) == "Be brief.\nQ: 1+2=\nA: 3\nQ: 12+30=\nA:"
    assert f.encode(TARGET) == tok.encode(f.render(TARGET), add_bos=False)  # chat text: no extra BOS


def test_raw_encoding_adds_bos():
    tok = CharTokenizer()
    f = PromptFormatter(tokenizer=tok)
    assert f.encode(TARGET) == [tok.bos_id] + tok.encode("12+30=")
    assert PromptFormatter(PromptFormat(add_bos=False), tokenizer=tok).encode(TARGET) == tok.encode("12+30=")


def test_prompt_format_validation():
    with pytest.raises(ValueError, match=r"\{prompt\}"):
        PromptFormat(template="no placeholder")
    with pytest.raises(ValueError, match="chat=True"):
        PromptFormat(system="sys")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        PromptFormatter(PromptFormat(chat=True))
    with pytest.raises(ValueError, match="leak"):
        PromptFormatter(shots=SHOTS).render(SHOTS[0])


def test_few_shot_examples_show_the_solution_as_written(tmp_path):
    """A GSM8K record's answer is reduced to "72" for the verifier, but as an example it shows the whole
    solution with its "#### 72" (the form the verifier and the format reward look for), raw and chat."""
    solution = "Natalia sold 48/2 = 24 clips in May.\nShe sold 48 + 24 = 72 clips.\n#### 72"
    p = _write_lines(tmp_path / "g.jsonl", [json.dumps({"question": "How many clips?", "answer": solution}),
                                            json.dumps({"question": "What is 2+2?", "answer": 4})])
    shot, plain = load_dataset(p)
    assert (shot.answer, shot.solution) == ("72", solution) and (plain.answer, plain.solution) == ("4", None)
    f = PromptFormatter(PromptFormat(template="Question: {prompt}\nAnswer: "), shots=[shot])
    text = f.render(TARGET)
    assert text == f"Question: How many clips?\nAnswer: {solution}\nQuestion: 12+30=\nAnswer: "
    assert format_reward(solution, "gsm8k") == 1.0  # what the example teaches is the rewarded format
    chat = PromptFormatter(PromptFormat(chat=True), shots=[shot], tokenizer=CharTokenizer())
    assert chat.messages(TARGET)[1] == {"role": "assistant", "content": solution}
    write_jsonl([shot, plain], tmp_path / "back.jsonl")  # round trip: the solution is what gets written
    assert [(s.answer, s.solution) for s in load_dataset(tmp_path / "back.jsonl")] == [("72", solution), ("4", None)]


def test_the_leak_check_compares_prompts_not_ids():
    """Ids of two files may coincide (``<file stem>-<index>``): a sample that shares only an id with an
    example renders; one that repeats an example's prompt under another id is refused, and select_shots
    never picks the problem of an excluded sample."""
    f = PromptFormatter(shots=SHOTS)
    assert f.render(Sample("s1", "7+7=", "14")) == "1+2=3\n4+4=8\n7+7="
    with pytest.raises(ValueError, match="has the prompt of one of the few-shot examples"):
        f.render(Sample("other-id", " 1+2= ", "3"))
    pool = [Sample("a", "1+2=", "3"), Sample("b", "5+5=", "10")]
    assert select_shots(pool, 1, exclude=[Sample("z", "1+2=", "3")]) == [pool[1]]


def test_select_shots_is_deterministic_and_excludes():
    pool = [Sample(f"p{i}", f"{i}+1=", str(i + 1)) for i in range(20)]
    a = select_shots(pool, 3, seed=1, exclude=pool[:10])
    assert a == select_shots(pool, 3, seed=1, exclude=pool[:10])
    assert len({s.id for s in a}) == 3 and all(int(s.id[1:]) >= 10 for s in a)
    with pytest.raises(ValueError, match="only 10 candidates"):
        select_shots(pool, 11, exclude=pool[:10])


def test_prompt_dataset_lengths_and_batches():
    tok = CharTokenizer()
    samples = ArithmeticTask(seed=3).train_samples(10)
    ds = PromptDataset(samples, tok)
    assert len(ds) == 10 and ds[0].token_ids == tuple([tok.bos_id] + tok.encode(samples[0].prompt))
    epoch0 = [p.sample.id for b in ds.batches(3, epoch=0) for p in b]
    assert sorted(epoch0) == sorted(s.id for s in samples)  # every prompt once per epoch
    assert epoch0 == [p.sample.id for b in ds.batches(3, epoch=0) for p in b]  # deterministic
    assert epoch0 != [p.sample.id for b in ds.batches(3, epoch=1) for p in b]  # reshuffled per epoch
    assert [len(b) for b in ds.batches(3, drop_last=True)] == [3, 3, 3]
    long = samples[:2] + [Sample("long", "1" * 40 + "=", "x")]
    expected = r"1 of 3 prompts exceed max_prompt_tokens=20 \(e.g. sample 'long': 42 tokens\)"
    with pytest.raises(ValueError, match=expected):
        PromptDataset(long, tok, max_prompt_tokens=20)
    kept = PromptDataset(long, tok, max_prompt_tokens=20, drop_long=True)
    assert len(kept) == 2 and kept.dropped_ids == ("long",)
    with pytest.raises(ValueError, match="duplicate sample id"):
        PromptDataset([samples[0], samples[0]], tok)


# ------------------------------------------------------------------------------------ ArithmeticTask
def _exact_value(expr: str) -> Fraction:
    """Independent reference: Python's own precedence over exact rationals."""
    assert re.fullmatch(r"\d+([-+*/]\d+)+", expr), expr
    value = eval(re.sub(r"\d+", lambda m: f"Fraction({m.group(0)})", expr), {"Fraction": Fraction})
    return value


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"ops": ("+", "-")}, {"digits": 2, "n_terms": 4, "ops": "+-*/"}, {"digits": 1, "n_terms": 3, "ops": "*/"}],
)
def test_arithmetic_answers_are_exact(kwargs):
    task = ArithmeticTask(**kwargs)
    for s in task.train_samples(300) + task.heldout_samples(100):
        assert s.prompt.endswith("=") and len(s.prompt) <= task.max_prompt_chars <= 64
        value = _exact_value(s.prompt[:-1])
        assert value.denominator == 1, s  # '/' always divides exactly
        assert s.answer == str(value.numerator)
        assert set(s.prompt + s.answer) <= set("0123456789+-*/=")
        assert exact_reward(s.answer + "\n", s.answer) == 1.0


def test_arithmetic_default_matches_the_issue_example():
    s = ArithmeticTask().train_samples(50)
    assert all(re.fullmatch(r"\d{1,3}\+\d{1,3}=", x.prompt) for x in s)
    assert all(int(x.answer) == sum(map(int, x.prompt[:-1].split("+"))) for x in s)


def test_arithmetic_splits_are_disjoint_deterministic_and_prefix_stable():
    task = ArithmeticTask(digits=2, seed=7)
    train = task.train_samples(3000)
    held = task.heldout_samples(300)
    assert not {s.prompt for s in train} & {s.prompt for s in held}
    assert len({s.prompt for s in held}) == 300  # held-out problems are distinct
    assert all(task.is_heldout(s.prompt) for s in held) and not any(task.is_heldout(s.prompt) for s in train)
    assert task.heldout_samples(50) == held[:50] and task.train_samples(100) == train[:100]
    assert ArithmeticTask(digits=2, seed=7).train_samples(100) == train[:100]
    other = ArithmeticTask(digits=2, seed=8)
    assert [s.prompt for s in other.train_samples(100)] != [s.prompt for s in train[:100]]
    assert len({s.id for s in train}) == 3000


def test_arithmetic_exports_through_load_dataset(tmp_path):
    task = ArithmeticTask(ops="+-")
    path = task.write_jsonl(tmp_path / "heldout.jsonl", "heldout", 25)
    assert load_dataset(path) == task.heldout_samples(25)


def test_arithmetic_validation_and_small_spaces():
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops=("^",))
    with pytest.raises(ValueError, match="n_terms"):
        ArithmeticTask(n_terms=1)
    with pytest.raises(ValueError, match="division supports digits"):
        ArithmeticTask(digits=6, ops="/")
    with pytest.raises(ValueError, match="split"):
        ArithmeticTask().samples("test", 1)
    tiny = ArithmeticTask(digits=1, n_terms=2, ops="+")  # 100 problems, ~10 held out
    with pytest.raises(ValueError, match="too small"):
        tiny.heldout_samples(30)  # below the bound (38): searched for, then refused
    # above it: refused at once (the search for 100000 distinct 2-digit sums ran for minutes)
    assert tiny.heldout_capacity() == 38 and ArithmeticTask(digits=9, n_terms=2).heldout_capacity() is None
    with pytest.raises(ValueError, match=r"60 distinct held-out problems asked of .* which has at most 38"):
        tiny.heldout_samples(60)
    assert len(tiny.train_samples(60)) == 60  # training problems may repeat: no bound


# ------------------------------------------------------------------------------------ exact verifier
EXACT_CASES = [
    ("579", "579", 1.0),
    ("579\n", "579", 1.0),
    ("579\n123+456=579", "579", 1.0),  # only the first line counts
    ("  579  \nmore", "579", 1.0),
    ("579", " 579\n", 1.0),
    ("-42\n", "-42", 1.0),
    ("5790", "579", 0.0),  # shares digits
    ("57", "579", 0.0),
    ("579.0", "579", 0.0),  # exact, not numeric
    ("+579", "579", 0.0),
    ("\n579", "579", 0.0),  # empty first line
    ("5 79", "579", 0.0),
    ("", "579", 0.0),
    ("", "", 0.0),  # an empty reference never matches
    ("42", "-42", 0.0),
]


@pytest.mark.parametrize("completion,answer,expected", EXACT_CASES)
def test_exact_reward(completion, answer, expected):
    assert exact_reward(completion, answer) == expected
    assert load_reward("exact")(completion, answer) == expected


@pytest.mark.parametrize(
    "completion,expected", [("579\n", 1.0), ("-3", 1.0), ("1.5", 1.0), ("abc", 0.0), ("", 0.0), ("5 7", 0.0),
                            ("12abc", 0.0), ("3 apples", 0.0), ("1.5.2", 0.0)]
)
def test_exact_format_reward(completion, expected):
    assert format_reward(completion, "exact") == expected


def test_conversational_prompts_render_through_the_chat_template(tmp_path):
    """TRL's conversational format: the prompt field holds messages; chat formatting renders them (a
    template wraps the last user turn, the conversation's own system message wins), raw formatting refuses."""
    from llamarl.data import PromptFormat, PromptFormatter, load_dataset, write_jsonl
    from llamarl.models import CharTokenizer

    rows = [{"id": "a", "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}],
             "answer": "2"},
            {"id": "b", "prompt": [{"role": "user", "content": "2+2="}], "answer": 4},
            {"id": "c", "prompt": "3+3=", "answer": "6"}]
    path = tmp_path / "conv.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b, c = load_dataset(path, prompt_field="prompt")
    assert a.messages == (("system", "Be brief."), ("user", "1+1=")) and a.prompt == "system: Be brief.\nuser: 1+1="
    assert b.answer == "4" and c.messages is None
    tok = CharTokenizer()
    fmt = PromptFormatter(PromptFormat(template="Q {prompt}", chat=True, system="Default."), tokenizer=tok, shots=[b])
    want = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q 2+2="},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "Q 1+1="}]
    assert fmt.messages(a) == want
    assert fmt.render(a) == tok.apply_chat_template(want)
    assert fmt.messages(c)[0] == {"role": "system", "content": "Default."}
    with pytest.raises(ValueError, match="sample 'a' is a conversation .* use chat formatting"):
        PromptFormatter(tokenizer=tok).render(a)
    again = load_dataset(write_jsonl([a, b, c], tmp_path / "again.jsonl"), prompt_field="question")
    assert again == [a, b, c]


def test_other_record_fields_reach_the_reward_info_and_survive_a_rewrite(tmp_path):
    from llamarl.data import load_dataset, write_jsonl

    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"id": "a", "question": "1+1=", "answer": "2", "tests": [1, 2], "level": 3}) + "\n")
    sample, = load_dataset(path)
    # the id field is a field like the others too (a reward asking for `id` was refused: "not every sample has it")
    assert sample.extra == {"id": "a", "tests": [1, 2], "level": 3}
    assert sample.reward_info() == {"id": "a", "tests": [1, 2], "level": 3, "prompt": "1+1=", "sample_id": "a"}
    again, = load_dataset(write_jsonl([sample], tmp_path / "again.jsonl"))
    assert again.extra == sample.extra
    path.write_text("".join(json.dumps({"id": 7, "question": q, "answer": "2"}) + "\n" for q in ("1+1=", "2+0=")))
    with pytest.raises(ValueError, match=r"duplicate id '7'.*set data.id_field=null \(llamarl.eval: --id-field none"):
        load_dataset(path)
    from llamarl.eval import _build_parser

    for spelled in ("none", "null", ""):  # llamarl.eval's spelling of "ids by position"
        assert _build_parser().parse_args(["--model", "m", "--dataset", "d", "--id-field", spelled]).id_field is None
    numbered = load_dataset(path, id_field=None)  # ids that repeat: by position (data.id_field: null)
    assert [s.id for s in numbered] == ["d-0", "d-1"] and numbered[0].extra == {"id": 7}
    back = load_dataset(write_jsonl(numbered, tmp_path / "back.jsonl", id_field="key"), id_field="key")
    assert [s.extra for s in back] == [{"id": 7, "key": "d-0"}, {"id": 7, "key": "d-1"}]


@pytest.mark.parametrize("prompt, match", [
    ([{"role": "user"}], r"its item 0 is not a \{\"role\": str, \"content\": str\} message"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
     r"must end with a user message .* got 'assistant' last"),
    ([], r"must end with a user message .* got 'no message' last"),
])
def test_malformed_conversations_are_refused(tmp_path, prompt, match):
    from llamarl.data import load_dataset

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": prompt, "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=match):
        load_dataset(path)
