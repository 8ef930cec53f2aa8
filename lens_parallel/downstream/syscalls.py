"""The system calls a sandboxed program may not make: a seccomp filter, built with libseccomp (``pyseccomp``, its
Python binding over the system's ``libseccomp.so.2``) and given to bubblewrap (``--seccomp FD``), which loads it
just before the program's interpreter starts; every process it starts inherits it.

What is refused follows Docker's default profile (keyrings, which no namespace separates: a key added would outlive
the sandbox; kernel modules, clocks, ``reboot``, ``ptrace`` and reading other processes' memory, ``bpf``,
``perf_event_open``, ``userfaultfd``, mounts and new namespaces), and adds what a HumanEval or MBPP program has no use
for and what reaches memory or kernel state by paths other than ``malloc``: ``memfd_create``, System V shared memory,
message queues and semaphores, and ``io_uring``. Each is answered ``EPERM`` (``clone3``: ``ENOSYS``, so that the C
library falls back to ``clone``, whose namespace flags the filter can see and refuses). A system call made for
another architecture (32-bit calls on x86-64) kills the process (libseccomp's default for a foreign architecture).
"""

from __future__ import annotations

import errno
import functools
import tempfile

REFUSED = (
    # keyrings (not namespaced)
    "add_key",
    "keyctl",
    "request_key",
    # memory and kernel objects outside the process's own address space
    "memfd_create",
    "memfd_secret",
    "shmget",
    "shmat",
    "shmctl",
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "semget",
    "semop",
    "semtimedop",
    "semctl",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    # other processes and the kernel's insides
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "kcmp",
    "perf_event_open",
    "bpf",
    "userfaultfd",
    "fanotify_init",
    "lookup_dcookie",
    "syslog",
    "personality",
    # mounts and namespaces
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "name_to_handle_at",
    "open_by_handle_at",
    # the machine
    "acct",
    "reboot",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "swapon",
    "swapoff",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "quotactl",
    "quotactl_fd",
    "iopl",
    "ioperm",
    "uselib",
    "ustat",
    "sysfs",
    "vm86",
    "vm86old",
)
"""Refused with ``EPERM`` (names libseccomp does not know on this machine's architecture are skipped)."""

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
"""``clone`` with any of these flags is refused (``EPERM``): no new namespace inside the sandbox."""


@functools.cache
def seccomp_program() -> bytes:
    """The filter as the BPF program bubblewrap loads (built once per process). Raises ``ImportError`` (no
    ``pyseccomp``) or ``OSError``/``RuntimeError`` (no ``libseccomp.so.2``) where it cannot be built."""
    import pyseccomp as seccomp

    refuse = seccomp.ERRNO(errno.EPERM)
    built = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in REFUSED:
        try:
            built.add_rule(refuse, name)
        except OSError:  # not a system call of this architecture
            continue
    for flag in NAMESPACE_FLAGS.values():
        built.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    built.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as out:
        built.export_bpf(out)
        out.seek(0)
        return out.read()
