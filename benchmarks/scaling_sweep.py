"""Component-scaling sweep on the real model, all layers edited.

    python benchmarks/scaling_sweep.py [--model smollm2-135m] [--n-docs 16] [--seq-len 128] [--out DIR]
                                       [--reference OLD/scaling_sweep.csv] [--part sweep|positions|all]

s_par in {-1, -0.5, 0, 0.5, 1.5, 2, 3} (s_perp = 1) and s_perp in {0, 0.25, 0.5, 0.75, 1.5} (s_par = 1) for the
value-exclude-self, residual-attn and residual-mlp spaces, on bundled English text (wikipedia-en). Writes
``scaling_sweep.csv``, ``scaling_sweep.json`` and ``scaling_sweep.html`` to ``--out`` and prints the table and the
cost of the sweep in units of one bare forward over the same tokens (the goal: about one forward per setting).
``--reference`` compares every setting's losses with a CSV an earlier version wrote (same numbers?).
``--part positions``: value and value-exclude-self at s_par in {0, 0.5, 1.5}, every position edited against the
first token left alone (``positions="after-first"``, the sanity-checks paper's frozen protocol): at t = 0, o_0 = v_0,
so value-space removal deletes the boundary token's whole output while exclude-self leaves it; the table shows how
much of the value / exclude-self gap that token carries.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

from lens_parallel import document_losses, load_model, scale_sweep, token_blocks
from lens_parallel.analyses.scaling import DEFAULT_S_PAR, DEFAULT_S_PERP

SPACES = ("value-exclude-self", "residual-attn", "residual-mlp")


def sweep(model, blocks, args, out: Path) -> None:
    document_losses(model, blocks, batch_size=args.batch_size)  # warm-up
    t0 = time.perf_counter()
    document_losses(model, blocks, batch_size=args.batch_size)
    bare = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = scale_sweep(model, blocks, space=SPACES, batch_size=args.batch_size, progress=True)
    elapsed = time.perf_counter() - t0

    df = result.to_dataframe()
    df.to_csv(out / "scaling_sweep.csv", index=False)
    result.save(out / "scaling_sweep")
    result.figure().write_html(out / "scaling_sweep.html", include_plotlyjs=True)
    n_settings = len(SPACES) * (len(DEFAULT_S_PAR) + len(DEFAULT_S_PERP))
    forwards = n_settings + len(SPACES)  # settings + one matched no-op per space
    cols = ["space", "vary", "s_par", "s_perp", "delta_loss", "delta_loss_lo", "delta_loss_hi", "delta_ppl"]
    print(f"{args.model}, {args.n_docs} x {args.seq_len} tokens (wikipedia-en), all layers edited")
    print(f"no-op loss {df.loss_noop.iloc[0]:.4f} nats/token, perplexity {df.ppl_noop.iloc[0]:.2f}")
    print(df[cols].to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    print(
        f"cost: sweep {elapsed:.1f} s for {n_settings} settings + {len(SPACES)} no-ops = {forwards} forwards; "
        f"bare forward {bare:.2f} s; sweep / ({forwards} x bare) = {elapsed / (forwards * bare):.2f}"
    )
    if args.reference:
        ref = pd.read_csv(args.reference)
        diff = (df[["loss_noop", "loss_edited", "delta_loss"]] - ref[["loss_noop", "loss_edited", "delta_loss"]]).abs()
        print(f"max |this run - {args.reference}| over losses and delta losses: {diff.to_numpy().max():.3g} nats/token")
    print(f"wrote {out / 'scaling_sweep.csv'}, {out / 'scaling_sweep.html'}")


def positions(model, blocks, args, out: Path) -> None:
    frames = []
    for where in ("all", "after-first"):
        result = scale_sweep(
            model,
            blocks,
            space=("value", "value-exclude-self"),
            s_par=[0.0, 0.5, 1.5],
            s_perp=[],
            positions=where,
            batch_size=args.batch_size,
            progress=True,
        )
        frames.append(result.to_dataframe().assign(positions=where))
    df = pd.concat(frames)
    df.to_csv(out / "scaling_positions.csv", index=False)
    table = df.pivot_table(index=["space", "s_par"], columns="positions", values="delta_loss").reset_index()
    table["boundary token"] = table["all"] - table["after-first"]
    print(f"{args.model}, {args.n_docs} x {args.seq_len} tokens: delta loss (nats/token), all layers edited")
    print(table.to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    gap = table.pivot(index="s_par", columns="space", values=["all", "after-first"])
    for s_par in gap.index:
        every = gap.loc[s_par, ("all", "value")] - gap.loc[s_par, ("all", "value-exclude-self")]
        after = gap.loc[s_par, ("after-first", "value")] - gap.loc[s_par, ("after-first", "value-exclude-self")]
        print(f"s_par={s_par}: value - exclude-self gap {every:.4f} (all positions), {after:.4f} (after the first)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--n-docs", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/out/scaling_sweep")
    parser.add_argument("--reference", default=None, help="an earlier run's scaling_sweep.csv to compare with")
    parser.add_argument("--part", choices=["sweep", "positions", "all"], default="all")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model)
    blocks = token_blocks(model, "wikipedia-en", n_docs=args.n_docs, seq_len=args.seq_len)
    if args.part in ("sweep", "all"):
        sweep(model, blocks, args, out)
    if args.part in ("positions", "all"):
        positions(model, blocks, args, out)


if __name__ == "__main__":
    main()
