"""Placement: which global ranks run which role, in which executor group, with what parallelism.

A ``Layout`` is the single source of truth for both launch paths. Global rank 0 is always the
controller; executor ranks follow in role order trainer, generator, reward::

    Layout.parse("trainer=2,generator=2x1,reward=2")        # generator = TP x replicas
    rank 0        controller
    ranks 1-2     group "trainer"      (2 ranks, FSDP)      group-local ranks 0-1
    ranks 3-4     group "generator"    (TP=2, 1 replica)    group-local ranks 0-1
    ranks 5-6     group "reward"       (2 workers)          group-local ranks 0-1

Each executor group owns its own torch.distributed process group (group-local ranks), so collectives
of one group never involve another. The generator has one group per replica (replicas are independent
engines; TP collectives stay inside a replica), named "generator" when there is one replica and
"generator.0", "generator.1", ... otherwise. A reward role with 0 workers has no group and no ranks
(llamarl.train uses this and scores in the controller's ``RewardPool`` worker processes). Trainer and
generator ranks run on ``device`` ("cpu" -> gloo, "cuda" -> nccl); reward ranks always run on the CPU
with gloo.

Accelerator assignment (``cuda_device``): locally, trainer+generator ranks take GPUs round-robin in
global-rank order (so a 1-GPU machine can co-locate a 1-rank trainer and a 1-rank generator); under
torchrun a rank uses ``LOCAL_RANK mod #GPUs``. NCCL cannot put two ranks of one group on one GPU; the
launcher then runs that group over gloo (host-staged CUDA collectives, ``launch.group_backend``). This
module is pure Python (no torch import) so configs can build layouts cheaply.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Literal

ROLES = ("trainer", "generator", "reward")
CONTROLLER = "controller"
TRAINER_PARALLEL = ("fsdp", "ddp", "none")
DEVICES = ("cpu", "cuda")


class LayoutError(ValueError):
    """A layout string or spec is invalid; the message names the offending part."""


@dataclass(frozen=True)
class TrainerSpec:
    """``ranks`` trainer processes in one group, splitting the work as ``parallel`` (fsdp|ddp|none)."""

    ranks: int = 1
    parallel: Literal["fsdp", "ddp", "none"] = "fsdp"

    def __post_init__(self) -> None:
        _check_count("trainer.ranks", self.ranks, minimum=1)
        if self.parallel not in TRAINER_PARALLEL:
            raise LayoutError(f"trainer.parallel: must be one of {', '.join(TRAINER_PARALLEL)}, got {self.parallel!r}")
        if self.parallel == "none" and self.ranks != 1:
            raise LayoutError(f"trainer.parallel: 'none' needs exactly 1 rank, got ranks={self.ranks}; use fsdp or ddp")


@dataclass(frozen=True)
class GeneratorSpec:
    """``replicas`` independent generator engines, each tensor-parallel over ``tp`` ranks."""

    tp: int = 1
    replicas: int = 1

    def __post_init__(self) -> None:
        _check_count("generator.tp", self.tp, minimum=1)
        _check_count("generator.replicas", self.replicas, minimum=1)


@dataclass(frozen=True)
class RewardSpec:
    """``workers`` reward-scoring processes in one group (0: no reward ranks and no group)."""

    workers: int = 2

    def __post_init__(self) -> None:
        _check_count("reward.workers", self.workers, minimum=0)


@dataclass(frozen=True)
class GroupPlacement:
    """One executor group: its name, role, global ranks (group rank i = ``global_ranks[i]``), backend."""

    name: str
    role: str
    global_ranks: tuple[int, ...]
    backend: str
    on_accelerator: bool

    @property
    def world_size(self) -> int:
        return len(self.global_ranks)


@dataclass(frozen=True)
class Assignment:
    """What a global rank runs: the controller, or rank ``rank`` of executor group ``group``."""

    global_rank: int
    role: str
    group: GroupPlacement | None = None
    rank: int = 0


@dataclass(frozen=True)
class Layout:
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    generator: GeneratorSpec = field(default_factory=GeneratorSpec)
    reward: RewardSpec = field(default_factory=RewardSpec)
    device: Literal["cpu", "cuda"] = "cpu"

    def __post_init__(self) -> None:
        for name, cls in (("trainer", TrainerSpec), ("generator", GeneratorSpec), ("reward", RewardSpec)):
            if not isinstance(getattr(self, name), cls):
                raise LayoutError(f"layout.{name}: expected a {cls.__name__}, got {getattr(self, name)!r}")
        if self.device not in DEVICES:
            raise LayoutError(f"layout.device: must be one of {', '.join(DEVICES)}, got {self.device!r}")

    # ---------------------------------------------------------------- parsing and printing
    @classmethod
    def parse(cls, spec: str, device: str | None = None) -> Layout:
        """Parse ``"trainer=2[:fsdp|ddp|none],generator=TPxREPLICAS|TP,reward=N[,device=cpu|cuda]"``.

        Omitted roles keep their defaults; ``device`` (argument) overrides a ``device=`` item.
        """
        if not isinstance(spec, str) or not spec.strip():
            raise LayoutError(f"layout: expected a string like 'trainer=2,generator=2x1,reward=2', got {spec!r}")
        items: dict[str, str] = {}
        for part in spec.split(","):
            key, sep, value = (s.strip() for s in part.partition("="))
            if not sep or not key or not value:
                raise LayoutError(f"layout: item {part.strip()!r} in {spec!r} is not of the form key=value")
            if key not in (*ROLES, "device"):
                hint = difflib.get_close_matches(key, (*ROLES, "device"), n=1)
                did = f" (did you mean '{hint[0]}'?)" if hint else ""
                raise LayoutError(f"layout: unknown role '{key}' in {spec!r}{did}; "
                                  f"known: trainer, generator, reward, device")
            if key in items:
                raise LayoutError(f"layout: '{key}' is given twice in {spec!r}")
            items[key] = value
        kwargs: dict = {}
        if "trainer" in items:
            ranks, _, parallel = items["trainer"].partition(":")
            kwargs["trainer"] = TrainerSpec(_parse_int("trainer", ranks, items, "N or N:fsdp|ddp|none"),
                                            parallel.strip().lower() or "fsdp")
        if "generator" in items:
            tp, _, replicas = items["generator"].lower().partition("x")
            form = "TPxREPLICAS (e.g. 2x1) or TP"
            kwargs["generator"] = GeneratorSpec(_parse_int("generator", tp, items, form),
                                                _parse_int("generator", replicas, items, form) if replicas else 1)
        if "reward" in items:
            kwargs["reward"] = RewardSpec(_parse_int("reward", items["reward"], items, "N"))
        kwargs["device"] = device if device is not None else items.get("device", "cpu")
        return cls(**kwargs)

    @property
    def spec(self) -> str:
        """The canonical string form; ``Layout.parse(layout.spec) == layout``."""
        return (f"trainer={self.trainer.ranks}:{self.trainer.parallel},"
                f"generator={self.generator.tp}x{self.generator.replicas},"
                f"reward={self.reward.workers},device={self.device}")

    def __str__(self) -> str:
        return self.spec

    # ---------------------------------------------------------------- rank assignment
    @property
    def groups(self) -> tuple[GroupPlacement, ...]:
        """All executor groups in global-rank order."""
        accel_backend = "nccl" if self.device == "cuda" else "gloo"
        groups: list[GroupPlacement] = []
        next_rank = 1

        def add(name: str, role: str, size: int, backend: str, on_accel: bool) -> None:
            nonlocal next_rank
            groups.append(GroupPlacement(name, role, tuple(range(next_rank, next_rank + size)), backend, on_accel))
            next_rank += size

        add("trainer", "trainer", self.trainer.ranks, accel_backend, self.device == "cuda")
        for i in range(self.generator.replicas):
            name = "generator" if self.generator.replicas == 1 else f"generator.{i}"
            add(name, "generator", self.generator.tp, accel_backend, self.device == "cuda")
        if self.reward.workers:
            add("reward", "reward", self.reward.workers, "gloo", False)
        return tuple(groups)

    @property
    def world_size(self) -> int:
        """Total processes: the controller plus every executor rank."""
        return 1 + sum(g.world_size for g in self.groups)

    def groups_of(self, role: str) -> tuple[GroupPlacement, ...]:
        if role not in ROLES:
            raise LayoutError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        return tuple(g for g in self.groups if g.role == role)

    def group(self, name: str) -> GroupPlacement:
        for g in self.groups:
            if g.name == name:
                return g
        raise LayoutError(f"layout {self.spec} has no group '{name}'; its groups are "
                          f"{', '.join(g.name for g in self.groups)}")

    def assignment(self, global_rank: int) -> Assignment:
        """What global rank ``global_rank`` runs under this layout."""
        if not isinstance(global_rank, int) or not 0 <= global_rank < self.world_size:
            raise LayoutError(f"global rank {global_rank!r} is outside layout {self.spec} "
                              f"(world size {self.world_size}: ranks 0..{self.world_size - 1})")
        if global_rank == 0:
            return Assignment(0, CONTROLLER)
        for g in self.groups:
            if global_rank in g.global_ranks:
                return Assignment(global_rank, g.role, g, g.global_ranks.index(global_rank))
        raise AssertionError("unreachable: groups cover ranks 1..world_size-1")

    def cuda_device(self, global_rank: int, num_devices: int, local_rank: int | None = None) -> int | None:
        """GPU index for ``global_rank`` (None for CPU ranks); see the module docstring for the rule."""
        a = self.assignment(global_rank)
        if a.group is None or not a.group.on_accelerator:
            return None
        if num_devices < 1:
            raise LayoutError(f"layout {self.spec} places '{a.group.name}' on cuda but no CUDA device is visible")
        if local_rank is not None:
            return local_rank % num_devices
        accel = [r for g in self.groups if g.on_accelerator for r in g.global_ranks]
        return accel.index(global_rank) % num_devices


def _check_count(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LayoutError(f"{name}: must be an integer >= {minimum}, got {value!r}")


def _parse_int(role: str, text: str, items: dict[str, str], form: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise LayoutError(f"layout: {role}={items[role]!r}: {text!r} is not a number; expected {form}") from None
