"""The version protocol: slots, holds, multi-writer publication, bounded waits, dead peers, torn reads."""

import contextlib
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from llamarl import _native
from llamarl.weight_sync import (
    GeneratorBuckets,
    GeneratorLayout,
    ParamSpec,
    PeerDied,
    SyncTimeout,
    TrainerLayout,
    VersionControl,
    WeightReceiver,
    WeightSender,
    plan_sync,
)

SPECS = [ParamSpec("model.layers.0.mlp.up_proj.weight", (96, 256), torch.float32, 0),
         ParamSpec("model.layers.0.mlp.down_proj.weight", (256, 96), torch.float32, 1),
         ParamSpec("model.embed_tokens.weight", (77, 64), torch.bfloat16, 0),
         ParamSpec("model.norm.weight", (256,), torch.float32, None)]


def filled(plan, t, value):
    """Trainer rank t's shards of a version whose every element equals `value` (exact in fp32/bf16)."""
    return {s.name: torch.full(plan.trainer.local_shape(s, t), float(value), dtype=s.dtype) for s in plan.specs}


def torn(views, version) -> list[str]:
    """Names of tensors that do not hold exactly `version` everywhere (a mixed or partial read)."""
    return [n for n, v in views.items() if not bool((v.float() == float(version)).all())]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ---- control block semantics, one process ---------------------------------------------------------------
def test_publication_needs_every_writer_and_versions_increase():
    c = VersionControl.create(nslots=2, n_writers=3, n_readers=1)
    try:
        with pytest.raises(SyncTimeout, match="no complete weight version"):
            c.acquire(timeout=0.05)
        s = c.claim(5)
        assert c.wait_claim(1, 5) == s and c.wait_claim(2, 5) == s
        assert not c.finish(0, s, 5) and not c.finish(2, s, 5)
        with pytest.raises(SyncTimeout):
            c.acquire(timeout=0.05)  # 2 of 3 writers done: nothing to read yet
        assert c.finish(1, s, 5)
        assert c.acquire(timeout=1) == (s, 5)
        c.release(s)
        with pytest.raises(RuntimeError, match="does not hold"):
            c.release(s)
        with pytest.raises(ValueError, match="not newer"):
            c.claim(5)
        with pytest.raises(RuntimeError, match="already moved past it"):
            c.wait_claim(1, 4, timeout=1)
    finally:
        c.close()


def test_one_slot_pauses_the_writer_until_the_reader_releases():
    c = VersionControl.create(nslots=1, n_writers=1)
    try:
        s = c.claim(1)
        c.finish(0, s, 1)
        slot, v = c.acquire()
        with pytest.raises(SyncTimeout, match="must release"):
            c.claim(2, timeout=0.1)  # the reader is mid-batch
        c.release(slot)
        # writer waits for the reader, then writes; a late newest-acquire waits for the write
        got = {}
        th = threading.Thread(target=lambda: got.setdefault("slot", c.claim(2, timeout=5)))
        slot, _ = c.acquire()
        th.start()
        time.sleep(0.05)
        assert c.snapshot()["slots"][0]["state"] == "DRAINING"
        c.release(slot)
        th.join(5)
        assert c.snapshot()["slots"][0]["state"] == "WRITING"
        with pytest.raises(SyncTimeout):
            c.acquire(timeout=0.05)
        c.finish(0, got["slot"], 2)
        assert c.acquire(timeout=1)[1] == 2
    finally:
        c.close()


def test_two_slots_let_the_writer_proceed_and_tp_peers_join_a_held_version():
    c = VersionControl.create(nslots=2, n_writers=1, n_readers=2)
    try:
        c.finish(0, c.claim(1), 1)
        leader_slot, v = c.acquire()
        c.finish(0, c.claim(2), 2)  # does not wait: the other slot was free
        assert c.acquire(timeout=1)[1] == 2
        c.release(c.snapshot()["latest_slot"])
        # the writer now needs the leader's slot (v1): it drains, a TP peer can still join v1
        th = threading.Thread(target=lambda: c.finish(0, c.claim(3, timeout=5), 3))
        th.start()
        time.sleep(0.05)
        assert c.acquire(version=1, timeout=1) == (leader_slot, 1)
        c.release(leader_slot)
        c.release(leader_slot)
        th.join(5)
        assert c.latest_version == 3
        with pytest.raises(RuntimeError, match="no longer held"):
            c.acquire(version=1, timeout=0.1)
    finally:
        c.close()


def test_an_unbounded_claim_waits_out_a_long_hold_and_still_sees_a_dead_reader():
    """The trainer's claims have no timeout (max_staleness >= 2 lets it push twice during one generation):
    it waits for the reader however long the batch takes, and a reader that dies is still reported."""
    c = VersionControl.create(nslots=2, n_writers=1, n_readers=1)
    try:
        c.finish(0, c.claim(1), 1)
        slot, _ = c.acquire()  # a generation batch holding v1
        c.finish(0, c.claim(2, timeout=float("inf")), 2)  # the idle slot: no wait
        done = threading.Event()
        th = threading.Thread(target=lambda: (c.finish(0, c.claim(3, timeout=float("inf")), 3), done.set()))
        th.start()
        assert not done.wait(0.3)  # v3 needs the held slot: it waits (past any short timeout)
        c.release(slot)
        assert done.wait(5) and c.latest_version == 3
        th.join(5)
        c.acquire()  # holds v3 ...
        c.finish(0, c.claim(4, timeout=float("inf")), 4)
        pid = dead_pid()
        _native.native().ctl_register(c._mem, False, 0, pid)  # ... and the reader dies holding it
        with pytest.raises(PeerDied, match=f"reader rank 0 \\(pid {pid}\\)"):
            c.claim(5, timeout=float("inf"))
    finally:
        c.close()


def test_dead_writer_is_named_and_abandon_recovers():
    c = VersionControl.create(nslots=2, n_writers=2)
    try:
        c.register_writer(0)
        s = c.claim(1)
        c.finish(0, s, 1)
        assert c.finish(1, s, 1)
        pid = dead_pid()
        _native.native().ctl_register(c._mem, True, 1, pid)  # writer 1 registered, then died
        s = c.claim(2)
        c.finish(0, s, 2)  # writer 1 never finishes version 2
        with pytest.raises(PeerDied, match=f"writer rank 1 \\(pid {pid}\\) has exited before version 2"):
            c.wait_version(2, timeout=5)
        assert c.acquire(timeout=1)[1] == 1  # the last complete version is still served
        c.release(c.snapshot()["latest_slot"])
        with pytest.raises(PeerDied, match="in the middle of writing version 2"):
            c.claim(3, timeout=5)
        c.abandon()
        c.register_writer(1)  # a restarted trainer rank 1 (this process)
        s = c.claim(3)
        assert c.wait_claim(1, 3) == s
        c.finish(0, s, 3)
        assert c.finish(1, s, 3) and c.latest_version == 3
    finally:
        c.close()


def test_a_sync_that_fails_on_one_replica_leaves_no_claim_behind_on_the_others():
    """Replica 1's reader holds its only slot: the claim there times out after replica 0's succeeded. The
    claim on replica 0 is dropped, so once the reader lets go the next sync goes through (it waited forever
    behind its own unfinished version before); the abandoned version itself is never written again."""
    plan = plan_sync(SPECS, TrainerLayout(1), GeneratorLayout(replicas=2))
    buckets = [GeneratorBuckets.create(plan, g, storage="shm", slots=1) for g in range(2)]
    try:
        sender = WeightSender(plan, 0, [b.handle() for b in buckets], timeout=0.5)
        sender.sync(filled(plan, 0, 1), 1)
        reader = WeightReceiver(buckets[1])
        with reader.reading() as v:
            assert v == 1
            with pytest.raises(SyncTimeout, match="must release"):
                sender.sync(filled(plan, 0, 2), 2)
        with pytest.raises(ValueError, match="claimed and abandoned before"):
            sender.sync(filled(plan, 0, 2), 2)
        sender.sync(filled(plan, 0, 3), 3)
        for b in buckets:
            r = WeightReceiver(b)
            with r.reading() as v:
                assert v == 3 and torn(r.named_tensors(), 3) == []
            r.close()
        reader.close()
        sender.close()
    finally:
        for b in buckets:
            b.close()


def failing_copy(monkeypatch):
    """Make the next copies write the first half of their ops, then raise (a CUDA error surfacing at the
    stream sync, an out-of-memory in the quantizer...): the slot then holds a partial version."""
    real = _native.copy_indexed

    def half_then_fail(dst, src, ops, **kwargs):
        real(dst, src, ops[: len(ops) // 2], **kwargs)
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(_native, "copy_indexed", half_then_fail)


@pytest.mark.parametrize("slots", [1, 2])
def test_a_sync_that_fails_mid_copy_is_abandoned_and_the_next_sync_goes_through(slots, monkeypatch):
    plan = plan_sync(SPECS, TrainerLayout(1), GeneratorLayout())
    b = GeneratorBuckets.create(plan, 0, storage="shm", slots=slots)
    sender, reader = WeightSender(plan, 0, [b.handle()], timeout=0.5), WeightReceiver(b)
    try:
        sender.sync(filled(plan, 0, 1), 1)
        failing_copy(monkeypatch)
        with pytest.raises(RuntimeError, match="injected copy failure"):
            sender.sync(filled(plan, 0, 2), 2)
        monkeypatch.undo()
        assert b.control.snapshot()["claim_version"] == -1  # nothing left claimed
        if slots == 2:  # the last complete version is still served, intact
            with reader.reading(timeout=1) as v:
                assert v == 1 and torn(reader.named_tensors(), 1) == []
        else:  # its only slot was partly overwritten: nothing to read until the next version
            with pytest.raises(SyncTimeout):
                with reader.reading(timeout=0.05):
                    pass
        sender.sync(filled(plan, 0, 3), 3)
        with reader.reading(timeout=1) as v:
            assert v == 3 and torn(reader.named_tensors(), 3) == []
    finally:
        sender.close()
        reader.close()
        b.close()


@contextlib.contextmanager
def two_trainer_ranks():
    """Two senders (trainer ranks 0 and 1 in this process) into one 2-slot replica, version 1 published, a
    reader, and a live stranger process whose pid a test registers for a writer that "runs elsewhere"."""
    plan = plan_sync(SPECS, TrainerLayout(2), GeneratorLayout())
    b = GeneratorBuckets.create(plan, 0, storage="shm", slots=2)
    senders = [WeightSender(plan, t, [b.handle()], timeout=5.0) for t in range(2)]
    reader, other = WeightReceiver(b), subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for t in range(2):
            senders[t].sync(filled(plan, t, 1), 1)
        yield plan, b.control, senders, reader, other
    finally:
        other.kill()
        other.wait()
        for s in senders:
            s.close()
        reader.close()
        b.close()


def both_sync(plan, senders, reader, version: int) -> None:
    """Both ranks sync ``version`` (rank 1 on a thread), and the reader then sees it whole."""
    _native.native().ctl_register(reader.control._mem, True, 0, os.getpid())  # writer 0 is this process again
    rank1 = threading.Thread(target=senders[1].sync, args=(filled(plan, 1, version), version))
    rank1.start()
    assert senders[0].sync(filled(plan, 0, version), version).version == version
    rank1.join(timeout=30)
    assert not rank1.is_alive()
    with reader.reading(timeout=5) as v:
        assert v == version and torn(reader.named_tensors(), version) == []


def test_a_trainer_rank_whose_sync_failed_abandons_it_once_the_others_finished(monkeypatch):
    """Writer 1 fails version 2 while writer 0 (a live process as far as the block knows) is still writing
    it, so it cannot be abandoned yet; writer 1's next sync abandons it once writer 0 finished, and
    version 3 is published by both (both waited forever behind version 2 before)."""
    with two_trainer_ranks() as (plan, ctl, senders, reader, other):
        _native.native().ctl_register(ctl._mem, True, 0, other.pid)  # writer 0 "runs elsewhere"
        slot = ctl.claim(2)  # writer 0 claims version 2 and is still copying
        failing_copy(monkeypatch)
        with pytest.raises(RuntimeError, match="injected copy failure"):
            senders[1].sync(filled(plan, 1, 2), 2)
        monkeypatch.undo()
        assert ctl.snapshot()["claim_version"] == 2  # writer 0 is still on it: not abandoned yet
        assert not ctl.finish(0, slot, 2)  # writer 0 done; version 2 can never complete
        with reader.reading(timeout=1) as v:
            assert v == 1 and torn(reader.named_tensors(), 1) == []
        both_sync(plan, senders, reader, 3)  # writer 0's claim waits until writer 1 abandoned version 2


def test_a_version_that_every_trainer_rank_failed_is_freed_by_the_last_to_give_up(monkeypatch):
    """Writers 0 and 1 (separate processes, as far as the block knows) both fail version 2 while holding its
    claim: each gives it up, and the second one frees it, so version 3 goes through with finite timeouts.
    Before, each waited for the other to finish a version neither would ever finish: the replica was wedged."""
    register = _native.native().ctl_register
    with two_trainer_ranks() as (plan, ctl, senders, reader, other):
        failing_copy(monkeypatch)
        register(ctl._mem, True, 1, other.pid)  # writer 1 "runs elsewhere" while writer 0 fails
        with pytest.raises(RuntimeError, match="injected copy failure"):
            senders[0].sync(filled(plan, 0, 2), 2)
        assert ctl.snapshot()["claim_version"] == 2  # writer 1 (alive) may still write it
        register(ctl._mem, True, 1, os.getpid())
        register(ctl._mem, True, 0, other.pid)  # and writer 0 "runs elsewhere" while writer 1 fails
        with pytest.raises(RuntimeError, match="injected copy failure"):
            senders[1].sync(filled(plan, 1, 2), 2)
        assert ctl.snapshot()["claim_version"] == -1  # both gave it up: freed, never published
        monkeypatch.undo()
        with reader.reading(timeout=1) as v:
            assert v == 1 and torn(reader.named_tensors(), 1) == []
        both_sync(plan, senders, reader, 3)


def test_abandon_names_its_version_and_leaves_another_alone():
    c = VersionControl.create(nslots=2, n_writers=2)
    try:
        c.register_writer(0)
        s = c.claim(1)
        c.abandon(0, version=7)  # not the claim in flight: nothing happens
        assert c.snapshot()["claim_version"] == 1
        c.finish(0, s, 1)
        c.abandon(1, version=1)  # writer 1 gives it up; writer 0 finished: freed
        snap = c.snapshot()
        assert snap["claim_version"] == -1 and snap["latest_version"] == -1
        assert snap["slots"][s] == dict(state="FREE", version=-1, readers=0)
        with pytest.raises(ValueError, match="writer 2 is not in"):
            c.abandon(2)
    finally:
        c.close()


def test_an_abandoned_version_is_never_claimed_again():
    """Claimed versions strictly increase, abandoned ones included: so a claim_version value names one claim,
    and an abandoner that checked it and was preempted cannot free a later claim of the same number (which
    made the writers of that later claim fail their sync)."""
    c = VersionControl.create(nslots=2, n_writers=1)
    try:
        c.register_writer(0)
        c.claim(4)
        c.abandon(0, version=4)
        assert c.snapshot()["claim_version"] == -1 and c.snapshot()["last_claimed"] == 4
        with pytest.raises(ValueError, match="version 4 is not newer than version 4, claimed and abandoned"):
            c.claim(4, timeout=1)
        s = c.claim(5)
        assert c.finish(0, s, 5) and c.latest_version == 5
    finally:
        c.close()


# ---- across processes: a writer process and concurrent readers -------------------------------------------
def _writer(handles, slots, versions, conn):
    plan = plan_sync(SPECS, TrainerLayout(2), GeneratorLayout(tp_size=2))
    senders = [WeightSender(plan, t, handles, num_threads=1, timeout=30) for t in range(2)]
    conn.send("ready")
    for v in range(1, versions + 1):
        for t, s in enumerate(senders):  # rank 0 then rank 1: a half-written version exists in between
            s.sync(filled(plan, t, v), v)
        time.sleep(0.002)  # let the reader in between versions
    conn.send("done")
    for s in senders:
        s.close()


def test_the_torn_read_check_can_fail():
    views = {"a": torch.full((4,), 3.0), "b": torch.full((4,), 3.0)}
    assert torn(views, 3) == []
    views["b"][2] = 4.0
    assert torn(views, 3) == ["b"]


@pytest.mark.parametrize("slots", [1, 2])
def test_concurrent_readers_never_observe_a_mix_of_two_versions(slots):
    plan = plan_sync(SPECS, TrainerLayout(2), GeneratorLayout(tp_size=2))
    leader = GeneratorBuckets.create(plan, 0, storage="shm", slots=slots)
    peer = GeneratorBuckets.create(plan, 1, storage="shm", slots=slots, control=leader.control_handle)
    readers = [WeightReceiver(leader), WeightReceiver(peer)]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    versions = 100
    proc = ctx.Process(target=_writer, args=([leader.handle(), peer.handle()], slots, versions, child), daemon=True)
    proc.start()
    try:
        assert parent.poll(60) and parent.recv() == "ready"
        seen, problems = [], []
        deadline = time.time() + 60
        while time.time() < deadline:
            v = readers[0].acquire(timeout=30)  # TP leader: newest; TP peer: exactly that version
            readers[1].acquire(version=v, timeout=30)
            for r in readers:
                bad = torn(r.named_tensors(), v)
                time.sleep(0.0005)  # hold the slot across a writer step
                bad += torn(r.named_tensors(), v)
                if bad:
                    problems.append((v, bad))
            readers[1].release()
            readers[0].release()
            seen.append(v)
            if v == versions:
                break
        assert problems == []
        assert seen == sorted(seen) and seen[-1] == versions
        assert len(set(seen)) >= 5  # the reader really interleaved with the writer
        assert parent.poll(30) and parent.recv() == "done"
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        for r in readers:
            r.close()
        peer.close()
        leader.close()


DYING_WRITER = r"""
import os, sys
from llamarl import _C
seg = _C.ShmSegment.attach(sys.argv[1], int(sys.argv[2]))
_C.ctl_register(seg, True, 1, os.getpid())
print("registered", flush=True)
_C.ctl_wait_claim(seg, 1, 2, 30.0)
os._exit(3)  # dies after the claim, before writing its half and finishing
"""


def test_a_writer_dying_mid_sync_leaves_the_last_complete_version_readable():
    plan = plan_sync(SPECS, TrainerLayout(2), GeneratorLayout())
    b = GeneratorBuckets.create(plan, 0, storage="shm", slots=2)
    try:
        senders = [WeightSender(plan, t, [b.handle()]) for t in range(2)]
        for t, s in enumerate(senders):
            s.sync(filled(plan, t, 1), 1)
        senders[1].close()  # rank 1 leaves; a new process takes its place below
        r = WeightReceiver(b)
        with r.reading() as v:
            assert v == 1 and torn(r.named_tensors(), 1) == []
        ctl = b.handle().control
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
        child = subprocess.Popen([sys.executable, "-c", DYING_WRITER, ctl.name, str(ctl.nbytes)],
                                 stdout=subprocess.PIPE, text=True, env=env)
        assert child.stdout.readline().strip() == "registered"
        senders[0].sync(filled(plan, 0, 2), 2)  # rank 0 writes its half of version 2 and finishes
        assert child.wait(timeout=30) == 3
        with pytest.raises(PeerDied, match=f"pid {child.pid}"):
            r.wait_for_version(2, timeout=10)
        with r.reading() as v:
            assert v == 1 and torn(r.named_tensors(), 1) == []
        b.control.abandon()
        senders[1] = WeightSender(plan, 1, [b.handle()])  # the restarted rank 1
        for t, s in enumerate(senders):
            s.sync(filled(plan, t, 3), 3)
        with r.reading() as v:
            assert v == 3 and torn(r.named_tensors(), 3) == []
        r.close()
        for s in senders:
            s.close()
    finally:
        b.close()
