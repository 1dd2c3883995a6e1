"""Hang detection (``command_timeout_s``): a command that runs too long stops its group with ``ExecutorHung``
and the stuck ranks' Python stacks, instead of leaving the controller waiting forever.

Real processes running ``llamarl.runtime.testing:ToyExecutor``; the limits are short so the tests are quick.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener

import pytest

from llamarl.config import ConfigError
from llamarl.config_cli import load_config
from llamarl.runtime import ExecutorDied, ExecutorGroup, ExecutorHung
from llamarl.runtime.executor import RankLink
from llamarl.runtime.frames import FrameReader
from test_runtime import TOY, _wait_gone


def test_a_command_over_the_limit_stops_the_group_and_dumps_its_stacks(capfd):
    group = ExecutorGroup.spawn("hang", TOY, 2, command_timeout_s=1.5)
    try:
        pids = group.pids
        time.sleep(1.0)  # let the monitor settle into waiting with no deadline: the new command must wake it
        fut = group.call_rank(0, "sleep", 120)
        time.sleep(0.5)  # rank 1 starts later, so the two ranks' stack dumps do not interleave on stderr
        later = group.call_rank(1, "sleep", 120)
        with pytest.raises(ExecutorHung) as info:
            fut.result(timeout=60)  # well before the sleep would end
        with pytest.raises(ExecutorHung):
            later.result(timeout=10)
        hung = info.value
        assert isinstance(hung, ExecutorDied)  # the runtime's failure path treats it like a death
        assert (hung.group, hung.method, hung.timeout_s) == ("hang", "sleep", 1.5)
        assert hung.rank == 0 and hung.seconds >= 1.5  # the rank busy for longest
        assert "command timeout" in str(hung) and "sleep()" in str(hung)
        with pytest.raises(ExecutorHung):
            group.failed.result(timeout=10)
        with pytest.raises(ExecutorHung):
            group.call("echo", 1).result(timeout=10)  # later calls fail the same way
        assert _wait_gone(pids) == []
        err = capfd.readouterr().err
        # both ranks were busy in sleep(): each printed its stacks (faulthandler) at the limit
        assert err.count("Timeout (0:00:01.500000)!") == 2, err
        assert "in sleep" in err and "testing.py" in err
    finally:
        group.shutdown(timeout=5.0)


def test_commands_that_each_finish_in_time_never_trip_it():
    """Eight 0.6 s commands queued at once take 4.8 s in all, longer than the 1 s limit plus the grace:
    the limit is per command, counted from when the rank could start it, not from when it was sent."""
    with ExecutorGroup.spawn("queue", TOY, 2, command_timeout_s=1.0) as group:
        futures = [group.call("sleep", 0.6) for _ in range(8)]
        assert [f.result(timeout=60) for f in futures] == [[0, 1]] * 8
        assert group.alive and group.call("echo", "still here").result(timeout=10)[0]["args"] == ("still here",)


def test_commands_queued_behind_a_hung_one_do_not_restart_its_clock():
    """The async controller queues the next command on a busy executor: a hang is still reported while commands
    keep arriving behind it (counted from when the hung command started: about the limit plus the 3 s grace; a
    clock restarted by each new call would report it only after the queueing stopped)."""
    group = ExecutorGroup.spawn("queued", TOY, 1, command_timeout_s=1.0)
    try:
        hung, queued_until = group.call("sleep", 60), time.monotonic() + 20
        while not hung.done() and time.monotonic() < queued_until:
            group.call("echo", "queued")
            time.sleep(0.5)
        assert hung.done(), "the hang was not reported while commands kept arriving"
        with pytest.raises(ExecutorHung):
            hung.result(timeout=0)
    finally:
        group.shutdown(timeout=5)


def test_no_limit_by_default():
    with ExecutorGroup.spawn("nolimit", TOY, 1) as group:
        assert group.command_timeout_s == 0.0
        assert group.call_rank(0, "sleep", 4.5).result(timeout=60) == 0  # longer than any limit-plus-grace above


def test_a_stopped_rank_is_taken_for_hung_even_while_a_send_to_it_blocks():
    """SIGSTOP: the rank cannot dump or answer. A large command sent to it meanwhile fills the pipe and blocks
    the sender while it holds the group's lock; the monitor must still stop the group and free the sender."""
    group = ExecutorGroup.spawn("stopped", TOY, 2, command_timeout_s=1.0)
    try:
        pids = group.pids
        first = group.call("sleep", 0.5)
        os.kill(pids[1], signal.SIGSTOP)
        sent: list = []
        sender = threading.Thread(target=lambda: sent.append(group.call("echo", b"x" * (64 << 20))), daemon=True)
        sender.start()
        with pytest.raises(ExecutorHung) as info:
            first.result(timeout=60)
        assert info.value.rank == 1 and info.value.method == "sleep"
        sender.join(timeout=30)
        assert not sender.is_alive(), "the send to the stopped rank is still blocked"
        with pytest.raises(ExecutorHung):
            sent[0].result(timeout=10)
        assert _wait_gone(pids) == []
    finally:
        for pid in group.pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except (ProcessLookupError, TypeError):
                pass
        group.shutdown(timeout=5.0)


def test_an_idle_group_is_never_taken_for_hung():
    with ExecutorGroup.spawn("idle", TOY, 1, command_timeout_s=0.5) as group:
        assert group.call_rank(0, "echo", 1).result(timeout=10)["args"] == (1,)
        time.sleep(4.0)  # idle for longer than limit + grace
        assert group.alive


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "2e6"])
def test_the_run_setting_is_validated(value):
    with pytest.raises(ConfigError, match="run.command_timeout_s"):
        load_config(["--set", f"run.command_timeout_s={value}"])


def test_bad_limits_are_refused_by_the_group():
    for bad in (-1.0, 3e6, float("nan")):  # above 1e6 s the waits' millisecond counts overflow
        with pytest.raises(ValueError, match="command_timeout_s"):
            ExecutorGroup("bad", [], command_timeout_s=bad)
    group = ExecutorGroup("inf", [], command_timeout_s=float("inf"))
    assert group.command_timeout_s == 0.0  # inf: no limit
    group.shutdown()


_SILENT_PEER = """
import sys, time
from multiprocessing.connection import Client
c = Client(("127.0.0.1", int(sys.argv[1])), family="AF_INET", authkey=b"k" * 16)
print("connected", flush=True)
time.sleep(float(sys.argv[2]))  # a rank stuck holding the GIL: its reader thread cannot read either
try:
    c.recv_bytes()
    print("got the command", flush=True)
except (EOFError, OSError):
    print("disconnected", flush=True)
"""


def test_a_hung_remote_rank_is_disconnected_and_frees_a_send_blocked_on_it():
    """A torchrun rank (no local process to kill) that stopped reading while a large command is being sent
    to it: the hang stops the group, wakes the blocked sender and gives the rank its end of file."""
    listener = Listener(("127.0.0.1", 0), family="AF_INET", authkey=b"k" * 16)
    # the peer stops reading for 12 s; the group takes it for hung and disconnects it after the 1 s limit
    # and HANG_GRACE_S (3 s), well before it reads again
    peer = subprocess.Popen([sys.executable, "-c", _SILENT_PEER, str(listener.address[1]), "12"],
                            stdout=subprocess.PIPE, text=True)
    group = ExecutorGroup("remote", [RankLink(listener.accept())], command_timeout_s=1.0)
    try:
        assert peer.stdout.readline().strip() == "connected"
        sent: list = []
        sender = threading.Thread(target=lambda: sent.append(group.call("echo", b"x" * (64 << 20))), daemon=True)
        sender.start()
        with pytest.raises(ExecutorHung):
            group.failed.result(timeout=30)
        sender.join(timeout=10)
        assert not sender.is_alive(), "the send to the hung remote rank is still blocked"
        with pytest.raises(ExecutorHung):
            sent[0].result(timeout=10)
        assert peer.stdout.readline().strip() == "disconnected"  # it never saw the command: it can exit
    finally:
        peer.kill()
        peer.wait()
        listener.close()
        group.shutdown(timeout=2.0)


_REPLYING_PEER = """
import os, pickle, socket, struct, sys, time
from multiprocessing.connection import Client
from llamarl.runtime.rpc import Reply
c = Client(("127.0.0.1", int(sys.argv[1])), family="AF_INET", authkey=b"k" * 16)
sock = socket.socket(fileno=os.dup(c.fileno()))
mode, calls = sys.argv[2], int(sys.argv[3])
ids = [pickle.loads(c.recv_bytes()).call_id for _ in range(calls)]
print("got the commands", flush=True)
if mode == "stall":  # the start of a 1 MiB reply, then nothing: a rank stopped, or a host cut off, mid-send
    sock.sendall(struct.pack("!i", 1 << 20) + b"x" * 100)
    time.sleep(60)
elif mode == "trickle":  # whole replies, a byte at a time (headers split too), two in one stream
    blobs = [pickle.dumps(Reply(i, True, f"reply {n}")) for n, i in enumerate(ids)]
    wire = b"".join(struct.pack("!i", len(b)) + b for b in blobs)
    for k in range(len(wire)):
        sock.sendall(wire[k:k + 1])
        time.sleep(0.001)
    c.recv_bytes()  # until the controller closes
elif mode == "leave":  # exits, once the stalled rank is mid-reply
    time.sleep(1.0)
"""


@contextlib.contextmanager
def remote_group(*modes_and_calls: tuple[str, int], command_timeout_s: float = 0.0):
    """A group of remote ranks played by ``_REPLYING_PEER`` subprocesses over TCP, one per (mode, calls);
    yields (group, their processes)."""
    listener = Listener(("127.0.0.1", 0), family="AF_INET", authkey=b"k" * 16)
    procs, links = [], []
    try:
        for mode, calls in modes_and_calls:
            procs.append(subprocess.Popen([sys.executable, "-c", _REPLYING_PEER, str(listener.address[1]), mode,
                                           str(calls)], stdout=subprocess.PIPE, text=True))
            links.append(RankLink(listener.accept()))
        group = ExecutorGroup("remote", links, command_timeout_s=command_timeout_s)
        try:
            yield group, procs
        finally:
            group.shutdown(timeout=2.0)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        listener.close()


def test_a_rank_stalled_mid_reply_is_taken_for_hung():
    """The monitor reads whole replies only: a rank that sent part of one and stopped cannot hold it in a read,
    so the command timeout still fires (before, the monitor waited inside recv_bytes for the rest, forever)."""
    with remote_group(("stall", 1), command_timeout_s=1.0) as (group, procs):
        fut = group.call("echo", 1)
        assert procs[0].stdout.readline().strip() == "got the commands"
        with pytest.raises(ExecutorHung):
            group.failed.result(timeout=30)
        with pytest.raises(ExecutorHung):
            fut.result(timeout=10)


def test_a_death_is_noticed_while_another_rank_is_stalled_mid_reply():
    """No command timeout: rank 1 leaving must still fail the group while rank 0 is stuck mid-reply."""
    with remote_group(("stall", 1), ("leave", 1)) as (group, _):
        fut = group.call("echo", 1)
        with pytest.raises(ExecutorDied) as info:
            group.failed.result(timeout=30)
        assert info.value.rank == 1
        with pytest.raises(ExecutorDied):
            fut.result(timeout=10)


def test_replies_that_arrive_a_byte_at_a_time_are_read_whole_and_in_order():
    with remote_group(("trickle", 2)) as (group, _):
        first, second = group.call("echo", 1), group.call("echo", 2)
        assert first.result(timeout=60) == ["reply 0"]
        assert second.result(timeout=60) == ["reply 1"]


def test_the_reader_follows_the_wire_format_of_multiprocessing():
    """Messages sent by ``Connection.send_bytes`` (empty ones too), and the 8-byte size form that messages of
    2 GiB and more use, written here by hand with a small size; end of file once the peer closes."""
    ours, theirs = multiprocessing.Pipe(duplex=True)
    reader = FrameReader(ours)
    try:
        for blob in (b"", b"a", b"b" * 100_000):
            theirs.send_bytes(blob)
        messages, closed = [], False
        while len(messages) < 3 and not closed:
            got, closed = reader.read()
            messages += got
        assert [bytes(m) for m in messages] == [b"", b"a", b"b" * 100_000] and not closed
        sock = socket.socket(fileno=os.dup(theirs.fileno()))
        sock.sendall(struct.pack("!i", -1) + struct.pack("!Q", 5) + b"hello" + struct.pack("!i", 3) + b"ab")
        time.sleep(0.2)
        got, closed = reader.read()
        assert [bytes(m) for m in got] == [b"hello"] and not closed  # the second is incomplete: kept
        sock.sendall(b"c")
        sock.close()
        theirs.close()
        time.sleep(0.2)
        got, closed = reader.read()
        assert [bytes(m) for m in got] == [b"abc"] and closed
    finally:
        reader.close()
        ours.close()
