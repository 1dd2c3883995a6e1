"""Code verifier: run the completion's Python program against the problem's tests in limited child processes.

    code_reward(completion, answer, **info) -> 1.0 iff every test passes, else 0.0
    run_tests(program, spec) -> CodeReport(passed, total, failure)        # partial credit: passed / total

The program is the last fenced block of the completion tagged ``python``, ``py``, ``python3`` or untagged (an
unclosed last fence runs to the end: generation may stop inside it); with no fence at all, the whole
completion. A completion whose fences are all another language has no program (0.0).

Tests (``parse_tests``), from the answer when it is a JSON object, else from the sample's dataset fields:
  assertions  ``{"tests": ["assert add(1, 2) == 3", ...], "setup": "import math"}``, or the fields
              ``test_list`` + ``test_setup_code`` (MBPP) or ``tests``: the program runs once, then each test
              in its namespace (HumanEval/MBPP style), each under its own time limit.
  stdin/out   ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}`` or the field ``input_output`` (a JSON
              string or object: APPS, TACO): one run of the program per input. Outputs match when equal
              after removing trailing whitespace from each line and trailing empty lines, or else token by
              token with numbers equal within 1e-6 (absolute or relative). Call-based problems
              (``fn_name``) are refused: write them as assertions.
Optional keys of a JSON answer: ``timeout_s`` (per test, default 2.0) and ``memory_mb`` (default 2048).
A sample without tests raises (the reward pool records it as that sample's error): it is a data problem.

Each child is ``python -I`` (no user site, PYTHON* variables ignored) with a minimal environment, in a fresh
temporary directory removed afterwards, in its own session; before the program runs, the harness sets
limits (address space ``memory_mb``, CPU seconds, 16 MiB per written file, standard output included since it
goes to a file, no core file), deletes the test file from disk, and replaces the calls that delete, move or
chmod files, signal processes, fork or start programs (``os.remove``, ``shutil.rmtree``, ``subprocess.Popen``,
``os.system``, ``os.kill``, ``os.fork``, ``os.exec*``, ...) by ones that raise. The parent kills the child's
process group at the wall-clock limit; on Linux a child also dies with the reward worker (PR_SET_PDEATHSIG),
which the reward pool kills at ``reward.timeout_s``. Each test's limit is kept by the harness (an alarm) and,
for what an alarm cannot interrupt (one long C call), by the parent, which the harness tells as each test
starts. A test passes only when the harness reports it, after
running it, through a pipe with a random token: a program that exits early, crashes or is killed passes
nothing, and a test that exits (``exit()`` inside the tested function) fails. A stdin/stdout program runs as
a script (``__name__ == "__main__"``; its non-daemon threads finish before its output is read, as at
interpreter exit); an assertion-tested one as a module named ``__solution__`` (its demo block stays out, as
in human-eval). Tests stop at the first failure unless ``stop_on_failure=False``.

This guards against accidents and the usual failures of a policy's programs. It is NOT a security sandbox:
a program can read files, reach the network, and, working at it, defeat an assertion (an object whose
``__eq__`` is always true) or find the token. Run untrusted policies' code in a container or VM, behind a
reward function of your own (``reward.reward=module:function``). The whole check must fit the reward pool's
``reward.timeout_s`` (default 5 s): raise it for long test suites.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llamarl._procs import describe_exit
from llamarl.rewards.inputs import completion_text

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MEMORY_MB = 2048
STARTUP_S = 1.0  # wall-clock allowance per child for the interpreter and the harness to start
STAGE_SLACK_S = 0.5  # beyond a test's own limit, before the parent stops a test the child's alarm did not
MAX_FILE_BYTES = 16 << 20
_PYTHON_TAGS = ("python", "py", "python3", "")
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(```|\Z)", re.DOTALL)  # tag, body, end


@dataclass(frozen=True)
class CodeTests:
    """``kind`` "assert": ``tests`` are statements run after the program (``setup`` first); "stdio":
    ``tests`` are inputs and ``outputs`` the expected standard outputs."""

    kind: str
    tests: tuple[str, ...]
    outputs: tuple[str, ...] = ()
    setup: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_mb: int = DEFAULT_MEMORY_MB


@dataclass(frozen=True)
class CodeReport:
    passed: int
    total: int
    failure: str | None = None  # the first failure, e.g. "test 2: AssertionError" or "input 0: timeout"

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


def extract_program(completion: str) -> str | None:
    """The program of a completion (module docstring); None when its fences hold no Python."""
    blocks = _FENCE_RE.findall(completion)
    if not blocks:
        return completion
    python = [body for tag, body, _ in blocks if tag.lower() in _PYTHON_TAGS]
    return python[-1] if python else None


def closed_python_block(completion: str) -> bool:
    """The completion holds a closed, non-empty fenced block that ``extract_program`` would take as Python (the
    "code" format style, llamarl.rewards.format)."""
    return any(tag.lower() in _PYTHON_TAGS and body.strip() and end == "```"
               for tag, body, end in _FENCE_RE.findall(completion))


def _strings(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"code_reward: {what} must be a string or a list of strings, got {value!r:.120}")
    return tuple(value)


def _stdio(io: Any, **limits: Any) -> CodeTests:
    if isinstance(io, str):
        io = json.loads(io)
    if not isinstance(io, dict) or "inputs" not in io or "outputs" not in io:
        raise ValueError(f"code_reward: stdin/stdout tests need 'inputs' and 'outputs', got {io!r:.120}")
    if io.get("fn_name"):
        raise ValueError(f"code_reward: call-based tests (fn_name={io['fn_name']!r}) are not supported; write them as "
                         "assertions ({\"tests\": [\"assert f(1) == 2\"]})")
    inputs, outputs = _strings(io["inputs"], "inputs"), _strings(io["outputs"], "outputs")
    if len(inputs) != len(outputs):
        raise ValueError(f"code_reward: {len(inputs)} inputs but {len(outputs)} outputs")
    return CodeTests("stdio", inputs, outputs, **limits)


def parse_tests(answer: str, info: dict[str, Any]) -> CodeTests:
    """The tests of a sample (module docstring), from a JSON answer or the dataset fields in ``info``."""
    spec: dict[str, Any] = {}
    if isinstance(answer, str) and answer.lstrip().startswith("{"):
        spec = json.loads(answer)
    limits = dict(timeout_s=float(spec.get("timeout_s", DEFAULT_TIMEOUT_S)),
                  memory_mb=int(spec.get("memory_mb", DEFAULT_MEMORY_MB)))
    if not (limits["timeout_s"] > 0 and limits["memory_mb"] > 0):
        raise ValueError(f"code_reward: timeout_s and memory_mb must be > 0, got {limits}")
    if "tests" in spec:
        out = CodeTests("assert", _strings(spec["tests"], "tests"), setup=str(spec.get("setup", "")), **limits)
    elif "inputs" in spec or "outputs" in spec:
        out = _stdio(spec, **limits)
    elif info.get("input_output"):
        out = _stdio(info["input_output"], **limits)
    elif info.get("test_list") or info.get("tests"):
        tests = info.get("test_list") or info.get("tests")
        out = CodeTests("assert", _strings(tests, "tests"), setup=str(info.get("test_setup_code") or ""), **limits)
    else:
        raise ValueError("code_reward: the sample has no tests: give the answer as JSON {\"tests\": [...]} or "
                         "{\"inputs\": [...], \"outputs\": [...]}, or dataset fields test_list / tests / input_output")
    if not out.tests:
        raise ValueError("code_reward: the sample's test list is empty")
    return out


def outputs_match(got: str, expected: str) -> bool:
    """Standard outputs compared as the module docstring says."""
    def lines(s: str) -> list[str]:
        out = [line.rstrip() for line in s.replace("\r\n", "\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out

    a, b = lines(got), lines(expected)
    if a == b:
        return True
    ta, tb = " ".join(a).split(), " ".join(b).split()
    if len(ta) != len(tb):
        return False
    for x, y in zip(ta, tb):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not (math.isfinite(fx) and math.isfinite(fy) and math.isclose(fx, fy, rel_tol=1e-6, abs_tol=1e-6)):
            return False
    return True


def run_tests(program: str, spec: CodeTests, *, stop_on_failure: bool = True) -> CodeReport:
    """Run ``program`` against ``spec``'s tests (module docstring); never raises for the program's faults."""
    total = len(spec.tests)
    if spec.kind == "assert":
        passed, failure = _run_child(program, spec, spec.tests, stdin_text=None, stop_on_failure=stop_on_failure)
        return CodeReport(passed, total, failure)
    passed, failure = 0, None
    for i, (stdin_text, expected) in enumerate(zip(spec.tests, spec.outputs)):
        ran, why = _run_child(program, spec, (), stdin_text=stdin_text, stop_on_failure=True)
        if ran == 1 and outputs_match(why or "", expected):
            passed += 1
            continue
        failure = failure or f"input {i}: " + ("wrong output" if ran == 1 else why)
        if stop_on_failure:
            break
    return CodeReport(passed, total, failure)


def code_reward(completion: str, answer: str, **info: Any) -> float:
    """1.0 iff the completion's program passes every test of the sample (module docstring), else 0.0."""
    spec = parse_tests(answer, info)  # raises for a sample without tests: a data problem, not a wrong answer
    completion = completion_text(completion, "code_reward")
    program = extract_program(completion)
    if program is None or not program.strip():
        return 0.0
    return 1.0 if run_tests(program, spec).all_passed else 0.0


# ---------------------------------------------------------------------------------------------- the child
def _run_child(program: str, spec: CodeTests, tests: tuple[str, ...], *, stdin_text: str | None,
               stop_on_failure: bool) -> tuple[int, str | None]:
    """One child: "assert" runs the program then ``tests`` -> (tests passed, first failure); "stdio" runs the
    program on ``stdin_text`` -> (1, its standard output) if it ended normally, else (0, why)."""
    token = secrets.token_hex(16)
    runs = len(tests) + 1 + bool(spec.setup) if tests else 1  # each under its own timer of timeout_s
    wall = spec.timeout_s * runs + STARTUP_S
    with tempfile.TemporaryDirectory(prefix="llamarl-code-") as tmp:
        work = Path(tmp)
        (work / "spec.json").write_text(json.dumps(dict(program=program, tests=list(tests), setup=spec.setup,
                                                        token=token, timeout_s=spec.timeout_s,
                                                        stop=stop_on_failure, cpu_s=math.ceil(wall) + 1,
                                                        memory=spec.memory_mb << 20, fsize=MAX_FILE_BYTES)))
        (work / "stdin.txt").write_text(stdin_text or "")
        read_fd, write_fd = os.pipe()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HOME": tmp}
        try:
            with open(work / "stdin.txt", "rb") as stdin, open(work / "stdout.txt", "wb") as stdout:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-c", _HARNESS, str(write_fd), str(os.getpid())], cwd=tmp, env=env,
                    stdin=stdin, stdout=stdout, stderr=subprocess.DEVNULL, pass_fds=(write_fd,),
                    start_new_session=True)
            os.close(write_fd)
            write_fd = -1
            try:
                lines, timed_out = _follow(read_fd, first=spec.timeout_s * (1 + bool(spec.setup)) + STARTUP_S,
                                           each=spec.timeout_s + STAGE_SLACK_S, wall=wall)
            finally:
                _kill_group(proc)
            lines += _read_available(read_fd).decode("utf-8", "replace").splitlines()
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
        reports = [line.split(" ", 2)[1:] for line in lines if line.startswith(token + " ")]
        passed = len({r[1] for r in reports if len(r) == 2 and r[0] == "pass"})
        failed = next((r[1] for r in reports if len(r) == 2 and r[0] == "fail"), None)
        started = [r[1] for r in reports if len(r) == 2 and r[0] == "start"]
        if failed is not None:
            why = failed
        elif timed_out:  # the test that started last never reported: stuck (a C call the alarm cannot stop)
            why = f"test {started[-1]}: timeout" if len(started) > passed else "timeout"
        else:
            why = f"{describe_exit(proc.returncode)} before its tests ran"
        if tests:
            return passed, (why if passed < len(tests) else None)
        if passed:
            return 1, (work / "stdout.txt").read_bytes()[:MAX_FILE_BYTES].decode("utf-8", "replace")
        return 0, why


def _follow(fd: int, *, first: float, each: float, wall: float) -> tuple[list[str], bool]:
    """The harness's report lines as they come, until it closes the pipe; (lines, timed out). The first
    line may take ``first`` s (start-up, setup and program), every later one ``each`` (one test, which it
    announces with "start i"): so a test stuck where the harness's alarm cannot reach (one long C call)
    is stopped at its own limit by the parent, not at the end of the whole budget ``wall``."""
    start = time.monotonic()
    deadline, buf, lines = start + first, b"", []
    while True:
        left = min(deadline, start + wall) - time.monotonic()
        if left <= 0:
            return lines, True
        if not select.select([fd], [], [], left)[0]:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return lines + ([buf.decode("utf-8", "replace")] if buf else []), False
        *complete, buf = (buf + chunk).split(b"\n")
        lines += [line.decode("utf-8", "replace") for line in complete]
        deadline = time.monotonic() + each


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child leads its session: pgid == pid
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read_available(fd: int) -> bytes:
    """What the pipe holds; does not wait for a writer that escaped the killed group."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    return b"".join(chunks)


_HARNESS = r"""
import json, os, resource, signal, sys
fd, parent = int(sys.argv[1]), int(sys.argv[2])
if sys.platform.startswith("linux"):
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the reward worker
    if os.getppid() != parent:
        os._exit(1)
with open("spec.json") as f:
    spec = json.load(f)
os.unlink("spec.json")
for res, value in ((resource.RLIMIT_CPU, spec["cpu_s"]), (resource.RLIMIT_AS, spec["memory"]),
                   (resource.RLIMIT_FSIZE, spec["fsize"]), (resource.RLIMIT_CORE, 0)):
    try:
        resource.setrlimit(res, (value, value))
    except (ValueError, OSError):
        pass
token, write, flush = spec["token"], os.write, sys.stdout.flush
def report(*words):
    write(fd, (" ".join([token, *words]) + "\n").encode())
class TestTimeout(BaseException):
    pass
def on_alarm(signum, frame):
    raise TestTimeout()
signal.signal(signal.SIGALRM, on_alarm)
def refused(*args, **kwargs):
    raise PermissionError("refused by llamarl's code verifier")
import shutil, subprocess, _posixsubprocess
for module, names in ((os, "system kill killpg fork forkpty remove unlink rmdir removedirs rename renames replace "
                           "truncate chmod chown lchown fchmod fchown putenv unsetenv setuid setgid setsid setpgid "
                           "execv execve execvp execvpe execl execle execlp execlpe spawnv spawnve spawnvp spawnvpe "
                           "posix_spawn posix_spawnp popen"),
                      (shutil, "rmtree move chown"), (subprocess, "Popen run call check_call check_output"),
                      (_posixsubprocess, "fork_exec")):
    for name in names.split():
        if hasattr(module, name):
            setattr(module, name, refused)
import threading
# a stdin/stdout program runs as a script; an assertion-tested one as a module (its demo block stays out)
namespace = {"__name__": "__solution__" if spec["tests"] else "__main__", "__builtins__": __builtins__}
def run(source, name, may_exit):
    signal.setitimer(signal.ITIMER_REAL, spec["timeout_s"])
    try:
        try:
            exec(compile(source, name, "exec"), namespace)
        except SystemExit as e:
            if not may_exit or e.code not in (None, 0):  # a test that exits has not passed
                raise
        for t in threading.enumerate():  # as the interpreter at exit: the program's threads finish first
            if t is not threading.main_thread() and not t.daemon:
                t.join()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
def why(e):
    return "timeout" if isinstance(e, TestTimeout) else type(e).__name__
try:
    if spec["setup"]:
        run(spec["setup"], "<setup>", True)
    run(spec["program"], "<program>", True)
    flush()
except BaseException as e:
    report("fail", ("program: " if spec["tests"] else "") + why(e))
    os._exit(0)
if not spec["tests"]:
    report("pass", "0")
for i, test in enumerate(spec["tests"]):
    report("start", str(i))
    try:
        run(test, "<test %d>" % i, False)
        report("pass", str(i))
    except BaseException as e:
        report("fail", "test %d: %s" % (i, why(e)))
        if spec["stop"]:
            break
os._exit(0)
"""
