"""Test support: a toy executor that exercises every runtime path. Not used in training.

It lives in the package (not under tests/) because spawned ranks must import it by name:
``"llamarl.runtime.testing:ToyExecutor"``. Commands echo, raise, sleep, all-reduce over the group's own
torch.distributed process group (proving each group has one), report their environment, and die in
the two ways a real executor can (``os._exit`` and SIGKILL).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, Sequence

from llamarl.runtime.rpc import RankInfo


class ToyError(ValueError):
    """Raised on purpose by ``ToyExecutor.fail``."""


class ToyExecutor:
    def __init__(self, tag: str = "toy", fail_in_init: bool = False, *, rank_info: RankInfo):
        if fail_in_init:
            raise ToyError(f"constructor of {tag} asked to fail on rank {rank_info.rank}")
        self.tag, self.info = tag, rank_info
        self.calls: list[str] = []
        self.items_seen: list = []

    def echo(self, *args: Any, **kwargs: Any) -> dict:
        self.calls.append("echo")
        return {"tag": self.tag, "rank": self.info.rank, "args": args, "kwargs": kwargs}

    def info_dict(self, keys: Sequence[str] = ("LLAMARL_TOY_ENV", "RANK", "WORLD_SIZE")) -> dict:
        """This rank: its RankInfo, process group, process (pid, parent pid, name in /proc/self/comm, Linux),
        torch's thread count and the environment variables ``keys`` (None where unset)."""
        import torch
        import torch.distributed as dist

        comm = None  # Linux only
        if os.path.exists("/proc/self/comm"):
            with open("/proc/self/comm") as f:
                comm = f.read().strip()
        return {"group": self.info.group, "role": self.info.role, "rank": self.info.rank,
                "world_size": self.info.world_size, "global_rank": self.info.global_rank,
                "device": self.info.device, "backend": self.info.backend, "pid": os.getpid(),
                "ppid": os.getppid(), "comm": comm,
                "dist_rank": dist.get_rank(), "dist_world_size": dist.get_world_size(),
                "threads": torch.get_num_threads(), "env": {k: os.environ.get(k) for k in keys}}

    def device_sum(self, n: int) -> float:
        """Sum of ``n`` ones computed on this rank's device (proves the device works in this process)."""
        import torch

        return float(torch.ones(n, device=self.info.device).sum().item())

    def write(self, text: str) -> None:
        """Write ``text`` to this process's stdout and stderr descriptors."""
        os.write(1, f"stdout of rank {self.info.rank}: {text}\n".encode())
        os.write(2, f"stderr of rank {self.info.rank}: {text}\n".encode())

    def fail(self, message: str = "boom") -> None:
        self.calls.append("fail")
        raise ToyError(f"{message} on rank {self.info.rank}")

    def fail_on_rank(self, rank: int, message: str = "boom") -> int:
        if self.info.rank == rank:
            raise ToyError(f"{message} on rank {rank}")
        return self.info.rank

    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.info.rank

    def all_reduce(self, values: list[float]) -> list[float]:
        """Sum ``values`` elementwise, each rank contributing ``values * (rank + 1)``."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64) * (self.info.rank + 1)
        dist.all_reduce(t)
        return t.tolist()

    def scale(self, tensor, factor: float):
        return tensor * factor

    def history(self) -> list[str]:
        return list(self.calls)

    def append(self, item: Any) -> int:
        """Record ``item``; ``items()`` shows the order in which this rank ran the calls."""
        self.items_seen.append(item)
        return len(self.items_seen)

    def items(self) -> list:
        return list(self.items_seen)

    def unpicklable(self):
        return lambda: None

    def raise_unprintable(self) -> None:
        """Raise an exception whose ``str()`` itself fails."""
        class Unprintable(Exception):
            def __str__(self):
                raise RuntimeError("no text")

        raise Unprintable()

    def exit_command(self, code: int = 0) -> None:
        """``sys.exit`` inside a command, with a non-daemon thread alive (it would keep a normal exit waiting)."""
        threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
        sys.exit(code)

    def exit_hard(self, code: int = 3, rank: int | None = None) -> int:
        if rank is None or rank == self.info.rank:
            os._exit(code)
        return self.info.rank

    def kill_self(self, rank: int | None = None) -> int:
        if rank is None or rank == self.info.rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.info.rank

    def close(self) -> None:
        marker = os.environ.get("LLAMARL_TOY_CLOSE_MARKER")
        if marker:
            with open(f"{marker}.{self.info.group}.{self.info.rank}", "w") as f:
                f.write("closed")


async def _torchrun_demo(rt) -> dict:
    """Controller of the torchrun simulation: start every role with the toy executor and use them."""
    groups = {}
    for role in ("trainer", "generator", "reward"):
        for group in rt.spawn_role(role, "llamarl.runtime.testing:ToyExecutor", init_kwargs={"tag": role}):
            groups[group.name] = group
    out = {}
    for name, group in groups.items():
        out[name] = {"info": await group.acall("info_dict"), "sum": await group.acall("all_reduce", [1.0])}
    return out


def torchrun_demo(layout_spec: str) -> None:
    """``python -c "from llamarl.runtime.testing import torchrun_demo; torchrun_demo('trainer=2,...')"``
    under torchrun (or with its variables set by hand): rank 0 prints one JSON line with what every
    executor reported; the other ranks serve and exit."""
    import json

    from llamarl.runtime import Layout, run

    result = run(Layout.parse(layout_spec), _torchrun_demo, start_timeout_s=120.0, dist_timeout_s=120.0)
    print("TORCHRUN_DEMO " + json.dumps(result), flush=True)
