"""Llama architecture configuration: one frozen dataclass, named presets, and HF config.json conversion.

A ``LlamaConfig`` fixes every tensor shape of the model:

    embed_tokens  [vocab_size, hidden_size]
    q_proj        [num_attention_heads * head_dim, hidden_size]
    k_proj/v_proj [num_key_value_heads * head_dim, hidden_size]
    o_proj        [hidden_size, num_attention_heads * head_dim]
    gate/up_proj  [intermediate_size, hidden_size]
    down_proj     [hidden_size, intermediate_size]
    norms         [hidden_size]
    lm_head       [vocab_size, hidden_size]   (the embedding itself when tie_word_embeddings)

Invariants checked in ``__post_init__``: all sizes positive, ``num_attention_heads`` a multiple of
``num_key_value_heads`` (grouped-query attention: query head h reads kv head h // group), ``head_dim``
even (RoPE rotates pairs), token ids inside the vocabulary, and a supported ``rope_scaling``:

    None / {"rope_type": "default"}  inv_freq_i = theta^(-2i / head_dim)
    {"rope_type": "linear", "factor": f}  inv_freq_i / f
    {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
     "original_max_position_embeddings"}  Llama 3.1 frequency-dependent scaling (see llama.py)

``from_hf_dict`` reads both config.json dialects: transformers 4.x (``rope_theta`` + ``rope_scaling``)
and 5.x (``rope_parameters`` holding ``rope_theta`` and the scaling keys). Absent keys take
transformers' LlamaConfig defaults, so both libraries build the same model from one file; in particular
a config.json without ``bos_token_id`` / ``eos_token_id`` means bos 1 / eos 2 (an explicit null: none).
``to_hf_dict`` writes the 4.x dialect, which both major versions of transformers load.
``from_hf_dict(d, architecture="LlamaForSequenceClassification")`` reads a reward model's config.json (the
same trunk, a one-label score head instead of lm_head; llamarl.models.reward_model).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from llamarl.models.tokenizer import CHAR_BOS_ID, CHAR_EOS_ID, CHAR_PAD_ID, CHAR_VOCAB_SIZE

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
CAUSAL_LM, SEQ_CLS = "LlamaForCausalLM", "LlamaForSequenceClassification"  # from_hf_dict's architectures
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _normalize_eos(eos: Any) -> int | tuple[int, ...] | None:
    if eos is None or isinstance(eos, int):
        return eos
    if isinstance(eos, (list, tuple)):
        ids = tuple(int(e) for e in eos)
        return ids[0] if len(ids) == 1 else ids
    raise ValueError(f"LlamaConfig.eos_token_id must be None, an int or a list of ints, got {eos!r}")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: = num_attention_heads (multi-head attention)
    head_dim: int | None = None  # None: = hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            if self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"LlamaConfig: hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_attention_heads, 1))
        object.__setattr__(self, "eos_token_id", _normalize_eos(self.eos_token_id))
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", _normalize_rope_scaling(self.rope_scaling))
        self._validate()

    def _validate(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"LlamaConfig: num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"LlamaConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (self.rms_norm_eps > 0):
            raise ValueError(f"LlamaConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not (self.rope_theta > 0):
            raise ValueError(f"LlamaConfig.rope_theta must be > 0, got {self.rope_theta}")
        eos = self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)
        named = (("bos_token_id", (self.bos_token_id,)), ("eos_token_id", eos), ("pad_token_id", (self.pad_token_id,)))
        for name, ids in named:
            for i in ids:
                if i is not None and not (0 <= i < self.vocab_size):
                    raise ValueError(
                        f"LlamaConfig.{name}={i} lies outside the vocabulary [0, {self.vocab_size})"
                    )

    # ---------------------------------------------------------------- derived quantities
    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    def num_parameters(self) -> int:
        """Parameter count implied by the shapes (tied embeddings counted once)."""
        d, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        per_layer = d * q + 2 * d * kv + q * d + 3 * d * self.intermediate_size + 2 * d
        embed = self.vocab_size * d
        return embed * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * per_layer + d

    def replace(self, **changes: Any) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], architecture: str = CAUSAL_LM) -> "LlamaConfig":
        """Build from a Hugging Face config.json dict (transformers 4.x or 5.x dialect).

        ``architecture`` is what the caller builds: ``"LlamaForCausalLM"`` (the policy, the default) or
        ``"LlamaForSequenceClassification"`` (a reward model, llamarl.models.reward_model), which also needs
        exactly one label (``id2label``, as transformers counts them: 2 when config.json names none). The
        returned config holds the trunk's shapes only; the head follows from the architecture."""
        if architecture not in (CAUSAL_LM, SEQ_CLS):
            raise ValueError(f"from_hf_dict: architecture must be {CAUSAL_LM!r} or {SEQ_CLS!r}, got {architecture!r}")
        model_type = d.get("model_type")
        if model_type is not None and model_type != "llama":
            what = "LlamaForCausalLM: Llama 2, 3, 3.1, 3.2" if architecture == CAUSAL_LM else architecture
            raise ValueError(
                f"unsupported architecture: model_type={model_type!r}; llamarl implements only 'llama' ({what})"
            )
        archs = d.get("architectures") or []
        if architecture == SEQ_CLS:
            _check_reward_head(archs, d)
        else:
            if SEQ_CLS in archs:
                raise ValueError(f"architectures={list(archs)} is a reward model (a Llama with a score head, no "
                                 "lm_head): it cannot generate; use it as reward.model, not as the policy")
            if "LlamaModel" in archs and "LlamaForCausalLM" not in archs:
                raise ValueError("architectures=['LlamaModel'] is a headless Llama (no lm_head, weights without "
                                 "the 'model.' prefix); llamarl needs a LlamaForCausalLM checkpoint")
            bad = [a for a in archs if a not in ("LlamaForCausalLM", "LlamaModel")]
            if bad:
                raise ValueError(f"unsupported architecture {bad}; llamarl implements only LlamaForCausalLM")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act={act!r}; Llama uses 'silu' (SwiGLU)")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag, False):
                raise ValueError(f"unsupported {flag}=true; llamarl's Llama has bias-free linear layers")
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
            if k not in d
        ]
        if missing:
            raise ValueError(f"config is missing required field(s) {missing}")

        # as transformers reads them: 4.x's rope_scaling (+ rope_theta) first, else 5.x's rope_parameters (its
        # rope_theta inside, else the top-level one)
        for key in ("rope_scaling", "rope_parameters"):
            if d.get(key) and not isinstance(d[key], Mapping):
                raise ValueError(f"config field {key!r} must be a mapping such as {{'rope_type': 'llama3', "
                                 f"'factor': 8.0, ...}}, got {d[key]!r}")
        rope_params = d.get("rope_scaling") or d.get("rope_parameters")
        scaling: dict | None = dict(rope_params) if rope_params else None
        rope_theta = float((scaling or {}).pop("rope_theta", d.get("rope_theta", 10000.0)))
        if scaling is not None:
            rtype = scaling.get("rope_type", scaling.get("type", "default"))
            if rtype == "default":
                scaling = None
            elif rtype == "llama3" and "original_max_position_embeddings" not in scaling:
                # transformers defaults it to max_position_embeddings
                scaling["original_max_position_embeddings"] = int(d.get("max_position_embeddings", 2048))

        vocab_size = _int_field(d, "vocab_size")
        return cls(
            vocab_size=vocab_size,
            hidden_size=_int_field(d, "hidden_size"),
            intermediate_size=_int_field(d, "intermediate_size"),
            num_hidden_layers=_int_field(d, "num_hidden_layers"),
            num_attention_heads=_int_field(d, "num_attention_heads"),
            num_key_value_heads=d.get("num_key_value_heads"),
            head_dim=d.get("head_dim"),
            max_position_embeddings=_int_field(d, "max_position_embeddings", 2048),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            tie_word_embeddings=_bool_field(d, "tie_word_embeddings", False),
            bos_token_id=_special_id(d, "bos_token_id", vocab_size),
            eos_token_id=_special_id(d, "eos_token_id", vocab_size),
            pad_token_id=_usable_pad_id(d.get("pad_token_id"), d["vocab_size"]),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that transformers' LlamaConfig (4.x and 5.x) loads to the same model."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling is not None else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "pretraining_tp": 1,
            "use_cache": True,
        }


def _check_reward_head(archs: Any, d: Mapping[str, Any]) -> None:
    """Refuse a config.json that is not a one-label LlamaForSequenceClassification (a scalar reward model)."""
    if CAUSAL_LM in archs:
        raise ValueError(f"architectures={list(archs)} is a causal LM: it has no score head, so it is no reward "
                         f"model; reward.model needs a {SEQ_CLS} with num_labels=1 (what TRL's RewardTrainer "
                         "saves), or use this checkpoint as the policy")
    bad = [a for a in archs if a != SEQ_CLS]
    if bad:
        raise ValueError(f"unsupported architecture {bad}; a llamarl reward model is a {SEQ_CLS}")
    id2label = d.get("id2label")
    if id2label is not None:
        if not isinstance(id2label, Mapping):
            raise ValueError(f"config field 'id2label' must be a mapping such as {{'0': 'LABEL_0'}}, got {id2label!r}")
        num_labels = len(id2label)
    else:  # transformers: num_labels only without id2label, 2 by default
        num_labels = _int_field(d, "num_labels", 2)
    if num_labels != 1:
        source = "id2label" if id2label is not None else "num_labels" if "num_labels" in d else \
            "no id2label in config.json: transformers' default"
        raise ValueError(f"the score head has num_labels={num_labels} ({source}); a scalar reward model needs "
                         'one label: save it with num_labels=1 (config.json id2label {"0": "LABEL_0"})')


def _normalize_rope_scaling(scaling: Mapping[str, Any]) -> dict | None:
    if not isinstance(scaling, Mapping):
        raise ValueError(f"LlamaConfig.rope_scaling must be None or a dict, got {type(scaling).__name__}")
    s = dict(scaling)
    rtype = s.pop("rope_type", None) or s.pop("type", None) or "default"
    s.pop("type", None)
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_scaling rope_type={rtype!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rtype == "default":
        return None
    out: dict[str, Any] = {"rope_type": rtype}
    if rtype == "linear":
        if "factor" not in s:
            raise ValueError("rope_scaling of type 'linear' needs a 'factor'")
        out["factor"] = float(s["factor"])
        if out["factor"] <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {out['factor']}")
    else:  # llama3
        missing = [k for k in _LLAMA3_KEYS if k not in s]
        if missing:
            raise ValueError(f"rope_scaling of type 'llama3' is missing {missing}")
        out["factor"] = float(s["factor"])
        out["low_freq_factor"] = float(s["low_freq_factor"])
        out["high_freq_factor"] = float(s["high_freq_factor"])
        out["original_max_position_embeddings"] = int(s["original_max_position_embeddings"])
        if out["factor"] < 1.0:
            raise ValueError(f"llama3 rope_scaling factor must be >= 1, got {out['factor']}")
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise ValueError(
                "llama3 rope_scaling needs high_freq_factor > low_freq_factor, got "
                f"{out['high_freq_factor']} <= {out['low_freq_factor']}"
            )
    return out


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3_COMMON = dict(
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    bos_token_id=128000,
    eos_token_id=128001,
)

LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    # The embedded default: character-level vocabulary of CharTokenizer, ~0.8M parameters.
    "tiny": LlamaConfig(
        vocab_size=CHAR_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=CHAR_BOS_ID,
        eos_token_id=CHAR_EOS_ID,
        pad_token_id=CHAR_PAD_ID,
    ),
    # ~22M parameters with a Llama-2-sized vocabulary: CPU benchmarks.
    "small": LlamaConfig(
        vocab_size=32000,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    # ~100M parameters (GPT-2-small-sized Llama): the top of the CPU benchmark range.
    "base": LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    "llama-2-7b": LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "llama-3.2-1b": LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
        tie_word_embeddings=True,
        **_LLAMA3_COMMON,
    ),
    "llama-3.1-8b": LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
        **_LLAMA3_COMMON,
    ),
    "llama-3.1-70b": LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
        **_LLAMA3_COMMON,
    ),
    "llama-3.1-405b": LlamaConfig(
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
        **_LLAMA3_COMMON,
    ),
}


def _int_field(d: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """An integer config.json field (an integral float such as 4096.0 is accepted, 100.7 or null is not)."""
    v = d.get(key, default)
    if not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v == int(v):
        return int(v)
    raise ValueError(f"config field {key!r} must be an integer, got {v!r}")


def _bool_field(d: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean config.json field: JSON true/false only (the string "false" would read as True)."""
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"config field {key!r} must be true or false, got {v!r}")
    return v


HF_DEFAULT_SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2}  # transformers.LlamaConfig's defaults


def _special_id(d: Mapping[str, Any], key: str, vocab_size: int) -> Any:
    """config.json's bos/eos_token_id as transformers reads it: an absent key takes transformers'
    LlamaConfig default (bos 1, eos 2: what its ``generate`` stops on), an explicit null stays None (no such
    token). A default that lies outside a vocabulary of <= 2 tokens is None: no token could match it."""
    if key in d:
        return d[key]
    default = HF_DEFAULT_SPECIAL_IDS[key]
    return default if default < vocab_size else None


def _usable_pad_id(pad: Any, vocab_size: Any) -> Any:
    """config.json's pad_token_id, or None for a value outside the vocabulary: some Llama conversions write
    -1 (or vocab_size) for "no pad token"; transformers only warns, and llamarl never reads the model's pad id
    (the tokenizer's is used), so such a value is dropped with a warning instead of refusing the checkpoint."""
    if isinstance(pad, int) and not isinstance(pad, bool) and isinstance(vocab_size, int) and not 0 <= pad < vocab_size:
        import warnings

        warnings.warn(f"config.json pad_token_id={pad} lies outside the vocabulary [0, {vocab_size}); ignoring it",
                      stacklevel=3)
        return None
    return pad
