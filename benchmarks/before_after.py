"""Run one benchmark on an earlier revision and on the working tree, back to back, each in its own process.

    python benchmarks/before_after.py REV SCRIPT [ARGS ...]
    python benchmarks/before_after.py 6913976 benchmarks/dominance.py --models smollm2-135m --force

The earlier revision is checked out in a temporary git worktree and its own copy of SCRIPT runs against its own
package (``PYTHONPATH``; a SCRIPT the revision lacks, the working tree's copy, on the old package); then the
working tree's. Each run's output is printed as it comes and saved under
``benchmarks/out/before_after/<script>-<rev>.log`` and ``...-worktree.log``. An ``--out`` of the benchmark, when
given, gets ``-<rev>`` / ``-worktree`` appended so the runs do not share files. Compare ratios measured within one
run of this script: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(tree: Path, script: Path, args: list[str], log: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, str(script), *args],
            cwd=tree,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            f.write(line)
        if proc.wait():
            raise SystemExit(f"{script} failed in {tree} (exit {proc.returncode}); see {log}")
    return time.perf_counter() - t0


def with_out(args: list[str], suffix: str) -> list[str]:
    out = list(args)
    if "--out" in out:
        i = out.index("--out") + 1
        out[i] = f"{out[i]}-{suffix}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", help="the earlier git revision")
    parser.add_argument("script", help="the benchmark, relative to the repository root")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    opts = parser.parse_args()
    logs = ROOT / "benchmarks" / "out" / "before_after"
    logs.mkdir(parents=True, exist_ok=True)
    name = Path(opts.script).stem
    walls = {}
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), opts.rev], cwd=ROOT, check=True)
        try:
            script = old / opts.script
            if not script.exists():  # a benchmark written with the change: its copy runs on the old package
                script = ROOT / opts.script
                print(f"== {opts.rev} has no {opts.script}: the working tree's copy runs on {opts.rev}'s package")
            print(f"== {opts.rev}: {opts.script} {' '.join(opts.args)}", flush=True)
            walls[opts.rev] = run(old, script, with_out(opts.args, opts.rev), logs / f"{name}-{opts.rev}.log")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=True)
    print(f"== working tree: {opts.script} {' '.join(opts.args)}", flush=True)
    walls["worktree"] = run(ROOT, ROOT / opts.script, with_out(opts.args, "worktree"), logs / f"{name}-worktree.log")
    for what, wall in walls.items():
        print(f"{what}: {wall:.1f} s wall (process, incl. model load)")


if __name__ == "__main__":
    main()
