"""The standard battery and the real-weight checks on the three real models obtainable offline.

    python benchmarks/real_models.py [--models smollm2-135m qwen2.5-coder-1.5b gemma-3-270m] [--threads 2]
                                     [--n-docs 8] [--seq-len 512] [--short-seq-len 128] [--skip-checks]
                                     [--out benchmarks/out/real_models] [--force]

Per model, in its own process (so that wall time and peak RSS are its own), after the first-use download:

1. the real-weight checks of ``tests/test_real_weights.py`` (``pytest -m "slow or real" -k <model>``): pass/fail
   per check;
2. decomposition in every space, and the causal null with the GQA within/across-group contrast, at
   T = ``--seq-len`` (512) on ``--n-docs`` (8) Austen blocks; a model with one kv group gets the causal null and a
   one-line "undefined" for the group contrast;
3. scaling, s_par in {0, 0.5, 1.5} and s_perp in {0.5, 0.75} in every space, all layers together, and layer
   sensitivity (parallel-value removal, each head alone and all jointly) on 4 evenly spaced layers, at
   T = ``--short-seq-len`` (128) on the same number of documents: these take one forward per setting, and at
   T = 512 the 26 scaling forwards alone would take about an hour for the Qwen on 2 CPU cores.

The published values of the closest models are printed beside ours: 2611.13543 Table 1 (GPT-2, Pythia-160M
cos_self / cos_null; Qwen2.5-0.5B, Qwen2.5-1.5B, TinyLlama within / across excess) and 2609.15975 (Qwen3-1.7B,
delta perplexity of s_par = 0 in value-exclude-self and residual-attn). A model whose results are already in
``--out`` is not rerun (``--force`` reruns it); the sweeps keep resumable stores there too. Writes per model
``<model>.summary.json``, its results (JSON + NPZ) and ``checks.xml``; then ``real_models.csv`` and
``real_models.html`` (+ PNG), the comparison figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

DEFAULT_MODELS = ("smollm2-135m", "qwen2.5-coder-1.5b", "gemma-3-270m")
TEST_IDS = {"smollm2-135m": "smollm2", "qwen2.5-coder-1.5b": "qwen", "gemma-3-270m": "gemma"}
PUBLISHED = [  # 2611.13543 Table 1 and 2609.15975, as the papers print them
    {"model": "GPT-2 (2611.13543)", "cos_self": 0.4828, "cos_null": 0.2987},
    {"model": "Pythia-160M (2611.13543)", "cos_self": 0.4180, "cos_null": 0.2637},
    {"model": "Qwen2.5-0.5B (2611.13543)", "within_excess": 0.2415, "across_excess": -0.1876},
    {"model": "Qwen2.5-1.5B (2611.13543)", "within_excess": 0.2731, "across_excess": -0.1922},
    {"model": "TinyLlama (2611.13543)", "within_excess": 0.2373, "across_excess": -0.1126},
    {
        "model": "Qwen3-1.7B (2609.15975)",
        "delta_ppl_s_par0_value-exclude-self": 0.46,
        "delta_ppl_s_par0_residual-attn": 21.0,
    },
]
SPACES = ("value", "value-exclude-self", "residual-attn", "residual-mlp", "residual-block")


def run_one(spec: str, out: Path, args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    from lens_parallel import load_model, token_blocks
    from lens_parallel.analyses.decompose import decompose
    from lens_parallel.analyses.nulls import causal_null, gqa_alignment, is_grouped
    from lens_parallel.analyses.scaling import scale_sweep
    from lens_parallel.analyses.sensitivity import head_sensitivity
    from lens_parallel.models import model_info

    torch.set_num_threads(args.threads)
    folder = out / spec
    folder.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    model = load_model(spec)
    info = model_info(model)
    seconds["load"] = time.perf_counter() - t0
    long = token_blocks(model, "austen", n_docs=args.n_docs, seq_len=args.seq_len, seed=0)
    short = token_blocks(model, "austen", n_docs=args.n_docs, seq_len=args.short_seq_len, seed=0)
    row: dict = {
        "model": spec,
        "family": info.family,
        "layers": info.n_layers,
        "heads (q/kv)": f"{info.n_heads}/{info.n_kv_heads}",
    }

    t0 = time.perf_counter()
    dec = decompose(model, long, space="all", batch_size=2, progress=False)
    dec.save(folder / "decomposition")
    df = dec.to_dataframe()
    for (space, level), mean in df.groupby(["space", "level"])["self_cos"].mean().items():
        row[f"self_cos_{space}" + ("" if level == "head" else "_sublayer")] = mean
    seconds["decomposition"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    null = (gqa_alignment if is_grouped(info) else causal_null)(model, long, seed=0, batch_size=2)
    null.save(folder / "null")
    summary = null.summary().iloc[0]
    row |= {k: summary[k] for k in ("cos_self", "cos_null", "excess")}
    if is_grouped(info):
        row |= {"within_excess": summary["within_excess"], "across_excess": summary["across_excess"]}
    else:
        try:
            gqa_alignment(model, long)
        except ValueError as exc:
            row["gqa_note"] = str(exc)
    seconds["null"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    scaling = scale_sweep(
        model,
        short,
        space=list(SPACES),
        s_par=(0.0, 0.5, 1.5),
        s_perp=(0.5, 0.75),
        batch_size=4,
        seed=0,
        store=folder / "scaling.jsonl",
        progress=True,
    )
    scaling.save(folder / "scaling")
    sc = scaling.to_dataframe()
    row["loss_noop"] = sc["loss_noop"].iloc[0]
    for r in sc.itertuples():
        value = r.s_par if r.vary == "s_par" else r.s_perp
        row[f"delta_loss_{r.vary}{value:g}_{r.space}"] = r.delta_loss
        if r.vary == "s_par" and value == 0.0:
            row[f"delta_ppl_s_par0_{r.space}"] = r.delta_ppl
    seconds["scaling"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    layers = sorted({int(x) for x in np.linspace(0, info.n_layers - 1, 4).round()})
    sens = head_sensitivity(
        model, short, layers=layers, batch_size=4, seed=0, store=folder / "sensitivity.jsonl", progress=True
    )
    sens.save(folder / "sensitivity")
    joint = sens.to_dataframe().loc[lambda d: d["head"].isna()]  # one row per layer: all heads jointly
    row["sensitivity_layers"] = " ".join(map(str, layers))
    row["joint_delta_loss_by_layer"] = " ".join(f"{v:.3f}" for v in joint.sort_values("layer")["delta_loss"])
    seconds["sensitivity"] = time.perf_counter() - t0

    row |= {f"seconds_{k}": round(v, 1) for k, v in seconds.items()}
    row["wall_s"] = round(sum(seconds.values()), 1)
    row["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    (out / f"{spec}.summary.json").write_text(json.dumps(row, default=float, indent=1))


def run_checks(spec: str, out: Path, threads: int) -> dict[str, str]:
    """The real-weight checks for one model in a pytest process of their own: check name -> passed/failed."""
    xml = out / spec / "checks.xml"
    xml.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "tests/test_real_weights.py", "-m", "slow or real", "-k", TEST_IDS[spec]]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([*cmd, "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"], env=env)
    results = {}
    for case in ET.parse(xml).iter("testcase"):
        name = case.get("name").removeprefix("test_").split("[")[0]
        params = case.get("name").split("[")[1].rstrip("]").replace(TEST_IDS[spec], "").strip("-")
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        results[name + (f" ({params})" if params else "")] = "FAILED" if failed else "skipped" if skipped else "passed"
    return results


def comparison_figure(rows: list[dict]):
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    colour = dict(zip([r["model"] for r in rows], qualitative.Plotly + qualitative.Dark24, strict=False))
    ours = [r for r in rows if "(" not in r["model"]]
    fig = make_subplots(
        rows=2,
        cols=2,
        subplot_titles=(
            "Mean self-cosine by space (T=512; residual-attn: whole sublayer)",
            "Causal null: cos_self vs earlier-position null (T=512)",
            "GQA: within- vs across-group excess (T=512)",
            "Perplexity change of s_par = 0, all layers (T=128)",
        ),
        vertical_spacing=0.16,
    )
    for r in ours:
        fig.add_bar(
            x=["value", "value-excl.-self", "residual-attn"],
            y=[r.get("self_cos_value"), r.get("self_cos_value-exclude-self"), r.get("self_cos_residual-attn_sublayer")],
            name=r["model"],
            legendgroup=r["model"],
            marker_color=colour[r["model"]],
            row=1,
            col=1,
        )
    for r in rows:
        if "cos_self" in r:
            paper = "(" in r["model"]
            fig.add_scatter(
                x=[r["cos_null"]],
                y=[r["cos_self"]],
                mode="markers",
                marker={"size": 12, "symbol": "diamond-open" if paper else "circle", "color": colour[r["model"]]},
                name=r["model"] if paper else f"{r['model']} (null)",
                legendgroup=r["model"],
                showlegend=paper,
                row=1,
                col=2,
            )
    fig.add_scatter(
        x=[0, 0.7],
        y=[0, 0.7],
        mode="lines",
        line={"dash": "dot", "color": "grey"},
        name="no excess (cos_self = null)",
        row=1,
        col=2,
    )
    grouped = [r for r in rows if r.get("within_excess") is not None]
    labels = [r["model"].replace(" (2611.13543)", " (paper)") for r in grouped]
    fig.add_bar(
        x=labels,
        y=[r["within_excess"] for r in grouped],
        name="within-group excess",
        marker_color="#b8860b",
        row=2,
        col=1,
    )
    fig.add_bar(
        x=labels,
        y=[r["across_excess"] for r in grouped],
        name="across-group excess",
        marker_color="#708090",
        row=2,
        col=1,
    )
    ppl = [r for r in rows if any(k.startswith("delta_ppl_s_par0_") for k in r)]
    for space, shade in zip(("value", "value-exclude-self", "residual-attn"), qualitative.Pastel2, strict=False):
        fig.add_bar(
            marker_color=shade,
            x=[r["model"].replace(" (2609.15975)", " (paper)") for r in ppl],
            y=[r.get(f"delta_ppl_s_par0_{space}") for r in ppl],
            name=f"ΔPPL, {space}",
            row=2,
            col=2,
        )
    fig.update_yaxes(title_text="mean self-cosine cos(m, r) over heads", row=1, col=1)
    fig.update_xaxes(title_text="cos_null (mean over heads, positions)", row=1, col=2)
    fig.update_yaxes(title_text="cos_self", row=1, col=2)
    fig.update_yaxes(title_text="excess = cos_self − cos_null", row=2, col=1)
    fig.update_yaxes(title_text="ΔPPL (edited − no-op), log", type="log", row=2, col=2)
    fig.update_layout(
        title="Real models offline vs the papers' closest models (open diamonds, '(paper)': published values)",
        barmode="group",
        height=850,
        width=1300,
        legend={"orientation": "h", "y": -0.12},
    )
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=DEFAULT_MODELS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-docs", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--short-seq-len", type=int, default=128)
    parser.add_argument("--skip-checks", action="store_true", help="do not run the real-weight checks")
    parser.add_argument("--out", default="benchmarks/out/real_models")
    parser.add_argument("--force", action="store_true", help="rerun models whose summary is already in --out")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process: one model
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one:
        run_one(args.one, out, args)
        return
    import pandas as pd

    from lens_parallel.plots.common import save_figure

    checks, rows = {}, []
    for spec in args.models:
        if not args.skip_checks:
            t0 = time.perf_counter()
            checks[spec] = run_checks(spec, out, args.threads)
            print(f"{spec}: real-weight checks {time.perf_counter() - t0:.1f} s")
        summary = out / f"{spec}.summary.json"
        if args.force or not summary.exists():
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            child = [a for a in sys.argv[1:] if a != "--force"]
            done = subprocess.run([sys.executable, __file__, *child, "--one", spec], env=env)
            if done.returncode != 0:
                print(f"{spec}: battery failed (exit status {done.returncode})")
                continue
        rows.append(json.loads(summary.read_text()))
    if checks:
        print("\nReal-weight checks (tests/test_real_weights.py):")
        print(pd.DataFrame(checks).fillna("-").to_string())
    table = pd.DataFrame(rows + PUBLISHED)
    table.to_csv(out / "real_models.csv", index=False)
    save_figure(comparison_figure(rows + PUBLISHED), out / "real_models")
    order = ("family", "layers", "heads", "self_cos", "cos_", "excess", "within", "across", "loss_noop", "delta_ppl")
    order += ("delta_loss", "sens", "joint", "wall_s", "peak_rss")
    rank = {c: next((i for i, p in enumerate(order) if c.startswith(p)), len(order)) for c in table.columns}
    shown = sorted((c for c in table.columns if c not in ("model", "gqa_note") and rank[c] < len(order)), key=rank.get)
    with pd.option_context("display.width", 250, "display.max_columns", 60, "display.max_colwidth", 40):
        print(f"\nStandard battery (T={args.seq_len} / {args.short_seq_len}, {args.n_docs} Austen blocks):")
        print(table.set_index("model")[shown].T.to_string(float_format=lambda v: f"{v:.4g}", na_rep="-"))
        seconds = [c for c in table.columns if c.startswith("seconds_")]
        print(table.set_index("model").loc[[r["model"] for r in rows], seconds].to_string())
    for r in rows:
        if "gqa_note" in r:
            print(r["gqa_note"])


if __name__ == "__main__":
    main()
