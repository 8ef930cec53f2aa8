"""The system calls a sandboxed program may make: a seccomp allow-list, built with libseccomp (``pyseccomp``, its
Python binding over the system's ``libseccomp.so.2``) and given to bubblewrap (``--seccomp FD``), which loads it
just before the program's first command starts (``setpriv`` as root, else the interpreter); every process it starts
inherits it.

Every call is named here with why a program needs it (:data:`ALLOWED`); anything else is answered ``EPERM``,
including the calls of kernels newer than this list. Docker's default profile is the anchor, narrowed to what
CPython and its standard library need to compute, to use pipes and UNIX sockets, to start processes and threads, and
to use the files inside the sandbox. Where a call is safe only in part, its arguments are checked
(:data:`SOCKET_FAMILIES`, :data:`IOCTL_REQUESTS`, :data:`FCNTL_COMMANDS`, :data:`NAMESPACE_FLAGS`). What it leaves
out reaches the host's kernel state or a pool the host shares (:data:`POOLS`): keyrings, System V IPC, POSIX
message queues, ``memfd``, ``io_uring`` and AIO, ``inotify``, ``fanotify`` and file locks, ``ptrace`` and other
processes' memory, ``bpf``, ``perf_event_open``, ``userfaultfd``, NUMA memory policy, I/O priorities, mounts and new
namespaces, ``landlock``, LSM attributes, mount listings, sockets other than UNIX ones (``AF_VSOCK`` would leave the
network namespace for the virtual machine's host). ``clone3`` is answered ``ENOSYS``, so that the C library falls
back to ``clone``, whose flags the filter can read. A system call made for another architecture (32-bit or x32 calls
on x86-64) kills the process (libseccomp's default for a foreign architecture).
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
        ("brk", "mmap", "munmap", "mremap", "mprotect", "madvise", "mincore", "msync", "exit", "exit_group"),
    ),
    Group(
        "threads and their locks, and the C library's per-thread start (rseq, robust futex lists, TLS)",
        ("futex", "set_tid_address", "set_robust_list", "get_robust_list", "rseq", "arch_prctl", "sched_yield"),
    ),
    Group(
        "processes inside the sandbox (its PID namespace): start, wait, signal, sessions (clone: flags checked)",
        ("clone", "fork", "vfork", "execve", "wait4", "waitid", "kill", "tgkill", "tkill", "setsid", "setpgid"),
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
            "getrlimit",
            "setrlimit",
            "prlimit64",
            "getrusage",
            "times",
            "sysinfo",
            "uname",
            "prctl",
            "capget",
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
        "setpriv's drop to the sandbox's own user before the interpreter starts (without capabilities after it, "
        "the kernel refuses any other change)",
        ("setresuid", "setresgid", "setreuid", "setregid", "setuid", "setgid", "setgroups", "capset"),
    ),
    Group(
        "signals, timers and clocks of the process itself (signal, time.sleep, faulthandler's stack)",
        (
            "rt_sigaction",
            "rt_sigprocmask",
            "rt_sigreturn",
            "rt_sigpending",
            "rt_sigtimedwait",
            "rt_sigsuspend",
            "sigaltstack",
            "restart_syscall",
            "pause",
            "alarm",
            "getitimer",
            "setitimer",
            "nanosleep",
            "clock_nanosleep",
            "clock_gettime",
            "clock_getres",
            "gettimeofday",
            "time",
            "getrandom",
        ),
    ),
    Group(
        "files: the read-only standard library and the sandbox's own /tmp (imports, open, os, shutil, tempfile)",
        (
            "read",
            "write",
            "pread64",
            "pwrite64",
            "readv",
            "writev",
            "preadv",
            "pwritev",
            "preadv2",
            "pwritev2",
            "open",
            "openat",
            "creat",
            "close",
            "close_range",
            "lseek",
            "stat",
            "fstat",
            "lstat",
            "newfstatat",
            "statx",
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
            "renameat2",
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
            "fadvise64",
            "fsync",
            "fdatasync",
            "umask",
            "utime",
            "utimes",
            "utimensat",
            "getxattr",
            "lgetxattr",
            "fgetxattr",
            "listxattr",
            "llistxattr",
            "flistxattr",
            "sendfile",
            "copy_file_range",
        ),
    ),
    Group(
        "file descriptors, pipes and waiting on them (subprocess, selectors; fcntl and ioctl: commands checked)",
        (
            "dup",
            "dup2",
            "dup3",
            "pipe",
            "pipe2",
            "fcntl",
            "ioctl",
            "select",
            "pselect6",
            "poll",
            "ppoll",
            "epoll_create",
            "epoll_create1",
            "epoll_ctl",
            "epoll_wait",
            "epoll_pwait",
            "epoll_pwait2",
        ),
    ),
    Group(
        "UNIX sockets inside the sandbox (socketpair, multiprocessing; socket and socketpair: family checked)",
        (
            "socket",
            "socketpair",
            "bind",
            "listen",
            "accept",
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

SOCKET_FAMILIES = {"AF_UNIX": 1}
"""``socket`` and ``socketpair`` are allowed for these families only. ``AF_INET`` and ``AF_INET6`` would meet an empty
network namespace, but a program has no use for them; ``AF_VSOCK`` leaves it; ``AF_NETLINK`` talks to the kernel."""

IOCTL_REQUESTS = {"TCGETS": 0x5401, "TIOCGWINSZ": 0x5413, "FIONREAD": 0x541B, "FIONBIO": 0x5421}
IOCTL_REQUESTS |= {"FIONCLEX": 0x5450, "FIOCLEX": 0x5451}
"""``ioctl`` requests allowed (the request's low 32 bits, as the kernel reads it): whether a descriptor is a terminal
(``isatty``) and its size, bytes waiting, non-blocking and close-on-exec (CPython sets close-on-exec with
``FIOCLEX`` and raises on any error but ``ENOTTY`` and ``EACCES``). No terminal control (``TIOCSTI`` would type into
a terminal), no device's requests."""

FCNTL_COMMANDS = {"F_DUPFD": 0, "F_GETFD": 1, "F_SETFD": 2, "F_GETFL": 3, "F_SETFL": 4, "F_DUPFD_CLOEXEC": 1030}
"""``fcntl`` commands allowed: duplicate a descriptor, its flags and status. No locks (a read lock on a read-only
host file blocks the host's write lock on it), no leases, no ``F_NOTIFY`` (a directory's changes), no signals on
I/O, no pipe resizing (pipe buffers are counted per user: :data:`POOLS`)."""

NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
    "CLONE_NEWTIME": 0x00000080,
}
"""``clone`` is allowed only with none of these flags: no new namespace inside the sandbox."""

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
    "pipe-user-pages-hard": "pipe buffers per user: OPEN_FILES x processes / 2 pipes of 16 pages, a quarter of it",
    "pipe-user-pages-soft": "pipe buffers per user: OPEN_FILES x processes / 2 pipes of 16 pages, a quarter of it",
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
    return {
        "default": "EPERM",
        "allowed": {group.why: list(group.calls) for group in ALLOWED},
        "socket families": list(SOCKET_FAMILIES),
        "ioctl requests": list(IOCTL_REQUESTS),
        "fcntl commands": list(FCNTL_COMMANDS),
        "clone flags refused": list(NAMESPACE_FLAGS),
        "ENOSYS": list(ENOSYS_CALLS),
    }


def markdown() -> str:
    """The filter as the sandbox guide shows it: one row per group (why, and the calls), then the arguments
    checked."""
    rows = ["| why a program needs them | system calls |", "| --- | --- |"]
    rows += [f"| {group.why} | {', '.join(f'`{call}`' for call in group.calls)} |" for group in ALLOWED]
    checked = (
        ("`socket`, `socketpair`: families", SOCKET_FAMILIES),
        ("`ioctl`: requests", IOCTL_REQUESTS),
        ("`fcntl`: commands", FCNTL_COMMANDS),
    )
    rows += [f"| {what} allowed | {', '.join(f'`{name}`' for name in names)} |" for what, names in checked]
    rows.append(f"| `clone`: refused with any of | {', '.join(f'`{flag}`' for flag in NAMESPACE_FLAGS)} |")
    rows.append(f"| answered `ENOSYS` | {', '.join(f'`{call}`' for call in ENOSYS_CALLS)} |")
    return "\n".join(rows) + "\n"


_LOW_32 = 0xFFFF_FFFF
"""``ioctl``'s request and ``fcntl``'s command are ``unsigned int`` in the kernel: only their low 32 bits are read."""


@functools.cache
def seccomp_program() -> bytes:
    """The filter as the BPF program bubblewrap loads (built once per process). Raises ``ImportError`` (no
    ``pyseccomp``) or ``OSError``/``RuntimeError`` (no ``libseccomp.so.2``) where it cannot be built. On another
    architecture, the calls it does not have are left out (refused)."""
    import pyseccomp as seccomp

    built = seccomp.SyscallFilter(seccomp.ERRNO(errno.EPERM))

    def rule(action: object, name: str, *args: object) -> None:
        with contextlib.suppress(OSError):  # a call this architecture does not have (x86-64 has every one)
            built.add_rule(action, name, *args)

    checked = {"socket", "socketpair", "ioctl", "fcntl", "clone"}
    for name in allowed_calls():
        if name not in checked:
            rule(seccomp.ALLOW, name)
    for name in ("socket", "socketpair"):
        for family in SOCKET_FAMILIES.values():
            rule(seccomp.ALLOW, name, seccomp.Arg(0, seccomp.EQ, family))
    for request in IOCTL_REQUESTS.values():
        rule(seccomp.ALLOW, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, _LOW_32, request))
    for command in FCNTL_COMMANDS.values():
        rule(seccomp.ALLOW, "fcntl", seccomp.Arg(1, seccomp.MASKED_EQ, _LOW_32, command))
    namespaces = functools.reduce(int.__or__, NAMESPACE_FLAGS.values())
    rule(seccomp.ALLOW, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, namespaces, 0))
    for name in ENOSYS_CALLS:
        rule(seccomp.ERRNO(errno.ENOSYS), name)
    with tempfile.TemporaryFile() as out:
        built.export_bpf(out)
        out.seek(0)
        return out.read()
