"""Weight-only int8 / fp8 quantization of a Llama for the generator.

``quantize_model(model, "int8" | "fp8")`` swaps, in place, every ``nn.Linear`` inside the decoder
layers (q, k, v, o, gate, up, down projections) for a ``QuantizedLinear``:

    QuantizedLinear.forward(x) = quantized_linear(x, qweight, scale)
                               = (x @ float(qweight).T) * scale      fp32 accumulate, x's dtype out

with one fp32 scale per output channel (see llamarl_kernels/quant.py for the exact rounding rules).
The lm_head stays in the model dtype unless ``include_lm_head=True`` (its error lands directly on the
logits; for 8B+ models it is a small part of the decode bandwidth). The token embeddings always stay:
a lookup reads one row per token, so quantizing them saves memory but no decode bandwidth.

State layout: a quantized module keeps ``qweight`` [out, in] (int8 or float8_e4m3fn) and ``scale``
[out] (float32) as *buffers*, not parameters, so the weight sync can write new versions into them in
place (they live in the generator's flat buckets) and ``state_dict`` names them
``<module>.qweight`` / ``<module>.scale`` next to where ``<module>.weight`` was.
``quantized_state_names(model)`` gives that mapping for the weight-sync planner.

Backends: ``"triton"`` (default) runs the Triton kernels (on CPU only under TRITON_INTERPRET=1, and
slowly). ``"eager"`` runs the eager reference of the same math (llamarl_kernels.reference): an explicit
choice for CPU runs where interpreted Triton is too slow, never picked automatically.
Quantizing (``from_linear``, ``load_weight_``) gives identical bytes on both backends.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import llamarl_kernels
from llamarl_kernels import reference

MODES = ("int8", "fp8")
BACKENDS = ("triton", "eager")
_QDTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _check(mode: str, backend: str) -> None:
    if mode not in MODES:
        raise ValueError(f"quantization mode must be one of {MODES} (or 'none' for quantize_model), got {mode!r}")
    if backend not in BACKENDS:
        raise ValueError(f"quantization backend must be one of {BACKENDS}, got {backend!r}")


def _quantize_into(w: torch.Tensor, mode: str, backend: str, qweight: torch.Tensor, scale: torch.Tensor) -> None:
    """Quantize ``w`` and write the result into the existing buffers (storage is kept)."""
    if w.shape != qweight.shape:
        raise ValueError(f"weight of shape {tuple(w.shape)} does not match the quantized buffer "
                         f"{tuple(qweight.shape)} ([out_features, in_features])")
    w = w.detach().to(qweight.device)
    if backend == "triton":
        llamarl_kernels.quantize(w.contiguous(), mode, out=(qweight, scale))
    else:
        q, s = reference.quantize_ref(w, mode)
        qweight.copy_(q)
        scale.copy_(s)


class QuantizedLinear(nn.Module):
    """y = quantized_linear(x, qweight, scale, bias): a drop-in for ``nn.Linear`` on the generator."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mode: str,
        *,
        bias: bool = False,
        backend: str = "triton",
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        _check(mode, backend)
        self.in_features = in_features
        self.out_features = out_features
        self.mode = mode
        self.backend = backend
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=_QDTYPE[mode], device=device))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str, *, backend: str = "triton") -> "QuantizedLinear":
        """Quantize an ``nn.Linear``'s weight (its bias, if any, is kept as is)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"QuantizedLinear.from_linear expects an nn.Linear, got {type(linear).__name__}")
        w = linear.weight
        mod = cls(linear.in_features, linear.out_features, mode, bias=linear.bias is not None,
                  backend=backend, device=w.device, dtype=w.dtype)
        mod.load_weight_(w)
        if linear.bias is not None:
            mod.bias.copy_(linear.bias.detach())
        return mod

    @torch.no_grad()
    def load_weight_(self, weight: torch.Tensor) -> None:
        """Quantize a full-precision weight [out, in] into ``qweight`` / ``scale`` in place."""
        _quantize_into(weight, self.mode, self.backend, self.qweight, self.scale)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return reference.dequantize_ref(self.qweight, self.scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, self.qweight, self.scale, self.bias)

    def _run(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        if self.backend == "triton":
            return llamarl_kernels.quantized_linear(x, qweight, scale, bias)
        return reference.quantized_linear_ref(x, qweight, scale, bias)

    # the stacked-projection protocol (llamarl.models.stacked): qweight rows and scales stack along dim 0
    def stack_tensors(self) -> tuple[torch.Tensor, ...] | None:
        buffers = self._buffers  # direct lookups: this runs once per projection per decode step
        return (buffers["qweight"], buffers["scale"]) if buffers.get("bias") is None else None

    def stacked_forward(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self._run(x, qweight, scale)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}, "
                f"bias={self.bias is not None}, backend={self.backend}")


@dataclasses.dataclass(frozen=True)
class QuantizedParamNames:
    """Where a full-precision parameter ``weight`` went after quantization (state_dict names)."""

    weight: str  # e.g. "model.layers.0.self_attn.q_proj.weight" (trainer / HF name)
    qweight: str  # "model.layers.0.self_attn.q_proj.qweight"  int8 | float8_e4m3fn [out, in]
    scale: str  # "model.layers.0.self_attn.q_proj.scale"      float32 [out]
    mode: str  # "int8" | "fp8"


def _is_decoder_layer_linear(name: str) -> bool:
    return ".layers." in f".{name}."


def quantize_model(
    model: nn.Module,
    mode: str,
    *,
    include_lm_head: bool = False,
    backend: str = "triton",
) -> nn.Module:
    """Replace, in place, the decoder layers' ``nn.Linear`` modules by ``QuantizedLinear``; returns model.

    ``mode="none"`` returns the model untouched. ``include_lm_head`` also quantizes ``lm_head``; a tied
    lm_head is untied by this (the embedding keeps the full-precision table). Code that reads
    ``lm_head.weight`` afterwards must read ``qweight``/``scale`` instead.
    """
    if mode == "none":
        return model
    _check(mode, backend)
    targets: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            is_head = name.split(".")[-1] == "lm_head"
            if (is_head and include_lm_head) or (not is_head and _is_decoder_layer_linear(name)):
                targets.append((name, mod))
    if not any(n.split(".")[-1] != "lm_head" for n, _ in targets):
        raise ValueError(
            "quantize_model found no nn.Linear inside decoder layers (module names containing '.layers.'); "
            "it expects a llamarl Llama (or HF-named model) that has not been quantized already"
        )
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantizedLinear.from_linear(mod, mode, backend=backend))
    return model


def quantized_state_names(model: nn.Module) -> dict[str, QuantizedParamNames]:
    """Map each quantized parameter's original name (``<module>.weight``) to its buffer names and mode."""
    out: dict[str, QuantizedParamNames] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, QuantizedLinear):
            prefix = f"{name}." if name else ""
            out[f"{prefix}weight"] = QuantizedParamNames(
                weight=f"{prefix}weight", qweight=f"{prefix}qweight", scale=f"{prefix}scale", mode=mod.mode
            )
    return out
