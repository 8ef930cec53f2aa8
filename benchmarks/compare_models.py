"""The standard battery across models: one summary row per model, a comparison figure, a side-by-side report.

    python benchmarks/compare_models.py [--models toy-gpt2 ... smollm2-135m qwen2.5-coder-1.5b gemma-3-270m
                                         /path/to/folder org/hub-name]
                                        [--n-docs 8] [--seq-len 128] [--out DIR] [--no-report]

Runs :func:`lens_parallel.report.run_battery` on each model (decomposition in every space, scaling sweep,
diagonal views, layer sensitivity, sanity checks) over the same texts, and writes ``summary.csv`` (one row per
model), ``comparison.html`` (+ PNG) and, unless ``--no-report``, ``report.html`` with every model side by side.
Prints the summary table and each model's time. How to read the outputs: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

from lens_parallel import load_model, token_blocks
from lens_parallel.models import TOY_MODELS, check_spec
from lens_parallel.plots import save_figure
from lens_parallel.plots.comparison import comparison_figure
from lens_parallel.report import run_battery, write_report
from lens_parallel.weights import REAL_MODELS

DEFAULT_MODELS = (*[m for m in TOY_MODELS if m != "toy-qwen3.5"], *REAL_MODELS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--texts", default="wikipedia-en")
    parser.add_argument("--n-docs", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/out/compare_models")
    parser.add_argument("--no-report", action="store_true", help="skip the side-by-side report.html")
    args = parser.parse_args()
    for spec in args.models:
        check_spec(spec)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for spec in args.models:
        t0 = time.perf_counter()
        model = load_model(spec)
        blocks = token_blocks(model, args.texts, n_docs=args.n_docs, seq_len=args.seq_len, seed=args.seed)
        reports.append(run_battery(model, blocks, seed=args.seed, progress=False))
        steps = ", ".join(f"{k} {v:.1f}" for k, v in reports[-1].seconds.items())
        print(f"{spec}: {time.perf_counter() - t0:.1f} s ({steps})")
        del model
    summary = pd.concat([r.summary() for r in reports], ignore_index=True)
    summary.to_csv(out / "summary.csv", index=False)
    save_figure(comparison_figure(summary), out / "comparison")
    if not args.no_report:
        write_report(reports, out, settings={"texts": args.texts, "n_docs": args.n_docs, "seq_len": args.seq_len})
    with pd.option_context("display.width", 220, "display.max_columns", 40, "display.float_format", "{:.4f}".format):
        print(summary.set_index("model").T.to_string())


if __name__ == "__main__":
    main()
