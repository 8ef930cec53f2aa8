"""How long the command line takes before it does any work: ``lens-parallel --help``, a subcommand's ``--help``, a
typo (argparse's one-line error) and ``import lens_parallel.cli``, each a fresh process, with ``python -X importtime``
naming the modules that cost most.

    python benchmarks/cli_startup.py [--repeats 5] [--root PATH]

``--root``: the checkout to time (default: this one), so that a before/after pair is measured in one run: e.g.
``git worktree add /tmp/before <commit>`` then ``--root /tmp/before``. Prints min / median / max wall seconds per
call and the top modules by cumulative import time; writes ``benchmarks/out/cli_startup/<label>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CALLS = {
    "--help": ["-m", "lens_parallel.cli", "--help"],
    "decompose --help": ["-m", "lens_parallel.cli", "decompose", "--help"],
    "typo": ["-m", "lens_parallel.cli", "decompsoe"],
    "import lens_parallel.cli": ["-c", "import lens_parallel.cli"],
}


def _time(root: Path, args: list[str], repeats: int) -> list[float]:
    env = os.environ | {"PYTHONPATH": str(root)}
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, check=False)
        out.append(time.perf_counter() - t0)
    return out


def _importtime(root: Path) -> tuple[float, list[tuple[float, str]]]:
    """``import lens_parallel.cli`` under ``python -X importtime``: the seconds of its top-level imports, and the
    cumulative seconds of every top-level package imported along the way (torch, transformer_lens, ...; a package
    imported inside another is counted where it is first imported), largest first."""
    env = os.environ | {"PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import lens_parallel.cli"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    total, packages = 0.0, []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line.removeprefix("import time:").split("|")
        seconds = int(cumulative) / 1e6
        if not name.startswith("  "):  # top level: one space after the bar (nested imports are indented)
            total += seconds
        if "." not in name.strip():
            packages.append((seconds, name.strip()))
    return total, sorted(packages, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--label", default=None, help="name of the JSON written (default: the root's folder name)")
    args = parser.parse_args()
    root = Path(args.root).resolve()
    result: dict[str, object] = {"root": str(root)}
    print(f"{root}: wall seconds over {args.repeats} fresh processes (min / median / max)")
    for name, call in CALLS.items():
        times = _time(root, call, args.repeats)
        result[name] = times
        print(f"  {name:<26} {min(times):6.2f} {statistics.median(times):6.2f} {max(times):6.2f}")
    total, packages = _importtime(root)
    result["importtime_total_s"] = total
    result["importtime_packages"] = packages[:10]
    print(f"python -X importtime -c 'import lens_parallel.cli': {total:.2f} s of imports; largest packages:")
    for seconds, module in packages[:8]:
        print(f"  {seconds:6.3f} s  {module}")
    out = Path(__file__).resolve().parent / "out" / "cli_startup"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.label or root.name}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
