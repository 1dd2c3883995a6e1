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


def test_dynamic_sampling_chooses_informative_groups_then_scored_flat_ones_in_draw_order():
    from llamarl.rollouts import choose_groups

    informative = [_rollout(0, 1, 1.0), _rollout(0, 1, 0.0)]
    flat = [_rollout(0, 1, 0.0), _rollout(0, 1, 0.0)]
    half_failed = [_rollout(0, 1, 0.0), _rollout(0, 1, 0.0, error="x")]
    failed = [_rollout(0, 1, 0.0, error="x"), _rollout(0, 1, 0.0, error="y")]
    drawn = [failed, informative, half_failed, flat, informative, informative]
    assert choose_groups(drawn, 2) == [1, 4]  # the first two informative ones
    assert choose_groups(drawn, 4) == [1, 3, 4, 5]
    assert choose_groups(drawn, 5) == [1, 2, 3, 4, 5]  # then flat, the most scored first: failed last
    assert choose_groups(drawn[:3], 3) == [0, 1, 2]


def test_lengths_and_tokens_count_every_sample_generated():
    kept = [_rollout(0, 3, 1.0), _rollout(0, 1, 0.0)]
    dropped = [_rollout(1, 8, 0.0, "length"), _rollout(1, 8, 0.0, "length")]
    batch = RolloutBatch(kept, n=2, meta={"drawn": dropped + kept})
    stats = batch.stats()
    assert batch.num_tokens == 20 and stats["completion_len_max"] == 8 and stats["length_capped_frac"] == 0.5
    assert stats["reward_mean"] == 0.5 and stats["zero_std_frac"] == 0.0  # rewards: what the step trains on


def test_a_group_that_is_not_flat_has_nonzero_advantages():
    """Rewards reach the advantages unrounded: 0.1 + 0.2 and 0.3 differ (is_flat says the group teaches
    something), and so must their advantages (in float32 both are 0.3 and the advantages were all 0)."""
    from llamarl.algorithms import group_advantages
    from llamarl.rollouts import is_flat

    group = [_rollout(0, 2, 0.1 + 0.2), _rollout(0, 2, 0.3), _rollout(0, 2, 0.3), _rollout(0, 2, 0.1 + 0.2)]
    batch = RolloutBatch(group, n=4)
    assert not is_flat(group)
    for method in ("mean", "grpo", "rloo"):
        advantages = group_advantages(batch.rewards(), 4, method=method)
        assert bool((advantages != 0).any()), (method, advantages)  # as is_flat says: not all 0
