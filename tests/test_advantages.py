"""group_advantages against hand-computed values, its invariants, and its input errors."""

import math

import pytest
import torch

from llamarl.algorithms import group_advantages

# two groups of n = 4, prompt-major
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])


def test_mean_baseline_hand_values():
    adv = group_advantages(REWARDS, 4, "mean")
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)


def test_grpo_divides_by_bessel_std_plus_eps():
    adv = group_advantages(REWARDS, 4, "grpo", eps=1e-6)
    # group 1: deviations ±0.5, sample std sqrt(4·0.25/3); group 2: deviations 1, -1, 0, 0, std sqrt(2/3)
    s1, s2 = math.sqrt(1.0 / 3.0), math.sqrt(2.0 / 3.0)
    std = torch.tensor([s1] * 4 + [s2] * 4)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0, 0.0]) / (std + 1e-6)
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-7)


def test_rloo_leave_one_out_hand_values():
    adv = group_advantages(REWARDS, 4, "rloo")
    # r_i minus the mean of the other three, written out element by element
    r = REWARDS.tolist()
    expected = []
    for g in range(2):
        group = r[4 * g : 4 * g + 4]
        expected += [group[i] - (sum(group) - group[i]) / 3 for i in range(4)]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=0, atol=1e-6)
    torch.testing.assert_close(adv[:4], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("method", ["mean", "grpo", "rloo"])
def test_groups_sum_to_zero_and_constant_groups_give_zero(method):
    torch.manual_seed(0)
    rewards = torch.randn(6 * 5, dtype=torch.float64)
    rewards[5:10] = 0.7  # a constant group
    adv = group_advantages(rewards, 5, method)
    assert adv.dtype == torch.float64 and adv.shape == rewards.shape
    torch.testing.assert_close(adv.view(6, 5).sum(1), torch.zeros(6, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.all(adv[5:10] == 0)


@pytest.mark.parametrize("method", ["mean", "grpo", "rloo", "reinforce_baseline"])
def test_a_flat_group_whose_mean_rounds_is_exactly_zero(method):
    """Six 0.1s do not sum to 0.6 in float64: the rounded mean left ±1e-17 per sample (±0.12 for grpo with a
    tiny eps), so a group that carries no gradient was trained on instead of skipped."""
    rewards = torch.tensor([1.0, 0.1, 0.1, 0.1, 0.1, 0.1] + [0.1] * 6 + [0.3, 0.3, 0.3, 5.0], dtype=torch.float64)
    valid = torch.ones_like(rewards, dtype=torch.bool)
    valid[-1] = False  # the last group's valid members (three 0.3s) are flat too
    for eps in (1e-6, 1e-16):
        adv = group_advantages(rewards[:12], 6, method, eps=eps)
        assert torch.all(adv[6:] == 0) and torch.all(adv[:6] != 0)
    adv = group_advantages(torch.cat([rewards[12:], rewards[12:]]), 4, method, valid=torch.cat([valid[12:]] * 2))
    assert torch.all(adv == 0)


def test_group_size_one_mean_is_zero_and_integer_rewards_become_float32():
    torch.testing.assert_close(group_advantages(torch.tensor([3.0, -1.0]), 1), torch.zeros(2))
    adv = group_advantages(torch.tensor([1, 0, 1, 1]), 2)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    adv_bool = group_advantages(torch.tensor([True, False]), 2, "rloo")
    torch.testing.assert_close(adv_bool, torch.tensor([1.0, -1.0]))


def test_bf16_rewards_keep_dtype():
    adv = group_advantages(torch.tensor([1.0, 0.0], dtype=torch.bfloat16), 2)
    assert adv.dtype == torch.bfloat16
    assert adv.tolist() == [0.5, -0.5]


@pytest.mark.parametrize(
    "rewards, group_size, method, eps, match",
    [
        (torch.zeros(2, 3), 3, "mean", 1e-6, "1-D"),
        (torch.zeros(7), 3, "mean", 1e-6, "multiple of group_size=3"),
        (torch.zeros(0), 1, "mean", 1e-6, "multiple"),
        (torch.zeros(4), 0, "mean", 1e-6, "group_size"),
        (torch.zeros(4), 2.0, "mean", 1e-6, "group_size"),
        (torch.zeros(4), 2, "ppo", 1e-6, "method"),
        (torch.zeros(4), 1, "grpo", 1e-6, "group_size >= 2"),
        (torch.zeros(4), 1, "rloo", 1e-6, "group_size >= 2"),
        (torch.zeros(4), 2, "grpo", 0.0, "eps"),
        (torch.tensor([0.0, float("nan"), 1.0, 1.0]), 2, "mean", 1e-6, r"rewards\[1\]"),
        (torch.tensor([0.0, 1.0, float("inf"), 1.0]), 2, "mean", 1e-6, r"rewards\[2\]"),
    ],
)
def test_bad_input_raises_clear_error(rewards, group_size, method, eps, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_size, method, eps)


def test_numpy_integers_are_group_sizes():
    import numpy as np

    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0])
    assert torch.equal(group_advantages(rewards, np.int64(2)), group_advantages(rewards, 2))


def test_non_tensor_rejected():
    with pytest.raises(TypeError, match="torch.Tensor"):
        group_advantages([1.0, 0.0], 2)


@pytest.mark.parametrize("method", ["mean", "grpo", "rloo"])
def test_failed_samples_take_no_part_in_their_group(method):
    """A crashed verifier's sample gets A = 0 and its group's baseline runs over the valid members only:
    the same advantages as the group without that sample."""
    torch.manual_seed(0)
    n = 5
    rewards = torch.rand(4 * n, dtype=torch.float64)
    valid = torch.ones(4 * n, dtype=torch.bool)
    valid[[1, 3]] = False  # group 0 keeps 3 of 5
    valid[n:n + 4] = False  # group 1 keeps 1 of 5
    valid[2 * n:3 * n] = False  # group 2 keeps none
    rewards[3] = float("nan")  # a failed sample's reward is never read
    got = group_advantages(rewards, n, method, valid=valid)
    assert got[~valid].eq(0).all()
    kept = rewards[[0, 2, 4]]
    assert torch.allclose(got[[0, 2, 4]], group_advantages(kept, 3, method), atol=1e-12)
    assert got[n + 4] == 0  # one valid member: no baseline but itself
    assert torch.allclose(got[3 * n:], group_advantages(rewards[3 * n:], n, method), atol=1e-12)
    # all valid: the plain result
    assert torch.equal(group_advantages(rewards[3 * n:], n, method, valid=torch.ones(n, dtype=torch.bool)),
                       group_advantages(rewards[3 * n:], n, method))
    with pytest.raises(ValueError, match="valid must be a bool tensor of shape"):
        group_advantages(rewards, n, method, valid=valid.float())


def test_reinforce_baseline_scales_the_group_baseline_by_the_batch_spread():
    adv = group_advantages(REWARDS, 4, "reinforce_baseline", eps=1e-6)
    centered = [0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0, 0.0]
    sigma = math.sqrt(sum(c * c for c in centered) / (len(centered) - 1))  # over the whole batch of 8
    torch.testing.assert_close(adv, torch.tensor([c / (sigma + 1e-6) for c in centered]), rtol=1e-6, atol=1e-7)
    # unlike grpo, the two groups share one scale: their relative sizes stay
    assert adv[4] / adv[0] == pytest.approx(2.0)
    assert group_advantages(REWARDS, 4, "grpo")[4] / group_advantages(REWARDS, 4, "grpo")[0] != pytest.approx(2.0)


def test_reinforce_baseline_invariants_and_failed_samples():
    torch.manual_seed(0)
    n = 5
    rewards = torch.randn(6 * n, dtype=torch.float64)
    rewards[n:2 * n] = 0.7  # a constant group
    valid = torch.ones(6 * n, dtype=torch.bool)
    valid[[0, 1]] = False
    rewards[0] = float("nan")  # never read
    adv = group_advantages(rewards, n, "reinforce_baseline", valid=valid)
    assert adv[~valid].eq(0).all() and adv[n:2 * n].eq(0).all()
    torch.testing.assert_close(adv.view(6, n).sum(1), torch.zeros(6, dtype=torch.float64), rtol=0, atol=1e-12)
    r = rewards.view(6, n)
    ok = valid.view(6, n)
    centered = torch.where(ok, r - torch.where(ok, r, 0.0).sum(1, keepdim=True) / ok.sum(1, keepdim=True), 0.0)
    sigma = float((centered.pow(2).sum() / (int(valid.sum()) - 1)).sqrt())
    torch.testing.assert_close(adv, (centered / (sigma + 1e-6)).reshape(-1), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(torch.zeros(4), 1, "reinforce_baseline")
