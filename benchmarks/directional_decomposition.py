"""The directional-decomposition paper's frozen-model protocol (arXiv 2609.15975) on real models offline, beside the
paper's Qwen3 numbers and beside today's defaults on the same model.

    python benchmarks/directional_decomposition.py [--models smollm2-135m gemma-3-270m qwen2.5-coder-1.5b]
        [--full-grid smollm2-135m] [--window 256] [--n-texts 4] [--n-c4 8]
        [--sensitivity-layers smollm2-135m=1,10,19,28 gemma-3-270m=1,6,11,16 qwen2.5-coder-1.5b=14,21]
        [--threads 2] [--out benchmarks/out/directional]

Per model:

- **Fig. 3** (component scaling): ``scale_sweep(protocol="directional-decomposition")``: lm-eval's word perplexity
  of whole texts in rolling windows of ``--window`` tokens, layer 0 never edited, the reference clamp, the scale-1
  canary against the unedited model; the paper's full grids for the ``--full-grid`` models, s_par = 0 alone in the
  three spaces for the others. Texts: the first ``--n-texts`` documents of the bundled ``wikipedia-en``, the offline
  stand-in for WikiText-2's 62 test documents (``--texts wikitext`` online). Beside it, **today's defaults** on the
  same model: token-level loss on blocks of ``--window`` tokens of the same corpus, every layer edited, positions
  with a tiny reference excluded.
- **Fig. 7** (head sensitivity): value s_par = 0 on each head alone (5,000 bootstrap resamples, 10,000
  token-weighted sign flips, seed 2026 + the model's index, as the authors), the four head statistics, their
  Pearson / Spearman correlations with signed Δloss across heads and our split-half ceiling; BH per model and across
  the models compared. Texts: ``sample_texts("wikipedia-en", paragraphs=True)`` (the paper's C4 filter on the
  bundled paragraphs: the offline stand-in for C4 validation), ``--n-c4`` of them, each whole; on the layers of
  ``--sensitivity-layers`` (the paper: every layer; every layer of smollm2-135m takes about 1.5 h on 2 threads here).

Every finished part is written to ``--out`` at once (result files, and the sweeps' stores), and a rerun skips what
is there: a killed run resumes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch

import lens_parallel as lp
from lens_parallel.downstream.perplexity import text_windows

PAPER_FIG3 = {
    "model": "Qwen3-1.7B",
    "ppl_noop": 22.04,
    "value-exclude-self": 0.46,
    "residual-attn": 21.0,
    "residual-mlp": 22.3,
}
"""The paper's Qwen3-1.7B WikiText-2 word perplexity: the no-op, and its change at s_par = 0 in each space."""
PAPER_FIG7 = {"Qwen3-0.6B": 0.52, "Qwen3-8B": 0.27}
"""The paper's Pearson r of head ratio against single-head sensitivity, at its two ends."""
SPACES = ("value-exclude-self", "residual-attn", "residual-mlp")


def cached(path: Path, cls: type, make):
    """The result saved at ``path``, else ``make()`` saved there first."""
    if path.with_suffix(".json").exists():
        return cls.load(path)
    t0 = time.perf_counter()
    result = make()
    result.save(path)
    print(f"  [{path.name}: {time.perf_counter() - t0:.0f} s]", flush=True)
    return result


def fig3(model, spec: str, args: argparse.Namespace) -> pd.DataFrame:
    out = args.out / spec
    texts = text_windows(model, "wikipedia-en", window=args.window, n_docs=args.n_texts)
    grid = {} if spec in args.full_grid else {"s_par": (0.0,), "s_perp": (), "residual_s_perp": ()}
    protocol = cached(
        out / "fig3_protocol",
        lp.ScalingResult,
        lambda: lp.scale_sweep(
            model, texts, protocol="directional-decomposition", store=str(out / "fig3_store.jsonl"), **grid
        ),
    )
    blocks = lp.token_blocks(model, "wikipedia-en", n_docs=2 * args.n_texts, seq_len=args.window)
    default = cached(
        out / "fig3_default",
        lp.ScalingResult,
        lambda: lp.scale_sweep(model, blocks, space=SPACES, s_par=(0.0,), s_perp=()),
    )
    rows = []
    for name, result in (
        ("protocol (word PPL, layer 0 kept, clamp)", protocol),
        ("today's defaults (token PPL)", default),
    ):
        df = result.to_dataframe()
        at0 = df[(df.vary == "s_par") & (df.s_par == 0.0)].set_index("space")
        rows.append(
            {
                "model": spec,
                "run": name,
                "ppl_noop": float(df.ppl_noop.iloc[0]),
                **{f"dPPL[{sp}]": float(at0.loc[sp, "delta_ppl"]) for sp in SPACES},
                "units": int(df.iloc[0][f"n_{result.unit}s"]),
            }
        )
    if spec in args.full_grid:
        df = protocol.to_dataframe()
        table = df.pivot_table(index=["vary", "s_par", "s_perp"], columns="space", values="delta_ppl", sort=False)
        print(
            f"\n{spec}: the paper's grid, Δ word perplexity vs the matched no-op ({protocol.to_dataframe().n_docs[0]} "
            f"texts, window {args.window})"
        )
        print(table.round(3).to_string())
        protocol.figure().write_image(out / "fig3.png")
    return pd.DataFrame(rows)


def fig7(model, spec: str, index: int, args: argparse.Namespace) -> tuple[lp.SensitivityResult, lp.HeadStatistics]:
    out = args.out / spec
    sample = lp.sample_texts("wikipedia-en", lp.TextSelection(max_texts=args.n_c4), paragraphs=True)
    docs = lp.whole_documents(model, list(sample.texts), n_docs=len(sample.texts))
    layers = args.layers.get(spec)
    kw = {} if layers is None else {"layers": layers}
    sens = cached(
        out / "fig7_sensitivity",
        lp.SensitivityResult,
        lambda: lp.head_sensitivity(
            model,
            docs,
            protocol="directional-decomposition",
            seed=2026 + index,
            store=str(out / "fig7_store.jsonl"),
            **kw,
        ),
    )
    stats = cached(
        out / "fig7_statistics",
        lp.HeadStatistics,
        lambda: lp.head_statistics(model, docs, protocol="directional-decomposition", **kw),
    )
    (out / "fig7_texts.json").write_text(json.dumps(sample.describe(), indent=1))
    return sens, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma-3-270m", "qwen2.5-coder-1.5b"])
    parser.add_argument("--full-grid", nargs="*", default=["smollm2-135m"], help="models swept on the paper's grids")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--n-texts", type=int, default=4)
    parser.add_argument("--n-c4", type=int, default=8)
    parser.add_argument(
        "--sensitivity-layers",
        nargs="*",
        default=["smollm2-135m=1,10,19,28", "gemma-3-270m=1,6,11,16", "qwen2.5-coder-1.5b=14,21"],
        help="MODEL=L1,L2,...: the layers of Fig. 7 (default for other models: every layer)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/directional"))
    args = parser.parse_args()
    args.layers = {k: tuple(int(x) for x in v.split(",")) for k, v in (s.split("=") for s in args.sensitivity_layers)}
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    scaling, pairs = [], {}
    for i, spec in enumerate(args.models):
        print(f"== {spec}", flush=True)
        model = lp.load_model(spec)
        (args.out / spec).mkdir(parents=True, exist_ok=True)
        scaling.append(fig3(model, spec, args))
        pairs[spec] = fig7(model, spec, i, args)
        del model
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(f"\n== Fig. 3: word perplexity at s_par = 0 (offline stand-in texts; {args.threads} threads)")
        print(pd.concat(scaling, ignore_index=True).round(3).to_string(index=False))
        paper = PAPER_FIG3
        print(
            f"   the paper, {paper['model']} on WikiText-2: no-op {paper['ppl_noop']}, "
            + ", ".join(f"dPPL[{sp}] +{paper[sp]}" for sp in SPACES)
        )
        print("\n== Fig. 7: signed single-head Δloss against the head statistics across heads")
        corr = lp.sensitivity_correlations(pairs)
        cols = [
            "model",
            "statistic",
            "pearson_r",
            "pearson_p",
            "spearman_rho",
            "n_heads",
            "r_stat_split_half",
            "r_delta_split_half",
            "rho_max_split_half",
        ]
        print(corr[cols].round(3).to_string(index=False))
        print(
            "   the paper: Pearson r of head ratio vs sensitivity "
            + ", ".join(f"{k} {v}" for k, v in PAPER_FIG7.items())
            + " (split-half columns: our addition)"
        )
        heads = lp.compare_sensitivity({k: s for k, (s, _) in pairs.items()})
        counts = heads.groupby("model")[["class_model", "class_global"]].agg(
            lambda c: int((c != "not significant").sum())
        )
        print("\n   single heads with q <= 0.05 (BH per model, and across the models compared):")
        print(counts.assign(n_heads=heads.groupby("model").size()).to_string())
        lp.head_ratio_figure(pairs).write_image(args.out / "fig7_head_ratio.png")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
