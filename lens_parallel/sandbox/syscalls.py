"""The system calls a sandboxed program may make: a seccomp allow-list, built with libseccomp (``pyseccomp``, its
Python binding over the system's ``libseccomp.so.2``) and loaded by the sandbox's server on itself
(:func:`~lens_parallel.sandbox.channel.confine`) before it reads the program: after ``setpriv``'s drop to the
sandbox's own user, so that no call that changes who a process is stays on the list. Every process it starts
inherits it.

Every call is named here with why a program needs it (:data:`ALLOWED`); anything else is answered ``EPERM``,
including the calls of kernels newer than this list. Docker's default profile is the anchor, narrowed to what
CPython and its standard library need to compute, to use pipes and UNIX sockets, to start processes and threads, and
to use the files inside the sandbox. Where a call is safe only in part, its arguments are checked (:data:`CHECKED`);
``fsync`` and ``fdatasync`` succeed without effect (:data:`NO_EFFECT_CALLS`). What it leaves out reaches the host's
kernel state or a pool the host shares (:data:`POOLS`): keyrings, System V IPC, POSIX message queues, ``memfd``,
``io_uring`` and AIO, ``inotify``, ``fanotify``, leases, ``ptrace`` and other processes' memory, ``bpf``,
``perf_event_open``, ``userfaultfd``, NUMA memory policy, I/O priorities, ``posix_fadvise`` (it evicts the host's
page cache), mounts and new namespaces, ``landlock``, LSM attributes, mount listings, sockets other than UNIX ones.
``clone3`` is answered ``ENOSYS``, so that the C library falls back to ``clone``, whose flags the filter can read. A
system call made for another architecture (32-bit or x32 calls on x86-64) kills the process (libseccomp's default
for a foreign architecture). :data:`UNTRACED` names the calls on the list that a trace of the datasets' canonical
solutions and ordinary programs does not make, each with why it stays.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    """System calls allowed together, and why a program needs them."""

    why: str
    calls: tuple[str, ...]


ALLOWED = (
    Group(
        "the process's own memory, exit and thread bookkeeping (the C library's start, CPython's allocator)",
        ("brk", "mmap", "munmap", "mremap", "mprotect", "madvise", "msync", "exit", "exit_group"),
    ),
    Group(
        "threads and their locks, and the C library's per-thread start (rseq, robust futex lists, TLS)",
        ("futex", "set_tid_address", "set_robust_list", "rseq", "arch_prctl", "sched_yield"),
    ),
    Group(
        "processes inside the sandbox (its PID namespace): start, wait, signal, sessions (clone: flags checked)",
        ("clone", "vfork", "execve", "wait4", "waitid", "kill", "tgkill", "setsid", "setpgid"),
    ),
    Group(
        "who the process is and what it may use (resource.setrlimit, os.getpid, ...)",
        (
            "getpid",
            "getppid",
            "gettid",
            "getpgrp",
            "getpgid",
            "getsid",
            "getuid",
            "geteuid",
            "getgid",
            "getegid",
            "getresuid",
            "getresgid",
            "getgroups",
            "prlimit64",
            "getrusage",
            "times",
            "sysinfo",
            "uname",
            "prctl",
            "getpriority",
            "setpriority",
            "sched_getaffinity",
            "sched_getparam",
            "sched_getscheduler",
            "sched_get_priority_max",
            "sched_get_priority_min",
        ),
    ),
    Group(
        "signals, timers and clocks of the process itself (signal, time.sleep, faulthandler's stack)",
        (
            "rt_sigaction",
            "rt_sigprocmask",
            "rt_sigreturn",
            "rt_sigpending",
            "rt_sigtimedwait",
            "sigaltstack",
            "restart_syscall",
            "pause",
            "alarm",
            "getitimer",
            "setitimer",
            "clock_nanosleep",
            "clock_gettime",
            "clock_getres",
            "getrandom",
        ),
    ),
    Group(
        "files: the read-only standard library and the sandbox's own /tmp (imports, open, os, shutil, tempfile, "
        "sqlite's locks)",
        (
            "read",
            "write",
            "pread64",
            "pwrite64",
            "readv",
            "writev",
            "preadv2",
            "pwritev2",
            "openat",
            "close",
            "close_range",
            "lseek",
            "newfstatat",
            "statfs",
            "fstatfs",
            "access",
            "faccessat",
            "faccessat2",
            "readlink",
            "readlinkat",
            "getdents64",
            "getcwd",
            "chdir",
            "fchdir",
            "rename",
            "renameat",
            "mkdir",
            "mkdirat",
            "rmdir",
            "unlink",
            "unlinkat",
            "link",
            "linkat",
            "symlink",
            "symlinkat",
            "chmod",
            "fchmod",
            "fchmodat",
            "truncate",
            "ftruncate",
            "fallocate",
            "flock",
            "umask",
            "utimensat",
            "getxattr",
            "listxattr",
            "sendfile",
            "copy_file_range",
        ),
    ),
    Group(
        "file descriptors, pipes and waiting on them (subprocess, selectors; fcntl and ioctl: commands checked)",
        (
            "dup2",
            "dup3",
            "pipe2",
            "fcntl",
            "ioctl",
            "pselect6",
            "poll",
            "epoll_create1",
            "epoll_ctl",
            "epoll_wait",
        ),
    ),
    Group(
        "UNIX sockets inside the sandbox (socketpair, multiprocessing; socket and socketpair: family checked)",
        (
            "socket",
            "socketpair",
            "bind",
            "listen",
            "accept4",
            "connect",
            "getsockname",
            "getpeername",
            "sendto",
            "recvfrom",
            "sendmsg",
            "recvmsg",
            "shutdown",
            "setsockopt",
            "getsockopt",
        ),
    ),
)
"""Allowed, by group; everything else is refused with ``EPERM``."""

_LOW_32 = 0xFFFF_FFFF
"""An ``int`` argument (a request, a command, an option, flags) is read by the kernel as its low 32 bits."""


@dataclass(frozen=True)
class OneOf:
    """Calls allowed only where argument ``index`` (its low 32 bits) is one of ``values``, and each ``(index,
    value)`` of ``fixed`` holds too; any other value is refused. ``why``: what the values are for, and what the
    others would reach."""

    calls: tuple[str, ...]
    index: int
    values: dict[str, int]
    why: str
    fixed: tuple[tuple[int, int], ...] = ()

    def conditions(self) -> list[tuple[tuple[int, int, int], ...]]:
        """One rule per allowed value: ``(index, mask, value)`` comparisons that must all hold."""
        fixed = tuple((i, _LOW_32, v) for i, v in self.fixed)
        return [((self.index, _LOW_32, value), *fixed) for value in self.values.values()]

    def row(self) -> str:
        names = ", ".join(f"`{name}`" for name in self.values)
        return f"| {', '.join(f'`{c}`' for c in self.calls)}: only {names} | {self.why} |"


@dataclass(frozen=True)
class NoneOf:
    """Calls allowed only where argument ``index`` has none of ``bits`` set."""

    calls: tuple[str, ...]
    index: int
    bits: dict[str, int]
    why: str

    def conditions(self) -> list[tuple[tuple[int, int, int], ...]]:
        return [((self.index, functools.reduce(int.__or__, self.bits.values()), 0),)]

    def row(self) -> str:
        names = ", ".join(f"`{name}`" for name in self.bits)
        return f"| {', '.join(f'`{c}`' for c in self.calls)}: none of {names} | {self.why} |"


CHECKED = (
    OneOf(
        ("socket", "socketpair"),
        0,
        {"AF_UNIX": 1},
        "UNIX sockets only: `AF_INET` and `AF_INET6` would meet an empty network namespace, but a program has no use "
        "for them; `AF_VSOCK` leaves it for the virtual machine's host; `AF_NETLINK` talks to the kernel",
    ),
    OneOf(
        ("setsockopt",),
        2,
        {
            "SO_REUSEADDR": 2,
            "SO_SNDBUF": 7,
            "SO_RCVBUF": 8,
            "SO_KEEPALIVE": 9,
            "SO_LINGER": 13,
            "SO_PASSCRED": 16,
            "SO_RCVTIMEO": 20,
            "SO_SNDTIMEO": 21,
        },
        "a UNIX socket's own settings (at `SOL_SOCKET`); no filter (`SO_ATTACH_FILTER` and `SO_ATTACH_BPF` put "
        "programs into the kernel's JIT, whose budget, `bpf_jit_limit`, is the host's)",
        fixed=((1, 1),),
    ),
    OneOf(
        ("ioctl",),
        1,
        {"TCGETS": 0x5401, "TIOCGWINSZ": 0x5413, "FIONREAD": 0x541B, "FIONBIO": 0x5421, "FIONCLEX": 0x5450}
        | {"FIOCLEX": 0x5451},
        "whether a descriptor is a terminal (`isatty`) and its size, bytes waiting, non-blocking and close-on-exec "
        "(CPython sets close-on-exec with `FIOCLEX` and raises on any error but `ENOTTY` and `EACCES`); no terminal "
        "control (`TIOCSTI` would type into a terminal), no device's requests",
    ),
    OneOf(
        ("fcntl",),
        1,
        {"F_DUPFD": 0, "F_GETFD": 1, "F_SETFD": 2, "F_GETFL": 3, "F_SETFL": 4, "F_GETLK": 5, "F_SETLK": 6}
        | {"F_SETLKW": 7, "F_OFD_GETLK": 36, "F_OFD_SETLK": 37, "F_OFD_SETLKW": 38, "F_DUPFD_CLOEXEC": 1030},
        "a descriptor's flags and status, and record locks (sqlite's, on its own files; a lock ends with the "
        "sandbox); no leases, no `F_NOTIFY` (a directory's changes), no signals on I/O, no pipe resizing (pipe "
        "buffers are counted per user)",
    ),
    OneOf(
        ("prctl",),
        0,
        {"PR_SET_NAME": 15, "PR_GET_NAME": 16, "PR_SET_VMA": 0x53564D41},
        "what the C library and CPython ask of their own process: thread names, names of their mappings; no "
        "`PR_SET_SECCOMP` (classic BPF into the kernel's JIT), no `PR_SET_MEMORY_MERGE` (KSM, the host's)",
    ),
    OneOf(
        ("madvise",),
        2,
        {"MADV_NORMAL": 0, "MADV_RANDOM": 1, "MADV_SEQUENTIAL": 2, "MADV_WILLNEED": 3, "MADV_DONTNEED": 4}
        | {"MADV_FREE": 8, "MADV_DONTFORK": 10, "MADV_DOFORK": 11, "MADV_HUGEPAGE": 14, "MADV_NOHUGEPAGE": 15}
        | {"MADV_DONTDUMP": 16, "MADV_DODUMP": 17, "MADV_WIPEONFORK": 18, "MADV_KEEPONFORK": 19},
        "the allocator's advice on its own memory; no `MADV_MERGEABLE` (KSM merges pages across the host)",
    ),
    NoneOf(
        ("mmap",),
        3,
        {"MAP_HUGETLB": 0x40000},
        "no pages from the host's hugepage pool, which no cgroup here is charged for",
    ),
    NoneOf(
        ("clone",),
        0,
        {
            "CLONE_NEWNS": 0x00020000,
            "CLONE_NEWCGROUP": 0x02000000,
            "CLONE_NEWUTS": 0x04000000,
            "CLONE_NEWIPC": 0x08000000,
            "CLONE_NEWUSER": 0x10000000,
            "CLONE_NEWPID": 0x20000000,
            "CLONE_NEWNET": 0x40000000,
            "CLONE_NEWTIME": 0x00000080,
        },
        "no new namespace inside the sandbox",
    ),
)
"""The calls allowed only in part: each with the arguments it is allowed with."""

UNTRACED = {
    "restart_syscall": "the kernel's own restart of a sleep a signal interrupted (a process stopped and continued)",
    "prctl": "CPython 3.14 names its threads (`PR_SET_NAME`) and the C library 2.39 its mappings (`PR_SET_VMA`); "
    "neither here",
    "faccessat": "the C library's `os.access(dir_fd=...)` where the kernel has no `faccessat2` (Linux before 5.8)",
}
"""Allowed calls that the trace of the canonical solutions and ordinary programs (``tests/test_sandbox_trace.py``)
does not make, and why each stays."""

NO_EFFECT_CALLS = ("fsync", "fdatasync")
NO_EFFECT_CALLS_WHY = """sqlite flushes its files, which live in the sandbox's tmpfs (where a flush does nothing); on
a file of the host the call would flush the host's disk"""
"""Answered success without effect, and why."""

ENOSYS_CALLS = ("clone3",)
"""Answered ``ENOSYS`` (the kernel has no such call), so that the C library falls back to the call the filter
checks: ``clone3`` takes its flags in memory, where a filter cannot read them."""

POOLS = {
    "aio-max-nr": "io_setup is refused: AIO contexts come from one host-wide budget",
    "aio-nr": "io_setup is refused",
    "binfmt_misc": "a mount: mounts are refused",
    "dentry-negative": "the kernel's cache of names, charged to the sandbox's memory cgroup",
    "dentry-state": "the kernel's cache of names, charged to the sandbox's memory cgroup",
    "dir-notify-enable": "fcntl's F_NOTIFY is refused",
    "epoll": "each watch needs a descriptor: RLIMIT_NOFILE times the processes bound them, far under the limit",
    "fanotify": "fanotify_init is refused",
    "file-max": "open files: RLIMIT_NOFILE per process, times the processes the cgroup allows",
    "file-nr": "open files: RLIMIT_NOFILE per process, times the processes the cgroup allows",
    "fuse": "a mount: mounts are refused",
    "inode-nr": "inodes of the sandbox's own tmpfs, which has a size",
    "inode-state": "inodes of the sandbox's own tmpfs, which has a size",
    "inotify": "inotify_init is refused (watching the standard library would show what the judge opens)",
    "lease-break-time": "leases (fcntl F_SETLEASE) are refused",
    "leases-enable": "leases (fcntl F_SETLEASE) are refused",
    "mount-max": "mounts are refused",
    "mqueue": "POSIX message queues (mq_open) are refused",
    "nr_open": "RLIMIT_NOFILE, set below it",
    "overflowgid": "a number, not a pool",
    "overflowuid": "a number, not a pool",
    "pipe-keep": "a setting, not a pool",
    "pipe-max-size": "fcntl's F_SETPIPE_SZ is refused: every pipe keeps the default 16 pages",
    "pipe-user-pages-hard": "pipe buffers per user: as root a user per sandbox; else open files x processes / 2 pipes "
    "of 16 pages (a third of it at one CPU; the sandbox guide), their memory charged to the cgroup",
    "pipe-user-pages-soft": "pipe buffers per user: as root a user per sandbox; else open files x processes / 2 pipes "
    "of 16 pages (a third of it at one CPU; the sandbox guide), their memory charged to the cgroup",
    "protected_fifos": "a setting, not a pool",
    "protected_hardlinks": "a setting, not a pool",
    "protected_regular": "a setting, not a pool",
    "protected_symlinks": "a setting, not a pool",
    "quota": "quotactl is refused",
    "suid_dumpable": "a setting; core files are off (RLIMIT_CORE 0)",
    "xfs": "a file system's settings, not a pool",
}
"""Each entry of ``/proc/sys/fs`` (the kernel's file-system limits and pools) and what keeps a program from using
up what the host shares. Beside these: pseudo-terminals (``kernel.pty``; non-initial devpts instances share one
budget) are out of reach, ``/dev/pts`` being an empty tmpfs in the sandbox; keyrings (``kernel.keys``) and System V
IPC (``kernel.shm*``, ``kernel.msg*``, ``kernel.sem``) are refused."""


def allowed_calls() -> tuple[str, ...]:
    """Every allowed system call's name, in :data:`ALLOWED`'s order."""
    return tuple(call for group in ALLOWED for call in group.calls)


def describe() -> dict[str, object]:
    """The filter as provenance records it: what is allowed, by group, and the arguments checked."""
    checked: dict[str, object] = {
        ", ".join(c.calls): {"argument": c.index, "only": list(c.values)}
        if isinstance(c, OneOf)
        else {"argument": c.index, "none of": list(c.bits)}
        for c in CHECKED
    }
    allowed: dict[str, object] = {group.why: list(group.calls) for group in ALLOWED}
    return {
        "default": "EPERM",
        "allowed": allowed,
        "checked": checked,
        "no effect": list(NO_EFFECT_CALLS),
        "ENOSYS": list(ENOSYS_CALLS),
    }


def markdown() -> str:
    """The filter as the sandbox guide shows it: one row per group (why, and the calls), then the arguments
    checked, the calls answered without effect and with ``ENOSYS``."""
    rows = ["| why a program needs them | system calls |", "| --- | --- |"]
    rows += [f"| {group.why} | {', '.join(f'`{call}`' for call in group.calls)} |" for group in ALLOWED]
    rows += ["", "| allowed only in part | why |", "| --- | --- |", *(checked.row() for checked in CHECKED)]
    rows.append(
        f"| {', '.join(f'`{c}`' for c in NO_EFFECT_CALLS)}: answered success, without effect | "
        f"{' '.join(NO_EFFECT_CALLS_WHY.split())} |"
    )
    rows.append(
        f"| {', '.join(f'`{c}`' for c in ENOSYS_CALLS)}: answered `ENOSYS` | the C library falls back to "
        "`clone`, whose flags the filter reads |"
    )
    rows += ["", "| allowed, though the trace does not make it | why it stays |", "| --- | --- |"]
    rows += [f"| `{call}` | {why} |" for call, why in UNTRACED.items()]
    return "\n".join(rows) + "\n"


@functools.cache
def seccomp_program() -> bytes:
    """The filter as the BPF program the sandbox's server loads on itself (built once per process). Raises
    ``ImportError`` (no ``pyseccomp``) or ``OSError``/``RuntimeError`` (no ``libseccomp.so.2``) where it cannot be
    built. On another architecture, the calls it does not have are left out (refused)."""
    import pyseccomp as seccomp

    built = seccomp.SyscallFilter(seccomp.ERRNO(errno.EPERM))

    def rule(action: object, name: str, *args: object) -> None:
        with contextlib.suppress(OSError):  # a call this architecture does not have (x86-64 has every one)
            built.add_rule(action, name, *args)

    checked = {call for c in CHECKED for call in c.calls}
    for name in allowed_calls():
        if name not in checked:
            rule(seccomp.ALLOW, name)
    for part in CHECKED:
        for conditions in part.conditions():
            args = [seccomp.Arg(index, seccomp.MASKED_EQ, mask, value) for index, mask, value in conditions]
            for name in part.calls:
                rule(seccomp.ALLOW, name, *args)
    for name in NO_EFFECT_CALLS:
        rule(seccomp.ERRNO(0), name)
    for name in ENOSYS_CALLS:
        rule(seccomp.ERRNO(errno.ENOSYS), name)
    with tempfile.TemporaryFile() as out:
        built.export_bpf(out)
        out.seek(0)
        return out.read()
