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
from lens_parallel.downstream.presets import TASK_PRESETS
from lens_parallel.plots.common import save_figure

PAPER_NAMES = {
    "residual-attn parallel removal": "attention-output parallel removal",
    "zero diagonal": "hard diagonal removal",
}
"""This script's setting names -> the paper's (the presets' ``reference``)."""
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
    parser.add_argument("--max-gen-toks", type=int, default=None, help="generation tasks: the most tokens per item")
    parser.add_argument("--allow-code-execution", action="store_true", help="HumanEval, MBPP: run the model's code")
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
            max_gen_toks=args.max_gen_toks,
            allow_code_execution=args.allow_code_execution,
            batch_size=args.batch_size,
            store=args.out / f"{spec}-requests.sqlite",
            progress=False,
        )
        wall = time.perf_counter() - start
        result.save(args.out / spec)
        for name, fig in result.figures().items():
            save_figure(fig, args.out / f"{spec}-{name}")
        samples = result.samples(context="full")
        samples.to_json(args.out / f"{spec}-samples.jsonl", orient="records", lines=True, force_ascii=False)
        (args.out / f"{spec}-samples.html").write_text(result.samples_html(), encoding="utf-8")
        table = result.differences()
        averaged = set(table.loc[table["task"] == "average", "metric"])
        metric = "score" if "score" in averaged else "acc" if "acc" in averaged else str(table["metric"].iloc[0])
        shown = in_points(table[(table["metric"] == metric) | (table["task"] != "average")])
        cols = ["task", "metric", "setting", "n_items", "unedited %", "edited %", "diff pp", "95% CI pp", "p_holm"]
        print(f"\n== {spec}: preset {args.preset!r}, {wall:.1f} s ({args.threads} threads) ==")
        print(shown[cols].to_string(index=False, float_format=lambda x: f"{x:.3g}"))
        if metric in ("score", "acc"):
            print("\nper setting, each task's score and the average over tasks (%; CI and difference in pp):")
            print(result.table().round(1).to_string())
        paper, what = (
            (PAPER_RULER_LLAMA32_3B_4K, "Llama-3.2-3B RULER averages at 4k")
            if args.preset == "long-context"
            else (TASK_PRESETS["directional-decomposition-general"].reference or {}, "Qwen3-1.7B general averages")
        )
        average = shown[(shown["task"] == "average") & (shown["metric"] == metric)].set_index("setting")
        print(f"\naverage {metric} over tasks (%), beside the paper's {what} (context only):")
        print(f"  {'unedited':34s} {100 * average['unedited'].iloc[0]:6.1f}   paper {paper['unedited']}")
        for setting, row in average.iterrows():
            reference = paper.get(PAPER_NAMES.get(str(setting), str(setting)), "-")
            print(f"  {setting!s:34s} {row['edited %']:6.1f}   paper {reference}")


if __name__ == "__main__":
    main()
