"""The executor side of the runtime: one process = one rank = one executor object serving commands.

Life of a rank (identical for locally spawned ranks and torchrun ranks; only how ``conn`` was obtained
differs):

0. a locally started rank (forked from the fork server, or spawned: ``starting.py``) installs the
   environment it was sent, if forked, and names itself "<group>-<rank>" for ``ps`` and ``top``;
1. receive ``Call(0, "__bootstrap__", (Bootstrap,), {})``; apply its ``env`` (a local rank already has
   it: in the environment it was sent, or, if spawned, put in its environment at exec time);
2. create this group's own torch.distributed process group (group-local rank/world size, ``gloo`` on
   CPU, ``nccl`` on CUDA, rendezvous at the bootstrap's master address); ``RANK``/``WORLD_SIZE``/
   ``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` are set to the group-local values so library code that
   reads them sees this group (``LOCAL_RANK`` is the CUDA device index, so code that picks its GPU
   from it gets the right one; the launcher's originals are kept as ``LLAMARL_GLOBAL_*``, and torchrun's
   ``TORCHELASTIC_USE_AGENT_STORE`` is removed because the group's store is hosted by its own rank 0);
3. import ``"pkg.module:Class"`` and construct ``Class(**init_kwargs, rank_info=RankInfo(...))``;
4. answer ``Reply(0, True, pid)`` (or the constructor's failure), then serve calls in arrival order:
   every public method of the object is a command; ``__close__`` calls the object's ``close()`` if it
   has one, destroys the process group and ends the loop.

A reader thread receives messages while the main thread executes commands, so the controller never
blocks sending to a busy rank, and a lost controller is noticed even mid-command: on EOF without a
prior close the process exits at once with code 1 (its work has no receiver any more). A call this rank
cannot unpickle (an argument whose class it cannot import) is answered in its turn with a failure that
says so (``UNREADABLE_ID``, ``rpc.py``), and the rank serves on; a bootstrap it cannot unpickle is
answered with that error before the rank exits. A locally
started rank also watches its parent process as soon as its own code runs (``exit_when_parent_dies``),
so a controller killed while the rank is still bootstrapping (importing torch, in the process-group
rendezvous, in the executor's constructor) or inside ``close()`` does not leave it behind either.
With a command timeout in the bootstrap, a command that runs longer has this rank print the Python
stacks of all its threads to stderr (``faulthandler``, from a C thread, so a rank stuck in native code or
holding the GIL still dumps); the controller stops the group a few seconds later (``ExecutorHung``).
SIGINT is ignored in local ranks so that Ctrl-C reaches only the controller, which then shuts
everything down in order; the launcher spawns them with SIGINT blocked, so a Ctrl-C that arrives while
a rank is still importing modules is discarded rather than raised there as a KeyboardInterrupt (a forked
rank imports nothing before it ignores SIGINT).
This module imports torch lazily (only once the bootstrap arrives), so importing it is cheap.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import multiprocessing as mp
import os
import pickle
import queue
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

from llamarl._procs import exit_when_parent_dies, ignore_sigint, set_process_name
from llamarl.runtime import starting
from llamarl.runtime.rpc import (
    BOOTSTRAP_ID,
    CLOSE,
    UNREADABLE_ID,
    Bootstrap,
    Call,
    RankInfo,
    RemoteFailure,
    Reply,
    send,
)

_EOF = object()


def child_main(conn: Connection, forked=None) -> None:
    """Entry point of a locally started rank (the ``target`` of its ``multiprocessing`` process);
    ``forked``: what a forked rank takes over from the controller (``starting.ForkedStart``)."""
    # A spawned rank starts with SIGINT blocked (ExecutorGroup.spawn): ignore it before unblocking, so
    # that a Ctrl-C which arrived while this process was importing is discarded, not raised.
    ignore_sigint()
    starting.install(forked)
    set_process_name(mp.current_process().name.removeprefix("llamarl-"))  # "generator-0", "trainer-1"
    exit_when_parent_dies(hard_exit)  # hard_exit flushes stdio first (os._exit 2 s later if that blocks)
    try:
        code = serve(conn)
    except BaseException:  # noqa: BLE001 - still a hard exit: a live non-daemon thread must not keep the rank up
        traceback.print_exc()
        code = 1
    hard_exit(code)  # skip interpreter teardown: no atexit surprises from libraries in a finished rank


def hard_exit(code: int) -> None:
    """Flush stdio and end the process now (``os._exit``), without running atexit hooks."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not keep us alive
            pass
    os._exit(code)


def import_target(target: str) -> Any:
    """Resolve ``"pkg.module:Attr"`` to the attribute; raises ``ValueError``/``ImportError`` that say why."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"executor target {target!r} must look like 'package.module:ClassName'")
    module = importlib.import_module(module_name)
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ImportError(f"module '{module_name}' has no attribute '{attr}' (executor target {target!r})") from None
    return obj


def failure_of(exc: BaseException) -> RemoteFailure:
    """Flatten an exception (being handled) into a picklable ``RemoteFailure`` with its traceback text."""
    cls = type(exc)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    try:
        message = str(exc)
    except Exception as e:  # noqa: BLE001 - an exception whose __str__ fails must still be reported
        message = f"<str() of the exception failed: {type(e).__name__}>"
    return RemoteFailure(name, message, "".join(traceback.format_exception(exc)))


def unpickling_failure(exc: BaseException, what: str) -> RemoteFailure:
    """The failure to answer for a message this rank could not unpickle; ``what`` names the message."""
    failure = failure_of(exc)
    return failure._replace(message=f"{what} could not be unpickled in the executor process: {failure.message} "
                                    "(pass plain data, tensors, or objects whose classes this process can import: "
                                    "not ones defined in __main__ or only on the controller's sys.path)")


def serve(conn: Connection) -> int:
    """Bootstrap an executor from the first message on ``conn`` and serve commands; returns an exit code."""
    try:
        blob = conn.recv_bytes()
    except (EOFError, OSError):
        print("llamarl executor: the controller went away before assigning this rank a role", file=sys.stderr)
        return 1
    try:
        first = pickle.loads(blob)
    except Exception as exc:  # noqa: BLE001 - e.g. an init_kwargs value whose class this process cannot import
        _send_or_exit(conn, Reply(BOOTSTRAP_ID, False, unpickling_failure(exc, "the bootstrap")))
        return 1
    if isinstance(first, Call) and first.method == CLOSE:
        return 0  # the controller finished without needing this rank
    if not (isinstance(first, Call) and first.call_id == BOOTSTRAP_ID and first.args
            and isinstance(first.args[0], Bootstrap)):
        raise RuntimeError(f"protocol error: the first message to an executor must be a bootstrap, got {first!r}")
    boot: Bootstrap = first.args[0]
    try:
        executor = _start_executor(boot)
    except Exception as exc:  # noqa: BLE001 - the controller gets the full remote error
        _send_or_exit(conn, Reply(BOOTSTRAP_ID, False, failure_of(exc)))
        return 1
    _send_or_exit(conn, Reply(BOOTSTRAP_ID, True, os.getpid()))
    return _serve_commands(conn, executor, boot.command_timeout_s)


def _start_executor(boot: Bootstrap) -> Any:
    os.environ.update(boot.env)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        if key in os.environ:
            os.environ.setdefault(f"LLAMARL_GLOBAL_{key}", os.environ[key])
    # The group's rendezvous store is hosted by its rank 0, not by the torchrun agent: with this variable
    # set, torch.distributed's tcp:// rendezvous would only connect as a client and wait forever.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    import torch
    import torch.distributed as dist

    device = torch.device(boot.device)
    local_rank = device.index if device.type == "cuda" and device.index is not None else boot.rank
    os.environ.update(RANK=str(boot.rank), WORLD_SIZE=str(boot.world_size), LOCAL_RANK=str(local_rank),
                      MASTER_ADDR=boot.master_addr, MASTER_PORT=str(boot.master_port))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    host = f"[{boot.master_addr}]" if ":" in boot.master_addr else boot.master_addr
    dist.init_process_group(
        boot.backend,
        init_method=f"tcp://{host}:{boot.master_port}",
        rank=boot.rank,
        world_size=boot.world_size,
        timeout=datetime.timedelta(seconds=boot.dist_timeout_s),
    )
    cls = import_target(boot.target)
    if "rank_info" in boot.init_kwargs:
        raise ValueError("init_kwargs must not contain 'rank_info': the runtime passes it to the executor")
    info = RankInfo(group=boot.group, role=boot.role, rank=boot.rank, world_size=boot.world_size,
                    global_rank=boot.global_rank, local_rank=local_rank, device=boot.device,
                    backend=boot.backend)
    return cls(**boot.init_kwargs, rank_info=info)


def _serve_commands(conn: Connection, executor: Any, command_timeout_s: float = 0.0) -> int:
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    closing = threading.Event()

    def read_loop() -> None:
        while True:
            try:
                blob = conn.recv_bytes()
            except (EOFError, OSError):
                if not closing.is_set():
                    hard_exit(1)  # the controller is gone: nobody will read our results
                inbox.put(_EOF)
                return
            try:
                message = pickle.loads(blob)
            except Exception as exc:  # noqa: BLE001 - answered in its turn as that call's failure
                inbox.put(unpickling_failure(exc, "the arguments"))
                continue
            if isinstance(message, Call) and message.method == CLOSE:
                closing.set()
            inbox.put(message)
            if closing.is_set():
                return

    threading.Thread(target=read_loop, name="llamarl-rpc-reader", daemon=True).start()
    while True:
        message = inbox.get()
        if message is _EOF:
            return 0
        if isinstance(message, RemoteFailure):  # a call whose message could not be unpickled (read_loop)
            _send_or_exit(conn, Reply(UNREADABLE_ID, False, message))
            continue
        if message.method == CLOSE:
            _send_or_exit(conn, _close(executor, message.call_id))
            return 0
        if command_timeout_s > 0:  # a C watchdog thread: it dumps even if Python is stuck holding the GIL
            faulthandler.dump_traceback_later(command_timeout_s, exit=False)
        try:
            reply = _execute(executor, message)
        finally:
            if command_timeout_s > 0:
                faulthandler.cancel_dump_traceback_later()
        _send_or_exit(conn, reply)


def _execute(executor: Any, call: Call) -> Reply:
    try:
        if call.method.startswith("_"):
            raise AttributeError(f"'{call.method}' is not a command: names starting with '_' are private")
        fn = getattr(executor, call.method, None)
        if not callable(fn):
            commands = sorted(n for n in dir(executor) if not n.startswith("_") and callable(getattr(executor, n)))
            raise AttributeError(f"{type(executor).__name__} has no command '{call.method}'; "
                                 f"its commands are: {', '.join(commands) or '(none)'}")
        return Reply(call.call_id, True, fn(*call.args, **call.kwargs))
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - every failure goes back to the caller (sys.exit() in a
        return Reply(call.call_id, False, failure_of(exc))  # command fails that call, it does not end the rank)


def _close(executor: Any, call_id: int) -> Reply:
    reply = Reply(call_id, True, None)
    close = getattr(executor, "close", None)
    if callable(close):
        try:
            close()
        except Exception as exc:  # noqa: BLE001
            reply = Reply(call_id, False, failure_of(exc))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return reply


def _send_or_exit(conn: Connection, reply: Reply) -> None:
    """Send a reply; if the result cannot be pickled, send that as the failure instead."""
    try:
        send(conn, reply)
    except (EOFError, OSError):
        hard_exit(1)  # controller gone
    except Exception as exc:  # noqa: BLE001 - unpicklable result
        failure = RemoteFailure(type(exc).__name__, f"the result could not be pickled: {exc}",
                                "".join(traceback.format_exception(exc)))
        try:
            send(conn, Reply(reply.call_id, False, failure))
        except (EOFError, OSError):
            hard_exit(1)
