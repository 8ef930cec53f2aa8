"""Attribution screening vs exact single-head ablation of every head, in one run.

    python benchmarks/attribution.py [--model smollm2-135m] [--n-docs 8] [--seq-len 128] [--threads 2]
                                     [--naive-heads N] [--out benchmarks/out/attribution]

Times, on the same documents and in one process: a plain forward over all documents (the unit), the attribution
screen of every head (one forward + one backward per batch) for parallel-value removal and for zero ablation, the
exact ablation engine on every single head for both edits, and the naive loop (one full forward per head) for
parallel-value removal (on the first ``--naive-heads`` heads if given, the time then scaled to all heads and said
so). Prints the times and their ratios to the plain forward, the Spearman and Pearson correlations between
estimated and exact effects over all heads for both edits, the top-10 overlap, and the largest engine - naive
difference. Writes the per-head table (CSV), both screens (JSON + NPZ) and the estimate-vs-exact figures.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.stats as sps
import torch

from lens_parallel import head_attribution, load_model, model_info, token_blocks
from lens_parallel.analyses.confirm import ConfirmResult
from lens_parallel.analyses.evaluate import document_losses
from lens_parallel.edits import HeadEdit
from lens_parallel.models import head_label
from lens_parallel.plots import save_figure
from lens_parallel.results import Provenance
from lens_parallel.stats import paired_bootstrap_ci, spearman
from lens_parallel.sweep import AblationJob, run_sweep


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--n-docs", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--naive-heads", type=int, default=None, help="time the naive loop on this many heads")
    parser.add_argument("--out", default="benchmarks/out/attribution")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model)
    info = model_info(model)
    blocks = token_blocks(model, "wikipedia-en", n_docs=args.n_docs, seq_len=args.seq_len, seed=0)
    bs = args.n_docs  # one batch: every method sees all documents at once
    document_losses(model, blocks, batch_size=bs)  # warm-up
    base, t_forward = timed(lambda: document_losses(model, blocks, batch_size=bs))
    heads = [(layer, h) for layer in range(info.n_layers) for h in range(info.n_heads)]
    jobs = [AblationJob(layer, (h,)) for layer, h in heads]
    n_tok = base.n_tokens.sum()
    rows, times, results = {}, {"plain forward": t_forward}, {}
    for ablation in ("parallel-value", "zero"):
        screen, times[f"attribution {ablation}"] = timed(
            lambda ablation=ablation: head_attribution(model, blocks, ablation=ablation, batch_size=bs, progress=False)
        )
        screen.save(out / f"attribution_{ablation}")
        run, times[f"exact engine {ablation}"] = timed(
            lambda ablation=ablation: run_sweep(
                model, blocks, jobs, ablation=ablation, batch_size=bs, tokens_per_forward=8 * bs * args.seq_len
            )
        )
        exact_docs = np.stack([run[j].loss_sum for j in jobs], axis=1) - run.base.loss_sum[:, None]
        rows[ablation] = pd.DataFrame(
            {
                "label": [head_label(layer, h) for layer, h in heads],
                "layer": [layer for layer, _ in heads],
                "head": [h for _, h in heads],
                "estimate": screen.head_estimate().ravel(),
                "exact": exact_docs.sum(0) / n_tok,
            }
        )
        results[ablation] = (screen, exact_docs)
    n_naive = args.naive_heads or len(jobs)
    naive, t_naive = timed(
        lambda: [
            document_losses(model, blocks, HeadEdit("parallel-value", layer, [h]), batch_size=bs).loss_sum
            for layer, h in heads[:n_naive]
        ]
    )
    times["naive loop parallel-value"] = t_naive * len(jobs) / n_naive
    engine = rows["parallel-value"]["exact"].to_numpy()[:n_naive]
    naive_diff = float(np.abs((np.stack(naive, 1) - base.loss_sum[:, None]).sum(0) / n_tok - engine).max())

    print(f"\n{info.name}: {len(jobs)} heads, {args.n_docs} documents x {args.seq_len} tokens, {args.threads} threads")
    timing = pd.DataFrame({"seconds": times}).assign(plain_forwards=lambda d: d["seconds"] / t_forward)
    print(timing.round(2).to_string())
    if n_naive < len(jobs):
        print(f"(naive loop timed on the first {n_naive} heads, {t_naive:.1f} s, scaled to {len(jobs)})")
    print(f"engine vs naive loop, largest difference over {n_naive} heads: {naive_diff:.2e} nats/token")
    summary = {"times": times, "naive_max_diff": naive_diff, "n_naive_timed": n_naive}
    for ablation, df in rows.items():
        est, exact = df["estimate"].to_numpy(), df["exact"].to_numpy()
        top_est = set(df.loc[np.argsort(-np.abs(est))[:10], "label"])
        top_exact = set(df.loc[np.argsort(-np.abs(exact))[:10], "label"])
        stats = {
            "spearman": spearman(est, exact),
            "pearson": float(sps.pearsonr(est, exact).statistic),
            "top10_overlap": len(top_est & top_exact),
            "median_exact_over_estimate": float(np.median(exact / est)),
        }
        summary[ablation] = stats
        print(
            f"{ablation}: "
            + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in stats.items())
        )
        df.to_csv(out / f"heads_{ablation}.csv", index=False)
        screen, exact_docs = results[ablation]
        weights = np.broadcast_to(screen.n_tokens[:, None], exact_docs.shape)
        lo, hi = paired_bootstrap_ci(exact_docs, np.zeros_like(exact_docs), weights)
        figure = ConfirmResult(
            ablation=ablation,
            labels=tuple(df["label"]),
            layers=df["layer"].to_numpy(),
            heads=df["head"].to_numpy(),
            chosen=("top",) * len(df),
            estimate=est,
            exact=exact,
            exact_lo=lo,
            exact_hi=hi,
            spearman=stats["spearman"],
            pearson=stats["pearson"],
            provenance=Provenance.of(info, blocks, "benchmarks/attribution.py", {"ablation": ablation}, None),
        ).figure()
        figure.update_traces(name=f"all {len(df)} heads", selector={"mode": "markers"})
        save_figure(figure, out / f"estimate_vs_exact_{ablation}")
        save_figure(screen.figure(), out / f"attribution_{ablation}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
