"""A control group per sandbox: the kernel counts and limits what all its processes use, by every path.

A program's memory is not only what ``/proc/PID/statm`` shows: ``memfd_create`` pages, SysV shared memory detached
from every process, message queues, socket buffers and page tables are charged to the memory cgroup of the process
that made them, as is its anonymous and file memory; a cgroup's limit holds them all, and the kernel's out-of-memory
killer ends the sandbox's processes when they reach it. The pids controller caps processes and threads together,
whatever user they run as; a CPU cgroup of its own makes the sandbox one scheduling entity, whose share of the
machine is one sandbox's however many processes or sessions (``setsid``) it starts.

Two layouts, one set of meanings (:class:`Layout`): cgroup v1's ``memory``, ``pids``, ``cpu`` and ``cpuacct``
hierarchies (as on these machines), and cgroup v2's unified tree where ``memory``, ``pids`` and ``cpu`` are enabled
for the children of this process's cgroup (the root of a container's cgroup namespace, or a subtree delegated to
this user whose ``cgroup.subtree_control`` already lists them). Each sandbox gets ``lens-parallel-<pid>-<n>``
beside the others under this process's own cgroup; it is emptied and removed with the sandbox
(:meth:`Cgroup.close`). Where neither can be had, :func:`cgroup_parent` says in one line what to enable.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from lens_parallel.errors import EnvironmentFailure

CgroupVersion = Literal["v1", "v2"]


@dataclass(frozen=True)
class Layout:
    """Where each meaning lives in one cgroup version: controller -> the hierarchy it is in (v1; v2: all in one),
    and the files (``controller/file``) that set the limits and read the kernel's counts."""

    controllers: tuple[str, ...]
    memory_limit: tuple[str, ...]
    """Files set to the memory limit (v1: with swap too, where swap is accounted)."""
    pids_limit: str
    oom_kills: tuple[str, str]
    """The file and its line's key whose value counts the out-of-memory kills."""
    peak_memory: str
    cpu_usage: tuple[str, str | None, float]
    """The file, its line's key (None: the whole file) and the unit in seconds of the CPU time all processes used."""


LAYOUTS: dict[CgroupVersion, Layout] = {
    "v1": Layout(
        controllers=("memory", "pids", "cpu", "cpuacct"),
        memory_limit=("memory/memory.limit_in_bytes", "memory/memory.memsw.limit_in_bytes"),
        pids_limit="pids/pids.max",
        oom_kills=("memory/memory.oom_control", "oom_kill"),
        peak_memory="memory/memory.max_usage_in_bytes",
        cpu_usage=("cpuacct/cpuacct.usage", None, 1e-9),
    ),
    "v2": Layout(
        controllers=("memory", "pids", "cpu"),
        memory_limit=("memory/memory.max", "memory/memory.swap.max"),
        pids_limit="pids/pids.max",
        oom_kills=("memory/memory.events", "oom_kill"),
        peak_memory="memory/memory.peak",
        cpu_usage=("cpu/cpu.stat", "usage_usec", 1e-6),
    ),
}


@dataclass(frozen=True)
class CgroupParent:
    """Where this process makes its sandboxes' cgroups: ``version`` and, per controller of its :class:`Layout`, the
    folder of this process's own cgroup in that controller's hierarchy (v2: the same folder for all)."""

    version: CgroupVersion
    folders: tuple[tuple[str, str], ...]

    def make(self, *, memory_bytes: int, processes: int) -> Cgroup:
        """A new, empty cgroup under each folder, limited to ``memory_bytes`` (swap included) and ``processes``
        (processes and threads)."""
        name = f"lens-parallel-{os.getpid()}-{next(_numbers)}"
        made = Cgroup(self.version, tuple((c, str(Path(f) / name)) for c, f in self.folders))
        try:
            for folder in dict(made.folders).values():
                if not os.path.isdir(folder):
                    os.mkdir(folder)
            layout = LAYOUTS[self.version]
            for file in layout.memory_limit:
                with contextlib.suppress(FileNotFoundError):  # no swap accounting: no swap to limit
                    made.write(file, str(memory_bytes) if "swap" not in file else "0")
            made.write(layout.pids_limit, str(processes))
        except OSError:
            made.close()
            raise
        return made


_numbers = itertools.count()


@dataclass(frozen=True)
class Cgroup:
    """One sandbox's cgroup: per controller, its folder. The files the watch reads every tick stay open
    (``counters``), read again from their start: opening a cgroup file cost 0.1 ms a read."""

    version: CgroupVersion
    folders: tuple[tuple[str, str], ...]
    counters: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def path(self, file: str) -> str:
        controller, name = file.split("/", 1)
        return os.path.join(dict(self.folders)[controller], name)

    def write(self, file: str, value: str) -> None:
        with open(self.path(file), "w") as out:
            out.write(value)

    def _number(self, file: str, key: str | None) -> int:
        if file not in self.counters:
            self.counters[file] = os.open(self.path(file), os.O_RDONLY | os.O_CLOEXEC)
        text = os.pread(self.counters[file], 1 << 16, 0).decode()
        if key is None:
            return int(text)
        return next(int(line.split()[1]) for line in text.splitlines() if line.split()[:1] == [key])

    def joins(self) -> list[str]:
        """The files a process writes its pid to, to join this cgroup (one per hierarchy)."""
        return sorted({os.path.join(folder, "cgroup.procs") for _, folder in self.folders})

    def cpu_seconds(self) -> float:
        """CPU time all its processes have used, as the kernel counts it."""
        file, key, unit = LAYOUTS[self.version].cpu_usage
        return self._number(file, key) * unit

    def oom_kills(self) -> int:
        """Processes the kernel's out-of-memory killer ended because this cgroup reached its memory limit."""
        return self._number(*LAYOUTS[self.version].oom_kills)

    def peak_memory(self) -> int:
        """The most memory charged to it at once (bytes), by the kernel's count."""
        return self._number(LAYOUTS[self.version].peak_memory, None)

    def processes(self) -> list[int]:
        """The processes in it now (host pids)."""
        found: set[int] = set()
        for join in self.joins():
            with contextlib.suppress(OSError):
                found |= {int(p) for p in Path(join).read_text().split()}
        return sorted(found)

    def close(self, *, wait: float = 10.0) -> None:
        """Kill every process in it, wait (up to ``wait`` seconds) until the kernel has taken them down, and remove
        it. A cgroup that cannot be emptied in time is left, named in the error."""
        for fd in self.counters.values():
            os.close(fd)
        self.counters.clear()
        deadline = time.monotonic() + wait
        folders = [folder for _, folder in self.folders]
        while any(os.path.isdir(f) for f in folders):
            for pid in self.processes():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for folder in dict.fromkeys(folders):
                with contextlib.suppress(OSError):  # gone already, or not yet empty
                    os.rmdir(folder)
            if any(os.path.isdir(f) for f in folders):
                if time.monotonic() > deadline:
                    raise EnvironmentFailure(f"the sandbox's cgroup {folders[0]} could not be emptied in {wait:g} s")
                time.sleep(0.001)


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """This process's cgroup mounts: (mount point, the cgroup path at the mount's root, fstype, super options)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            found.append((fields[4], fields[3], tail[0], set(tail[2].split(","))))
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller (``"0"``: its v2 path), from ``/proc/self/cgroup``."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else ["0" if number == "0" else ""]:
            own[controller] = path
    return own


def _inside(mount: str, mount_root: str, path: str) -> str:
    """The folder of cgroup ``path`` under a hierarchy mounted at ``mount`` whose root is cgroup ``mount_root``."""
    relative = os.path.relpath(path, mount_root) if path.startswith(mount_root) else path.lstrip("/")
    return os.path.normpath(os.path.join(mount, relative))


def cgroup_parent() -> CgroupParent:
    """Where this process can make its sandboxes' cgroups (module docstring), else why not, in one line."""
    fix = "or run without allow_code_execution=True"
    own, mounts = _own_cgroups(), _mounts()
    v1 = {}
    for mount, root, kind, options in mounts:
        for controller in LAYOUTS["v1"].controllers:
            if kind == "cgroup" and controller in options and controller in own:
                v1[controller] = _inside(mount, root, own[controller])
    if len(v1) == len(LAYOUTS["v1"].controllers) and all(os.access(f, os.W_OK) for f in v1.values()):
        return CgroupParent("v1", tuple(v1.items()))
    for mount, root, kind, _ in mounts:
        if kind == "cgroup2" and "0" in own:
            folder = _inside(mount, root, own["0"])
            if _enables(folder, LAYOUTS["v2"].controllers):
                return CgroupParent("v2", tuple((c, folder) for c in LAYOUTS["v2"].controllers))
    raise EnvironmentFailure(
        "running the code a model writes needs a cgroup per program and none can be made here: cgroup v1 (memory, "
        "pids, cpu, cpuacct) writable, or v2 with memory pids cpu in this cgroup's subtree_control (run as root or "
        f"in a delegated subtree), {fix}"
    )


def _enables(folder: str, controllers: tuple[str, ...]) -> bool:
    """Whether cgroup v2 ``folder``'s children get ``controllers`` (enabling them where they are available)."""
    try:
        enabled = set(Path(folder, "cgroup.subtree_control").read_text().split())
        missing = [c for c in controllers if c not in enabled]
        if missing:
            Path(folder, "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in missing))
        return True
    except OSError:
        return False
