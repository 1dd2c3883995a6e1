"""The version control block's TP-peer join while the trainer drains the slot (csrc/sync_ctl.cpp).

A TP peer asks for exactly the version its leader holds (``acquire(version=v)``). Meanwhile the trainer
may be claiming that slot for a newer version: while the leader's hold keeps it from succeeding,
``ctl_claim`` flips the slot's state WRITING <-> DRAINING (its Dekker handshake with the readers), and the
slot stays labelled v. A peer that scans during a WRITING flip must retry, not fail with "version v is no
longer held" (the leader's hold still pins the bytes). The flip lasts a few instructions, so the test
holds the slot in the WRITING state by writing the control block directly, then lets it flip back.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from llamarl.weight_sync import SyncTimeout, VersionControl

STATES = {"READY": 1, "DRAINING": 2, "WRITING": 3}


def _slot_words(ctl: VersionControl, slot: int) -> np.ndarray:
    """The [state, version, readers] words of ``slot`` (SlotCtl, 64-byte aligned, the last member of SyncCtl)."""
    from llamarl import _native

    words = np.frombuffer(ctl._mem, dtype=np.int64)
    max_slots = _native.native().CTL_MAX_SLOTS
    base = (len(words) * 8 - (max_slots - slot) * 64) // 8
    return words[base:base + 3]


def test_a_peer_joining_a_held_version_waits_out_a_writing_flip():
    ctl = VersionControl.create(nslots=2, n_writers=1, n_readers=2, shared=False)
    try:
        s0 = ctl.claim(0)
        ctl.finish(0, s0, 0)
        leader_slot, v = ctl.acquire(version=0)  # the TP leader holds version 0
        s1 = ctl.claim(1)
        ctl.finish(0, s1, 1)  # a newer version is published: version 0 lives on only through the hold
        words = _slot_words(ctl, leader_slot)
        assert v == 0 and list(words) == [STATES["READY"], 0, 1], "control block layout changed"
        snap = ctl.snapshot()
        assert snap["latest_version"] == 1

        words[0] = STATES["WRITING"]  # the trainer, claiming this slot for version 2, mid-flip
        with pytest.raises(SyncTimeout):  # retried until the timeout: not "no longer held"
            ctl.acquire(version=0, timeout=0.2)

        def flip_back():
            time.sleep(0.1)
            words[0] = STATES["DRAINING"]  # the claim sees the leader's hold and gives the slot back

        threading.Thread(target=flip_back).start()
        peer_slot, peer_v = ctl.acquire(version=0, timeout=5.0)
        assert (peer_slot, peer_v) == (leader_slot, 0) and words[2] == 2  # both TP ranks hold it
        ctl.release(peer_slot)
        ctl.release(leader_slot)

        words[0], words[1] = STATES["WRITING"], -1  # a claim that succeeded relabels the slot: now it is gone
        with pytest.raises(RuntimeError, match="version 0 is no longer held"):
            ctl.acquire(version=0, timeout=0.2)
    finally:
        ctl.close()
