"""How a step's stats combine those of its updates (llamarl.executors.step_stats.combine_updates)."""

import math

from llamarl.executors.step_stats import combine_updates


def _update(loss, grad_norm, tokens, empty=False):
    return {"applied": not empty, "empty": empty, "loss": loss, "grad_norm": grad_norm, "lr": 1e-3, "train_s": 0.5,
            "tokens": tokens, "ratio_mean": 1.25}


def test_an_update_without_a_trained_token_does_not_dilute_the_logged_loss():
    """mini_batches=2 where one mini-batch was truncated away (mask_truncated): one AdamW update was made, and
    the step logs its loss and gradient norm, not their mean with the empty update's zeros."""
    made, empty = _update(-0.08, 1.5, 12.0), _update(0.0, 0.0, 0.0, empty=True)
    for results in ([made, empty], [empty, made], [empty, made, empty]):
        stats = combine_updates(results)
        assert stats["loss"] == -0.08 and stats["grad_norm"] == 1.5
        assert stats["updates"] == 1 and stats["empty_updates"] == len(results) - 1 and stats["tokens"] == 12.0
    two = combine_updates([made, empty, _update(-0.02, 0.5, 4.0)])
    assert math.isclose(two["loss"], -0.05) and math.isclose(two["grad_norm"], 1.0) and two["updates"] == 2
    nothing = combine_updates([empty, empty])
    assert not nothing["applied"] and nothing["loss"] == 0.0 and nothing["grad_norm"] == 0.0
    # a non-finite update stays in the mean, so the step shows it
    assert math.isnan(combine_updates([made, _update(math.nan, math.nan, 3.0)])["loss"])
