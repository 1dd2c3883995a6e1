"""The LlamaRL algorithm: one asyncio program that drives generator, reward and trainer executors.

Per training step s (policy version v = number of updates applied so far):

    rollouts  = generate(prompts_s, μ = newest weights the generator holds)      generator executor(s)
    rewards   = score(rollouts)                                                  reward worker processes
                (+ reward.model_weight · reward model score, if one is set)      a thread of this process
    A         = r − mean(r of the same prompt)           (or GRPO / RLOO)        here
    π ← AdamW step on the AIPO loss  −Σ min(π/μ, ρ)·A·log π / Σ mask             trainer executor
    v ← v + 1;  DDMA weight sync trainer → generator buckets, tagged v           trainer → generator

Three stages run concurrently, like the paper's executors: sampling, scoring and training. Sampling of
step s starts as soon as the trainer has finished step s − 1 − max_staleness, so the oldest weights any
token of step s was sampled with are at most ``max_staleness`` versions behind the policy that trains on
it (the invariant; every token carries its version and each step records ``staleness = v − min
version``); meanwhile the reward workers score step s − 1. Queues (one sampled batch awaiting its scores,
``max(1, max_staleness)`` scored batches) give back-pressure. The trainer's commands run one step ahead in
async mode: step s + 1's ``train_step`` is queued on the trainer while it runs step s, so it never idles
while this process handles a result (the trainer owns the version count, so the push of each applied update
needs no answer from here; results are handled in step order). With ``max_staleness = 0`` (sync mode)
the same code runs in lock step: generate → score → train → sync → generate ... — the baseline every
speed-up is measured against.

Dynamic sampling (``generator.dynamic_sampling``, DAPO's): the sampling stage also scores, and draws further
batches of prompts until the step has ``prompts_per_step`` prompt groups whose rewards differ (or
``generator.max_sample_batches`` batches are spent); see ``_sample_informative``. Each step logs its
``sample_batches``.

All process plumbing (spawning, RPC, failures) lives in llamarl.runtime; executors are reached through
``acall``. An executor failure raises out of ``run`` with the remote traceback.

Groups of several ranks (an FSDP trainer, a tensor-parallel generator replica) get every command on every
rank (their collectives need all of them) and answer with one result per rank: the trainer's ranks agree
on every number (rank 0's is used; a sync takes as long as its slowest rank), the TP ranks of a replica
return identical samples (rank 0's are used, the others are checked against them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, NamedTuple

import torch

from llamarl.algorithms import group_advantages
from llamarl.config import TrainConfig
from llamarl.generation import SamplingParams
from llamarl.rewards import RewardPool, RewardPoolError
from llamarl.rewards.model import TERM_NAME as MODEL_TERM
from llamarl.rewards.terms import overlong_penalty, term_names
from llamarl.rollouts import Rollout, RolloutBatch, choose_groups, collate, is_flat, without_truncated
from llamarl.runlog import RunLog
from llamarl.runtime import ExecutorGroup
from llamarl.train_data import TrainData

REPLICA_SEED_STRIDE = 1_000_000_007  # > any step count: replica seeds never meet another step's seed
BATCH_SEED_STRIDE = 1024 * REPLICA_SEED_STRIDE  # a step's further batches (dynamic sampling), past any replica's
EVAL_SEED_OFFSET = 2**60  # sampled evaluations: past any training batch's seed, still an int64 with the strides
CUT_WARNING_FRAC = 0.9  # warn once when this share of a step's completions ran out of tokens


class Sampled(NamedTuple):
    """One step's generator outputs, on their way to the reward workers."""

    step: int
    samples: list  # the step's prompts as data samples (answers included)
    prompts: list[list[int]]  # their token ids
    outputs: list[dict]  # generator outputs, prompt-major, samples_per_prompt per prompt
    cursor: int  # the data stream position after this step's prompts (what a checkpoint records)
    generate_s: float  # the slowest replica's time in its engine (not waiting behind an evaluation there)
    rollouts: list | None = None  # scored already (dynamic sampling), in the order of ``samples``
    score_s: float = 0.0
    batches: int = 1  # batches of prompts drawn for the step
    drawn: list | None = None  # every rollout generated for the step, kept or dropped (dynamic sampling)


@dataclass
class Executors:
    generators: list[ExecutorGroup]  # one group per generator replica (its ranks are TP shards)
    trainer: ExecutorGroup
    rewards: RewardPool | None  # None: no reward functions (reward.reward=none), the reward model alone
    reward_model: Any = None  # a llamarl.rewards.model.RewardModelScorer when reward.model is set


class Controller:
    def __init__(self, cfg: TrainConfig, data: TrainData, ex: Executors, log: RunLog, *, tokenizer,
                 start_step: int = 0, start_version: int = 0,
                 on_checkpoint: Callable[[int, int, int], Awaitable[None]] | None = None):
        self.cfg, self.data, self.ex, self.log, self.tok = cfg, data, ex, log, tokenizer
        self.step, self.version = start_step, start_version
        self.max_staleness = cfg.run.max_staleness
        self.on_checkpoint = on_checkpoint
        self._finished = start_step  # steps done with their evaluation and checkpoint (self.step: trained)
        self._progress = asyncio.Condition()  # notified when self.step or self._finished grows
        self._last_step_end = time.perf_counter()
        self._failed_steps = 0  # consecutive steps whose every sample's verifier failed
        self._warned_cut = False
        # the reward's terms, as metrics name them: its functions, then DAPO's overlong punishment if on
        self.term_names = term_names([*cfg.reward.specs, *(["overlong"] if cfg.reward.overlong_buffer else []),
                                      *([MODEL_TERM] if cfg.reward.model else [])])
        g = cfg.generator
        self.sampling = SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                                       top_k=g.top_k, top_p=g.top_p, min_p=g.min_p, n=g.samples_per_prompt,
                                       stop=g.stop, logprobs_mode=g.logprobs_mode)

    # ------------------------------------------------------------------ the algorithm
    async def run(self) -> None:
        """Rollouts, trainer commands and their results run as three concurrent stages (see below)."""
        queue: asyncio.Queue[RolloutBatch] = asyncio.Queue(maxsize=max(1, self.max_staleness))
        submitted: asyncio.Queue = asyncio.Queue()
        self._last_step_end = time.perf_counter()  # step 1's time starts here, not at the evaluation before RL
        await _run_stages(self.produce(queue), self.submit_steps(queue, submitted), self.finish_steps(submitted))

    async def produce(self, queue: asyncio.Queue) -> None:
        """Rollouts for the trainer, as a two-stage pipeline: the generators sample step s + 1 while the
        reward workers score step s. The staleness gate is on sampling, where the versions are fixed. The
        first step after a checkpoint samples with the checkpointed weights (no run-ahead), as a run
        resumed from that checkpoint must (it holds no older version): so a resumed run continues exactly
        like the uninterrupted one, in async mode too, for one pipeline stall per checkpoint."""
        sampled: asyncio.Queue = asyncio.Queue(maxsize=1)

        async def sample_all() -> None:
            for step in range(self.step, self.cfg.run.max_steps):
                need = step if self._checkpoint_after(step - 1) else step - self.max_staleness  # the staleness bound
                await self._wait_until(lambda: self.step >= need)
                await sampled.put(await self.sample(step))

        async def score_all() -> None:
            for _ in range(self.step, self.cfg.run.max_steps):
                await queue.put(await self.score(await sampled.get()))

        await _run_stages(sample_all(), score_all())

    async def submit_steps(self, queue: asyncio.Queue, submitted: asyncio.Queue) -> None:
        """Queue each step's ``train_step`` on the trainer as soon as its batch is ready. In async mode the
        command for step s + 1 waits on the trainer while it runs step s, so the trainer never idles while
        this process handles a result. Sync mode cannot run ahead (the next batch needs this step's
        weights), and no step is queued behind a checkpoint or an evaluation (they must see exactly their
        step's weights: an evaluation waiting on a busy generator would otherwise measure the next update)."""
        ahead = 1 if self.max_staleness >= 1 else 0
        for step in range(self.step, self.cfg.run.max_steps):
            batch = await queue.get()
            held = self._checkpoint_after(step - 1) or self._due(self.cfg.run.eval_every, step - 1)
            need = step if held else step - ahead
            await self._wait_until(lambda: self._finished >= need)
            # an applied update is pushed as the trainer's next version in the same call
            command = self.ex.trainer.acall("train_step", batch.meta["tensors"], push=True, step=step)
            await submitted.put((step, batch, command))

    async def finish_steps(self, submitted: asyncio.Queue) -> None:
        """Results in step order: log, evaluate and checkpoint as configured."""
        for _ in range(self.step, self.cfg.run.max_steps):
            step, batch, result = await submitted.get()
            await self.train(step, batch, result)
            if self._due(self.cfg.run.eval_every, step):
                await self.evaluate(step + 1)
            if self._checkpoint_after(step):
                await self.on_checkpoint(step + 1, self.version, batch.meta["cursor_after"])
            async with self._progress:
                self._finished = step + 1
                self._progress.notify_all()

    async def sample(self, step: int) -> Sampled:
        """The step's prompts and their samples; with generator.dynamic_sampling, scored and filtered."""
        sampled = await self._sample_batch(step, 0)
        return await self._sample_informative(sampled) if self.cfg.generator.dynamic_sampling else sampled

    async def _sample_batch(self, step: int, k: int) -> Sampled:
        """Batch k of step ``step``: the next prompts_per_step prompts of the stream, sampled with a seed of its own."""
        samples = self.data.next(self.cfg.generator.prompts_per_step)
        prompts = self.data.encode(samples)
        cursor = self.data.cursor
        seed = self.cfg.run.seed * 1_000_003 + step + k * BATCH_SEED_STRIDE
        outputs, seconds = await self.generate(prompts, dataclasses.replace(self.sampling, seed=seed))
        return Sampled(step, samples, prompts, outputs, cursor, seconds)

    async def _sample_informative(self, first: Sampled) -> Sampled:
        """DAPO's dynamic sampling. A prompt group is flat when its scored samples all earned the same reward
        (llamarl.rollouts.is_flat): its advantages are 0 and it teaches nothing. Batches of
        prompts_per_step prompts are drawn, sampled and scored until prompts_per_step groups are not flat,
        generator.max_sample_batches batches are spent, or the verifier failed on every sample of a batch (so
        a broken reward stops the run after reward.max_failed_steps steps, not that many times the batches);
        the step keeps prompts_per_step groups (``rollouts.choose_groups``: the first that are not flat, filled
        up with flat ones, in draw order; the step's size stays fixed, so mini-batches still split it evenly).
        The other groups are dropped, as in DAPO; the step's metrics of what was generated (tokens, lengths,
        the share cut by the budget, reward failures) count them too. The batches are drawn one after
        another in this stage, and in sync mode which prompts a step gets depends only on the data stream and
        the seeds (a resumed run draws the same); in async mode the rewards, and so the batches drawn,
        depend on the weights each batch saw. Every token keeps the version it was sampled with, and later
        batches only sample with newer weights."""
        g, n = self.cfg.generator, self.sampling.n
        groups: list[tuple] = []  # (sample, prompt ids, its n rollouts), in the order drawn
        batch, batches, generate_s, score_s = first, 1, 0.0, 0.0
        while True:
            generate_s += batch.generate_s
            rollouts = self._rollouts(batch)
            t0 = time.perf_counter()
            await self._score(rollouts, batch.samples)
            score_s += time.perf_counter() - t0
            groups += [(sample, prompt, rollouts[i * n:(i + 1) * n])
                       for i, (sample, prompt) in enumerate(zip(batch.samples, batch.prompts))]
            informative = sum(not is_flat(gr) for _, _, gr in groups)
            failed = all(r.reward_error is not None for r in rollouts)
            if informative >= g.prompts_per_step or batches >= g.max_sample_batches or failed:
                break
            batch = await self._sample_batch(first.step, batches)
            batches += 1
        chosen = [groups[i] for i in choose_groups([gr for _, _, gr in groups], g.prompts_per_step)]
        rollouts = []
        for j, (_, _, group) in enumerate(chosen):
            for r in group:
                r.group = j
                rollouts.append(r)
        return Sampled(first.step, [c[0] for c in chosen], [c[1] for c in chosen], [], batch.cursor, generate_s,
                       rollouts=rollouts, score_s=score_s, batches=batches,
                       drawn=[r for _, _, gr in groups for r in gr])

    def _rollouts(self, sampled: Sampled) -> list[Rollout]:
        samples, prompts, n = sampled.samples, sampled.prompts, self.sampling.n
        return [
            Rollout(sample_id=f"{samples[i // n].id}#{i % n}", group=i // n, prompt_ids=prompts[i // n],
                    completion_ids=o["token_ids"], logprobs=o["logprobs"], versions=o["policy_versions"],
                    answer=samples[i // n].answer, finish_reason=o["finish_reason"],
                    text=self.tok.decode(o["token_ids"]))
            for i, o in enumerate(sampled.outputs)
        ]

    async def _score(self, rollouts: list[Rollout], samples: list) -> None:
        """Fill in the rewards of ``rollouts`` (prompt-major, n per sample), or the verifier's error."""
        n = self.sampling.n
        infos = [s.reward_info() for s in samples]  # (the pool sends on what the function asks for)
        scores, model_scores = await self._verify_beside_model(
            samples, [(r.prompt_ids, r.completion_ids) for r in rollouts],
            lambda pool: pool.score_async([(r.sample_id, r.text, r.answer, infos[i // n])
                                           for i, r in enumerate(rollouts)]))
        if scores is None:  # reward.reward=none: no reward functions, the reward model's term alone
            for r in rollouts:
                r.reward, r.reward_error, r.reward_terms = 0.0, None, ()
        else:
            for r, s in zip(rollouts, scores):
                r.reward, r.reward_error, r.reward_terms = s.reward, s.error, s.terms
        rw = self.cfg.reward
        if rw.overlong_buffer:
            for r in rollouts:
                if r.reward_error is None:
                    penalty = overlong_penalty(len(r.completion_ids), self.sampling.max_new_tokens,
                                               rw.overlong_buffer, rw.overlong_penalty)
                    r.reward, r.reward_terms = r.reward + penalty, (*r.reward_terms, penalty)
        if model_scores is not None:  # r += model_weight * s; a sample it cannot score costs that sample
            for r, s in zip(rollouts, model_scores):
                if r.reward_error is not None:
                    continue
                if isinstance(s, str):
                    r.reward, r.reward_error, r.reward_terms = 0.0, s, ()
                else:
                    r.reward, r.reward_terms = r.reward + rw.model_weight * s, (*r.reward_terms, s)

    async def score(self, sampled: Sampled) -> RolloutBatch:
        step, n = sampled.step, self.sampling.n
        if sampled.rollouts is None:
            rollouts = self._rollouts(sampled)
            t2 = time.perf_counter()  # the pipeline may have held the samples since they were generated
            await self._score(rollouts, sampled.samples)
            score_s = time.perf_counter() - t2
        else:  # scored while sampling (dynamic sampling)
            rollouts, score_s = sampled.rollouts, sampled.score_s
        drawn = sampled.drawn or rollouts  # everything generated for the step (dynamic sampling drops some)
        self._check_verifier(step, [r.reward_error for r in drawn])
        batch = RolloutBatch(rollouts, n=n, generate_s=sampled.generate_s, score_s=score_s,
                             meta={"step": step, "cursor_after": sampled.cursor, "batches": sampled.batches,
                                   "drawn": drawn})
        # advantages, the trainer's tensors and the logged samples are prepared here, off the trainer's path
        # a sample whose verifier failed (raised, timed out) has no reward: it takes no part in its group
        scored_ok = torch.tensor([r.reward_error is None for r in rollouts])
        advantages = group_advantages(batch.rewards(), n, method=self.cfg.trainer.advantage, valid=scored_ok)
        trained = rollouts
        if self.cfg.trainer.mask_truncated:  # after the baselines, which still count these rewards
            trained, advantages = without_truncated(rollouts, advantages)
        batch.meta["samples"] = [
            {"step": step + 1, "sample_id": r.sample_id,
             "prompt": self.tok.decode(r.prompt_ids, skip_special_tokens=False), "completion": r.text,
             "answer": r.answer, "reward": r.reward, "reward_error": r.reward_error, "advantage": float(a),
             **({"reward_terms": dict(zip(self.term_names, r.reward_terms))} if len(self.term_names) > 1 else {}),
             "finish_reason": r.finish_reason, "tokens": len(r.completion_ids), "min_version": r.min_version}
            for r, a in zip(rollouts[:self.cfg.run.log_samples], advantages)]
        t = self.cfg.trainer
        exact = t.kl_coef == 0 and t.entropy_coef == 0  # A = 0 rows add nothing; see llamarl.rollouts
        size = len(rollouts) // t.mini_batches  # whole prompt groups (the config checks that they divide)
        parts = [collate(trained[lo:lo + size], advantages[lo:lo + size], self.tok.pad_id,
                         drop_zero_advantage=t.skip_zero_advantage and exact, row_multiple=t.ranks,
                         share_prompts=t.share_prompts) for lo in range(0, len(rollouts), size)]
        batch.meta["tensors"] = parts[0] if len(parts) == 1 else parts
        batch.meta["rows"] = sum(int(p["targets"].shape[0]) for p in parts)
        return batch

    async def train(self, step: int, batch: RolloutBatch, result: Awaitable[list[dict]]) -> None:
        """The trainer's answer to step ``step``: an applied update was pushed as version + 1 (a non-finite
        loss skips the update, and a step without a trained token has none: no new version). Steps finish
        in order, so ``self.version`` is the version the step trained."""
        per_rank = await result
        stats = dict(per_rank[0])
        pushed = stats.pop("version")
        if "tokens" in stats:  # the loss's token count; "tokens" in the row is what the generator sampled
            stats["trained_tokens"] = stats.pop("tokens")
        staleness = self.version - batch.oldest_version
        sync_s = sync_wait_s = 0.0
        if stats.pop("sync", None) is not None:
            self.version += 1
            sync_s = max(r["sync"]["seconds"] for r in per_rank)  # published when the last rank is done
            # of which waiting for a slot (a generation batch still reading the one the push needs)
            sync_wait_s = max(r["sync"]["wait_seconds"] for r in per_rank)
        if pushed != self.version:
            raise RuntimeError(f"step {step + 1}: the trainer holds version {pushed}, the controller expected "
                               f"{self.version}; the two version counts diverged")
        now = time.perf_counter()
        self.log.step({
            "step": step + 1, "policy_version": self.version, "staleness": staleness,
            **batch.stats(self.term_names), "step_s": now - self._last_step_end,
            "sync_s": sync_s, "sync_wait_s": sync_wait_s, "generate_s": batch.generate_s, "score_s": batch.score_s,
            "tokens": batch.num_tokens, "tokens_per_s": batch.num_tokens / max(batch.generate_s, 1e-9),
            "reward_errors": sum(r.reward_error is not None for r in batch.generated),
            "sample_batches": batch.meta["batches"],
            "rows_trained": batch.meta["rows"], **stats,
        })
        self.log.samples(batch.meta["samples"])
        self._warn_if_cut(self.log.rows[-1])
        self._last_step_end = now
        async with self._progress:
            self.step = step + 1
            self._progress.notify_all()

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list[dict], float]:
        """The prompts' samples (prompt-major) and the slowest replica's engine time.

        The prompts are split over the generator replicas; each replica's TP ranks run together. Replica g
        samples with seed + g * REPLICA_SEED_STRIDE: one seed would give every replica the same random
        numbers, and the stride keeps replica seeds apart from the next steps' (seed + step)."""
        gens = self.ex.generators
        busy = [g for g in range(len(gens)) if g < len(prompts)]  # replica g takes prompts g, g+R, g+2R, ...
        per_replica = [params if params.seed is None else
                       dataclasses.replace(params, seed=params.seed + g * REPLICA_SEED_STRIDE) for g in busy]
        results = await asyncio.gather(*(gens[g].acall("generate", prompts[g::len(gens)], p)
                                         for g, p in zip(busy, per_replica)))
        n = params.n
        out: list[dict] = [None] * (len(prompts) * n)  # type: ignore[list-item]
        seconds = 0.0
        for g, per_rank in zip(busy, results):
            if any(r["samples"] != per_rank[0]["samples"] for r in per_rank[1:]):
                raise RuntimeError(f"the tensor-parallel ranks of generator replica {g} returned different outputs; "
                                   "they must hold the same weight version and sampling seed")
            seconds = max([seconds] + [r["seconds"] for r in per_rank])
            for j, o in enumerate(per_rank[0]["samples"]):  # TP ranks return identical outputs; take rank 0's
                prompt = g + (j // n) * len(gens)
                out[prompt * n + j % n] = o
        return out, seconds

    async def evaluate(self, step: int) -> dict:
        """Held-out accuracy of the newest weights: the fraction of completions whose verifier (the first reward
        term, reward.reward) gives 1 or more. Greedy by default; with ``run.eval_samples`` = k > 1, k completions
        per problem drawn at ``run.eval_temperature`` (a seed of the step's own), whose mean is the accuracy
        (mean@k), and ``pass@k``, the fraction of problems with a correct one among their k. With a reward model
        (``reward.model``), ``model_score``: its mean score of the completions it can score (a score that rises
        while the accuracy does not is the reward model being gamed)."""
        run, held = self.cfg.run, self.data.heldout
        k = run.eval_samples
        seed = run.seed * 1_000_003 + step + EVAL_SEED_OFFSET if run.eval_temperature > 0 else None
        params = SamplingParams(max_new_tokens=self.cfg.generator.max_new_tokens, temperature=run.eval_temperature,
                                n=k, stop=self.cfg.generator.stop, seed=seed)
        prompts = self.data.encode(held)
        outputs, _ = await self.generate(prompts, params)  # prompt-major: problem i's at i*k..
        # the verifier alone (other terms cannot fail a right answer); with a reward model, its mean score of the
        # completions beside the accuracy (reward hacking shows)
        scores, model_scores = await self._verify_beside_model(
            held, [(prompts[j // k], o["token_ids"]) for j, o in enumerate(outputs)],
            lambda pool: pool.score_async(
                [(s.id if k == 1 else f"{s.id}#{j % k}", self.tok.decode(o["token_ids"]), s.answer, s.reward_info())
                 for j, (s, o) in enumerate(zip((s for s in held for _ in range(k)), outputs))], verifier_only=True))
        result = {"policy_version": min(min(o["policy_versions"], default=-1) for o in outputs)}
        if scores is not None:  # (reward.reward=none: no verifier, no accuracy)
            correct = [r.verifier >= 1.0 for r in scores]
            result["accuracy"] = sum(correct) / len(correct)
            if k > 1:
                result[f"pass@{k}"] = sum(any(correct[i * k:(i + 1) * k]) for i in range(len(held))) / len(held)
        if model_scores is not None:
            scored = [x for x in model_scores if not isinstance(x, str)]  # (too long for it: left out)
            if scored:
                result["model_score"] = math.fsum(scored) / len(scored)
        self.log.eval(step, result)
        return result

    # ------------------------------------------------------------------ helpers
    async def _verify_beside_model(self, samples: list, pairs: list[tuple],
                                   verify: Callable[[RewardPool], Awaitable[list]]) -> tuple[list | None, list | None]:
        """(``verify(pool)``'s results, or None without reward functions (reward.reward=none); the reward model's
        scores of ``pairs``, or None without one). ``pairs``: (prompt ids, completion ids), ``len(samples)``
        groups of equal size, prompt-major. The reward model scores in a thread while the pool verifies (with
        the prompts' chat messages only where it renders them with its own template, llamarl.rewards.model); an
        exception out of ``verify`` drops its scores."""
        rm, model_scores = self.ex.reward_model, None
        if rm is not None:
            n = len(pairs) // len(samples)
            msgs = [self.data.formatter.messages(s) for s in samples] if rm.wants_messages else None
            model_scores = asyncio.ensure_future(rm.score_rollouts(
                [(p, c, msgs[i // n] if msgs else None) for i, (p, c) in enumerate(pairs)]))
        try:
            verified = await verify(self.ex.rewards) if self.ex.rewards is not None else None
        except BaseException:
            if model_scores is not None:
                model_scores.cancel()
            raise
        return verified, (await model_scores if model_scores is not None else None)

    def _warn_if_cut(self, row: dict) -> None:
        """Once per run: most completions of a step ran into the token budget, so their answers were cut
        off (e.g. a preset's budget left in place for a longer task)."""
        if not self._warned_cut and row["length_capped_frac"] >= CUT_WARNING_FRAC:
            self._warned_cut = True
            self.log.warn(f"{row['length_capped_frac']:.0%} of step {row['step']}'s completions stopped at "
                          f"generator.max_new_tokens={self.cfg.generator.max_new_tokens} tokens, cut before they "
                          "ended; if answers need more, raise it (--set generator.max_new_tokens=N)")

    def _check_verifier(self, step: int, errors: list[str | None]) -> None:
        """One failed sample costs that sample; a reward function that fails on every sample of
        ``reward.max_failed_steps`` steps in a row is broken, and the run stops instead of training on nothing."""
        limit = self.cfg.reward.max_failed_steps
        self._failed_steps = self._failed_steps + 1 if all(e is not None for e in errors) else 0
        if limit and self._failed_steps >= limit:
            if self.ex.rewards is None:  # reward.reward=none: the reward model's errors alone
                raise RewardPoolError(f"the reward model could score no sample of {limit} steps in a row (steps "
                                      f"{step + 2 - limit}-{step + 1}); the last error: {errors[-1]}; "
                                      "reward.max_failed_steps=0 never stops")
            raise RewardPoolError(f"the reward function failed on every sample of {limit} steps in a row (steps "
                                  f"{step + 2 - limit}-{step + 1}); the last error: {errors[-1]}. Fix it (or raise "
                                  f"reward.timeout_s if these are timeouts); reward.max_failed_steps=0 never stops")

    async def _wait_until(self, predicate: Callable[[], bool]) -> None:
        async with self._progress:
            await self._progress.wait_for(predicate)

    def _due(self, every: int, step: int) -> bool:
        return every > 0 and (step + 1) % every == 0 and step + 1 < self.cfg.run.max_steps

    def _checkpoint_after(self, step: int) -> bool:
        """Whether a checkpoint is written after step ``step`` (the next step must then start from exactly
        the saved state)."""
        return self.on_checkpoint is not None and self._due(self.cfg.run.checkpoint_every, step)


async def _run_stages(*stages: Awaitable[None]) -> None:
    """Run coroutines concurrently until all are done; the first failure cancels the others and raises."""
    tasks = [asyncio.ensure_future(s) for s in stages]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
