"""Where each weight lives on the trainer and on the generator: parameter specs and the two layouts.

Every parameter is handled as a row-major matrix ``[rows, cols]`` with ``rows = shape[0]`` and
``cols = prod(shape[1:])`` (``cols = 1`` for a 1-D norm weight); all shards below are rectangles of it.

Trainer layout (``TrainerLayout``), FSDP style over ``R_t`` ranks:
    sharded     rank t holds rows [t*c, min((t+1)*c, rows)) with c = ceil(rows / R_t), i.e. the
                ``torch.chunk(w, R_t, dim=0)[t]`` shard of FSDP2: the last shard may be shorter and
                trailing ranks may hold zero rows. The local tensor is contiguous ``[n_t, *shape[1:]]``.
    replicated  every rank holds the whole tensor; the copy work is still split by the same row chunks,
                so each trainer rank moves 1/R_t of the bytes.
Either way a trainer rank owns *whole rows*, which is what makes per-row quantization local to it.

Generator layout (``GeneratorLayout``): ``replicas`` independent copies, each tensor parallel over
``tp_size`` ranks; global generator rank ``g = replica * tp_size + tp_rank``. Per parameter
(``ParamSpec.tp_split``):
    0     column-parallel (q, k, v, gate, up, lm_head, embeddings): rank p holds rows R_p
    1     row-parallel (o, down): rank p holds columns C_p of every row
    None  replicated (norm weights): every rank holds everything
with balanced bounds: R_p = [p*q + min(p, r), ...) for rows = q*tp_size + r, i.e. the first r ranks get
one extra row; this equals the usual even split whenever tp_size divides the dimension.

Split units (``ParamSpec.tp_unit``): a split dimension may be made of indivisible blocks of ``tp_unit``
rows (tp_split 0) or columns (tp_split 1) - one attention head (``head_dim``) for q/k/v rows and o
columns. Such a dimension is only split between whole units, so ``tp_size`` must divide its number of
units (``GeneratorLayout.check_specs``, run by every plan); then the balanced bounds are the even split
and every shard boundary is a unit boundary. ``tp_unit = 1`` (the default) allows any split, even an
uneven one: that is how the vocabulary (embeddings, lm_head) and the intermediate size (gate/up rows,
down columns) are split, which llamarl.parallel.tensor_parallel supports.

Quantized generators (``GeneratorLayout.quant = "int8" | "fp8"``): every linear weight inside the
decoder layers (and ``lm_head`` if ``quantize_lm_head``) is stored as ``q`` (int8 / float8_e4m3fn, same
shape and split as the weight) plus ``<name>_scale`` (float32 ``[rows]``, one scale per row). The scale
follows the rows: split like the weight for column-parallel weights, replicated for row-parallel ones
(each rank holds a column slice of every row, and every row's scale comes from the full row). The
expansion of ``ParamSpec``s into the tensors that are actually moved is ``sync_tensors``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
SCALE_SUFFIX = "_scale"

_COLUMN_PARALLEL = re.compile(
    r"^(model\.embed_tokens\.weight|lm_head\.weight|"
    r"model\.layers\.\d+\.self_attn\.[qkv]_proj\.(weight|bias)|"
    r"model\.layers\.\d+\.mlp\.(gate|up)_proj\.(weight|bias))$"
)
_ROW_PARALLEL = re.compile(r"^model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight$")
_REPLICATED = re.compile(
    r"^(model\.norm\.weight|model\.layers\.\d+\.(input|post_attention)_layernorm\.weight|"
    r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.bias)$"
)
_QUANTIZABLE = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


class _Shaped:
    """Row view of a tensor's shape: rows = dim 0, cols = the product of the other dims."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ParamSpec(_Shaped):
    """One parameter: its full (unsharded) shape and dtype, and how tensor parallelism splits it.

    ``tp_unit``: the split dimension (dim 0 for tp_split=0, dim 1 for tp_split=1) consists of blocks of
    ``tp_unit`` rows / columns that must stay on one generator rank (``head_dim`` for the q/k/v rows and
    o columns of attention); it divides that dimension, and is 1 (splittable anywhere) when not split.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tp_split: int | None = None
    tp_unit: int = 1

    @property
    def tp_units(self) -> int:
        """How many indivisible units the split dimension has (its size when ``tp_unit`` is 1)."""
        return self.shape[self.tp_split] // self.tp_unit if self.tp_split is not None else 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not self.shape or any(s <= 0 for s in self.shape):
            raise ValueError(f"ParamSpec {self.name!r}: shape must be non-empty with positive sizes, got {self.shape}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"ParamSpec {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        if self.tp_split not in (None, 0, 1):
            raise ValueError(f"ParamSpec {self.name!r}: tp_split must be None, 0 or 1, got {self.tp_split!r}")
        if self.tp_split == 1 and len(self.shape) != 2:
            raise ValueError(f"ParamSpec {self.name!r}: a row-parallel (tp_split=1) split needs a 2-D weight, "
                             f"got shape {self.shape}")
        if isinstance(self.tp_unit, bool) or not isinstance(self.tp_unit, int) or self.tp_unit < 1:
            raise ValueError(f"ParamSpec {self.name!r}: tp_unit must be an int >= 1, got {self.tp_unit!r}")
        if self.tp_unit > 1:
            if self.tp_split is None:
                raise ValueError(f"ParamSpec {self.name!r}: tp_unit={self.tp_unit} needs a split dimension; a "
                                 "replicated (tp_split=None) parameter takes tp_unit=1")
            n = self.shape[self.tp_split]
            if n % self.tp_unit:
                raise ValueError(f"ParamSpec {self.name!r}: tp_unit={self.tp_unit} does not divide dim "
                                 f"{self.tp_split} of shape {self.shape} ({n}); a head-split weight has "
                                 "heads * head_dim there - check head_dim")


def llama_tp_split(name: str) -> int | None:
    """The tensor-parallel split of a Hugging Face Llama parameter name (ValueError if it is not one)."""
    if _COLUMN_PARALLEL.match(name):
        return 0
    if _ROW_PARALLEL.match(name):
        return 1
    if _REPLICATED.match(name):
        return None
    raise ValueError(
        f"{name!r} is not a Hugging Face Llama parameter name (model.embed_tokens.weight, "
        "model.layers.{i}.self_attn.{q,k,v,o}_proj.weight, model.layers.{i}.mlp.{gate,up,down}_proj.weight, "
        "model.layers.{i}.{input,post_attention}_layernorm.weight, model.norm.weight, lm_head.weight); "
        "build the ParamSpec list yourself for other models"
    )


_HEAD_SPLIT = re.compile(r"^model\.layers\.\d+\.self_attn\.([qkv]_proj\.(weight|bias)|o_proj\.weight)$")


def llama_tp_unit(name: str, head_dim: int | None) -> int:
    """The split unit of a Llama parameter: ``head_dim`` for q/k/v rows and o columns, else 1."""
    return int(head_dim) if head_dim is not None and _HEAD_SPLIT.match(name) else 1


def _unit_noun(spec: ParamSpec) -> str:
    """What one ``tp_unit`` of ``spec`` is, for error messages."""
    if ".self_attn.k_proj." in spec.name or ".self_attn.v_proj." in spec.name:
        return "key/value heads"
    if ".self_attn.q_proj." in spec.name or ".self_attn.o_proj." in spec.name:
        return "attention heads"
    return f"units of {spec.tp_unit}"


def _cfg(source: Any, key: str, default: Any = None) -> Any:
    if isinstance(source, Mapping):
        return source.get(key, default)
    return getattr(source, key, default)


def llama_param_specs(source: Any, dtype: torch.dtype | None = None, *,
                      head_dim: int | None = None) -> list[ParamSpec]:
    """``ParamSpec``s of a Llama model, from a state dict (name -> tensor) or a config.

    ``source`` may be a state dict (shapes and dtypes are read from the tensors; ``dtype`` overrides the
    dtype), a ``LlamaConfig``-like object or an HF ``config.json`` dict (``dtype`` defaults to float32).
    Order: embeddings, then per layer the HF module order, then final norm and lm_head. A tensor that is
    the same memory as an earlier one (a tied lm_head in ``model.state_dict()``) is one parameter, listed
    once under its first name, as ``named_parameters()`` and the config path list it.

    Attention weights get ``tp_unit = head_dim`` (q/k/v rows, o columns), so a plan refuses a generator
    ``tp_size`` that would split inside a head. A config gives head_dim; a state dict has no head counts,
    so pass ``head_dim`` with it to get that check (without it, its specs have ``tp_unit = 1``).
    """
    if isinstance(source, Mapping) and source and all(isinstance(v, torch.Tensor) for v in source.values()):
        seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
        specs = []
        for n, t in source.items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            if key[0] and key in seen:  # (meta tensors, without memory, all have address 0)
                continue  # tied to an earlier tensor
            seen.add(key)
            spec = ParamSpec(n, tuple(t.shape), dtype or t.dtype, llama_tp_split(n), llama_tp_unit(n, head_dim))
            specs.append(spec)
        return specs
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in need if _cfg(source, k) is None]
    if missing:
        raise ValueError(f"llama_param_specs needs a state dict or a Llama config; {type(source).__name__} lacks "
                         f"{', '.join(missing)}")
    dt = dtype or torch.float32
    d, v = int(_cfg(source, "hidden_size")), int(_cfg(source, "vocab_size"))
    inter = int(_cfg(source, "intermediate_size"))
    heads = int(_cfg(source, "num_attention_heads"))
    kv_heads = int(_cfg(source, "num_key_value_heads") or heads)
    cfg_head_dim = int(_cfg(source, "head_dim") or d // heads)
    if head_dim is not None and int(head_dim) != cfg_head_dim:
        raise ValueError(f"llama_param_specs: head_dim={head_dim} contradicts the config's head_dim {cfg_head_dim}; "
                         "leave head_dim out for a config (it is read from it)")
    head_dim = cfg_head_dim
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, d))]
    for i in range(int(_cfg(source, "num_hidden_layers"))):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (q, d)),
            (p + "self_attn.k_proj.weight", (kv, d)),
            (p + "self_attn.v_proj.weight", (kv, d)),
            (p + "self_attn.o_proj.weight", (d, q)),
            (p + "mlp.gate_proj.weight", (inter, d)),
            (p + "mlp.up_proj.weight", (inter, d)),
            (p + "mlp.down_proj.weight", (d, inter)),
            (p + "input_layernorm.weight", (d,)),
            (p + "post_attention_layernorm.weight", (d,)),
        ]
    shapes.append(("model.norm.weight", (d,)))
    if not _cfg(source, "tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (v, d)))
    return [ParamSpec(n, s, dt, llama_tp_split(n), llama_tp_unit(n, head_dim)) for n, s in shapes]


# ----------------------------------------------------------------------------------------------------
# shard bounds
# ----------------------------------------------------------------------------------------------------
def chunk_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows of ``torch.chunk(x, world)[rank]`` (FSDP2): chunks of ceil(n / world), trailing ones shorter."""
    c = -(-n // world)
    return min(rank * c, n), min((rank + 1) * c, n)


def balanced_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """The rank-th of ``world`` contiguous parts of [0, n) whose sizes differ by at most one."""
    q, r = divmod(n, world)
    start = rank * q + min(rank, r)
    return start, start + q + (1 if rank < r else 0)


def _check_size(field: str, value) -> None:
    """A rank count must be a plain int >= 1 (not a bool, a float or a string that merely compares like one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field} must be an integer >= 1, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class TrainerLayout:
    """FSDP-style dim-0 shards over ``world_size`` trainer ranks, or the full tensor on every rank."""

    world_size: int = 1
    replicated: bool = False

    def __post_init__(self) -> None:
        _check_size("TrainerLayout.world_size", self.world_size)

    def rows(self, spec: ParamSpec, rank: int) -> tuple[int, int]:
        """The rows of ``spec`` this trainer rank copies (and, when sharded, holds)."""
        self._check_rank(rank)
        return chunk_bounds(spec.rows, self.world_size, rank)

    def held_rows(self, spec: ParamSpec, rank: int) -> tuple[int, int]:
        """The rows present in the rank's local tensor."""
        return (0, spec.rows) if self.replicated else self.rows(spec, rank)

    def local_shape(self, spec: ParamSpec, rank: int) -> tuple[int, ...]:
        a, b = self.held_rows(spec, rank)
        return (b - a, *spec.shape[1:])

    def shard(self, full: torch.Tensor, spec: ParamSpec, rank: int) -> torch.Tensor:
        """This rank's local tensor cut from the full weight (contiguous; a reference for tests and tools)."""
        a, b = self.held_rows(spec, rank)
        return full[a:b].contiguous()

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"trainer rank {rank} is not in [0, {self.world_size})")


@dataclass(frozen=True)
class GeneratorLayout:
    """``replicas`` generator copies, each tensor parallel over ``tp_size`` ranks; optional int8/fp8."""

    tp_size: int = 1
    replicas: int = 1
    quant: str | None = None
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        _check_size("GeneratorLayout.tp_size", self.tp_size)
        _check_size("GeneratorLayout.replicas", self.replicas)
        if self.quant not in (None, *QUANT_DTYPES):
            raise ValueError(f"GeneratorLayout.quant must be None, 'int8' or 'fp8', got {self.quant!r}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.replicas

    def tp_rank(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.tp_size

    def replica(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.tp_size

    def region(self, spec: "ParamSpec | SyncTensor", rank: int) -> tuple[int, int, int, int]:
        """(row0, row1, col0, col1): the rectangle of the [rows, cols] matrix this rank holds."""
        p = self.tp_rank(rank)
        if spec.tp_split == 0:
            return (*balanced_bounds(spec.rows, self.tp_size, p), 0, spec.cols)
        if spec.tp_split == 1:
            return (0, spec.rows, *balanced_bounds(spec.cols, self.tp_size, p))
        return (0, spec.rows, 0, spec.cols)

    def local_shape(self, spec: "ParamSpec | SyncTensor", rank: int) -> tuple[int, ...]:
        r0, r1, c0, c1 = self.region(spec, rank)
        if spec.tp_split == 1:
            return (r1 - r0, c1 - c0)
        return (r1 - r0, *spec.shape[1:])

    def shard(self, full: torch.Tensor, spec: "ParamSpec | SyncTensor", rank: int) -> torch.Tensor:
        """The tensor this rank holds, cut from the full one (the reference a sync must reproduce)."""
        r0, r1, c0, c1 = self.region(spec, rank)
        if spec.tp_split == 1:
            return full[r0:r1, c0:c1].contiguous()
        return full[r0:r1].contiguous()

    def check_specs(self, specs: Sequence[ParamSpec]) -> None:
        """Raise ValueError unless ``tp_size`` splits every parameter between whole ``tp_unit``s.

        The invariant a plan relies on: for every spec with ``tp_unit > 1``, ``tp_size`` divides its
        ``tp_units`` (e.g. the attention and key/value head counts), so each rank's rows / columns are
        whole heads. Dimensions with ``tp_unit = 1`` (vocabulary, intermediate size) may split unevenly.
        """
        bad = [s for s in specs if s.tp_unit > 1 and s.tp_units % self.tp_size]
        if not bad:
            return
        groups: dict[tuple[int, str], list[str]] = {}  # (units, noun) -> names, one entry per head count
        for s in bad:
            groups.setdefault((s.tp_units, _unit_noun(s)), []).append(s.name)
        what = " or ".join(f"the model's {n} {noun} ({names[0]}{f' and {len(names) - 1} more' if names[1:] else ''})"
                            for (n, noun), names in groups.items())
        g = math.gcd(*(s.tp_units for s in specs if s.tp_unit > 1))
        ok = [r for r in range(1, g + 1) if g % r == 0]
        raise ValueError(f"GeneratorLayout.tp_size={self.tp_size} does not divide {what}: its shards would split "
                         f"a head between ranks and the generator's attention would be wrong; use tp_size in "
                         f"{{{', '.join(map(str, ok))}}}")

    def quantizes(self, spec: ParamSpec) -> bool:
        """Whether this layout stores ``spec`` as (q, scale)."""
        if self.quant is None or len(spec.shape) != 2:
            return False
        return bool(_QUANTIZABLE.match(spec.name)) or (self.quantize_lm_head and spec.name == "lm_head.weight")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"generator rank {rank} is not in [0, {self.world_size}) "
                             f"(tp_size={self.tp_size} x replicas={self.replicas})")


@dataclass(frozen=True)
class SyncTensor(_Shaped):
    """A tensor the sync moves: a parameter as is, or the q / scale half of a quantized one."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tp_split: int | None
    param: str  # the ParamSpec it comes from
    kind: str  # "param" | "qweight" | "scale"


def sync_tensors(specs: Sequence[ParamSpec], generator: GeneratorLayout) -> tuple[SyncTensor, ...]:
    """The tensors moved for ``specs`` into ``generator``, in order (q then scale for quantized ones).

    Raises ValueError for repeated names or a ``tp_size`` that splits inside a ``tp_unit``
    (``GeneratorLayout.check_specs``)."""
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"parameter names must be unique, these repeat: {dup}")
    generator.check_specs(specs)
    out: list[SyncTensor] = []
    for s in specs:
        if generator.quantizes(s):
            if not s.dtype.is_floating_point:
                raise TypeError(f"{s.name}: quantize-on-sync needs a floating-point trainer weight, got {s.dtype}")
            out.append(SyncTensor(s.name, s.shape, QUANT_DTYPES[generator.quant], s.tp_split, s.name, "qweight"))
            out.append(SyncTensor(s.name + SCALE_SUFFIX, (s.rows,), torch.float32,
                                  0 if s.tp_split == 0 else None, s.name, "scale"))
        else:
            out.append(SyncTensor(s.name, s.shape, s.dtype, s.tp_split, s.name, "param"))
    return tuple(out)
