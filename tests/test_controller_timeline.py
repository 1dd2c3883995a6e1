"""The real ``Controller`` against fake executors with chosen timings: what each step and evaluation saw.

The fakes keep the real executors' contract: an executor runs its commands one at a time in arrival order;
a generator call holds the newest published version for the whole call and tags every token with it;
``train_step(push=True)`` publishes version + 1 before it answers. Sleeps only shape the timeline (the
margins are tenfold); every assertion is on versions and values, none on time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest

from llamarl.config import DataConfig, GeneratorConfig, RewardConfig, RunConfig, TrainConfig, TrainerConfig
from llamarl.controller import Controller, Executors
from llamarl.models import CharTokenizer
from llamarl.rewards import RewardPoolError, RewardResult
from llamarl.runlog import RunLog
from llamarl.train_data import TrainData


class _Serial:
    """Commands run one at a time, first come first served (an asyncio.Lock is FIFO)."""

    def __init__(self):
        self._lock = asyncio.Lock()

    def acall(self, method, *args, **kwargs):
        async def run():
            async with self._lock:
                return await getattr(self, method)(*args, **kwargs)
        return asyncio.ensure_future(run())


class FakeGenerator(_Serial):
    def __init__(self, world, delay=0.01, eval_delay=0.01, slow_steps=(), slow_delay=0.5, finish="stop"):
        super().__init__()
        self.world, self.delay, self.eval_delay, self.finish = world, delay, eval_delay, finish
        self.slow_steps, self.slow_delay = set(slow_steps), slow_delay
        self.params = []  # the SamplingParams of every call

    async def generate(self, prompts, params):
        self.params.append(params)
        version = self.world["published"]
        greedy = params.temperature == 0.0
        step = None if greedy else params.seed  # run.seed 0: a step's seed is its index
        seconds = self.eval_delay if greedy else self.slow_delay if step in self.slow_steps else self.delay
        await asyncio.sleep(seconds)
        samples = [{"token_ids": [5, 6], "logprobs": [-1.0, -1.0], "policy_versions": [version, version],
                    "finish_reason": self.finish} for _ in prompts for _ in range(params.n)]
        return [{"samples": samples, "seconds": seconds}]  # one TP rank


class FakeTrainer(_Serial):
    def __init__(self, world, delay=0.1):
        super().__init__()
        self.world, self.delay = world, delay
        self.batches = []  # the tensors of every step

    async def train_step(self, tensors, push=False, step=None):
        self.batches.append(tensors)
        await asyncio.sleep(self.delay)
        self.world["published"] += 1
        return [{"applied": True, "loss": 0.0, "version": self.world["published"],
                 "sync": {"seconds": 0.0, "wait_seconds": 0.0}}]


class FakeRewards:
    """Every sample earns ``terms`` (the verifier first), or fails: every ``fail_every``-th one, or every one
    scored with all its terms when ``extra_fails`` (an extra term that raises)."""

    def __init__(self, fail_every: int = 0, terms: tuple[float, ...] = (1.0,), extra_fails: bool = False):
        self.fail_every, self.terms, self.extra_fails = fail_every, terms, extra_fails

    async def score_async(self, items, verifier_only=False):
        out = []
        terms = self.terms[:1] if verifier_only else self.terms
        for i, (sid, *_) in enumerate(items):
            failed = (self.fail_every and i % self.fail_every == 0) or (self.extra_fails and not verifier_only)
            out.append(RewardResult(sample_id=sid, reward=0.0 if failed else sum(terms),
                                    error="ValueError: flaky" if failed else None, elapsed_s=0.0,
                                    terms=() if failed else terms))
        return out


def _run(run: dict, *, generator: dict = None, trainer_delay: float = 0.1, fail_every: int = 0,
         rewards: FakeRewards | None = None, reward: RewardConfig = RewardConfig(), sampling: dict = None,
         controller: list | None = None, trainer: dict | None = None, reward_model=None,
         no_verifier: bool = False) -> RunLog:
    cfg = TrainConfig(generator=GeneratorConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=4,
                                                **(sampling or {})),
                      data=DataConfig(eval_size=4), run=RunConfig(checkpoint_every=0, **run), reward=reward,
                      trainer=TrainerConfig(**(trainer or {})))
    tok = CharTokenizer()
    world = {"published": 0}
    log = RunLog(None, cfg.run.max_steps, progress=False)
    log.bar.write = lambda *a, **k: None
    gen = FakeGenerator(world, **(generator or {}))
    ex = Executors([gen], FakeTrainer(world, trainer_delay),
                   None if no_verifier else rewards or FakeRewards(fail_every), reward_model)
    ctrl = Controller(cfg, TrainData(cfg.data, tok, seed=0), ex, log, tokenizer=tok)
    if controller is not None:
        controller.append(ctrl)
    asyncio.run(ctrl.run())
    return log


@pytest.mark.parametrize("staleness", [1, 2, 3])
def test_an_evaluation_sees_exactly_its_steps_weights(staleness):
    """Step index 3's sampling is slow, so the evaluation after step 2 queues behind it on the generator while
    the trainer could already train step 3: the trainer must wait, or the step-2 evaluation measures v3."""
    log = _run(dict(mode="async", max_staleness=staleness, max_steps=6, eval_every=2),
               generator=dict(slow_steps={3}))
    assert [(e["step"], e["policy_version"]) for e in log.evals] == [(2, 2), (4, 4)]
    assert all(r["staleness"] <= staleness for r in log.rows)


@pytest.mark.parametrize("mode, staleness", [("sync", 0), ("async", 1), ("async", 2)])
def test_generate_time_is_the_engines_not_the_wait_behind_an_evaluation(mode, staleness):
    log = _run(dict(mode=mode, max_staleness=staleness, max_steps=6, eval_every=2),
               generator=dict(delay=0.01, eval_delay=0.3))
    assert [r["generate_s"] for r in log.rows] == [0.01] * 6
    assert [r["tokens_per_s"] for r in log.rows] == [8 / 0.01] * 6  # 4 samples of 2 tokens


def test_reward_mean_is_over_the_samples_that_were_scored():
    log = _run(dict(mode="sync", max_staleness=0, max_steps=2, eval_every=0), fail_every=2, trainer_delay=0.0)
    assert [(r["reward_mean"], r["reward_errors"]) for r in log.rows] == [(1.0, 2), (1.0, 2)]
    log = _run(dict(mode="sync", max_staleness=0, max_steps=1, eval_every=0), fail_every=1, trainer_delay=0.0)
    assert math.isnan(log.rows[0]["reward_mean"]) and log.rows[0]["reward_errors"] == 4


def test_a_verifier_failing_on_every_sample_stops_the_run_after_max_failed_steps():
    with pytest.raises(RewardPoolError, match=r"every sample of 3 steps in a row \(steps 1-3\).*ValueError: flaky"):
        _run(dict(mode="sync", max_staleness=0, max_steps=10, eval_every=0), fail_every=1, trainer_delay=0.0)
    log = _run(dict(mode="sync", max_staleness=0, max_steps=6, eval_every=0), fail_every=2, trainer_delay=0.0)
    assert len(log.rows) == 6  # failures on some samples of every step: the run goes on


@pytest.mark.parametrize("terms, accuracy", [((0.0, 1.0, 1.0), 0.0), ((1.0, 0.0, 0.0), 1.0)])
def test_accuracy_is_the_verifiers_alone_and_each_term_is_logged(terms, accuracy):
    """A reward of several functions: a format bonus adding up to 2 is not a correct answer, a right answer
    without it is."""
    reward = RewardConfig(extra=("format_exact", "format_exact"))
    log = _run(dict(mode="sync", max_staleness=0, max_steps=3, eval_every=1), trainer_delay=0.0,
               rewards=FakeRewards(terms=terms), reward=reward)
    assert [e["accuracy"] for e in log.evals] == [accuracy, accuracy]
    row = log.rows[0]
    assert (row["reward_mean"], row["reward/exact"], row["reward/format_exact"], row["reward/format_exact_2"]) == \
        (sum(terms), *terms)
    # an extra term that fails costs the training samples, never a right answer in the evaluation
    log = _run(dict(mode="sync", max_staleness=0, max_steps=3, eval_every=1), trainer_delay=0.0,
               rewards=FakeRewards(terms=terms, extra_fails=True),
               reward=dataclasses.replace(reward, max_failed_steps=0))
    assert [e["accuracy"] for e in log.evals] == [accuracy, accuracy] and log.rows[0]["reward_errors"] == 4


class PromptRewards(FakeRewards):
    """Prompt k of the stream (sample id arith-train-k#j) is informative when k % 3 == 0 (its samples earn
    j % 2), flat otherwise (all 0); records which prompts it scored."""

    def __init__(self):
        super().__init__()
        self.scored: list[int] = []

    async def score_async(self, items):
        out = []
        for sid, *_ in items:
            k, j = (int(x) for x in sid.removeprefix("arith-train-").split("#"))
            self.scored.append(k)
            r = float(j % 2) if k % 3 == 0 else 0.0
            out.append(RewardResult(sample_id=sid, reward=r, error=None, elapsed_s=0.0, terms=(r,)))
        return out


@pytest.mark.parametrize("mode, staleness", [("sync", 0), ("async", 2)])
def test_dynamic_sampling_trains_on_groups_whose_rewards_differ(mode, staleness):
    """2 prompts per step; prompts 0, 3, 6, 9, ... are informative. Step 1 draws (0, 1), (2, 3) and keeps 0 and
    3; step 2 draws (4, 5), (6, 7), (8, 9) and keeps 6 and 9; with at most 2 batches, step 2 keeps 6 and
    fills up with the flat 4."""
    for max_batches, batches, zero_std in ((4, [2, 3], [0.0, 0.0]), (2, [2, 2], [0.0, 0.5])):
        rewards, ctrl = PromptRewards(), []
        log = _run(dict(mode=mode, max_staleness=staleness, max_steps=2, eval_every=0), trainer_delay=0.0,
                   rewards=rewards, sampling=dict(dynamic_sampling=True, max_sample_batches=max_batches),
                   controller=ctrl)
        assert [r["sample_batches"] for r in log.rows] == batches
        assert [r["zero_std_frac"] for r in log.rows] == zero_std
        assert sorted(set(rewards.scored)) == list(range(2 * sum(batches)))  # every batch drawn was scored
        assert ctrl[0].data.cursor == 2 * sum(batches)
        assert all(r["reward_mean"] == 0.25 * (2 - 2 * z) for r, z in zip(log.rows, zero_std))
        assert [r["tokens"] for r in log.rows] == [2 * 2 * 2 * b for b in batches]  # every sample drawn, 2 tokens
    # a batch whose every sample failed ends the drawing: a broken verifier stops the run after 3 steps
    ctrl = []
    with pytest.raises(RewardPoolError, match="every sample of 3 steps in a row"):
        _run(dict(mode=mode, max_staleness=staleness, max_steps=6, eval_every=0), trainer_delay=0.0,
             rewards=FakeRewards(fail_every=1), sampling=dict(dynamic_sampling=True), controller=ctrl)
    assert len(ctrl[0].ex.generators[0].params) <= 3 + staleness + 1  # one batch per step (of 4 allowed)
    log = _run(dict(mode=mode, max_staleness=staleness, max_steps=2, eval_every=0), trainer_delay=0.0,
               rewards=PromptRewards())
    assert [r["sample_batches"] for r in log.rows] == [1, 1] and [r["zero_std_frac"] for r in log.rows] == [0.5, 0.5]


@pytest.mark.parametrize("mask", [False, True])
def test_mask_truncated_trains_no_token_of_a_length_capped_completion(mask):
    ctrl = []
    _run(dict(mode="sync", max_staleness=0, max_steps=2, eval_every=0), generator=dict(finish="length"),
         trainer=dict(mask_truncated=mask, skip_zero_advantage=False), controller=ctrl)
    batches = ctrl[0].ex.trainer.batches
    assert len(batches) == 2
    for b in batches:
        assert float(b["total_rows"]) == 4  # the completions still count as rows
        assert float(b["mask"].sum()) == (0 if mask else 8) == float(b["total_tokens"])  # 4 completions x 2 tokens


def test_overlong_punishment_top_k_and_logprobs_mode_reach_the_rollouts():
    """Every fake completion has 2 tokens of a budget of 4: with overlong_buffer=3 the punishment starts after
    1 token, so each loses 1/3 of overlong_penalty=0.6; the verifier alone decides the accuracy; top_k, min_p
    and logprobs_mode reach the generator."""
    ctrl = []
    log = _run(dict(mode="sync", max_staleness=0, max_steps=3, eval_every=1), trainer_delay=0.0,
               reward=RewardConfig(overlong_buffer=3, overlong_penalty=0.6),
               sampling=dict(top_k=5, min_p=0.05, logprobs_mode="raw"),
               controller=ctrl)
    row = log.rows[0]
    assert row["reward/exact"] == 1.0 and row["reward/overlong"] == pytest.approx(-0.2)
    assert row["reward_mean"] == pytest.approx(0.8) and [e["accuracy"] for e in log.evals] == [1.0, 1.0]
    params = ctrl[0].ex.generators[0].params
    assert {(p.top_k, p.min_p, p.logprobs_mode) for p in params if p.temperature > 0} == {(5, 0.05, "raw")}


class RecordingRewards(FakeRewards):
    """Records what each sample was scored against: (sample id, answer, reward info)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple] = []

    async def score_async(self, items, verifier_only=False):
        if not verifier_only:
            self.seen += [(sid, answer, info) for sid, _, answer, info in items]
        return await super().score_async(items, verifier_only)


@pytest.mark.parametrize("mode, staleness", [("sync", 0), ("async", 2)])
def test_each_sample_is_scored_against_its_own_records_answer_and_fields(mode, staleness):
    """The reference is the data stream drawn again on its own: sample ``arith-train-k#j`` is scored with
    record k's answer and reward info (prompt, sample_id), never a neighbour's."""
    rewards, ctrl = RecordingRewards(), []
    _run(dict(mode=mode, max_staleness=staleness, max_steps=3, eval_every=0), rewards=rewards, controller=ctrl)
    drawn = TrainData(ctrl[0].cfg.data, CharTokenizer(), seed=0).next(ctrl[0].data.cursor)
    records = {s.id: s for s in drawn}
    assert len({answer for _, answer, _ in rewards.seen}) > 1  # the answers differ, so a mix-up would show
    assert len(rewards.seen) == 3 * 2 * 2
    for sid, answer, info in rewards.seen:
        record = records[sid.rsplit("#", 1)[0]]
        assert (answer, info) == (record.answer, record.reward_info()), sid


@pytest.mark.parametrize("staleness", [1, 2])
def test_async_mode_runs_ahead_to_its_staleness_bound(staleness):
    """A fast generator and a slow trainer: once the pipeline is full the sampler is ``max_staleness``
    versions ahead (the bound is reached, not only respected), so async mode really overlaps the work."""
    log = _run(dict(mode="async", max_staleness=staleness, max_steps=6, eval_every=0), trainer_delay=0.1)
    assert max(r["staleness"] for r in log.rows) == staleness, [r["staleness"] for r in log.rows]


@pytest.mark.parametrize("trainer, dropped", [(dict(), True), (dict(kl_coef=0.1), False),
                                              (dict(entropy_coef=0.01), False)])
def test_zero_advantage_rows_are_dropped_only_where_that_is_exact(trainer, dropped):
    """Every sample earns the same reward (all advantages 0): without KL and entropy terms those rows add
    nothing and are dropped (their tokens still count in the denominator; llamarl.rollouts); with either term
    they change the gradient and must reach the trainer."""
    ctrl = []
    _run(dict(mode="sync", max_staleness=0, max_steps=1, eval_every=0), trainer=trainer, controller=ctrl)
    batch, = ctrl[0].ex.trainer.batches
    assert float(batch["total_rows"]) == 4 and float(batch["total_tokens"]) == 8
    assert batch["mask"].shape[0] == (1 if dropped else 4)  # dropped: one filler row keeps the step an update


class FlakyPromptRewards(PromptRewards):
    """PromptRewards whose verifier fails on one sample of prompt 1 (a timeout, say)."""

    async def score_async(self, items):
        out = await super().score_async(items)
        return [RewardResult(sample_id=r.sample_id, reward=0.0, error="TimeoutError", elapsed_s=0.0, terms=())
                if r.sample_id == "arith-train-1#0" else r for r in out]


def test_dynamic_sampling_goes_on_past_a_batch_with_one_failed_sample():
    """Drawing stops early only when the verifier failed on every sample of a batch: one failure leaves step 1
    drawing its two batches, as without failures (test_dynamic_sampling_trains_on_groups_whose_rewards_differ);
    every batch of every step draws with its own seed."""
    ctrl = []
    log = _run(dict(mode="sync", max_staleness=0, max_steps=2, eval_every=0), trainer_delay=0.0,
               rewards=FlakyPromptRewards(), sampling=dict(dynamic_sampling=True, max_sample_batches=4),
               controller=ctrl)
    assert [r["sample_batches"] for r in log.rows] == [2, 3] and log.rows[0]["zero_std_frac"] == 0.0
    seeds = [p.seed for p in ctrl[0].ex.generators[0].params if p.temperature > 0]
    assert len(seeds) == 5 and len(set(seeds)) == 5, seeds


class _RightIds(FakeRewards):
    """The verifier gives 1 to the completions whose id is listed, 0 to the others."""

    def __init__(self, right: set[str]):
        super().__init__()
        self.right = right

    async def score_async(self, items, verifier_only=False):
        return [RewardResult(sample_id=sid, reward=float(sid in self.right), error=None, elapsed_s=0.0,
                             terms=(float(sid in self.right),)) for sid, *_ in items]


def test_a_sampled_evaluation_reports_mean_and_pass_at_k():
    """run.eval_samples=3 at run.eval_temperature=0.7: three completions per held-out problem, each evaluation
    with a seed of its own; accuracy is the mean over the 12 completions, pass@3 the share of the 4 problems
    with a right one. By hand: problem 0 right 3 times, problem 1 once, the others never: 4/12 and 2/4."""
    held = TrainData(DataConfig(eval_size=4), CharTokenizer(), seed=0).heldout
    right = {f"{held[0].id}#{j}" for j in range(3)} | {f"{held[1].id}#2"}
    ctrl = []
    log = _run(dict(mode="sync", max_staleness=0, max_steps=3, eval_every=1, eval_samples=3, eval_temperature=0.7),
               rewards=_RightIds(right), trainer_delay=0.0, controller=ctrl)
    assert [(e["step"], e["accuracy"], e["pass@3"]) for e in log.evals] == [(1, 4 / 12, 0.5), (2, 4 / 12, 0.5)]
    evals = [p for p in ctrl[0].ex.generators[0].params if p.n == 3]
    assert [(p.temperature, p.seed) for p in evals] == [(0.7, 2**60 + 1), (0.7, 2**60 + 2)]
    greedy = _run(dict(mode="sync", max_staleness=0, max_steps=2, eval_every=1), rewards=_RightIds(right),
                  trainer_delay=0.0, controller=ctrl)
    assert [(e["accuracy"], "pass@1" in e) for e in greedy.evals] == [(0.0, False)]  # ids without '#j': none right
    assert [(p.n, p.temperature, p.seed) for p in ctrl[1].ex.generators[0].params if p.temperature == 0] == \
        [(1, 0.0, None)]


class FailingRewardModel:
    """A reward model that can score no sequence (each is too long for its context)."""

    wants_messages = False

    async def score_rollouts(self, pairs):
        return ["reward model: the sequence has 9 tokens, more than the reward model's context of 8"] * len(pairs)


def test_a_run_without_a_verifier_whose_reward_model_scores_nothing_stops_naming_the_reward_model():
    """reward.reward=none: the reward model's errors alone fail the samples; after reward.max_failed_steps
    steps of nothing scored the run stops, and the message names the reward model, not reward functions."""
    reward = RewardConfig(reward="none", model="rm", max_failed_steps=2)
    with pytest.raises(RewardPoolError, match=r"the reward model could score no sample of 2 steps in a row "
                                              r"\(steps 1-2\).*context of 8") as e:
        _run(dict(mode="sync", max_staleness=0, max_steps=4, eval_every=0), reward=reward, no_verifier=True,
             reward_model=FailingRewardModel())
    assert "reward.timeout_s" not in str(e.value)
