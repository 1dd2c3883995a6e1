"""Reward specs (load_reward) and the RewardPool: misbehaving user functions (raising, hanging, killing
their process, returning junk) cost one sample a 0.0 and a counted error, never the run; stuck and
dead workers are replaced; close() leaves no child process behind."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dist_harness import finish_quietly
from llamarl.rewards import (
    FormattedReward,
    RewardPool,
    RewardPoolError,
    RewardSpecError,
    exact_reward,
    gsm8k_reward,
    load_reward,
    math_reward,
)

USER_REWARDS = textwrap.dedent(
    """
    import os
    import sys

    CALLS = []

    def reward(completion, answer):
        if completion == "raise":
            raise ValueError("boom")
        if completion == "hang":
            while True:
                pass
        if completion == "die":
            os._exit(7)
        if completion == "exit":
            sys.exit(3)
        if completion == "nan":
            return float("nan")
        if completion == "huge":
            return 1e300  # finite in Python, inf in the float32 advantages
        if completion == "str":
            return "yes"
        if completion == "numeric-str":
            return "1.0"  # not a number, although float() would take it
        if completion == "overflow":
            return 10**400  # float() raises OverflowError
        if completion == "fork-hang":
            if os.fork() == 0:  # a child the reward function leaves behind
                open(os.environ["LLAMARL_TEST_CHILD_PIDS"], "a").write(f"{os.getpid()}\\n")
                while True:
                    pass
            while True:
                pass
        CALLS.append(completion)
        return 1.0 if completion == answer else 0.0

    def make_closure(bonus):
        return lambda completion, answer: float(completion == answer) + bonus

    closure_reward = make_closure(0.5)  # a lambda: not picklable, fine since workers get the spec

    def one_arg(completion):
        return 1.0

    NOT_CALLABLE = 3
    """
)

CHILD_FAILS = textwrap.dedent(
    """
    import multiprocessing
    if multiprocessing.parent_process() is not None:
        raise RuntimeError("this module refuses to load in a worker")

    def reward(completion, answer):
        return 1.0
    """
)


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("user_rewards")
    (d / "my_rewards.py").write_text(USER_REWARDS)
    (d / "child_fails.py").write_text(CHILD_FAILS)
    (d / "needs_a_dependency.py").write_text("import no_such_dependency_xyz\n\ndef reward(c, a):\n    return 1.0\n")
    return d


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(pid, 0); it is not running if its state is Z
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# ------------------------------------------------------------------------------------ load_reward
def test_builtin_specs():
    assert load_reward("gsm8k") is gsm8k_reward
    assert load_reward("math") is math_reward
    assert load_reward(" exact ") is exact_reward


def test_user_function_from_file_and_module(user_file, monkeypatch):
    fn = load_reward(f"{user_file / 'my_rewards.py'}:reward")
    assert fn("a", "a") == 1.0 and fn("a", "b") == 0.0
    monkeypatch.syspath_prepend(str(user_file))
    fn = load_reward("my_rewards:closure_reward")
    assert fn("x", "x") == 1.5


@pytest.mark.parametrize(
    "spec,message",
    [
        ("no_such_module_xyz:reward", "cannot import module 'no_such_module_xyz'"),
        ("no_such_module_xyz.sub:reward", "cannot import module 'no_such_module_xyz.sub'"),
        # found, but what it imports is missing: no hint to put the module itself on PYTHONPATH
        ("needs_a_dependency:reward", "importing module 'needs_a_dependency' failed with ModuleNotFoundError: "
                                      "No module named 'no_such_dependency_xyz' (install what it imports)"),
        ("my_rewards:missing", "has no attribute 'missing'"),
        ("my_rewards:NOT_CALLABLE", "not a function"),
        ("my_rewards:one_arg", "cannot be called as fn(completion, answer, **info)"),
        ("gsm9k", "neither a built-in"),
        ("", "non-empty"),
        ("/definitely/not/here.py:reward", "does not exist"),
    ],
)
def test_bad_specs_name_the_problem(spec, message, user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file))
    with pytest.raises(RewardSpecError, match=re.escape(message)):
        load_reward(spec)


def test_a_ctrl_c_while_a_reward_module_loads_is_not_a_bad_spec(tmp_path, monkeypatch):
    """KeyboardInterrupt raised while the module executes (Ctrl-C during a slow import) propagates as the user's
    stop (exit 130), instead of becoming a RewardSpecError (an "invalid configuration", exit 2)."""
    (tmp_path / "interrupted_reward.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in ("interrupted_reward:f", f"{tmp_path / 'interrupted_reward.py'}:f"):
        with pytest.raises(KeyboardInterrupt):
            load_reward(spec)


def test_format_weight():
    fn = load_reward("gsm8k", format_weight=0.2)
    assert isinstance(fn, FormattedReward)
    assert fn("#### 72", "72") == 1.0  # right and well formatted
    assert fn("#### 71", "72") == pytest.approx(0.2)  # well formatted only
    assert fn("the answer is 72", "72") == pytest.approx(0.8)  # right, no '####'
    assert fn("nothing", "72") == 0.0
    with pytest.raises(RewardSpecError, match="format_style"):
        load_reward("os.path:join", format_weight=0.1)
    with pytest.raises(RewardSpecError, match=r"\[0, 1\]"):
        load_reward("math", format_weight=1.5)
    fn = load_reward("format_gsm8k", format_weight=0.5)  # a format reward's own style ("unknown style" before)
    assert fn("#### 71", "72") == 1.0 and fn("71", "72") == 0.0


# ------------------------------------------------------------------------------------ RewardPool
def test_pool_survives_misbehaving_functions(user_file):
    spec = f"{user_file / 'my_rewards.py'}:reward"
    items = [
        ("ok-0", "a", "a"),
        ("raise-1", "raise", "x"),
        ("hang-2", "hang", "x"),
        ("die-3", "die", "x"),
        ("exit-4", "exit", "x"),
        ("nan-5", "nan", "x"),
        ("str-6", "str", "x"),
        ("huge-9", "huge", "x"),
        ("wrong-7", "b", "a"),
        ("ok-8", "a", "a"),
    ]
    with RewardPool(spec, num_workers=2, timeout_s=1.0) as pool:
        initial_pids = set(pool.worker_pids())
        results = pool.score(items)
        current_pids = set(pool.worker_pids())
        assert [r.sample_id for r in results] == [i[0] for i in items]  # input order
        by_id = {r.sample_id: r for r in results}
        assert [by_id[k].reward for k in ("ok-0", "wrong-7", "ok-8")] == [1.0, 0.0, 1.0]
        assert all(by_id[k].error is None for k in ("ok-0", "wrong-7", "ok-8"))
        for sid in ("raise-1", "hang-2", "die-3", "exit-4", "nan-5", "str-6", "huge-9"):
            assert by_id[sid].reward == 0.0 and sid in by_id[sid].error  # the error names the sample
        assert "ValueError: boom" in by_id["raise-1"].error and "my_rewards.py" in by_id["raise-1"].error
        assert "timeout after 1s" in by_id["hang-2"].error
        assert "exit code 7" in by_id["die-3"].error
        assert "SystemExit" in by_id["exit-4"].error
        assert "nan" in by_id["nan-5"].error and "'yes'" in by_id["str-6"].error
        assert "float32's range" in by_id["huge-9"].error
        stats = pool.stats
        assert (stats.submitted, stats.completed, stats.timeouts) == (10, 10, 1)
        assert stats.errors == 6  # raise, die, exit, nan, str, huge
        assert stats.worker_deaths == 1
        assert stats.workers_started == 4  # 2 + one replacement for the hang + one for the death
        assert len(current_pids) == 2 and current_pids != initial_pids  # stuck/dead workers were replaced
        # the pool keeps working after all that, and futures/asyncio give the same answers
        assert pool.submit("late", "q", "q").result().reward == 1.0
        again = asyncio.run(pool.score_async([("as-1", "a", "a"), ("as-2", "raise", "a")]))
        assert [r.reward for r in again] == [1.0, 0.0] and "as-2" in again[1].error
    assert all(_gone(pid) for pid in initial_pids | current_pids)
    assert mp.active_children() == []
    with pytest.raises(RewardPoolError, match="closed"):
        pool.submit("after", "a", "a")


def test_bad_return_values_and_forked_children_cost_one_sample(user_file, tmp_path, monkeypatch):
    """A reward returning a numeric string or a number float() cannot take costs its sample (the worker
    lives on); one that forks a child and hangs is killed with the child at the timeout and at close."""
    pids_file = tmp_path / "child_pids"
    monkeypatch.setenv("LLAMARL_TEST_CHILD_PIDS", str(pids_file))
    spec = f"{user_file / 'my_rewards.py'}:reward"
    with RewardPool(spec, num_workers=1, timeout_s=1.0) as pool:
        got = {r.sample_id: r for r in pool.score([("s", "numeric-str", "x"), ("o", "overflow", "x"),
                                                    ("f", "fork-hang", "x"), ("ok", "a", "a")])}
        assert "'1.0' (str); expected a number" in got["s"].error
        assert "expected a number that converts to float" in got["o"].error
        assert "timeout after 1s" in got["f"].error and got["ok"].reward == 1.0
        assert pool.stats.worker_deaths == 0 and pool.stats.workers_started == 2  # one restart: the hang
    child = int(pids_file.read_text().split()[0])
    deadline = time.monotonic() + 10  # liveness: SIGKILL to the worker's process group
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child), "the reward function's child outlived its worker"


def test_pool_with_builtin_math_matches_in_process():
    items = [
        ("m0", r"\boxed{\frac{2}{4}}", "0.5"),
        ("m1", r"\boxed{3}", "4"),
        ("m2", r"\boxed{9^{9^{9}}}", "1"),
        ("m3", r"so \boxed{\sqrt{8}}", r"2\sqrt2"),
    ]
    with RewardPool("math", num_workers=1, timeout_s=20.0) as pool:
        results = pool.score(items)
    assert [r.reward for r in results] == [math_reward(c, a) for _, c, a in items] == [1.0, 0.0, 0.0, 1.0]
    assert all(r.error is None for r in results)


def test_unprintable_exceptions_and_values_cost_their_sample_only():
    """A user's exception or returned value whose str()/repr() raises killed the worker (or eval's loop)."""
    from llamarl.rewards.terms import as_reward, describe_exception

    class BadRepr:
        def __repr__(self):
            raise RuntimeError("repr failed")

        __str__ = __repr__

        def __float__(self):
            raise RuntimeError("float failed")

    assert describe_exception(KeyError(BadRepr())).startswith("KeyError: <unprintable>")
    with pytest.raises(TypeError, match=r"returned <unprintable> \(BadRepr\)"):
        as_reward(BadRepr())


def test_a_broken_pool_resolves_a_task_put_back_after_a_failed_send():
    """A task re-queued after a failed send already runs; breaking the pool raised 'Future in unexpected state'
    on it and killed the dispatcher, leaving every queued sample unresolved."""
    from concurrent.futures import Future

    from llamarl.rewards.workers import _Task

    with RewardPool("exact", num_workers=1, timeout_s=5.0) as pool:
        running, waiting = Future(), Future()
        assert running.set_running_or_notify_cancel()
        with pool._lock:
            pool._queue.extend(_Task(i, f"s{i}", "a", "a", None, fut) for i, fut in ((90, running), (91, waiting)))
        pool._break("the spec failed to load")
        for fut in (running, waiting):
            with pytest.raises(RewardPoolError, match="the spec failed to load"):
                fut.result(timeout=5)


def test_pool_fails_fast_on_a_bad_spec():
    with pytest.raises(RewardSpecError, match="no_such_module_xyz"):
        RewardPool("no_such_module_xyz:reward")
    with pytest.raises(TypeError, match="reward functions are given by name, as strings.* got function"):
        RewardPool(lambda completion, answer: 1.0)  # TRL passes functions; the workers import theirs by name
    with pytest.raises(ValueError, match="num_workers"):
        RewardPool("exact", num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool("exact", timeout_s=0)


def test_pool_reports_workers_that_cannot_start(user_file):
    spec = f"{user_file / 'child_fails.py'}:reward"
    assert load_reward(spec)("a", "b") == 1.0  # loads in this process...
    with RewardPool(spec, num_workers=1, timeout_s=5.0) as pool:
        future = pool.submit("s0", "a", "b")
        with pytest.raises(RewardPoolError, match="refuses to load in a worker"):
            future.result(timeout=300)  # liveness bound only
        with pytest.raises(RewardPoolError, match="failed to start 3 times"):
            pool.submit("s1", "a", "b")
    assert mp.active_children() == []


def test_pool_rejects_malformed_items():
    with RewardPool("exact", num_workers=1) as pool:
        with pytest.raises(TypeError, match="item 0"):
            pool.score([("only-two", "x")])
        with pytest.raises(TypeError, match="must be str"):
            pool.submit("s", 5, "5")
        assert pool.score([("s", " 5\nmore", "5")])[0].reward == 1.0


def test_close_fails_pending_samples_and_is_idempotent(user_file):
    spec = f"{user_file / 'my_rewards.py'}:reward"
    pool = RewardPool(spec, num_workers=1, timeout_s=30.0)
    stuck = pool.submit("stuck", "hang", "x")
    queued = pool.submit("queued", "a", "a")
    deadline = time.monotonic() + 120
    while not stuck.running() and time.monotonic() < deadline:  # wait until the worker has it
        time.sleep(0.05)
    pool.close()
    pool.close()
    for fut, sid in ((stuck, "stuck"), (queued, "queued")):
        with pytest.raises(RewardPoolError, match=sid):
            fut.result(timeout=1)
    assert mp.active_children() == []


class _SlowPoll:
    """Wraps the pool's wake-up pipe so that draining it takes a while: widens the race window."""

    def __init__(self, conn):
        self._conn = conn

    def poll(self, *args):
        time.sleep(0.02)
        return self._conn.poll(*args)

    def __getattr__(self, name):
        return getattr(self._conn, name)


def test_a_submit_during_the_wakeup_drain_is_not_lost():
    # Regression: the dispatcher used to clear its wake-up flag before draining the wake pipe; a submit
    # landing in between left the flag set with no byte pending, and the next burst slept forever.
    with RewardPool("exact", num_workers=1, timeout_s=5.0) as pool:
        pool.score([("warm", "1", "1")])
        pool._wake_r = _SlowPoll(pool._wake_r)
        for burst in range(6):
            first = pool.submit(f"{burst}-first", "7", "7")
            time.sleep(0.005)  # the dispatcher wakes and starts draining (slowly)
            rest = [pool.submit(f"{burst}-{i}", "7", "7") for i in range(4)]
            assert [f.result(timeout=10).reward for f in [first, *rest]] == [1.0] * 5


# ------------------------------------------------------------------------------------ process hygiene
SLEEPING_REWARD = textwrap.dedent(
    """
    import multiprocessing
    import os
    import signal
    import sys
    import time

    if multiprocessing.parent_process() is not None and os.environ.get("LLAMARL_TEST_SIGINT_AT_IMPORT"):
        # a Ctrl-C while the worker is still importing (its spec's module is the first user code it runs)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # give a handler the chance to run here, as it would for a real Ctrl-C

    def reward(completion, answer):
        if completion == "torch?":  # did the worker import torch (e.g. by re-importing its owner's main)?
            return float("torch" in sys.modules)
        if completion == "hang":
            import subprocess
            subprocess.Popen(["sleep", "600"])  # what a reward function starts must die with its worker too
            open(os.environ["LLAMARL_TEST_MARKER"], "w").close()  # "I am inside the function now"
            time.sleep(600)
        return float(completion == answer)
    """
)

POOL_OWNER = textwrap.dedent(
    """
    import os
    import signal
    import sys
    import time

    import torch  # a heavy __main__, as a user's training script is  # noqa: F401

    if __name__ == "__main__":
        from llamarl.rewards import RewardPool

        pool = RewardPool(sys.argv[1], num_workers=1, timeout_s=600.0)
        mask_after_spawn = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        print("MASK", int(signal.SIGINT in mask_after_spawn), flush=True)
        future = pool.submit("s0", sys.argv[2], "a")
        print("PIDS", *pool.worker_pids(), flush=True)
        if sys.argv[2] != "hang":
            print("RESULT", future.result(timeout=300).reward, flush=True)
            print("STATS", pool.stats.workers_started, flush=True)
            pool.close()
            sys.exit(0)
        time.sleep(600)  # stuck in the reward function; killed by the test
    """
)


def _sig_masks(pid: int) -> tuple[int, int]:
    """(blocked, ignored) signal masks of a running process, from /proc."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return int(fields["SigBlk"], 16), int(fields["SigIgn"], 16)


def _descendants(root: int) -> set[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _start_owner(tmp_path, completion: str, **env_extra: str):
    (tmp_path / "sleeping_reward.py").write_text(SLEEPING_REWARD)
    (tmp_path / "pool_owner.py").write_text(POOL_OWNER)
    marker = tmp_path / "in_reward"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
               LLAMARL_TEST_MARKER=str(marker), **env_extra)
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "pool_owner.py"), f"{tmp_path / 'sleeping_reward.py'}:reward", completion],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path),
    )
    return proc, marker


def test_workers_stuck_in_a_reward_die_with_a_killed_owner(tmp_path):
    # Regression: a worker stuck inside a (hanging) reward function noticed its parent's end only between
    # samples, so a SIGKILLed/SIGTERMed controller left it (and multiprocessing's resource tracker, which
    # it keeps alive) running for the length of the hang.
    proc, marker = _start_owner(tmp_path, "hang")
    try:
        assert proc.stdout.readline().startswith("MASK")
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), proc.stderr.read() if proc.poll() is not None else line
        worker = int(line.split()[1])
        deadline = time.monotonic() + 120  # liveness bound: the worker imports and loads the spec first
        while not marker.exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        assert marker.exists(), "the worker never entered the reward function"
        children = _descendants(proc.pid)
        assert worker in children and len(children) >= 3  # the worker, its sleep and the resource tracker
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20  # liveness, not timing: the watchdog reacts within ~1 s
        while not all(_gone(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in children if not _gone(pid)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_workers_skip_the_owners_main_by_their_name_not_by_editing_it():
    """The owner's __main__ is left out of a worker's start by the process's name: the pool used to delete
    __main__.__file__ for the moment of a start, from its dispatcher thread, under the user's running code."""
    from multiprocessing import spawn

    from llamarl.rewards import workers

    assert getattr(workers.mp_spawn.get_preparation_data, "llamarl_wrapped", False)  # installed at import

    main = sys.modules["__main__"]
    records_main = getattr(main.__spec__, "name", None) is not None or getattr(main, "__file__", None) is not None
    worker = spawn.get_preparation_data("llamarl-reward-0")
    assert "init_main_from_name" not in worker and "init_main_from_path" not in worker
    other = spawn.get_preparation_data("someone-else")
    assert ("init_main_from_name" in other or "init_main_from_path" in other) == records_main


def test_workers_do_not_import_their_owners_main_module(tmp_path):
    # Regression: 'spawn' re-imported the owner's __main__ (llamarl.train, hence torch) in every worker:
    # ~2 s and ~250 MB per worker, paid again at every restart after a timeout.
    proc, _ = _start_owner(tmp_path, "torch?")
    lines = finish_quietly(proc)
    assert lines["RESULT"] == "0.0"


def test_workers_start_with_sigint_blocked_then_ignore_it(tmp_path):
    # Regression: a Ctrl-C in the first second or two of a worker (while it imports) raised
    # KeyboardInterrupt there: a traceback, and a worker lost to a start failure.
    proc, _ = _start_owner(tmp_path, "a", LLAMARL_TEST_SIGINT_AT_IMPORT="1")
    lines = finish_quietly(proc)
    assert lines["MASK"] == "0"  # the parent's own mask is restored after the spawn
    assert lines["RESULT"] == "1.0" and lines["STATS"] == "1"  # the first worker survived the Ctrl-C
    # and a running worker ignores SIGINT with it unblocked (a pending one was discarded, not raised)
    with RewardPool("exact", num_workers=1) as pool:
        assert pool.score([("s", "1", "1")])[0].reward == 1.0
        blocked, ignored = _sig_masks(pool.worker_pids()[0])
        bit = 1 << (signal.SIGINT - 1)
        assert ignored & bit and not blocked & bit
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_a_relative_file_spec_survives_a_chdir_and_a_respawn(user_file, monkeypatch):
    """The pool resolves a file spec once: a worker respawned after the process changed directory (a death,
    or a timeout kill) still finds the file (it failed to start three times, and the pool was broken)."""
    monkeypatch.chdir(user_file.parent)
    with RewardPool(f" {user_file.name}/my_rewards.py:reward", num_workers=1, timeout_s=30) as pool:  # (spaces:
        # load_reward strips them, so the pool must too)
        assert pool.score([("a", "x", "x")])[0].reward == 1.0
        monkeypatch.chdir("/")
        assert "worker died" in pool.score([("b", "die", "x")])[0].error
        assert pool.score([("c", "x", "x")])[0].reward == 1.0
