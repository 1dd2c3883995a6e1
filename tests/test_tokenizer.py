"""Tokenizers: the built-in CharTokenizer and the tokenizer.json-backed one (checked against transformers'
PreTrainedTokenizerFast for ids, decoding and chat-template rendering)."""

from __future__ import annotations

import json
import string

import pytest

from llamarl.models import CharTokenizer, HFTokenizer, load_tokenizer

LLAMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
MESSAGES = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 12 + 30?  "},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "And $x^2$ at x=3?"},
]


def test_char_tokenizer_roundtrip_and_alphabet():
    tok = CharTokenizer()
    required = string.digits + "+-*/=(),.? \n" + string.ascii_letters + "#\\{}$^_"
    ids = tok.encode(required)
    assert len(ids) == len(required) and tok.unk_id not in ids
    assert tok.decode(ids) == required
    assert len(set(ids)) == len(set(required))
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
    assert tok.encode("1+1", add_bos=True)[0] == tok.bos_id
    assert tok.decode([tok.bos_id, *tok.encode("ab"), tok.eos_id]) == "ab"
    assert tok.decode([tok.bos_id, *tok.encode("ab"), tok.eos_id], skip_special_tokens=False) == "<bos>ab<eos>"
    assert tok.encode("é") == [tok.unk_id] and tok.decode([tok.unk_id]) == "\ufffd"
    # ids past the vocabulary (a model's padded embedding rows) decode to nothing; negative ids are errors
    assert tok.decode([*tok.encode("a"), tok.vocab_size, tok.vocab_size + 27, *tok.encode("b")]) == "ab"
    with pytest.raises(ValueError, match="negative"):
        tok.decode([-1])


def test_char_tokenizer_chat_template_and_save(tmp_path):
    tok = CharTokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "2+2=?"}])
    assert text == "Q: 2+2=?\nA:"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False) == "Q: x\n"
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, CharTokenizer) and again.encode("abc") == tok.encode("abc")
    assert isinstance(load_tokenizer("char"), CharTokenizer)


@pytest.fixture
def hf_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["What is 12 + 30? The answer is 42.", "Compute $x^2$ at x=3, giving 9.", "Natalia sold clips."] * 20
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_STYLE_TEMPLATE,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_hf_tokenizer_matches_transformers(hf_dir):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == len(ref)
    assert tok.bos_id == ref.bos_token_id and tok.eos_id == ref.eos_token_id
    assert tok.pad_id == tok.eos_id  # no pad token in the checkpoint
    text = "What is 12 + 30?<|eot_id|> Natalia sold 48 clips, é!"
    ids = tok.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_bos=True) == [ref.bos_token_id] + ids
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids) == text
    padded = ids[:3] + [len(ref), len(ref) + 100] + ids[3:]  # ids of a model's padded embedding rows
    assert tok.decode(padded) == ref.decode(padded, skip_special_tokens=True) == tok.decode(ids)
    with pytest.raises(ValueError, match="negative"):
        tok.decode([-1])
    for gen in (True, False):
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=gen) == ref.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=gen
        )


def test_a_vocabulary_with_unused_ids_decodes_every_token(hf_dir):
    """Ids need not be contiguous (a reserved block left unused): vocab_size is the largest id + 1, and decode
    keeps every token of the vocabulary, as transformers does (tokens past the entry count were dropped)."""
    transformers = pytest.importorskip("transformers")
    data = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    data["model"]["vocab"] = {t: i + 100 if i >= 200 else i for t, i in vocab.items()}  # ids 200..299 unused
    (hf_dir / "tokenizer.json").write_text(json.dumps(data))
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    tok = load_tokenizer(hf_dir)
    assert tok.vocab_size == max(ref.get_vocab().values()) + 1 == len(vocab) + 100
    text = "Natalia sold 48 clips, giving 9. What is 12 + 30?"
    ids = tok.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False) and max(ids) >= len(vocab)
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text


def test_hf_tokenizer_save_load_and_template_file(hf_dir, tmp_path):
    tok = load_tokenizer(hf_dir)
    out = tmp_path / "copy"
    tok.save(out)
    again = load_tokenizer(out)
    assert again.encode("x=3") == tok.encode("x=3") and again.eos_id == tok.eos_id
    assert again.apply_chat_template(MESSAGES) == tok.apply_chat_template(MESSAGES)
    cfg = json.loads((out / "tokenizer_config.json").read_text())  # older checkpoints: AddedToken dicts
    cfg["eos_token"] = {"__type": "AddedToken", "content": "<|end_of_text|>", "special": True}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(out).eos_id == tok.encode("<|end_of_text|>")[0]
    (out / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}]{% endfor %}")
    assert load_tokenizer(out).apply_chat_template(MESSAGES[:2]) == "[system][user]"


def test_tokenizer_errors(hf_dir, tmp_path):
    tok = load_tokenizer(hf_dir)
    with pytest.raises(ValueError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="must be a dict with a 'role'"):
        tok.apply_chat_template([{"content": "x"}])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json"):
        load_tokenizer(empty)
    (hf_dir / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        load_tokenizer(hf_dir)
    bad_cfg = tmp_path / "badcfg"
    bad_cfg.mkdir()
    (bad_cfg / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(bad_cfg)


def test_special_token_not_in_vocab(hf_dir):
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "</s>"
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="eos_token '</s>' is not in the tokenizer vocabulary"):
        load_tokenizer(hf_dir)


def _with_config(d, **changes) -> None:
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_truncation_and_padding_saved_in_tokenizer_json_are_ignored_as_in_transformers(hf_dir):
    transformers = pytest.importorskip("transformers")
    raw = json.loads((hf_dir / "tokenizer.json").read_text())
    raw["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    raw["padding"] = {"strategy": {"Fixed": 32}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                      "pad_type_id": 0, "pad_token": "<|end_of_text|>"}
    (hf_dir / "tokenizer.json").write_text(json.dumps(raw))
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    text = "What is 12 + 30? The answer is 42."
    ids = load_tokenizer(hf_dir).encode(text)
    assert ids == ref.encode(text, add_special_tokens=False) and len(ids) > 4
    assert load_tokenizer(hf_dir).decode(ids) == text


TEMPLATE_VARIABLES = (
    "{% if tools is not none %}TOOLS{% endif %}{% if documents is not none %}DOCS{% endif %}"
    "[{{ unk_token }}|{{ bos_token }}|{{ pad_token }}]"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}<{{ m['content'] }}>{% endgeneration %}"
    "{% else %}{{ m['role'] }}:{{ m.get('content') or '' }};{% endif %}{% endfor %}"
)


def test_chat_template_variables_match_transformers(hf_dir):
    transformers = pytest.importorskip("transformers")
    _with_config(hf_dir, chat_template=TEMPLATE_VARIABLES, unk_token="<|end_of_text|>")
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "tool"}]  # a message without content (tool calls) is allowed
    got = load_tokenizer(hf_dir).apply_chat_template(messages, add_generation_prompt=False)
    assert got == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert got == "[<|end_of_text|>|<|begin_of_text|>|]user:hi;<yo>tool:;"


def test_a_special_token_the_tokenizer_lacks_is_undefined_in_templates_as_in_transformers(hf_dir):
    """No bos_token anywhere: transformers leaves it undefined, so a Llama-2 style ``bos_token + '[INST] '``
    fails instead of rendering a prompt without its BOS; printed alone it renders empty, in both."""
    transformers = pytest.importorskip("transformers")
    import jinja2

    _with_config(hf_dir, bos_token=None, chat_template="{{ bos_token + '[INST] ' + messages[0]['content'] }}")
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    with pytest.raises(jinja2.UndefinedError):
        ref.apply_chat_template(MESSAGES[:1], tokenize=False)
    with pytest.raises(ValueError, match=r"chat template uses 'bos_token' is undefined.*tokenizer_config.json"):
        load_tokenizer(hf_dir).apply_chat_template(MESSAGES[:1])
    _with_config(hf_dir, chat_template="[{{ bos_token }}]{{ messages[0]['content'] }}")
    assert load_tokenizer(hf_dir).apply_chat_template(MESSAGES[:1]) == ref.__class__.from_pretrained(
        str(hf_dir)).apply_chat_template(MESSAGES[:1], tokenize=False) == "[]" + MESSAGES[0]["content"]


def test_special_tokens_map_fills_what_tokenizer_config_lacks(hf_dir):
    transformers = pytest.importorskip("transformers")
    _with_config(hf_dir, bos_token=None, eos_token=None)
    (hf_dir / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": {"content": "<|begin_of_text|>", "lstrip": False}, "eos_token": "<|eot_id|>"}))
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    tok = load_tokenizer(hf_dir)
    assert (tok.bos_id, tok.eos_id) == (ref.bos_token_id, ref.eos_token_id) != (None, None)
    assert tok.apply_chat_template(MESSAGES) == ref.apply_chat_template(MESSAGES, tokenize=False,
                                                                        add_generation_prompt=True)
    # where both name the token, the two layouts differ: special_tokens_map.json wins in the layout saved before
    # transformers 4.34 (no added_tokens_decoder), tokenizer_config.json in the current one
    _with_config(hf_dir, eos_token="<|end_of_text|>")
    for decoder in (None, {str(i): {"content": t, "special": True} for i, t in enumerate(SPECIALS)}):
        _with_config(hf_dir, added_tokens_decoder=decoder)
        ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
        assert load_tokenizer(hf_dir).eos_id == ref.eos_token_id
        assert ref.eos_token == ("<|eot_id|>" if decoder is None else "<|end_of_text|>")


def test_named_chat_templates_use_default_or_refuse(hf_dir):
    _with_config(hf_dir, chat_template=[{"name": "tool_use", "template": "TOOL"},
                                        {"name": "default", "template": "DEFAULT"}])
    assert load_tokenizer(hf_dir).apply_chat_template(MESSAGES) == "DEFAULT"
    _with_config(hf_dir, chat_template=[{"name": "tool_use", "template": "TOOL"}, {"name": "rag", "template": "RAG"}])
    with pytest.raises(ValueError, match=r"named chat templates \['rag', 'tool_use'\] but none named 'default'"):
        load_tokenizer(hf_dir).apply_chat_template(MESSAGES)


@pytest.mark.parametrize("post, bos_token", [
    (None, "<|begin_of_text|>"),  # adds nothing although a bos_token is named (many chat models)
    ("$A", None),  # the same, said by a template
    ("<|begin_of_text|> $A", None),  # adds a BOS that tokenizer_config does not name
    ("<|begin_of_text|> $A", "<|begin_of_text|>"),  # Llama 3
])
def test_raw_prompts_get_the_special_tokens_transformers_adds(hf_dir, post, bos_token):
    """A raw prompt starts with what the tokenizer's post-processor puts before a text (transformers'
    ``tokenizer(text)``), whatever bos_token names: a named bos_token used to be prepended always."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, processors

    from llamarl.data import PromptFormatter, Sample

    if post is not None:
        raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
        raw.post_processor = processors.TemplateProcessing(
            single=post, special_tokens=[("<|begin_of_text|>", raw.token_to_id("<|begin_of_text|>"))])
        raw.save(str(hf_dir / "tokenizer.json"))
    _with_config(hf_dir, bos_token=bos_token)
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    tok = load_tokenizer(hf_dir)
    text = "What is 12 + 30?"
    assert PromptFormatter(tokenizer=tok).encode(Sample("a", text, "42")) == ref(text)["input_ids"]


def test_a_suffix_of_the_post_processor_is_not_put_after_prompts(hf_dir):
    from tokenizers import Tokenizer, processors

    raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    bos, eos = raw.token_to_id("<|begin_of_text|>"), raw.token_to_id("<|end_of_text|>")
    raw.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A <|end_of_text|>", special_tokens=[("<|begin_of_text|>", bos), ("<|end_of_text|>", eos)])
    raw.save(str(hf_dir / "tokenizer.json"))
    tok = load_tokenizer(hf_dir)
    assert tok.prefix_ids == (bos,)
    assert tok.encode("What is", add_bos=True) == [bos] + tok.encode("What is")


def test_the_prefix_is_found_when_the_vocabulary_cannot_spell_a(tmp_path):
    """A digits-only vocabulary: the probe "a" encodes to nothing, so a vocabulary entry is the probe (the
    post-processor's suffix must not be taken for a prefix)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    for single, want in (("$A </s>", ()), ("<s> $A </s>", (1,))):
        raw = Tokenizer(models.BPE({"</s>": 0, "<s>": 1, "1": 2, "2": 3, "+": 4, "=": 5}, merges=[]))
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
        raw.add_special_tokens(["</s>", "<s>"])
        raw.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("</s>", 0), ("<s>", 1)])
        raw.save(str(tmp_path / "tokenizer.json"))
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
        tok = load_tokenizer(tmp_path)
        assert tok.prefix_ids == want, single
        ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
        assert ref("1+2=")["input_ids"][:len(want) + 1] == [*want, 2]


def test_chat_template_errors_name_their_cause(hf_dir):
    """Only an undefined special token is blamed on the tokenizer's files; an empty conversation or a message
    the template cannot read says so (both used to read 'the tokenizer does not define it')."""
    _with_config(hf_dir, chat_template="{{ bos_token }}{{ messages[0]['content'].strip() }}")
    tok = load_tokenizer(hf_dir)
    with pytest.raises(ValueError, match="empty conversation"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="chat template failed on these messages: 'dict object' has no attribute "
                                         "'content'") as info:
        tok.apply_chat_template([{"role": "user"}])
    assert "special token" not in str(info.value)
