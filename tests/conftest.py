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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama over the CharTokenizer vocabulary, saved by transformers (the reference): (the
    transformers model, its directory). For the llamarl.eval tests."""
    transformers = pytest.importorskip("transformers")
    from llamarl.models import CharTokenizer

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=CharTokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("eval_model")
    hf.save_pretrained(path)
    CharTokenizer().save(path)
    return hf, path
