"""RolloutBatch.stats: the per-step rollout statistics of metrics.jsonl, against hand-computed values."""

import math

from llamarl.rollouts import Rollout, RolloutBatch


def _rollout(group: int, tokens: int, reward: float, finish: str = "stop", error: str | None = None) -> Rollout:
    return Rollout(f"s{group}", group, [1], list(range(tokens)), [0.0] * tokens, [0] * tokens, "", finish,
                   reward=reward, reward_error=error)


def test_rewards_over_scored_samples_groups_and_lengths():
    batch = RolloutBatch([
        _rollout(0, 3, 1.0), _rollout(0, 5, 0.0, "length"),  # a group that teaches something
        _rollout(1, 2, 1.0), _rollout(1, 4, 1.0),  # all correct: zero std
        _rollout(2, 0, 0.0, error="boom"), _rollout(2, 6, 0.0, "length"),  # one scored sample: zero std
    ], n=2)
    stats = batch.stats()
    scored = [1.0, 0.0, 1.0, 1.0, 0.0]
    mean = sum(scored) / 5
    assert stats["reward_mean"] == mean == 0.6
    assert math.isclose(stats["reward_std"], math.sqrt(sum((x - mean) ** 2 for x in scored) / 5), rel_tol=1e-15)
    assert stats["zero_std_frac"] == 2 / 3
    assert stats["completion_len_mean"] == 20 / 6 and stats["completion_len_max"] == 6
    assert stats["length_capped_frac"] == 2 / 6


def test_no_scored_sample_gives_nan_rewards():
    stats = RolloutBatch([_rollout(0, 1, 0.0, error="x"), _rollout(0, 2, 0.0, error="y")], n=2).stats()
    assert math.isnan(stats["reward_mean"]) and math.isnan(stats["reward_std"]) and stats["zero_std_frac"] == 1.0
