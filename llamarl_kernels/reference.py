"""Eager PyTorch specification of every Triton kernel in llamarl_kernels.

Each function here has the same signature as the kernel it specifies and is written to be read next
to the math. Tests compare kernel and reference against float64 evaluations of these functions.
Kernel authors: add your reference below, in its own section; never rewrite other sections.
"""

import torch  # noqa: F401  (used by the sections below)
