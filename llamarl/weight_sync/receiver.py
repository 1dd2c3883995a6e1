"""Generator side: read weights only inside a hold on a complete policy version.

    receiver = WeightReceiver(buckets)          # buckets: this rank's GeneratorBuckets
    receiver.bind(model)                        # model params become views into the held slot
    while serving:
        with receiver.reading() as version:     # at a batch boundary: newest complete version
            outputs = generate(model, batch)    # tag tokens with `version`; weights cannot change here

Invariant: between ``acquire`` and ``release`` the held slot is READY or DRAINING, never WRITING, so
every tensor the generator reads belongs to the same complete version (see versioning.py). Outside a
hold the views may be overwritten at any time: compute only inside ``reading()``.

A bound module's parameters are re-pointed (not copied) when a hold lands on another slot; ``load_views``
then sets ``module.weights_key`` to an identity of the slot's storage, so a CUDA-graph decoder
(llamarl.generation.cuda_graphs) keeps one graph per slot instead of reading the old one - stale, or
being rewritten.

TP ranks of one replica read the same version: the leader acquires the newest, broadcasts the number,
and the other ranks ``acquire(version=v)``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from llamarl.weight_sync.buckets import GeneratorBuckets, load_views


class WeightReceiver:
    """Version-safe reads of one generator rank's buckets."""

    def __init__(self, buckets: GeneratorBuckets):
        self.buckets = buckets
        self.control = buckets.control
        self.reader_rank = buckets.plan.generator.tp_rank(buckets.rank)
        self.control.register_reader(self.reader_rank)
        self._slot: int | None = None
        self._version: int | None = None
        self._module: torch.nn.Module | None = None
        self._bound_slot: int | None = None
        self._strict = True
        self._names: dict[str, str] | None = None

    # ---- holds -------------------------------------------------------------------------------------
    def acquire(self, version: int | None = None, timeout: float = 60.0) -> int:
        """Hold the newest complete version (or exactly ``version``) and return its number.

        Waits (up to ``timeout``) for a first version, or while a single-slot sync is in progress;
        raises SyncTimeout / PeerDied with the control block's state otherwise.
        """
        if self._slot is not None:
            raise RuntimeError(f"this receiver already holds version {self._version}; release() it first")
        slot, v = self.control.acquire(version, timeout)
        self._slot, self._version = slot, v
        if self._module is not None and self._bound_slot != slot:
            try:
                self._bind_slot(slot)
            except BaseException:
                self.release()
                raise
        return v

    def _bind_slot(self, slot: int) -> None:
        load_views(self._module, self.buckets.tensors(slot), strict=self._strict,
                   where=f"generator rank {self.buckets.rank} slot {slot}", names=self._names)
        self._bound_slot = slot

    def release(self) -> None:
        """End the hold; the slot may be rewritten from now on."""
        if self._slot is None:
            raise RuntimeError("release() without a matching acquire()")
        slot, self._slot, self._version = self._slot, None, None
        self.control.release(slot)

    @contextlib.contextmanager
    def reading(self, version: int | None = None, timeout: float = 60.0) -> Iterator[int]:
        """``with receiver.reading() as v:`` - hold a complete version for the block."""
        v = self.acquire(version, timeout)
        try:
            yield v
        finally:
            self.release()

    # ---- access ------------------------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        """The version held now (None outside a hold)."""
        return self._version

    @property
    def slot(self) -> int | None:
        return self._slot

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """name -> view of the held version (valid until release())."""
        if self._slot is None:
            raise RuntimeError("named_tensors() outside a hold: call acquire() or use reading()")
        return self.buckets.tensors(self._slot)

    def bind(self, module: torch.nn.Module, *, strict: bool = True, names: dict[str, str] | None = None) -> None:
        """Make ``module``'s parameters views of the held slot, now and on every later acquire
        (``names``: bucket tensor name -> module tensor name where they differ, see ``load_views``).
        A module that does not fit the buckets is refused here, not at the next acquire."""
        load_views(module, self.buckets.tensors(0), strict=strict, names=names, check_only=True,
                   where=f"generator rank {self.buckets.rank}'s buckets")  # views only: reads no slot
        self._module, self._strict, self._bound_slot, self._names = module, strict, None, names
        if self._slot is not None:
            self._bind_slot(self._slot)

    @property
    def latest_version(self) -> int:
        """Newest published version (-1 before the first sync); does not hold it."""
        return self.control.latest_version

    def wait_for_version(self, version: int, timeout: float = 60.0) -> None:
        """Block until ``version`` or newer is published (PeerDied if a writer died meanwhile)."""
        self.control.wait_version(version, timeout)

    def close(self) -> None:
        if self._slot is not None:
            self.release()
        self.control.deregister(writer=False, rank=self.reader_rank)
        self._module = None
