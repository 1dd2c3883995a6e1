"""Test configuration shared by the whole suite.

Without a CUDA device, Triton kernels run under the interpreter: TRITON_INTERPRET=1 must be set before
any kernel module is imported, which is why it happens here, at collection time.
Markers: ``gpu`` (skipped without CUDA), ``slow`` (long CPU tests; run by default, deselect with
``-m "not slow"``).
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)  # tests run next to executor processes on small CI machines


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    """The device kernel tests run on: CUDA when present, else CPU (Triton interpreted)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
