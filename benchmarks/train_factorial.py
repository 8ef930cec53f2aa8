"""Training-time interventions, paired by seed: does removing the parallel part during training lower validation loss?

    python benchmarks/train_factorial.py --preset cpu-small [--arms ...] [--seeds 0 1 2 3] [--out DIR] [--threads N]
    python benchmarks/train_factorial.py --preset qwen3-59m --texts hf:DATASET[:CONFIG[:SPLIT]]   # on a GPU
    python benchmarks/train_factorial.py --design xsa-controls   # the paper's factorial (GPU, FineWeb-Edu online)

``cpu-small`` trains baseline, value-parallel-removal and random-direction with 4 seeds each (12 runs of a ~1.5M
parameter GPT-2-style model on the bundled English texts; 161-267 s a run on one thread); value-parallel-removal
is the primary endpoint here. ``--design xsa-controls`` runs the sanity-checks paper's design instead (arms, seeds,
endpoints, the 50.9M model; ``--tokens`` sets the tokens per run). Runs write checkpoints
and their results under ``--out`` as they go: rerunning the command resumes an interrupted factorial. Prints the
paired table (arm - baseline final validation loss, nats/token) and the wall time; writes ``factorial.json``,
``paired.csv``, ``curves.csv`` and the figures (HTML, and PNG when kaleido can render).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import pandas as pd
import torch

from lens_parallel.plots import save_figure
from lens_parallel.protocols import designs
from lens_parallel.training import ARMS, PRESETS, run_design, run_factorial

DEFAULT_ARMS = ("baseline", "value-parallel-removal", "random-direction")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(DEFAULT_ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--texts", nargs="+", default=None, help="corpora to train on (default: the preset's)")
    parser.add_argument("--steps", type=int, default=None, help="override the preset's number of steps")
    parser.add_argument("--design", choices=sorted(designs()), default=None, help="a pre-specified factorial")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per run (with --design)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="default: benchmarks/out/train_<preset>")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    changes = ({"texts": tuple(args.texts)} if args.texts else {}) | ({"steps": args.steps} if args.steps else {})
    out = Path(args.out or f"benchmarks/out/train_{args.design or args.preset}")
    t0 = time.perf_counter()
    if args.design:
        result = run_design(args.design, out=out, plan=out / "plan.json", tokens=args.tokens, **changes)
        config = PRESETS[designs()[args.design].preset]
    else:
        config = dataclasses.replace(PRESETS[args.preset], **changes)
        result = run_factorial(config, args.arms, args.seeds, out=out, primary="value-parallel-removal")
    elapsed = time.perf_counter() - t0
    table = result.paired_table()
    table.to_csv(out / "paired.csv", index=False)
    result.curves().to_csv(out / "curves.csv", index=False)
    save_figure(result.figure(), out / "factorial")
    save_figure(result.gates_figure(), out / "gates")
    run = result.runs[0]
    print(
        f"{args.design or args.preset}: {run.n_params:,} parameters, {config.steps} steps x {config.batch_size} x "
        f"{config.seq_len} tokens, seeds {list(result.seeds)}; this invocation {elapsed:.0f} s, "
        f"summed run time {sum(r.wall_s for r in result.runs):.0f} s"
    )
    finals = result.finals().pivot(index="seed", columns="arm", values="final_val_loss")[list(result.arms)]
    with pd.option_context("display.width", 200, "display.float_format", "{:.4f}".format):
        print("final validation loss (nats/token) per seed:")
        print(finals.to_string())
        print("paired deltas (mde_paper: the paper's 2.9 sigma/sqrt(n); mde_80/90: exact noncentral t):")
        cols = [
            "contrast",
            "role",
            "n_seeds",
            "mean_delta",
            "ci_lo",
            "ci_hi",
            "t",
            "p",
            "p_holm",
            "cohens_dz",
            "sigma_paired",
            "mde_paper",
            "mde_80",
            "mde_90",
        ]
        print(table[cols].to_string(index=False))


if __name__ == "__main__":
    main()
