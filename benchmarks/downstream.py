"""What the paper's edits do to downstream tasks, through lm-evaluation-harness, on real models offline.

    python benchmarks/downstream.py [--models smollm2-135m qwen2.5-coder-1.5b] [--preset quick] [--limit N]
                                    [--settings NAME ...] [--threads 2] [--batch-size 8]
                                    [--out benchmarks/out/downstream]

Per model, one ``task_effects`` call (lm-eval's task definitions on the offline data; one unedited run shared by
every setting): value-parallel removal on every layer (``ComponentScale("value", s_par=0)``), its random-direction
control (the same rank-one removal along a fixed random unit direction per head, ``RandomDirectionRemoval``, plain
and norm-matched), residual-attn parallel removal (``ComponentScale("residual-attn", s_par=0)``) and hard diagonal
removal (``ZeroDiagonal``); ``--settings`` runs some of them. Prints per task the score of each setting (accuracy;
RULER's ``long-context`` preset: its score at the length asked for) and the paired difference with its 95%
bootstrap CI and Holm-adjusted McNemar p, and the unweighted average over tasks; writes each result
(``<model>.json`` + ``.npz``) and its figures. Resumable: the request caches live in ``--out``.

The directional-decomposition paper's Qwen3-1.7B general-task averages (baseline 53.0, value-parallel removal 53.2,
attention-output parallel removal 42.4, hard diagonal removal 26.9) are printed beside as context only: another
model, 14 other task settings, full data sets; these numbers are not comparable with them. With the
``long-context`` preset its RULER averages at 4k on Llama-3.2-3B instead (baseline 77.2, attention-output parallel
removal 52.6, value-parallel removal 76.2; no hard diagonal removal): all 13 RULER tasks, another model.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

from lens_parallel import ComponentScale, RandomDirectionRemoval, ZeroDiagonal, load_model, task_effects
from lens_parallel.plots.common import save_figure

PAPER_QWEN3_17B = {
    "unedited": 53.0,
    "value-parallel removal": 53.2,
    "residual-attn parallel removal": 42.4,
    "zero diagonal": 26.9,
}
PAPER_RULER_LLAMA32_3B_4K = {"unedited": 77.2, "value-parallel removal": 76.2, "residual-attn parallel removal": 52.6}


def in_points(table: pd.DataFrame) -> pd.DataFrame:
    """``task_effects``' differences with the scores in % and the difference and its CI in percentage points."""
    out = table.copy()
    out["unedited %"], out["edited %"] = 100 * out["unedited"], 100 * out["edited"]
    out["diff pp"] = 100 * out["difference"]
    out["95% CI pp"] = [f"[{100 * lo:+.1f}, {100 * hi:+.1f}]" for lo, hi in zip(out.ci_low, out.ci_high, strict=True)]
    return out


def settings() -> dict[str, object]:
    return {
        "value-parallel removal": ComponentScale("value", s_par=0.0),
        "random direction": RandomDirectionRemoval(seed=0),
        "random direction (norm-matched)": RandomDirectionRemoval(seed=0, norm_matched=True),
        "residual-attn parallel removal": ComponentScale("residual-attn", s_par=0.0),
        "zero diagonal": ZeroDiagonal(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-1.5b"])
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--settings", nargs="+", choices=sorted(settings()), default=sorted(settings()))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/downstream"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in args.models:
        model = load_model(spec)
        start = time.perf_counter()
        result = task_effects(
            model,
            {name: edit for name, edit in settings().items() if name in args.settings},
            args.preset,
            limit=args.limit,
            batch_size=args.batch_size,
            store=args.out / f"{spec}-requests.sqlite",
            progress=False,
        )
        wall = time.perf_counter() - start
        result.save(args.out / spec)
        for name, fig in result.figures().items():
            save_figure(fig, args.out / f"{spec}-{name}")
        table = result.differences()
        metric = "acc" if (table["metric"] == "acc").any() else str(table["metric"].iloc[0])
        acc = in_points(table[table["metric"] == metric])
        cols = ["task", "setting", "n_items", "unedited %", "edited %", "diff pp", "95% CI pp", "p_holm"]
        print(f"\n== {spec}: preset {args.preset!r}, metric {metric!r}, {wall:.1f} s ({args.threads} threads) ==")
        print(acc[cols].to_string(index=False, float_format=lambda x: f"{x:.3g}"))
        average = acc[acc["task"] == "average"].set_index("setting")
        paper, what = (
            (PAPER_RULER_LLAMA32_3B_4K, "Llama-3.2-3B RULER averages at 4k")
            if args.preset == "long-context"
            else (PAPER_QWEN3_17B, "Qwen3-1.7B general-task averages")
        )
        print(f"\naverage {metric} over tasks (%), beside the paper's {what} (context only):")
        print(f"  {'unedited':34s} {100 * average['unedited'].iloc[0]:6.1f}   paper {paper['unedited']}")
        for setting, row in average.iterrows():
            print(f"  {setting!s:34s} {row['edited %']:6.1f}   paper {paper.get(str(setting), '-')}")


if __name__ == "__main__":
    main()
