"""Reward-model scoring: length-sorted batches against batches in the given order and one sequence at a time.

RL rollouts vary in length by an order of magnitude (most completions end early, a few run to
``max_new_tokens``), and a batch runs at the length of its longest row. The rows (the same sequences, the
same reward model, one process, timed alternately):

  single    one sequence per forward: no padding, no batching
  ordered   batches of ``batch_size`` in the order given, each padded to its longest
  sorted    batches of ``batch_size`` after sorting by length (``RewardModelScorer.score``, what llamarl runs)

Each row reports the positions its forwards run (deterministic) and the share of them that are real tokens
(``real_frac``: 1.0 is no padding, the bound), the median time to score every sequence,
sequences per second, the speed-up over ``ordered``, and the largest difference of its scores from
``single``'s (the variants agree up to float summation order: the padding after a row's last real token
never reaches it).

    python -m benchmarks.reward_model [--model small] [--sequences 64] [--batch-size 16] [--max-new-tokens 256]
    python -m benchmarks.reward_model --device cuda --dtype bfloat16 --model llama-3.2-1b --sequences 256
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from benchmarks.harness import Report, completion_length, measure, positive_int
from llamarl.models import LLAMA_CONFIGS, CharTokenizer, LlamaRewardModel
from llamarl.rewards.model import RewardModelScorer


def make_sequences(args, vocab: int) -> list[list[int]]:
    """``sequences`` prompt + completion id lists: prompt lengths uniform in [P/2, P], completion lengths
    lognormal (median ``median_new_tokens``, sigma 0.8) capped at ``max_new_tokens``; no pad id (0)."""
    g = torch.Generator().manual_seed(args.seed)
    out = []
    for _ in range(args.sequences):
        n_prompt = int(torch.randint(args.prompt_len // 2, args.prompt_len + 1, (), generator=g))
        n_new = completion_length(args.median_new_tokens, args.max_new_tokens, g)
        out.append(torch.randint(3, vocab, (n_prompt + n_new,), generator=g).tolist())
    return out


def positions(lengths: list[int], batch_size: int, *, sort: bool) -> int:
    """Positions the forwards of batches of ``batch_size`` run, each padded to its longest row."""
    order = sorted(lengths) if sort else lengths
    return sum(len(order[i:i + batch_size]) * max(order[i:i + batch_size]) for i in range(0, len(order), batch_size))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=sorted(LLAMA_CONFIGS), help="the reward model's trunk")
    p.add_argument("--sequences", type=positive_int, default=64)
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--prompt-len", type=positive_int, default=64)
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--median-new-tokens", type=positive_int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--iters", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = LLAMA_CONFIGS[args.model]
    if args.prompt_len + args.max_new_tokens > config.max_position_embeddings:
        p.error(f"--prompt-len + --max-new-tokens exceeds the {args.model} context ({config.max_position_embeddings})")
    seqs = make_sequences(args, config.vocab_size)
    lengths = [len(s) for s in seqs]
    report = Report("reward_model", f"Reward-model scoring: length-sorted batches ({args.model}, {args.device})")
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(args.seed)
        LlamaRewardModel(config).save_pretrained(tmp)
        scorer = RewardModelScorer(tmp, policy_tokenizer=CharTokenizer(), dtype=args.dtype, device=args.device,
                                   batch_size=args.batch_size)
        b = args.batch_size
        variants = {
            "single": (lambda: [x for s in seqs for x in scorer.score([s])], sum(lengths)),
            "ordered": (lambda: [x for i in range(0, len(seqs), b) for x in scorer.score(seqs[i:i + b])],
                        positions(lengths, b, sort=False)),
            "sorted": (lambda: scorer.score(seqs), positions(lengths, b, sort=True)),
        }
        scores = {name: fn() for name, (fn, _) in variants.items()}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.iters):  # alternately, so a drift of the machine's speed hits every variant alike
            for name, (fn, _) in variants.items():
                times[name].append(measure(fn, warmup=0, iters=1, device=args.device).median_s)
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    for name, (_, pos) in variants.items():
        diff = max(abs(a - c) for a, c in zip(scores[name], scores["single"]))
        report.add(variant=name, positions=pos, real_frac=sum(lengths) / pos, score_s=median[name],
                   seq_per_s=len(seqs) / median[name], speedup_vs_ordered=median["ordered"] / median[name],
                   max_abs_diff_vs_single=diff)
    report.note(f"{len(seqs)} sequences, lengths {min(lengths)}-{max(lengths)} (median "
                f"{sorted(lengths)[len(lengths) // 2]}), batches of {b}; {args.model} trunk "
                f"({sum(t.numel() for t in scorer.model.parameters()) / 1e6:.1f}M parameters), {args.dtype}")
    report.note(f"median of {args.iters} alternated timings; real_frac is the share of the positions run that are "
                "real tokens (1.0: no padding, the bound `single` reaches without batching)")
    report.save()


if __name__ == "__main__":
    main()
