"""Stop strings (llamarl.generation.stop): the exact end against a brute-force scan of every prefix, the
scanner's prefilter never skipping a token that ends a stop, and the engine cutting completions exactly
where a run without stops would show the stop, while decoding fewer steps."""

from __future__ import annotations

import random

import pytest
import torch

from llamarl.generation import GenerationEngine, SamplingParams, generate
from llamarl.generation.stop import StopStrings, TailScanner, check_stop_strings
from llamarl.models import CharTokenizer, HFTokenizer, Llama
from llamarl.models.config import LLAMA_CONFIGS


def brute_force_end(decode, stops, ids) -> int | None:
    """The definition: the smallest k whose prefix text holds a stop."""
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        if any(s in text for s in stops):
            return k
    return None


CORPUS = ["Question: what is 12 + 30?\n\nAnswer: 42.\n\nQuestion: 日本 é?", "The answer is </answer> done."] * 20


def _byte_level():
    """A byte-level BPE (Llama 3 style) whose merges straddle stop boundaries ('.\\n\\n', ' Question') and
    that spells characters outside its corpus in several byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return HFTokenizer(tok, bos_token="<s>", eos_token="</s>")


def _metaspace():
    """A SentencePiece-style BPE (Llama 2 style): '▁' marks a space, and decoding a text drops the space
    of its first word, so a token's text alone differs from the text it adds after another."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    return HFTokenizer(tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _byte_fallback():
    """Llama 2's tokenizer.json layout: SentencePiece pieces plus the 256 byte tokens <0x00>..<0xFF> for what
    the pieces cannot spell ("\n" among them), decoded by ByteFallback, which writes U+FFFD for a whole run of
    byte tokens while it is not valid UTF-8."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "▁The", "▁answer", "▁is", "▁4", "2", ".", "▁x", "▁Question", ":", "▁what"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return HFTokenizer(tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


TOKENIZERS = {"byte_level": _byte_level, "metaspace": _metaspace, "byte_fallback": _byte_fallback}


@pytest.fixture(scope="module")
def byte_level():
    return _byte_level()


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def any_tokenizer(request):
    return TOKENIZERS[request.param]()


def test_a_newline_hidden_by_a_later_incomplete_byte_run_still_ends_the_completion():
    """ByteFallback: "\n" is the byte token <0x0A>; while the next byte tokens spell only part of "✅" the
    whole run decodes to U+FFFD, hiding the newline in those prefixes. The end is still the newline's token,
    also when the budget cuts the character, or a stray continuation byte never completes it."""
    tok = _byte_fallback()
    ss = StopStrings(["\n"], tok.decode)
    ids = tok.encode("The answer is 42.\n✅ x")
    newline = ids.index(tok._tok.token_to_id("<0x0A>")) + 1
    assert "\n" not in tok.decode(ids[:newline + 1])  # hidden in the next prefix
    assert ss.first_end(ids) == ss.first_end(ids[:newline + 2]) == newline
    stray = ids[:newline] + [tok._tok.token_to_id("<0x85>")] + tok.encode(" The") + ids[newline - 1:newline]
    assert "\n" not in tok.decode(stray)[:-1] and ss.first_end(stray) == newline


def test_first_end_matches_the_definition_on_random_text(any_tokenizer):
    byte_level = any_tokenizer
    rng = random.Random(0)
    pieces = ["Question", ":", " what", "\n\n", ".", "42", " 日本", "é", "</answer>", " done", "?", "\n"]
    stops_found = 0
    for _ in range(150):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        ids = byte_level.encode(text)
        if rng.random() < 0.3:  # arbitrary ids too, partial UTF-8 included
            ids = [rng.randrange(byte_level.vocab_size) for _ in range(rng.randint(1, 15))]
        full = byte_level.decode(ids)
        cands = [full[i:j] for i in range(len(full)) for j in range(i + 1, min(len(full), i + 12) + 1)]
        stops = rng.sample(cands, min(2, len(cands))) if cands and rng.random() < 0.8 else ["\n\nQuestion:", "本"]
        stops = [s for s in stops if "\ufffd" not in s] or ["zz"]
        ss = StopStrings(stops, byte_level.decode)
        want = brute_force_end(byte_level.decode, stops, ids)
        assert ss.first_end(ids) == want, (ids, stops)
        if want is not None:
            stops_found += 1
            assert ss.could_end(ids[want - 1]), (ids, stops, want)  # the prefilter never skips the end
    assert stops_found > 80  # the cases mostly do stop


def test_a_stop_is_found_however_it_is_tokenized(byte_level):
    ss = StopStrings(["\n\nQuestion:"], byte_level.decode)
    ids = byte_level.encode("Answer: 42.\n\nQuestion: what")
    k = ss.first_end(ids)
    assert byte_level.decode(ids[:k]).endswith("\n\nQuestion:") or "\n\nQuestion:" in byte_level.decode(ids[:k])
    assert "\n\nQuestion:" not in byte_level.decode(ids[: k - 1])
    assert ss.first_end(byte_level.encode("Answer: 42.\n\nAnswer")) is None
    # a character the vocabulary spells in byte tokens: the token that completes the stop decodes alone to
    # U+FFFD, and the scanner must still look at the row
    euro = StopStrings(["5€"], byte_level.decode)
    ids = byte_level.encode("price 5€ each")
    k = euro.first_end(ids)
    assert k is not None and byte_level.decode(ids[k - 1 : k]) == "\ufffd"
    assert TailScanner(euro, rows=1).scan([ids[:k]], [0], [False]) == [0]


def test_the_scanner_sees_a_stop_that_a_later_stray_byte_masks():
    """A ByteFallback decoder writes U+FFFD for a whole run of byte tokens that is not valid UTF-8: "é" (C3 A9)
    followed, before the next scan, by a lone lead byte C3 decodes as three U+FFFD. The scanner must still stop
    the row (the tokens kept were always right: first_end; this is about when the row stops costing compute)."""
    byte = {100: 0xC3, 101: 0xA9}

    def decode(ids):
        out, run = [], []
        for t in [*ids, None]:
            if t in byte:
                run.append(byte[t])
                continue
            if run:
                try:
                    out.append(bytes(run).decode("utf-8"))
                except UnicodeDecodeError:
                    out.append("\ufffd" * len(run))
                run.clear()
            if t is not None:
                out.append("abcdefghijklmnop"[t % 16])
        return "".join(out)

    ss = StopStrings(["é"], decode)
    ids = [1, 2, 100, 101, 100, 3]
    assert decode(ids[:4]) == "bcé" and decode(ids[:5]) == "bc\ufffd\ufffd\ufffd"
    assert ss.first_end(ids) == 4
    assert TailScanner(ss, rows=1).scan([ids[:5]], [0], [False]) == [0]


def test_a_completion_cut_inside_a_character_is_settled_by_a_few_decodes():
    """A long completion without a stop whose budget ends inside a byte-spelled character: its text ends in
    U+FFFD, and first_end steps back over the cut character instead of decoding every candidate's prefix."""
    tok = _byte_fallback()
    calls = []
    ss = StopStrings(["\n\n"], lambda ids: calls.append(len(ids)) or tok.decode(ids))
    ids = tok.encode("The answer is 42.\n" * 200 + "✅")[:-1]  # cut after the first two bytes of the check mark
    assert tok.decode(ids).endswith("\ufffd\ufffd")
    assert ss.first_end(ids) is None and sum(calls) < 8 * len(ids)  # scanning every newline: ~200 x len(ids)
    tail = tok.encode("\n\nx")  # the newlines after the cut character end it
    assert ss.first_end(ids + tail) == len(ids) + tail.index(tok._tok.token_to_id("<0x0A>")) + 2


def test_the_scanner_finds_what_first_end_finds_fed_in_chunks(any_tokenizer):
    byte_level = any_tokenizer
    rng = random.Random(1)
    for trial in range(60):
        ids = byte_level.encode("".join(rng.choice(["Question", ":", " 42", "\n\n", "é", "日本", " x"])
                                        for _ in range(rng.randint(2, 14))))
        stops = rng.choice([["\n\nQuestion:"], ["本"], [": 42", "é"], ["x\n"], ["Question: "], [" "]])
        ss = StopStrings(stops, byte_level.decode)
        want = ss.first_end(ids)
        scanner = TailScanner(ss, rows=1)
        found_at, seen = None, 0
        while seen < len(ids) and found_at is None:
            step = rng.randint(1, 3)
            if scanner.scan([ids[seen : seen + step]], [0], [False]):
                found_at = min(seen + step, len(ids))
            seen += step
        if want is None:
            assert found_at is None
        else:  # found in the chunk that completed it
            assert found_at is not None and found_at - 3 < want <= found_at, (trial, ids, stops, want, found_at)


def test_stop_string_validation():
    assert check_stop_strings("s", ["a", "\n"]) == ("a", "\n")
    with pytest.raises(ValueError, match=r"list of strings, got the string '\\n'"):
        check_stop_strings("s", "\n")
    with pytest.raises(ValueError, match="non-empty strings"):
        check_stop_strings("s", ["a", ""])
    with pytest.raises(ValueError, match="non-empty strings"):
        check_stop_strings("s", [3])
    with pytest.raises(ValueError, match="SamplingParams.stop"):
        SamplingParams(stop=[None])
    assert SamplingParams(stop=["x"]).stop == ("x",)


# ---------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Llama(LLAMA_CONFIGS["tiny"])
    with torch.no_grad():  # larger weights than the init's: greedy text that does not repeat one character
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return m


TOK = CharTokenizer()
PROMPTS = [TOK.encode(s, add_bos=True) for s in ["Q: 1+2=?\nA:", "hello", "abc", "The answer", "x"]]


def test_engine_cuts_greedy_completions_where_the_unstopped_run_shows_the_stop(model, monkeypatch):
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    base = generate(model, PROMPTS, params, eos_token_id=())
    texts = [TOK.decode(o.token_ids) for o in base]
    # a stop inside the first four completions (spanning tokens), none in the last
    stops = [texts[0][5:8], texts[1][10:12], texts[2][3:6], texts[3][20:23]]
    assert not any(s in texts[4] for s in stops)
    engine = GenerationEngine(model, max_batch_size=8, max_seq_len=64, pack_weights=False)
    steps = []
    decode_step = engine._decode
    monkeypatch.setattr(engine, "_decode", lambda tokens, slot: steps.append(tokens.shape[0]) or decode_step(tokens, slot))
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=40, temperature=0.0, stop=stops),
                           eos_token_id=(), decode=TOK.decode)
    for o, b in zip(outs, base):
        end = brute_force_end(TOK.decode, stops, b.token_ids)
        if end is None:
            assert o.token_ids == b.token_ids and o.finish_reason == "length"
        else:
            assert o.token_ids == b.token_ids[:end] and o.finish_reason == "stop"
            assert o.logprobs == pytest.approx(b.logprobs[:end], abs=1e-5)
    # rows left the batch when they stopped: fewer row-steps than the 5 x 39 decodes of the unstopped run
    assert sum(steps) < 5 * 39 and outs[4].finish_reason == "length"


def test_engine_stops_a_sampled_row_where_the_same_seed_without_stops_shows_the_stop(model):
    prompt = [PROMPTS[1]]
    base, = generate(model, prompt, SamplingParams(max_new_tokens=30, temperature=1.0, seed=3), eos_token_id=())
    text = TOK.decode(base.token_ids)
    stop = text[12:14]
    out, = generate(model, prompt, SamplingParams(max_new_tokens=30, temperature=1.0, seed=3, stop=[stop]),
                    eos_token_id=(), decode=TOK.decode)
    end = brute_force_end(TOK.decode, [stop], base.token_ids)
    assert end is not None and end <= 14
    assert out.token_ids == base.token_ids[:end] and out.finish_reason == "stop"


def test_engine_needs_decode_for_stop_strings(model):
    with pytest.raises(ValueError, match=r"decode=tokenizer.decode"):
        generate(model, PROMPTS[:1], SamplingParams(max_new_tokens=4, stop=["x"]))


# ---------------------------------------------------------------------------- a training run
def test_train_cuts_rollouts_at_generator_stop(tmp_path, monkeypatch):
    """generator.stop reaches the generator processes: every logged rollout holds a stop string only as its
    last token (one character with the built-in tokenizer), and some rollouts end there."""
    import json

    from llamarl.config_cli import load_config
    from llamarl.train import train

    monkeypatch.setenv("LLAMARL_CACHE_DIR", str(tmp_path / "cache"))
    stops = [str(d) for d in range(10)]
    cfg = load_config(["--preset", "smoke", "--set", "warm_start.steps=3", "--set", f"generator.stop={stops}",
                       "--set", "run.log_samples=8", "--out", str(tmp_path / "run")])
    assert cfg.generator.stop == tuple(stops)
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 8 * cfg.run.max_steps
    stopped = 0
    for r in rows:
        text = r["completion"]
        assert not any(s in text[:-1] for s in stops), r
        if text and text[-1] in stops:
            assert r["finish_reason"] == "stop"
            stopped += 1
    assert stopped > 0
