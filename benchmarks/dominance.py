"""Next-layer head dominance, the Qwen3.5 study's protocol, on several models, beside the study's own numbers.

    python benchmarks/dominance.py [--models toy-qwen3.5 smollm2-135m Qwen/Qwen3.5-2B] [--threads 2]
                                   [--out benchmarks/out/dominance] [--force]

Protocol (``head_dominance`` defaults): four 32-token texts (two English, two Chinese: ``study_texts``), receiving
query tokens 7-31, every adjacent layer pair, halves ranked on the Q/K/V scale. Each model runs in its own process
so that its wall time and peak RSS are its own; a model whose summary is already in ``--out`` is not rerun
(``--force`` reruns it). A model that cannot be loaded here (``Qwen/Qwen3.5-2B`` needs the Hugging Face hub) is
reported as not run, with the reason. Writes per model the result (JSON + NPZ), the summary table (CSV), the
figure (HTML + PNG) and ``<model>.summary.json``; prints one table with the study's values in the first column.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

STUDY = {
    "model": "Qwen3.5-2B (study)",
    "n_pairs": 23,
    "qkv_effective_fraction": 0.760,
    "qkv_top25_share": 0.446,
    "qkv_bottom25_share": 0.106,
    "js_distance_effective_fraction": 0.558,
    "js_distance_top25_share": 0.565,
    "js_distance_bottom25_share": 0.068,
    "qkv_joint_weak": 0.0904,
    "qkv_joint_strong": 0.2092,
    "qkv_strong_weak_ratio": 2.358,
    "qkv_weak_smaller": 0.956,
    "wall_s": 2636.4,
    "peak_rss_mib": 155.9,
}
ROWS = {
    "n_pairs": "layer pairs",
    "qkv_observations": "observations (Q/K/V scale)",
    "qkv_effective_fraction": "Q/K/V: effective fraction, median",
    "qkv_top25_share": "Q/K/V: top-25% share, median",
    "qkv_bottom25_share": "Q/K/V: bottom-25% share, median",
    "qkv_heads_for_90": "Q/K/V: heads for 90%, median",
    "js_distance_effective_fraction": "sqrt(JS): effective fraction, median",
    "js_distance_top25_share": "sqrt(JS): top-25% share, median",
    "js_distance_bottom25_share": "sqrt(JS): bottom-25% share, median",
    "qkv_joint_weak": "joint weak half (Q/K/V), mean",
    "qkv_joint_weak_median": "joint weak half (Q/K/V), median",
    "qkv_joint_strong": "joint strong half (Q/K/V), mean",
    "qkv_joint_strong_median": "joint strong half (Q/K/V), median",
    "qkv_joint_random": "joint random half (Q/K/V), mean",
    "qkv_joint_all": "all upstream heads (Q/K/V), mean",
    "qkv_strong_weak_ratio": "strong/weak ratio, median",
    "qkv_weak_smaller": "weak < strong, share of observations",
    "js_distance_strong_weak_ratio": "sqrt(JS) strong/weak ratio, median",
    "js_distance_weak_smaller": "sqrt(JS) weak < strong, share",
    "wall_s": "wall time (s)",
    "peak_rss_mib": "peak RSS (MiB)",
}


def _stem(spec: str) -> str:
    return spec.replace("/", "_")


def run_one(spec: str, out: Path, threads: int) -> None:
    import torch

    from lens_parallel import LensParallelError, head_dominance, load_model
    from lens_parallel.analyses.dominance import study_texts
    from lens_parallel.plots.common import save_figure

    torch.set_num_threads(threads)
    stem = out / _stem(spec)
    try:
        model = load_model(spec)
    except LensParallelError as exc:
        stem.with_name(stem.name + ".failed").write_text(" ".join(str(exc).split()))
        sys.exit(3)
    blocks = study_texts(model)
    head_dominance(model, blocks, upstream_layers=[0], query_positions=[7], progress=False)  # warm-up
    t0 = time.perf_counter()
    result = head_dominance(model, blocks, progress=True)
    wall = time.perf_counter() - t0
    result.save(stem.with_name(stem.name + "_dominance"))
    table = result.group_table()
    table.to_csv(stem.with_name(stem.name + "_dominance_summary.csv"), index=False)
    save_figure(result.figure(), stem.with_name(stem.name + "_dominance"))
    row = result.summary().iloc[0].to_dict()
    overall = table[(table.level == "all") & (table.scale == "qkv") & (table.mask_scale == "qkv")].set_index("metric")
    row["qkv_joint_weak_median"] = overall.loc["joint_weak", "median"]
    row["qkv_joint_strong_median"] = overall.loc["joint_strong", "median"]
    row["wall_s"] = round(wall, 1)
    row["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    by_type = table[(table.level == "receiving_type") & (table.metric == "effective_fraction")]
    print(by_type[["group", "scale", "count", "q1", "median", "q3"]].to_string(index=False))
    stem.with_name(stem.name + ".summary.json").write_text(json.dumps(row, default=float, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["toy-qwen3.5", "smollm2-135m", "Qwen/Qwen3.5-2B"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/out/dominance")
    parser.add_argument("--force", action="store_true", help="rerun models whose summary is already in --out")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process: one model
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one:
        run_one(args.one, out, args.threads)
        return
    columns, failed = [STUDY], {}
    for spec in args.models:
        summary = out / f"{_stem(spec)}.summary.json"
        if args.force or not summary.exists():
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            cmd = [sys.executable, __file__, "--one", spec, "--out", str(out), "--threads", str(args.threads)]
            done = subprocess.run(cmd, env=env)
            if done.returncode != 0:
                reason = out / f"{_stem(spec)}.failed"
                failed[spec] = reason.read_text() if reason.exists() else f"exit status {done.returncode}"
                continue
        columns.append(json.loads(summary.read_text()))
    import pandas as pd

    table = pd.DataFrame(columns).set_index("model").T.reindex(list(ROWS)).rename(index=ROWS)
    print("\nNext-layer head dominance, study protocol (4 texts x 32 tokens, query tokens 7-31)")
    print(table.to_string(float_format=lambda v: f"{v:.4g}"))
    for spec, reason in failed.items():
        print(f"{spec}: not run: {reason}")


if __name__ == "__main__":
    main()
