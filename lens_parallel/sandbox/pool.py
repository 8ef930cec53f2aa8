"""The programs of a run scored in parallel, each (program, item) once per process.

lm-eval asks for a code task's metric one item at a time. Its filters see every item at once, so the offline
HumanEval and MBPP filters (:mod:`~lens_parallel.downstream.task_functions`) :func:`start` all their programs on a
pool of one thread per core (each thread waits on its sandbox and judge,
:func:`~lens_parallel.sandbox.fence.run_program`); the metric then takes its item's :func:`verdict`, started
now if no filter started it. A program a second setting writes again is not run again: both get the same verdict,
so that a paired comparison never counts a timing difference as an effect of the edit. :func:`known` gives a
finished verdict (its reason, in :meth:`~lens_parallel.downstream.effects.TaskResult.samples`).

A verdict is known by the program and everything that judges it: the item's tests, the dataset's ``prompt`` and
``entry_point`` that the judge trusts (:func:`~lens_parallel.sandbox.fence.run_program`), and the limits. A program
judged against another prompt or entry point is another verdict, run on its own: an item is never judged, or judged
again after a refusal, without its prompt.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import astuple

from lens_parallel.sandbox.fence import LIMITS, Case, Execution, SandboxLimits, check_opted_in, run_program

_lock = threading.Lock()
_started: dict[str, Future[Execution]] = {}
_pool: list[ThreadPoolExecutor] = []


def _key(case: Case, limits: SandboxLimits) -> str:
    return hashlib.sha256(json.dumps([*astuple(case), astuple(limits)]).encode()).hexdigest()


def workers() -> int:
    """Programs run at once: one per core this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def start(case: Case, *, limits: SandboxLimits = LIMITS) -> Future[Execution]:
    """The verdict of ``case`` (a program, its item's tests and what the judge trusts of the item:
    :func:`~lens_parallel.sandbox.fence.run_program`), running on the pool (started once; later calls share it).
    Refused at once unless the caller opted in to code execution."""
    check_opted_in()
    key = _key(case, limits)
    with _lock:
        earlier = _started.get(key)
        if earlier is None or (earlier.done() and earlier.exception() is not None):  # a refusal is not kept
            if not _pool:
                _pool.append(ThreadPoolExecutor(max_workers=workers(), thread_name_prefix="lens-parallel-program"))
            _started[key] = _pool[0].submit(
                run_program, case.program, case.tests, prompt=case.prompt, entry_point=case.entry_point, limits=limits
            )
        return _started[key]


def verdict(case: Case, *, limits: SandboxLimits = LIMITS) -> Execution:
    """``case``'s verdict, waiting for it (started now if it was not)."""
    return start(case, limits=limits).result()


def known(case: Case, *, limits: SandboxLimits = LIMITS) -> Execution | None:
    """``case``'s finished verdict, else None (nothing is started)."""
    with _lock:
        future = _started.get(_key(case, limits))
    return future.result() if future is not None and future.done() and future.exception() is None else None
