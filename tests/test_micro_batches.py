"""Micro-batches (llamarl.micro_batches): rows cut to the columns they need, ordered by length, and
sized by a token budget, without changing the step.

* ``take_rows`` keeps every trained position and the tokens before it: the model's log-probs at the kept
  positions equal those of the untrimmed rows;
* ``plan`` covers every row once, puts the longest first, keeps prompt groups together, and keeps each
  micro-batch of more than one row within the token budget;
* a trainer step with length grouping and a token budget equals the step on the whole batch at once
  (both layouts, every normalisation), and the decoupled clip's logπ_old lands on the right rows.
The sharded trainer with a token budget (ranks that plan different numbers of micro-batches) is checked
against one process in tests/test_train_scaleout.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dist_harness import assert_same_step, random_model, single_process_train_step, single_process_trainer
from llamarl.algorithms import token_logprobs
from llamarl.config import ConfigError, TrainerConfig
from llamarl.micro_batches import extents, idle_part, plan, positions, take_rows
from llamarl.models import LlamaConfig
from llamarl.rollouts import Rollout, collate

CFG = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=96)
TRAINER = dataclasses.asdict(TrainerConfig(lr=1e-3, weight_decay=0.1, grad_clip=0.5, micro_batch_size=3,
                                           loss="reference", kl_coef=0.05, entropy_coef=0.01))
LENGTHS = [2, 30, 5, 0, 17, 1, 9, 24, 3, 12, 6, 28]  # completion lengths: ragged, one empty
N = 3  # samples per prompt


def _rollouts() -> list[Rollout]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i, c in enumerate(LENGTHS):
        if i % N == 0:
            prompt = torch.randint(3, CFG.vocab_size, (2 + i % 5,), generator=g).tolist()
        completion = torch.randint(3, CFG.vocab_size, (c,), generator=g).tolist()
        logprobs = (-4.0 + 0.5 * torch.randn(c, generator=g)).tolist()
        out.append(Rollout(f"s{i}", i // N, prompt, completion, logprobs, [0] * c, "", "length"))
    return out


def _batch(share_prompts: bool) -> dict[str, torch.Tensor]:
    adv = torch.randn(len(LENGTHS), generator=torch.Generator().manual_seed(4))
    return collate(_rollouts(), adv, 0, share_prompts=share_prompts)


@pytest.mark.parametrize("share_prompts", [False, True])
def test_take_rows_cuts_each_part_to_its_longest_row_and_keeps_its_logprobs(tmp_path, share_prompts):
    batch = _batch(share_prompts)
    ext = extents(batch)
    assert ext == [c + (len(r.prompt_ids) - 1 if not share_prompts and c else 0)
                   for c, r in zip(LENGTHS, _rollouts())]
    rows = [0, 5, 2]  # short completions: 2, 1 and 5 tokens
    part = take_rows(batch, rows)
    width = max(ext[r] for r in rows)
    assert part["targets"].shape == (3, width) and part["mask"].shape == (3, width)
    assert torch.equal(part["targets"], batch["targets"][rows, :width])
    assert torch.equal(part["mask"].sum(1), batch["mask"][rows].sum(1))  # no trained token lost
    if not share_prompts:
        assert part["input_ids"].shape == (3, width + 1)
    else:
        assert part["group"].tolist() == [0, 1, 0] and part["prompt_ids"].shape[0] == 2
    assert "total_tokens" not in part

    from llamarl.executors.trainer import _final_hidden

    def _logits(model, part):
        return model.lm_head(_final_hidden(model, part))

    model = random_model(CFG)
    with torch.no_grad():
        full = token_logprobs(_logits(model, take_rows(batch, rows, trim=False)), batch["targets"][rows], 1.0)[0]
        cut = token_logprobs(_logits(model, part), part["targets"], 1.0)[0]
    mask = part["mask"] > 0
    torch.testing.assert_close(cut[mask], full[:, :width][mask], rtol=0, atol=1e-5)

    idle = idle_part(batch, range(3, 9))  # shared prompts: two columns, so its forward makes both passes
    assert idle["mask"].shape == (1, 2 if share_prompts else 1) and not idle["mask"].any()
    if share_prompts:  # a row of the shorter prompt: prompt 1 has 5 tokens, prompt 2 has 3
        assert idle["prompt_ids"].shape == (1, 3)
    else:
        assert torch.equal(idle["input_ids"], batch["input_ids"][3:4, :2])
    if share_prompts:
        assert take_rows(batch, [5])["targets"].shape == (1, 2)  # one trained token, two columns


def _split(batch, order: list[int], rows_per: int, budget: int, max_rows: int | None = None) -> list[list[int]]:
    """Reference cut: ``rows_per`` rows each, or greedily within ``budget`` positions (and ``max_rows``)."""
    if not budget:
        return [order[i:i + rows_per] for i in range(0, len(order), rows_per)]
    parts = [[order[0]]]
    for r in order[1:]:
        if (max_rows is None or len(parts[-1]) < max_rows) and positions(batch, parts[-1] + [r]) <= budget:
            parts[-1].append(r)
        else:
            parts.append([r])
    return parts


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("budget", [0, 40, 64])
def test_plan_covers_every_row_once_longest_first_within_the_budget(share_prompts, budget):
    batch = _batch(share_prompts)
    ext = extents(batch)
    rows = list(range(2, 11))  # a rank's share: not the whole batch
    parts = plan(batch, rows, rows_per=4, token_budget=budget)
    assert sorted(r for p in parts for r in p) == rows
    cost = [positions(batch, p) for p in parts]
    assert cost == sorted(cost, reverse=True)  # the largest micro-batch runs first
    by_extent = sorted(rows, key=lambda r: -ext[r])
    if share_prompts:  # whole prompt groups, longest group first, or all rows by extent within its peak
        group = batch["group"].tolist()
        by_group = _split(batch, sorted(rows, key=lambda r: (-max(ext[q] for q in rows if group[q] == group[r]),
                                                            [group[q] for q in rows].index(group[r]), -ext[r])),
                          4, budget)
        peak = budget or max(positions(batch, p) for p in by_group)
        by_row = _split(batch, by_extent, 4, peak, None if budget else 4)
        total = [sum(positions(batch, p) for p in c) for c in (by_group, by_row)]
        assert sorted(parts) == sorted((by_group, by_row)[total.index(min(total))])
    else:
        assert sorted(parts) == sorted(_split(batch, by_extent, 4, budget))
    if budget:
        assert all(c <= budget for c, p in zip(cost, parts) if len(p) > 1)
        assert len(parts) > len(rows) // 4  # the budget, not rows_per, decided
    else:
        assert all(len(p) <= 4 for p in parts)
        if not share_prompts:
            assert sorted(len(p) for p in parts) == [1, 4, 4]
    assert plan(batch, rows, rows_per=4, by_length=False) == [rows[0:4], rows[4:8], rows[8:]]


def _groups(prompt_len: int, lengths: list[list[int]]) -> dict[str, torch.Tensor]:
    rollouts = [Rollout(f"g{g}s{i}", g, [5 + g] * prompt_len, [7] * c, [-1.0] * c, [0] * c, "", "length")
                for g, group in enumerate(lengths) for i, c in enumerate(group)]
    return collate(rollouts, torch.ones(len(rollouts)), 0, share_prompts=True)


def test_shared_prompts_take_whichever_order_runs_fewer_positions():
    """Long prompts, each group's lengths alike: groups stay together (135 positions; by extent 188).
    Short prompts, one long row per group: rows by extent (61 positions, at most 25 each; by group 78)."""
    long_prompts = _groups(30, [[5, 1, 5], [4, 2, 4], [6, 1, 6]])
    parts = plan(long_prompts, range(9), rows_per=3)
    assert parts == [[6, 8, 7], [0, 2, 1], [3, 5, 4]]
    assert [positions(long_prompts, p) for p in parts] == [48, 45, 42]
    short_prompts = _groups(2, [[9, 1, 1], [8, 1, 1], [7, 1, 1]])
    parts = plan(short_prompts, range(9), rows_per=3)
    assert parts == [[6, 1, 2], [0, 3], [4, 5, 7], [8]]
    assert [positions(short_prompts, p) for p in parts] == [25, 22, 10, 4]


def test_mixing_prompts_never_raises_the_peak_over_whole_groups():
    """Rows by extent run far fewer positions here (460 against 720), but a micro-batch of the four long
    rows would hold four prompts (240 positions); it is cut to three, within a whole group's 180."""
    batch = _groups(20, [[40, 1, 1, 1]] * 4)
    parts = plan(batch, range(16), rows_per=4)
    assert [positions(batch, p) for p in parts] == [180, 160, 48, 48, 24]
    assert parts[0] == [0, 4, 8] and all(len(p) <= 4 for p in parts)


@pytest.mark.parametrize("norm", ["token", "sequence", "constant"])
@pytest.mark.parametrize("share_prompts", [False, True])
def test_grouped_and_budgeted_micro_batches_give_the_whole_batch_step(tmp_path, norm, share_prompts):
    random_model(CFG).save_pretrained(tmp_path / "model")
    batch = _batch(share_prompts)
    cfg = dict(TRAINER, norm=norm)
    whole = single_process_train_step(tmp_path / "model", CFG, batch,
                                      dict(cfg, micro_batch_size=len(LENGTHS), length_grouping=False),
                                      max_new_tokens=32)
    ext = extents(batch)
    for variant in (dict(length_grouping=True), dict(micro_batch_tokens=48)):
        stats, weights = single_process_train_step(tmp_path / "model", CFG, batch, dict(cfg, **variant),
                                                   max_new_tokens=32)
        assert_same_step(stats, weights, *whole, atol=4e-6)
        parts = plan(batch, range(len(ext)), rows_per=cfg["micro_batch_size"],
                     token_budget=variant.get("micro_batch_tokens", 0))
        # what the forwards ran (a micro-batch of only the empty completion is skipped)
        assert stats["train_positions"] == sum(positions(batch, p) for p in parts if any(ext[r] for r in p))
    assert whole[0]["train_positions"] == positions(batch, range(len(ext))) > stats["train_positions"]


def test_old_logprobs_land_on_their_rows(tmp_path):
    """The decoupled clip's logπ_old is computed in the length-ordered, trimmed micro-batches and written
    back to each row's own columns: it equals a plain forward over the whole batch."""
    random_model(CFG).save_pretrained(tmp_path / "model")
    batch = _batch(False)
    with single_process_trainer(tmp_path / "model", CFG, dict(TRAINER, micro_batch_tokens=40)) as ex:
        old = ex._old_logprobs(batch)
        with torch.no_grad():
            full = token_logprobs(ex.model(batch["input_ids"])[:, :-1], batch["targets"], 1.0)[0]
    mask = batch["mask"] > 0
    torch.testing.assert_close(old[mask], full[mask], rtol=0, atol=1e-5)


def test_micro_batch_tokens_is_checked():
    with pytest.raises(ConfigError, match=r"trainer.micro_batch_tokens: must be >= 0"):
        TrainerConfig(micro_batch_tokens=-1)
    with pytest.raises(ValueError, match="token_budget >= 0"):
        plan(_batch(False), [0], rows_per=1, token_budget=-5)
