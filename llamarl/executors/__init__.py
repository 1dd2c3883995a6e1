"""Executor classes, one per role, each run by llamarl.runtime in its own process(es).

    generator: GeneratorExecutor — the generation engine over weights that live in DDMA buckets
    trainer:   TrainerExecutor   — AIPO updates with AdamW; pushes new weights into the generator buckets
Rewards are scored by llamarl.rewards.RewardPool worker processes owned by the controller.
"""

# the modules of the executor classes (what the fork server of CPU ranks preloads: llamarl.runtime.starting)
MODULES = ("llamarl.executors.generator", "llamarl.executors.trainer")
