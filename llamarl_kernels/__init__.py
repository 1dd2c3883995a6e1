"""Triton kernels for llamarl, one op per file; ``reference.py`` is the eager specification of each.

Names are resolved lazily so that ``import llamarl_kernels`` never imports Triton by itself: on a CPU
machine the tests set ``TRITON_INTERPRET=1`` before the first kernel import, and that must still be
possible after this package was imported.
"""

import importlib

_EXPORTS = {
    # name -> module (relative to this package) that defines it
    "fused_aipo_loss": "aipo_loss",
    "fused_logprobs": "logprobs",
    "rms_norm": "fused_ops",
    "rope": "fused_ops",
    "silu_mul": "fused_ops",
    "quantize": "quant",
    "dequantize": "quant",
    "quantized_linear": "qlinear",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'llamarl_kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"llamarl_kernels.{module}"), name)
