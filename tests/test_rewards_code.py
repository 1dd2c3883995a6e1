"""The code verifier (llamarl.rewards.code): program extraction, test specs, output matching, the limited child
processes (timeouts, memory, refused calls, early exits), and the reward pool running it."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from llamarl.rewards import RewardPool, load_reward
from llamarl.rewards.code import (CodeTests, code_reward, extract_program, outputs_match, parse_tests, run_tests)
from llamarl.rewards.format import format_reward

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the harness's limits are tested on Linux")

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = json.dumps({"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]})


def fenced(body: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{body}```\nDone."


def asserts(*tests: str, timeout_s: float = 2.0, memory_mb: int = 2048, setup: str = "") -> CodeTests:
    return CodeTests("assert", tests, setup=setup, timeout_s=timeout_s, memory_mb=memory_mb)


def test_the_program_is_the_last_python_block_or_the_whole_completion():
    two = "```python\nx = 1\n```\ntext\n```py\nx = 2\n```\n```cpp\nint x;\n```"
    assert extract_program(two) == "x = 2\n"
    assert extract_program("```\nprint(1)\n```") == "print(1)\n"
    assert extract_program("```python\nprint(1)\n") == "print(1)\n"  # unclosed: to the end
    assert extract_program("print(1)") == "print(1)"
    assert extract_program("```cpp\nint main() {}\n```") is None
    assert format_reward("```python\nx = 1\n```", "code") == 1.0
    assert format_reward("```python\nx = 1\n", "code") == 0.0  # unclosed
    assert format_reward("```cpp\nint x;\n```", "code") == 0.0


def test_tests_come_from_a_json_answer_or_the_dataset_fields():
    spec = parse_tests(json.dumps({"tests": ["assert f()"], "setup": "import math", "timeout_s": 0.5}), {})
    assert (spec.kind, spec.tests, spec.setup, spec.timeout_s) == ("assert", ("assert f()",), "import math", 0.5)
    io = {"inputs": ["1\n", "2\n"], "outputs": ["2\n", "4\n"]}
    assert parse_tests(json.dumps(io), {}) == CodeTests("stdio", ("1\n", "2\n"), ("2\n", "4\n"))
    assert parse_tests("42", {"input_output": json.dumps(io)}).kind == "stdio"  # APPS/TACO field
    mbpp = parse_tests("def f(): ...", {"test_list": ["assert f() is None"], "test_setup_code": "import os"})
    assert (mbpp.kind, mbpp.tests, mbpp.setup) == ("assert", ("assert f() is None",), "import os")
    with pytest.raises(ValueError, match="the sample has no tests"):
        parse_tests("42", {"other": 1})
    with pytest.raises(ValueError, match="call-based tests"):
        parse_tests("x", {"input_output": {"inputs": [[1]], "outputs": [2], "fn_name": "f"}})
    with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
        parse_tests(json.dumps({"inputs": ["1", "2"], "outputs": ["1"]}), {})
    with pytest.raises(ValueError, match="test list is empty"):
        parse_tests(json.dumps({"tests": []}), {})


def test_outputs_match_up_to_trailing_whitespace_and_number_rounding():
    assert outputs_match("3  \n4\n\n\n", "3\n4")
    assert outputs_match("3\r\n4\r\n", "3\n4\n")
    assert outputs_match("0.3333333", "0.33333333333")
    assert not outputs_match("0.33", "0.3333")
    assert not outputs_match("3 4", "3")
    assert not outputs_match("yes", "Yes")
    assert outputs_match("nan", "nan") and not outputs_match("nan", "0")  # equal text matches as text
    assert not outputs_match("inf", "1e400")


def test_assertion_tests_pass_fail_and_count():
    assert run_tests(ADD, parse_tests(ADD_TESTS, {})) == run_tests(ADD, asserts("assert add(1, 2) == 3",
                                                                                "assert add(-1, 1) == 0"))
    ok = run_tests(ADD, asserts("assert add(1, 2) == 3", "assert add(-1, 1) == 0"))
    assert (ok.passed, ok.total, ok.failure, ok.all_passed) == (2, 2, None, True)
    wrong = "def add(a, b):\n    return a * b\n"  # passes the second test only
    first = run_tests(wrong, asserts("assert add(1, 2) == 3", "assert add(0, 0) == 0"))
    assert (first.passed, first.failure) == (0, "test 0: AssertionError")  # stops at the first failure
    every = run_tests(wrong, asserts("assert add(1, 2) == 3", "assert add(0, 0) == 0"), stop_on_failure=False)
    assert (every.passed, every.total) == (1, 2)
    assert run_tests("def add(a, b) return a", asserts("assert add(1, 2) == 3")).failure == "program: SyntaxError"
    setup = run_tests("def f(): return math.pi", asserts("assert f() > 3", setup="import math"))
    assert setup.all_passed


def test_a_program_that_exits_early_passes_nothing_but_sys_exit_0_lets_the_tests_run():
    gone = run_tests("import os\nos._exit(0)\n" + ADD, asserts("assert add(1, 2) == 3"))
    assert (gone.passed, gone.failure) == (0, "exit code 0 before its tests ran")
    killed = run_tests("import signal, os\nos.kill(os.getpid(), signal.SIGKILL)", asserts("assert True"))
    assert killed.passed == 0  # os.kill is refused: the program fails with PermissionError instead
    assert killed.failure == "program: PermissionError"
    done = run_tests(ADD + "import sys\nsys.exit(0)\n", asserts("assert add(1, 2) == 3"))
    assert done.all_passed


@pytest.mark.parametrize("exit_call", ["exit()", "import sys; sys.exit(0)", "raise SystemExit"])
def test_a_tested_function_that_exits_fails_its_test(exit_call):
    """exit() inside the tested function made every assertion pass without being evaluated: a reward hack."""
    hack = run_tests(f"def add(a, b):\n    {exit_call}\n", asserts("assert add(1, 2) == 3"))
    assert (hack.passed, hack.failure) == (0, "test 0: SystemExit")


def test_programs_run_as_their_graders_run_them():
    """An assertion-tested program is a module (its demo block does not run: human-eval's exec); a stdin/stdout
    program is a script whose non-daemon threads finish before its output is read (the deep-recursion idiom)."""
    demo = ADD + "if __name__ == '__main__':\n    print(add(int(input()), 1))\n"
    assert run_tests(demo, asserts("assert add(1, 2) == 3")).all_passed
    threaded = ("import threading\ndef main():\n    a, b = map(int, input().split())\n    print(a + b)\n"
                "threading.stack_size(1 << 26)\nthreading.Thread(target=main).start()\n")
    spec = parse_tests(json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}), {})
    assert run_tests(threaded, spec).all_passed
    stuck = "import threading, time\nthreading.Thread(target=lambda: time.sleep(60)).start()\nprint(3)\n"
    slow = run_tests(stuck, CodeTests("stdio", ("1 2\n",), outputs=("3\n",), timeout_s=0.5))
    assert (slow.passed, slow.failure) == (0, "input 0: timeout")


def test_time_and_memory_limits():
    spin = run_tests("while True:\n    pass\n", asserts("assert True", timeout_s=0.3))
    assert (spin.passed, spin.failure) == (0, "program: timeout")
    slow = run_tests("import time\ndef f():\n    time.sleep(60)\n", asserts("f()", "assert True", timeout_s=0.3),
                     stop_on_failure=False)
    assert (slow.passed, slow.failure) == (1, "test 0: timeout")  # each test has its own timer
    # one C call the child's alarm cannot interrupt: the parent stops the test at its own limit (the sample
    # used to run the whole budget of every test, past the reward pool's timeout: an error, not a 0.0)
    c_call = run_tests("def f():\n    return sum(range(10**12))\n", asserts("f()", "assert True", "assert True",
                                                                          timeout_s=0.5))
    assert (c_call.passed, c_call.failure) == (0, "test 0: timeout")
    stubborn = "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass\n"
    t0 = time.monotonic()
    assert run_tests(stubborn, asserts("assert True", timeout_s=0.3)).failure == "timeout"  # the wall-clock kill
    assert time.monotonic() - t0 < 30
    big = run_tests("x = bytearray(4 << 30)\n", asserts("assert True", memory_mb=512))
    assert big.failure == "program: MemoryError"
    spam = run_tests("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", asserts("assert True"))
    assert spam.failure == "program: OSError"  # standard output is a file of at most 16 MiB


def test_destructive_calls_are_refused_and_the_spec_is_gone(tmp_path: Path):
    victim = tmp_path / "keep.txt"
    victim.write_text("data")
    for call in (f"os.remove({str(victim)!r})", f"shutil.rmtree({str(tmp_path)!r})", "os.system('true')",
                 "subprocess.run(['true'])", "os.fork()", f"os.rename({str(victim)!r}, 'x')"):
        report = run_tests(f"import os, shutil, subprocess\n{call}\n", asserts("assert True"))
        assert report.failure == "program: PermissionError", (call, report)
    assert victim.read_text() == "data"
    peek = run_tests("import os\nFILES = os.listdir('.')\n", asserts("assert 'spec.json' not in FILES"))
    assert peek.all_passed  # the tests (and expected outputs) are off the disk before the program runs


def test_stdin_stdout_tests():
    spec = parse_tests(json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}), {})
    good = "a, b = map(int, input().split())\nprint(a + b)\n"
    assert run_tests(good, spec).all_passed
    bad = run_tests("a, b = map(int, input().split())\nprint(a + b if a == 1 else 0)\n", spec, stop_on_failure=False)
    assert (bad.passed, bad.failure) == (1, "input 1: wrong output")
    crash = run_tests("raise ValueError('no')", spec)
    assert (crash.passed, crash.failure) == (0, "input 0: ValueError")
    quiet_exit = run_tests("import sys\na, b = map(int, input().split())\nprint(a + b)\nsys.exit(0)\n", spec)
    assert quiet_exit.all_passed


def test_code_reward_end_to_end_and_in_the_reward_pool():
    assert code_reward(fenced(ADD), ADD_TESTS) == 1.0
    assert code_reward(fenced("def add(a, b):\n    return 0\n"), ADD_TESTS) == 0.0
    assert code_reward(fenced("int add();", "cpp"), ADD_TESTS) == 0.0
    assert code_reward(fenced(ADD), "def add(): ...", test_list=["assert add(2, 2) == 4"]) == 1.0
    assert load_reward("code") is code_reward
    hang = json.dumps({"tests": ["assert True"], "timeout_s": 60})
    items = [("ok", fenced(ADD), ADD_TESTS), ("no-tests", fenced(ADD), "4"),
             ("hang", fenced("import time\ntime.sleep(120)\n"), hang)]
    with RewardPool("code", num_workers=2, timeout_s=3.0) as pool:
        ok, missing, hung = pool.score(items)
    assert (ok.reward, ok.error) == (1.0, None)
    assert missing.reward == 0.0 and "the sample has no tests" in missing.error
    assert hung.reward == 0.0 and "timeout" in hung.error
    # the hung program died with its killed worker (PR_SET_PDEATHSIG): no harness process is left
    deadline = time.monotonic() + 5
    while _harness_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _harness_processes() == []


def _harness_processes() -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"refused by llamarl's code verifier" in cmd:
            out.append(int(pid))
    return out


def test_the_config_knows_every_built_in_reward():
    from llamarl.config import FORMAT_REWARD_NAMES, REWARD_NAMES
    from llamarl.rewards import BUILTIN_REWARDS

    assert sorted(REWARD_NAMES + FORMAT_REWARD_NAMES) == sorted(BUILTIN_REWARDS)
