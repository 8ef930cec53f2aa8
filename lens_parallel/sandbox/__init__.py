"""Running untrusted code (the programs a model writes) where the kernel holds it, judged by a process that never
runs it.

The public surface is small: :func:`run_program` runs one program against a dataset's tests and returns its
:class:`Execution`; :class:`SandboxLimits` says what one program may use; :func:`start`, :func:`verdict` and
:func:`known` share the verdicts of :class:`Case` s (a program and what judges it) across a run on a pool of one
program per core (each on CPUs of its own, :attr:`SandboxLimits.cpus`); :func:`sandbox_fence` says, once, whether
this machine can run code at all (else one line naming what to install); :func:`check_opted_in` refuses unless the
caller opted in (:data:`ALLOW_ENV`). What it guarantees, needs and does not cover: the sandbox guide
(``docs/guides/sandbox.md``).

Its parts, one concept each:

- :mod:`~lens_parallel.sandbox.fence`: the bubblewrap sandbox (namespaces, mounts, a user of its own, limits) and the
  watch over one program and its judge;
- :mod:`~lens_parallel.sandbox.syscalls`: the seccomp filter, an allow-list of the system calls a program may make;
- :mod:`~lens_parallel.sandbox.cgroups`: a control group per sandbox (memory, processes, CPU, by the kernel's count);
- :mod:`~lens_parallel.sandbox.channel`: both ends of the channel, the program's server inside (which loads the
  seccomp filter on itself) and the judge outside;
- :mod:`~lens_parallel.sandbox.values`: the values that cross it, and what reading one may cost the judge;
- :mod:`~lens_parallel.sandbox.pool`: the programs of a run, each (program, item) once per process.
"""

from lens_parallel.sandbox.fence import (
    ALLOW_ENV,
    LIMITS,
    Case,
    Execution,
    Fence,
    SandboxLimits,
    check_opted_in,
    run_program,
    sandbox_fence,
)
from lens_parallel.sandbox.pool import known, start, verdict

__all__ = [
    "ALLOW_ENV",
    "LIMITS",
    "Case",
    "Execution",
    "Fence",
    "SandboxLimits",
    "check_opted_in",
    "known",
    "run_program",
    "sandbox_fence",
    "start",
    "verdict",
]
