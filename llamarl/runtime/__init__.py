"""llamarl.runtime: executor processes, RPC futures, failure propagation, placement, launch.

The controller's whole view of processes::

    from llamarl.runtime import Layout, run

    async def main(rt):                                   # the controller: reads like the algorithm
        trainer, = rt.spawn_role("trainer", "llamarl.executors.trainer:TrainerExecutor", init_kwargs=...)
        metrics = await trainer.acall("train_step", batch)  # list of per-rank results
    run(Layout.parse("trainer=2,generator=1x1,reward=2"), main)

Modules: ``rpc`` (messages and errors), ``server`` (the executor process loop), ``executor``
(``ExecutorGroup``: futures, monitoring, shutdown), ``placement`` (``Layout``), ``launch`` (``Runtime``,
local spawn and torchrun), ``starting`` (how a local rank's process starts: forked from a preloaded
server or spawned), ``net`` (ports, addresses), ``testing`` (a toy executor for tests).
Executor classes are constructed as ``Class(**init_kwargs, rank_info=RankInfo)``; their public methods
are the commands.
"""

from llamarl.runtime.executor import ExecutorGroup
from llamarl.runtime.launch import Runtime, TorchrunEnv, run, serve_torchrun
from llamarl.runtime.placement import (
    Assignment,
    GeneratorSpec,
    GroupPlacement,
    Layout,
    LayoutError,
    RewardSpec,
    TrainerSpec,
)
from llamarl.runtime.rpc import ExecutorDied, ExecutorError, ExecutorHung, RankInfo

__all__ = [
    "Assignment",
    "ExecutorDied",
    "ExecutorError",
    "ExecutorHung",
    "ExecutorGroup",
    "GeneratorSpec",
    "GroupPlacement",
    "Layout",
    "LayoutError",
    "RankInfo",
    "RewardSpec",
    "Runtime",
    "TorchrunEnv",
    "TrainerSpec",
    "run",
    "serve_torchrun",
]
