"""Next-layer head dominance, the Qwen3.5 study's protocol, on several models, beside the study's own numbers.

    python benchmarks/dominance.py [--models toy-qwen3.5 smollm2-135m Qwen/Qwen3.5-2B] [--threads 2]
                                   [--out benchmarks/out/dominance] [--force]

Protocol (``head_dominance`` defaults): four 32-token texts (two English, two Chinese: ``study_texts``), receiving
query tokens 7-31, every adjacent layer pair, halves ranked on the Q/K/V scale. Each model runs in its own process
so that its wall time and peak RSS are its own; a model whose summary is already in ``--out`` is not rerun
(``--force`` reruns it). A model that cannot be loaded here (``Qwen/Qwen3.5-2B`` needs the Hugging Face hub) is
reported as not run, with the reason. Writes per model the result (JSON + NPZ), the summary table (CSV), the
figure (HTML + PNG) and ``<model>.summary.json``; prints one table with the study's values in the first column.

Throughput: the forwards head dominance runs are counted (rows and lengths, after its deduplication of rows), their
multiply-adds computed from the model's shapes (:func:`protocol_macs`; softmax-attention models), and the achieved
GFLOP/s (2 x MACs / wall time) printed beside that of a float32 matmul of the model's MLP shape measured in the same
process at the same thread count.
"""

from __future__ import annotations

import argparse
import contextlib
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
    "forwards": "forwards run",
    "rows": "rows run (texts x removals, deduplicated)",
    "tokens": "tokens run",
    "gmac": "multiply-adds run (G)",
    "gflops_achieved": "achieved GFLOP/s (2 x MACs / wall)",
    "gflops_matmul": "float32 matmul GFLOP/s, MLP shape",
    "share_of_matmul": "achieved / matmul",
}


def _stem(spec: str) -> str:
    return spec.replace("/", "_")


@contextlib.contextmanager
def count_forwards(log: list[tuple[int, int, int]]):
    """Record (rows, length, start layer) of every forward head dominance runs (its ``run_rows`` wrapped)."""
    from lens_parallel.analyses import dominance

    plain = dominance.run_rows

    def counted(model, info, batch, *, rows=None, length=None, start_layer=0, **kw):
        n = len(batch.docs.lengths) if rows is None else len(rows)
        log.append((n, batch.docs.tokens.shape[1] if length is None else length, start_layer))
        return plain(model, info, batch, rows=rows, length=length, start_layer=start_layer, **kw)

    dominance.run_rows = counted
    try:
        yield
    finally:
        dominance.run_rows = plain


def protocol_macs(model, forwards: list[tuple[int, int, int]]) -> float | None:
    """Multiply-adds of the forwards run: each row of length L through block l (q/k/v/o projections, QK^T and AV
    over the full L x L map as the bridge's eager attention computes it, the MLP) and block l+1 up to its attention
    pattern (q/k/v projections, QK^T). None for models with linear-attention layers (not counted here)."""
    from lens_parallel import model_info

    info, cfg = model_info(model), model.cfg
    if "linear" in info.layer_types:
        return None
    d, h, kv, dh = info.d_model, info.n_heads, info.n_kv_heads, info.d_head
    qkv = d * (h + 2 * kv) * dh
    mlp = (3 if getattr(cfg, "gated_mlp", False) else 2) * d * cfg.d_mlp
    total = 0.0
    for rows, length, _ in forwards:
        block_l = length * (qkv + h * dh * d + mlp) + 2 * h * length * length * dh
        block_next = length * qkv + h * length * length * dh
        total += rows * (block_l + block_next)
    return total


def mlp_matmul_gflops(model, tokens: int = 4096, repeats: int = 5) -> float:
    """Float32 GFLOP/s of a dense matmul of the model's own MLP shape ([tokens, d_model] x [d_model, d_mlp]) at the
    current thread count: the best of ``repeats``."""
    import torch

    a, b = torch.randn(tokens, model.cfg.d_model), torch.randn(model.cfg.d_model, model.cfg.d_mlp)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * tokens * model.cfg.d_model * model.cfg.d_mlp / best / 1e9


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
    forwards = []
    with count_forwards(forwards):
        t0 = time.perf_counter()
        result = head_dominance(model, blocks, progress=True)
        wall = time.perf_counter() - t0
    macs = protocol_macs(model, forwards)
    matmul = mlp_matmul_gflops(model)
    result.save(stem.with_name(stem.name + "_dominance"))
    table = result.group_table()
    table.to_csv(stem.with_name(stem.name + "_dominance_summary.csv"), index=False)
    save_figure(result.figure(), stem.with_name(stem.name + "_dominance"))
    row = result.summary().iloc[0].to_dict()
    overall = table[(table.level == "all") & (table.scale == "qkv") & (table.mask_scale == "qkv")].set_index("metric")
    row["qkv_joint_weak_median"] = overall.loc["joint_weak", "median"]
    row["qkv_joint_strong_median"] = overall.loc["joint_strong", "median"]
    row["wall_s"] = round(wall, 1)
    row["forwards"] = len(forwards)
    row["rows"] = sum(rows for rows, _, _ in forwards)
    row["tokens"] = sum(rows * length for rows, length, _ in forwards)
    row["gmac"] = None if macs is None else round(macs / 1e9, 1)
    row["gflops_achieved"] = None if macs is None else round(2 * macs / wall / 1e9, 1)
    row["gflops_matmul"] = round(matmul, 1)
    row["share_of_matmul"] = None if macs is None else round(2 * macs / wall / 1e9 / matmul, 3)
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
