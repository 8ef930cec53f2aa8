"""Directional decomposition of compression error on the real model.

    python benchmarks/compression_error.py [--model smollm2-135m] [--positions last|all] [--out DIR]

12 fixed prompts (the first 12 eligible wikipedia-en documents in the seeded order, 128 tokens each); Wanda is
calibrated on 16 blocks of a different text (austen). Methods: int8, int4 with groups of 128 (576-wide inputs end in
a group of 64), magnitude 50%, Wanda 50%, Wanda 2:4, Wanda 4:8. Prints, per method and sublayer, the mean over
layers of |e_perp|/|delta| and |e_par|/|delta|, the share of squared error that is perpendicular, the correlation
across layers of |e| with |e_perp|, and the end-to-end delta loss (nats/token, 95% bootstrap CI over prompts);
writes the per-layer table (CSV), the summary and the figures (HTML, PNG when kaleido can render).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

from lens_parallel import load_model, token_blocks
from lens_parallel.analyses.compression import compression_error
from lens_parallel.plots import save_figure

METHODS = ("int8", "int4-g128", "magnitude-50%", "wanda-50%", "wanda-2:4", "wanda-4:8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--scored", choices=("last", "all"), default="last")
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/out/compression_error")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model)
    prompts = token_blocks(model, "wikipedia-en", n_docs=12, seq_len=128)
    calibration = token_blocks(model, "austen", n_docs=16, seq_len=128)
    t0 = time.perf_counter()
    result = compression_error(model, prompts, method=args.methods, scored=args.scored, calibration=calibration)
    elapsed = time.perf_counter() - t0
    result.save(out / "compression_error")
    result.layer_table().to_csv(out / "per_layer.csv", index=False)
    summary = result.method_table()
    summary.to_csv(out / "summary.csv", index=False)
    for sub in ("attn", "mlp"):
        save_figure(result.figure(sublayer=sub), out / f"compression_{sub}")
    print(
        f"{args.model}: 12 prompts x 128 tokens, {args.scored} positions, dense loss {result.loss_dense:.4f} "
        f"nats/token, {elapsed:.0f} s"
    )
    with pd.option_context("display.width", 200, "display.float_format", "{:.4f}".format):
        print(summary.to_string(index=False))


if __name__ == "__main__":
    main()
