"""Hugging Face checkpoint I/O for Llama: config.json + safetensors (single file or sharded index).

Directory layout read and written (the one transformers uses):

    config.json                         LlamaConfig.to_hf_dict() + "torch_dtype" and "dtype"
    model.safetensors                   every tensor, keys = HF parameter names
  or
    model.safetensors.index.json        {"metadata": {"total_size": bytes}, "weight_map": {key: shard}}
    model-00001-of-0000N.safetensors    the shards

Keys are exactly ``Llama.state_dict()`` keys, except that ``lm_head.weight`` is omitted when the
embeddings are tied (as transformers does). What loading checks, and where (``check_checkpoint`` runs
the same checks with the same messages, so a checkpoint it accepts passes them at load; only damaged
tensor data shows up later, when the tensors are read):

    keys    missing and extra keys are refused (extra: except rotary ``inv_freq`` buffers of old
            checkpoints, and ``lm_head.weight`` when tied, see below); from the headers, before any read
    shape   each tensor's, the one config.json implies; from the header, before reading the tensor
    dtype   one whitelist, ``LOADABLE_DTYPES`` (F64/F32/BF16/F16): float8, integer and other quantized
            tensors are refused, never silently upcast; from the header, before reading the tensor
    tied    with tie_word_embeddings=true, an ``lm_head.weight`` in the checkpoint is accepted only if its
            values equal ``model.embed_tokens.weight`` (some tools save both); a different head would be
            silently dropped, so it is refused (transformers 5 would load it untied). The one value check:
            it reads both tensors, in row blocks, and only when both are present.

The reward model (llamarl.models.reward_model: a LlamaForSequenceClassification, ``score.weight`` instead of
``lm_head.weight``) runs the same checks with its own expected keys (the ``expected`` arguments below).

Tensors are read on the CPU and copied into a model built on the meta device, converted to ``dtype``.
Each file is written under a temporary name and renamed, so no file is ever half-written; a crash during
a save can still leave a mix of old and new files.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from llamarl._fs import write_text_atomic
from llamarl.models.config import CAUSAL_LM, LlamaConfig
from llamarl.models.packing import owns_storage

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_IGNORED_KEY_RE = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def load_config(path: str | os.PathLike, architecture: str = CAUSAL_LM) -> LlamaConfig:
    """Read and validate ``path/config.json`` as a checkpoint of ``architecture`` (see
    ``LlamaConfig.from_hf_dict``)."""
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"checkpoint directory {d} does not exist")
    cfg_path = d / CONFIG_FILE
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: a Hugging Face checkpoint directory needs a config.json")
    raw = _read_json(cfg_path)
    try:
        return LlamaConfig.from_hf_dict(raw, architecture=architecture)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{cfg_path}: {e}") from e


def generation_eos_ids(path: str | os.PathLike) -> tuple[int, ...]:
    """The stop tokens of ``path/generation_config.json`` (``eos_token_id``: an int or a list), () without the
    file. Instruct checkpoints often list end-of-turn there and only end-of-text in config.json; transformers'
    ``generate`` stops at these."""
    f = Path(path) / GENERATION_CONFIG_FILE
    if not f.is_file():
        return ()
    eos = _read_json(f).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{f}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(ids)


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config`` holds, by HF name (no lm_head when tied)."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q, d)
        shapes[p + "self_attn.k_proj.weight"] = (kv, d)
        shapes[p + "self_attn.v_proj.weight"] = (kv, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, q)
        shapes[p + "mlp.gate_proj.weight"] = (f, d)
        shapes[p + "mlp.up_proj.weight"] = (f, d)
        shapes[p + "mlp.down_proj.weight"] = (d, f)
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
    shapes["model.norm.weight"] = (d,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def _weight_files(d: Path) -> dict[str, Path]:
    """key -> file holding it, from model.safetensors or the sharded index."""
    from safetensors import safe_open

    single, index = d / WEIGHTS_FILE, d / INDEX_FILE
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map' object mapping tensor names to shard files")
        files = sorted({d / name for name in weight_map.values()})
        for fp in files:
            if not fp.is_file():
                raise FileNotFoundError(f"shard {fp.name} listed in {index} is missing from {d}")
    else:
        present = sorted(p.name for p in d.iterdir())
        hint = ""
        if any(n.endswith((".bin", ".pt", ".pth")) for n in present):
            hint = " (found PyTorch pickles: convert them to safetensors first)"
        raise FileNotFoundError(f"{d} has neither {WEIGHTS_FILE} nor {INDEX_FILE}{hint}; files: {present}")

    where: dict[str, Path] = {}
    for fp in files:
        try:
            with safe_open(str(fp), framework="pt", device="cpu") as f:
                keys = list(f.keys())
        except Exception as e:  # safetensors raises SafetensorError / OSError on bad headers
            raise ValueError(f"{fp} is not a readable safetensors file ({type(e).__name__}: {e})") from e
        for k in keys:
            if k in where:
                raise ValueError(f"tensor {k!r} appears in both {where[k].name} and {fp.name}")
            where[k] = fp
    return where


def _check_keys(
    d: Path, where: dict[str, Path], config: LlamaConfig, expected: dict[str, tuple[int, ...]] | None = None
) -> dict[str, tuple[int, ...]]:
    """The expected shapes, after refusing missing tensors and ones a Llama of ``config`` lacks.

    ``expected``: the shapes of another model of ``config`` (the reward model's) instead of
    ``expected_shapes(config)``; every key is then required exactly, with no allowance for a tied lm_head."""
    tied_head_allowed = expected is None and config.tie_word_embeddings
    expected = expected_shapes(config) if expected is None else expected
    missing = [k for k in expected if k not in where]
    if missing:
        hint = ""
        if missing == ["lm_head.weight"]:
            hint = " (config.json says tie_word_embeddings=false; is the checkpoint tied?)"
        raise ValueError(f"{d}: checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:4]}{hint}")
    redundant_head = "lm_head.weight" if tied_head_allowed else None
    unexpected = [k for k in where if k not in expected and not _IGNORED_KEY_RE.match(k) and k != redundant_head]
    if unexpected:
        raise ValueError(
            f"{d}: checkpoint has {len(unexpected)} tensor(s) a Llama of this config.json does not have, "
            f"e.g. {unexpected[:4]} (wrong architecture or num_hidden_layers?)"
        )
    return expected


# safetensors header dtype -> torch dtype: the only dtypes a checkpoint tensor may have (both load paths)
LOADABLE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
EMBED_KEY, HEAD_KEY = "model.embed_tokens.weight", "lm_head.weight"
_COMPARE_BLOCK_BYTES = 64 << 20


def _check_header(fp: Path, key: str, sl, expected: tuple[int, ...]) -> None:
    """Refuse a tensor whose safetensors header (``sl``: a ``safe_open`` slice) has the wrong shape or a
    dtype outside ``LOADABLE_DTYPES``; the one check both ``check_checkpoint`` and ``load_state_dict`` run."""
    shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
    if shape != expected:
        raise ValueError(
            f"{fp.name}: tensor {key!r} has shape {shape} but config.json implies {expected} "
            "(hidden_size / intermediate_size / heads / head_dim / vocab_size disagree with the weights)"
        )
    if dtype not in LOADABLE_DTYPES:
        raise ValueError(
            f"{fp.name}: tensor {key!r} has dtype {dtype}; llamarl loads only float64/float32/bfloat16/float16 "
            f"weights ({'/'.join(LOADABLE_DTYPES)}), it never upcasts float8, integer or other quantized tensors "
            "silently: convert the checkpoint to bf16 (dequantizing it first) and load that"
        )


def _check_tied_head(d: Path, where: dict[str, Path], config: LlamaConfig) -> None:
    """With tie_word_embeddings, accept an ``lm_head.weight`` in the checkpoint only if it equals the
    embedding (shape, loadable dtype, and every value, compared exactly after an exact cast to fp64).

    Runs only when both tensors are present and the config is tied; reads both in row blocks of
    ~64 MiB, so it never holds more than a block of each in memory."""
    if not config.tie_word_embeddings or HEAD_KEY not in where:
        return
    from safetensors import safe_open

    shape = (config.vocab_size, config.hidden_size)
    with safe_open(str(where[HEAD_KEY]), framework="pt", device="cpu") as fh, \
            safe_open(str(where[EMBED_KEY]), framework="pt", device="cpu") as fe:
        head, emb = fh.get_slice(HEAD_KEY), fe.get_slice(EMBED_KEY)
        _check_header(where[HEAD_KEY], HEAD_KEY, head, shape)
        _check_header(where[EMBED_KEY], EMBED_KEY, emb, shape)
        rows = max(1, _COMPARE_BLOCK_BYTES // (8 * config.hidden_size))
        for r in range(0, config.vocab_size, rows):
            try:
                same = torch.equal(head[r : r + rows].to(torch.float64), emb[r : r + rows].to(torch.float64))
            except Exception as e:  # safetensors raises SafetensorError / OSError on a damaged file
                raise ValueError(f"{d}: {HEAD_KEY!r} or {EMBED_KEY!r} could not be read ({type(e).__name__}: "
                                 f"{e}); the file may be truncated or corrupt") from e
            if not same:
                raise ValueError(
                    f"{d}: config.json says tie_word_embeddings=true, but the checkpoint's {HEAD_KEY!r} "
                    f"({where[HEAD_KEY].name}) differs from {EMBED_KEY!r} ({where[EMBED_KEY].name}), first in "
                    f"rows [{r}, {min(r + rows, config.vocab_size)}); a tied model would silently drop that "
                    'output head. To use the checkpoint\'s head (as transformers 5 does), set '
                    '"tie_word_embeddings": false in config.json; to use the embedding as the head, delete '
                    f"{HEAD_KEY!r} from the checkpoint."
                )


def _check_headers(where: dict[str, Path], expected: dict[str, tuple[int, ...]]) -> None:
    """``_check_header`` for every expected tensor of the files in ``where``, from the headers only."""
    from safetensors import safe_open

    for fp in sorted(set(where.values())):  # _weight_files opened each: headers read, sizes covered
        with safe_open(str(fp), framework="pt", device="cpu") as f:
            for k in f.keys():
                if k in expected:
                    _check_header(fp, k, f.get_slice(k), expected[k])


def check_checkpoint(path: str | os.PathLike) -> LlamaConfig:
    """Everything ``load_llama`` would refuse in a Hugging Face directory, found from config.json and the
    safetensors headers (keys, shapes, dtypes) without reading a tensor, except in one case: a tied config
    whose checkpoint also holds ``lm_head.weight``, whose values are compared with the embedding's (see the
    module docstring). A run checks its model before it starts anything."""
    d = Path(path)
    config = load_config(d)
    where = _weight_files(d)
    expected = _check_keys(d, where, config)
    _check_headers(where, expected)
    _check_tied_head(d, where, config)
    return config


def load_state_dict(
    path: str | os.PathLike, config: LlamaConfig, expected: dict[str, tuple[int, ...]] | None = None
) -> dict[str, torch.Tensor]:
    """Read and validate all tensors of a checkpoint (CPU, checkpoint dtype; checks in the module docstring).
    A redundant tied ``lm_head.weight`` is checked, then left out: the model ties it to the embedding.
    ``expected``: exactly these keys and shapes instead (see ``_check_keys``)."""
    from safetensors import safe_open

    d = Path(path)
    where = _weight_files(d)
    tied_head_allowed = expected is None
    expected = _check_keys(d, where, config, expected)
    if tied_head_allowed:
        _check_tied_head(d, where, config)
    by_file: dict[Path, list[str]] = {}
    for k in expected:
        by_file.setdefault(where[k], []).append(k)
    out: dict[str, torch.Tensor] = {}
    for fp, keys in by_file.items():
        try:
            with safe_open(str(fp), framework="pt", device="cpu") as f:
                for k in keys:
                    _check_header(fp, k, f.get_slice(k), expected[k])
                    out[k] = f.get_tensor(k)
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(
                f"{fp} could not be read ({type(e).__name__}: {e}); the file may be truncated or corrupt"
            ) from e
    return out


def load_llama(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """``Llama.from_pretrained``: build on the meta device, then materialise and copy the checkpoint."""
    from llamarl.models.llama import Llama

    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"from_pretrained dtype must be a floating torch.dtype, got {dtype!r}")
    config = load_config(path)
    tensors = load_state_dict(path, config)
    with torch.device("meta"):
        model = Llama(config)
    model = model.to(dtype=dtype).to_empty(device=torch.device(device))
    if config.tie_word_embeddings:  # to_empty re-creates Parameters: restore the tie
        model.lm_head.weight = model.model.embed_tokens.weight
    return fill(model, tensors)


def fill(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``model`` (materialised, e.g. by ``to_empty``) with each checkpoint tensor copied into the parameter of
    its name (converted to the parameter's dtype and device), in eval mode; the loaders of Llama and of the
    reward model share it."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k, t in tensors.items():
            params[k].copy_(t)
    return model.eval()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save_llama(model, path: str | os.PathLike, max_shard_bytes: int | None = None) -> None:
    """``Llama.save_pretrained``: config.json + one safetensors file, or shards of <= max_shard_bytes."""
    config: LlamaConfig = model.config
    save_checkpoint(model, path, expected_shapes(config), config.to_hf_dict(), max_shard_bytes)


def save_checkpoint(
    model, path: str | os.PathLike, expected: dict[str, tuple[int, ...]], hf_config: dict,
    max_shard_bytes: int | None = None,
) -> None:
    """Write ``model``'s tensors named in ``expected`` (each checked against its shape) and ``hf_config`` +
    its dtype as config.json; refuses parameters outside ``expected`` (a tied lm_head aside)."""
    from safetensors.torch import save_file

    config: LlamaConfig = model.config
    sd = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for k, shape in expected.items():
        t = sd.get(k)
        if t is None or tuple(t.shape) != shape or not t.is_floating_point():
            raise ValueError(
                f"save_pretrained: parameter {k!r} is missing or not a plain {shape} float tensor "
                "(quantized models cannot be saved as HF checkpoints; save the unquantized weights)"
            )
        t = t.detach().to("cpu").contiguous()
        if not owns_storage(t):
            t = t.clone()  # a view into a flat buffer (packed or bucket weights): safetensors saves whole storages
        tensors[k] = t
    extra = [k for k in sd if k not in expected and not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if extra:
        raise ValueError(f"save_pretrained: model has parameters HF Llama does not: {extra[:4]}")

    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    # shards
    if max_shard_bytes is None:
        groups = [list(tensors)]
    else:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        groups, cur, size = [], [], 0
        for k, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if cur and size + nbytes > max_shard_bytes:
                groups.append(cur)
                cur, size = [], 0
            cur.append(k)
            size += nbytes
        groups.append(cur)
    names = (
        [WEIGHTS_FILE]
        if max_shard_bytes is None
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    # remove the other layout's files first, so a completed save leaves no file of another layout
    for old in d.iterdir():
        if old.name in (WEIGHTS_FILE, INDEX_FILE) or _SHARD_RE.match(old.name):
            if old.name not in names:
                old.unlink()
    for name, keys in zip(names, groups):
        tmp = d / (name + ".tmp")
        save_file({k: tensors[k] for k in keys}, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, d / name)
    if max_shard_bytes is not None:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {k: name for name, keys in zip(names, groups) for k in keys},
        }
        _write_json(d / INDEX_FILE, index)
    cfg = dict(hf_config)
    cfg["torch_dtype"] = cfg["dtype"] = _dtype_name(model.dtype)  # transformers 4.x / 5.x spelling
    _write_json(d / CONFIG_FILE, cfg)


def _write_json(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")
