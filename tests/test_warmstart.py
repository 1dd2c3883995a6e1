"""The supervised warm start's batch and loss (llamarl.warmstart): the loss is the mean negative log-likelihood
of exactly the answer tokens and the EOS after them, given everything before (a hand-built reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dist_harness import random_model
from llamarl.data import Sample
from llamarl.models import LlamaConfig
from llamarl.warmstart import sft_batch, sft_loss

CFG = LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=32)


def test_the_sft_loss_covers_the_answer_and_eos_tokens_only():
    samples = [Sample("a", "p", "7"), Sample("b", "q", "12")]
    prompts = {"a": [3, 4, 5], "b": [6, 7]}
    answers = {"7": [8], "12": [9, 10]}
    ids, mask = sft_batch(samples, lambda s: prompts[s.id], lambda a: answers[a], eos_id=2, pad_id=0)
    assert ids.tolist() == [[3, 4, 5, 8, 2], [6, 7, 9, 10, 2]]
    model = random_model(CFG)
    with torch.no_grad():
        got = sft_loss(model, ids, mask)
        logp = F.log_softmax(model(ids).double(), dim=-1)
    # by hand: row a predicts 8 after [3, 4, 5] and EOS after 8; row b 9 after [6, 7], 10 after 9, EOS after 10
    wanted = [(0, 2, 8), (0, 3, 2), (1, 1, 9), (1, 2, 10), (1, 3, 2)]
    reference = -sum(float(logp[row, pos, token]) for row, pos, token in wanted) / len(wanted)
    assert abs(float(got) - reference) < 1e-5


def test_the_presets_warm_start_keys_stay_the_same():
    """Cached warm starts stay valid while what they depend on is unchanged: a DataConfig field added later and
    left at its default does not change the key (data.eval_dataset did: every run retrained its warm start, and
    a resumed one its KL reference). Changing what a warm start computes is done by bumping "warmstart-v2"."""
    from llamarl.presets import PRESETS
    from llamarl.training import warm_start_key

    assert warm_start_key(PRESETS["default"]) == "abbd338fecc2ed0d"
    assert warm_start_key(PRESETS["smoke"]) == "e3151aadb913fc55"


def test_an_unwritable_warm_start_cache_is_refused_before_the_warm_start(tmp_path, capsys):
    from llamarl.train import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["--preset", "smoke", "--set", f"warm_start.cache_dir={blocker / 'cache'}",
                 "--out", str(tmp_path / "run")]) == 2
    assert f"warm_start.cache_dir: cannot write {blocker / 'cache'}: " in capsys.readouterr().err
