"""Two sizes of one Qwen family under the sanity-checks paper's Check 1 (arXiv 2611.13543): the self-cosine, the
causal null and the grouped-query within / across-group excess, beside the paper's Qwen2.5-0.5B and -1.5B rows.

    python benchmarks/qwen_sizes.py [--models qwen2.5-coder-0.5b qwen2.5-coder-1.5b] [--n-docs 8] [--seq-len 512]
                                    [--threads 2] [--out benchmarks/out/qwen_sizes]

Per model, in its own process (wall time and peak RSS its own): ``gqa_alignment`` with the paper's sampled
earlier-position partner (first token excluded; model level = means over heads): cos_self, cos_null, excess, and
the excess of partners in the head's own kv group over those in other groups (within / across); the exact null
(expectation over the partner) beside it. Same text for both: ``--n-docs`` Austen blocks of ``--seq-len`` tokens.

The paper's rows are context, not a target: its Qwen2.5 are the base models on its own corpus; these are the Coder
Instruct models (the 0.5B a GGUF requantised from the AWQ checkpoint) on Austen. Writes ``qwen_sizes.csv`` and the
figure ``qwen_sizes.html`` (+ PNG) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

PAPER = [  # 2611.13543, Check 1, as printed
    {"model": "Qwen2.5-0.5B (paper)", "within_excess": 0.2415, "across_excess": -0.1876},
    {"model": "Qwen2.5-1.5B (paper)", "within_excess": 0.2731, "across_excess": -0.1922},
]
COLUMNS = ["cos_self", "cos_null", "excess", "within_excess", "across_excess"]


def run_one(spec: str, args: argparse.Namespace) -> dict[str, object]:
    import torch

    from lens_parallel import load_model, token_blocks
    from lens_parallel.analyses.nulls import causal_null, gqa_alignment

    torch.set_num_threads(args.threads)
    model = load_model(spec)
    blocks = token_blocks(model, "austen", n_docs=args.n_docs, seq_len=args.seq_len, seed=0)
    start = time.perf_counter()
    sampled = gqa_alignment(model, blocks, seed=0, batch_size=2).summary().iloc[0]
    exact = causal_null(model, blocks, null="exact", batch_size=2).summary().iloc[0]
    row: dict[str, object] = {"model": spec, "heads": f"{model.cfg.n_heads}/{model.cfg.n_key_value_heads}"}
    row |= {c: float(sampled[c]) for c in COLUMNS} | {"exact_cos_null": float(exact["cos_null"])}
    row |= {"seconds": time.perf_counter() - start}
    row["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def figure(rows: list[dict[str, object]]) -> object:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=["self-cosine against the causal null", "grouped-query excess by kv group"],
        horizontal_spacing=0.14,
    )
    names = [str(r["model"]) for r in rows]
    for name, colour in (("cos_self", "#1f77b4"), ("cos_null", "#aaaaaa")):
        fig.add_trace(go.Bar(x=names, y=[r[name] for r in rows], name=name, marker_color=colour), row=1, col=1)
    for name, colour in (("within_excess", "#2ca02c"), ("across_excess", "#d62728")):
        fig.add_trace(
            go.Bar(x=names, y=[r[name] for r in rows], name=f"{name} (ours)", marker_color=colour), row=1, col=2
        )
        fig.add_trace(
            go.Bar(
                x=names,
                y=[p[name] for p in PAPER[: len(rows)]],
                name=f"{name}: the paper's Qwen2.5 base of the same size",
                marker={
                    "color": "white",
                    "line": {"color": colour, "width": 2},
                    "pattern": {"shape": "/", "fgcolor": colour},
                },
            ),
            row=1,
            col=2,
        )
    fig.update_yaxes(title_text="cosine (mean over heads)", row=1, col=1)
    fig.update_yaxes(title_text="excess cosine over the null (mean over heads)", row=1, col=2)
    fig.update_layout(
        title="Qwen2.5-Coder 0.5B and 1.5B, sanity-checks Check 1 (Austen; sampled earlier-position partner)",
        barmode="group",
        template="plotly_white",
        height=480,
        width=1150,
    )
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    parser.add_argument("--n-docs", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/qwen_sizes"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one model here and print its row as JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return
    import pandas as pd

    from lens_parallel.plots import save_figure

    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in args.models:
        argv = [sys.executable, __file__, "--one", spec, "--n-docs", str(args.n_docs), "--seq-len", str(args.seq_len)]
        done = subprocess.run([*argv, "--threads", str(args.threads)], capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    table = pd.DataFrame([*rows, *PAPER]).set_index("model")
    table.to_csv(args.out / "qwen_sizes.csv")
    written = save_figure(figure(rows), args.out / "qwen_sizes")
    print(f"{args.n_docs} Austen blocks x {args.seq_len} tokens; sampled partner, seed 0 (exact null beside)")
    shown = ["heads", *COLUMNS, "exact_cos_null", "seconds", "peak_rss_mib"]
    print(table[shown].to_string(float_format=lambda x: f"{x:.4f}", na_rep=""))
    print("wrote:", args.out / "qwen_sizes.csv", *map(str, written))


if __name__ == "__main__":
    main()
