"""Control-plane messages between the controller and executor ranks, and the errors they carry.

Wire format: every message is one ``pickle`` blob sent with ``Connection.send_bytes`` over a
``multiprocessing.connection`` connection (a socket pair for locally spawned ranks, TCP with an authkey
under torchrun). We pickle with the plain ``pickle`` module on purpose: ``Connection.send`` would use
``ForkingPickler``, for which torch registers reductions that move tensors through shared memory and
file-descriptor passing; that cannot cross a TCP link and would make both modes behave differently.
Tensors therefore travel by value (fine for control-size data; bulk weights go through the weight sync).

Messages (NamedTuples, i.e. plain tuples on the wire)::

    controller -> rank   Call(call_id, method, args, kwargs)
    rank -> controller   Reply(call_id, ok, payload)      payload = result           if ok
                                                          payload = RemoteFailure     if not ok

``call_id`` 0 is the start-up handshake: the controller sends a ``Bootstrap`` with id 0 and the rank
answers ``Reply(0, True, pid)`` once its process group is up and the executor object is constructed (or
``Reply(0, False, failure)`` if that failed). Method names starting with ``__`` are reserved for the
runtime (``CLOSE``). Invariant: a rank answers every call exactly once, in the order the calls arrived.
A call whose message the rank cannot unpickle (an argument's class is unknown there) has no readable id:
the rank answers it with ``Reply(UNREADABLE_ID, False, failure)``, which by that invariant is the oldest
call still pending on that rank. Likewise a reply the controller cannot unpickle fails the oldest call.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from llamarl._procs import describe_exit  # noqa: F401 - part of this module's interface

CLOSE = "__close__"
BOOTSTRAP_ID = 0
UNREADABLE_ID = -1  # the reply to a call the rank could not unpickle: the oldest call pending on it
SHUT_DOWN = "ShutDown"  # ExecutorError.exc_type of a call abandoned because its group was shut down


class Call(NamedTuple):
    call_id: int
    method: str
    args: tuple
    kwargs: dict


class Reply(NamedTuple):
    call_id: int
    ok: bool
    payload: Any


class RemoteFailure(NamedTuple):
    """An exception raised inside an executor, flattened so it unpickles without the remote classes."""

    exc_type: str
    message: str
    traceback: str


@dataclass(frozen=True)
class Bootstrap:
    """Everything a rank needs to become an executor: sent as the first message on its connection.

    ``master_addr``/``master_port`` are the rendezvous of the group's own torch.distributed process
    group (group-local ranks ``0..world_size-1``); ``device`` is where the executor should put its
    tensors ("cpu" or "cuda:N"); ``env`` is applied to ``os.environ`` before the process group is
    created (locally spawned ranks also had it in their environment from the start).
    """

    group: str
    role: str
    target: str
    init_kwargs: dict
    rank: int
    world_size: int
    global_rank: int
    master_addr: str
    master_port: int
    backend: str
    device: str
    dist_timeout_s: float
    env: dict = field(default_factory=dict)
    command_timeout_s: float = 0.0  # > 0: a command running longer dumps the rank's Python stacks to stderr


@dataclass(frozen=True)
class RankInfo:
    """Where an executor object runs; passed to every executor constructor as ``rank_info=``.

    ``rank``/``world_size`` are within the executor group (= its torch.distributed default group);
    ``global_rank`` is the rank the ``Layout`` gave it (0 is the controller); ``device`` is "cpu" or
    "cuda:N" (already made current); ``local_rank`` is N on CUDA, else ``rank``.
    """

    group: str
    role: str
    rank: int
    world_size: int
    global_rank: int
    local_rank: int
    device: str
    backend: str


def send(conn: Connection, message: Any) -> None:
    """Pickle ``message`` (raising here, in the sender, if it cannot be pickled) and send it."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> Any:
    """Receive one message; raises ``EOFError``/``OSError`` when the peer has gone."""
    return pickle.loads(conn.recv_bytes())


class ExecutorError(RuntimeError):
    """A command failed inside an executor; the message carries the remote traceback.

    Attributes: ``group`` (executor group name), ``rank`` (rank in that group), ``method`` (the command),
    ``exc_type`` (name of the remote exception class), ``remote_traceback`` (its formatted traceback).
    """

    def __init__(self, group: str, rank: int, method: str, exc_type: str, message: str,
                 remote_traceback: str = "", note: str = ""):
        self.group, self.rank, self.method = group, rank, method
        self.exc_type, self.remote_message, self.remote_traceback = exc_type, message, remote_traceback
        self.note = note
        text = f"executor '{group}' rank {rank}: {method}() raised {exc_type}: {message}"
        if note:
            text += f" {note}"
        if remote_traceback:
            text += "\n--- remote traceback ---\n" + remote_traceback.rstrip()
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.group, self.rank, self.method, self.exc_type, self.remote_message,
                             self.remote_traceback, self.note))


class ExecutorDied(ExecutorError):
    """An executor process exited (crash, ``os._exit``, kill) or its connection was lost.

    ``exitcode`` is the process exit status (negative: killed by that signal) or ``None`` when only the
    connection was lost (torchrun ranks on other hosts). ``method`` is the command that was pending on
    that rank when it died, or "" if it was idle.
    """

    def __init__(self, group: str, rank: int, exitcode: int | None, method: str = "", cause: str = ""):
        self.exitcode, self.cause = exitcode, cause
        how = cause or describe_exit(exitcode)
        super().__init__(group, rank, method or "<idle>", "ExecutorDied", how)
        pending = f" while running {method}()" if method else ""
        self.args = (f"executor '{group}' rank {rank} died ({how}){pending}",)

    def __reduce__(self):
        return (type(self), (self.group, self.rank, self.exitcode, self.method if self.method != "<idle>" else "",
                             self.cause))


class ExecutorHung(ExecutorDied):
    """A command ran longer than its group's command timeout; the group was stopped (its ranks killed).

    ``method`` is the command the rank was running, ``seconds`` how long it had run when the controller
    gave up, ``timeout_s`` the limit. Each busy rank printed its Python stacks to its stderr when its own
    copy of the limit expired, just before the controller stopped the group (``server.py``).
    """

    def __init__(self, group: str, rank: int, method: str, seconds: float, timeout_s: float):
        self.seconds, self.timeout_s = seconds, timeout_s
        ExecutorError.__init__(self, group, rank, method or "<idle>", "ExecutorHung", "command timeout")
        self.exitcode = None
        self.args = (f"executor '{group}' rank {rank}: {method}() did not finish within the command timeout "
                     f"({seconds:.0f} s running, limit {timeout_s:g} s), so its group was stopped; each busy "
                     f"rank that could still run printed its Python stacks to stderr at the limit ('Timeout' "
                     f"blocks above)",)

    def __reduce__(self):
        return (type(self), (self.group, self.rank, self.method, self.seconds, self.timeout_s))


class MonitorFailed(ExecutorDied):
    """The controller thread that watches a group failed unexpectedly (a bug in llamarl.runtime). Without it
    no death or hang of the group's ranks could be noticed, so the group was stopped like after a death.
    ``error`` is the monitor's exception (repr); its traceback was printed to the controller's stderr."""

    def __init__(self, group: str, error: str):
        self.error = error
        ExecutorError.__init__(self, group, -1, "<monitor>", "MonitorFailed", error)
        self.exitcode = None
        self.args = (f"executor group '{group}': its monitor thread failed ({error}), so deaths and hangs of its "
                     f"ranks could no longer be noticed and the group was stopped; this is a bug in "
                     f"llamarl.runtime, please report it with the traceback printed above",)

    def __reduce__(self):
        return (type(self), (self.group, self.error))


def shut_down_error(group: str, rank: int, method: str, detail: str = "") -> ExecutorError:
    """The error of a call abandoned by its group's shutdown (``exc_type`` ``SHUT_DOWN``)."""
    return ExecutorError(group, rank, method, SHUT_DOWN,
                         "the executor group was shut down before the call finished" + detail)


def is_shut_down(exc: BaseException | None) -> bool:
    """True for the error of a call that a shutdown abandoned (not a failure of the call itself)."""
    return type(exc) is ExecutorError and exc.exc_type == SHUT_DOWN
