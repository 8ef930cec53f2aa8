"""Half precision end to end: each headline statistic in bfloat16 (or float16) beside float32, on one model.

    python benchmarks/precision.py [--model smollm2-135m] [--dtype bfloat16] [--n-docs 8] [--seq-len 128]
                                   [--threads 2] [--out benchmarks/out/precision]

Loads the model twice (float32, then ``--dtype``: the weights rounded once) and runs on the same documents:
decomposition (cos_self per layer and head, value space), the causal null (cos_self, cos_null and the excess per
head), head sensitivity on every layer (delta loss per head ablated alone, zero ablation) and the attribution
screen (first-order estimate and dloss/ds_par per head). Reductions run in float64 in both; only the model's own
arithmetic differs. Prints, per statistic, the largest and the median absolute difference and the spread of the
float32 values (their standard deviation over heads) for scale, and the Spearman correlation of the two over heads
(does half precision reorder the heads?), and writes them as a CSV. The tolerances that
``tests/test_smollm2.py`` asserts come from this table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.stats as sps
import torch

from lens_parallel import causal_null, decompose, head_attribution, head_sensitivity, load_model, token_blocks


def headline(model, blocks, batch_size: int) -> dict[str, np.ndarray]:
    """The statistics compared, each an array over (layer, head)."""
    kw = {"batch_size": batch_size, "progress": False}
    table = decompose(model, blocks, space="value", **kw).table("value")
    null = causal_null(model, blocks, **kw)
    sens = head_sensitivity(model, blocks, ablation="zero", n_resamples=200, n_permutations=200, **kw)
    attr = head_attribution(model, blocks, ablation="parallel-value", **kw)
    return {
        "decompose cos_self": table.self_cos,
        "null cos_self": null.cos_self.mean(0),
        "null cos_null": null.cos_null.mean(0),
        "null excess": null.excess,
        "sensitivity delta loss (nats)": sens.head_delta,
        "attribution estimate (nats)": attr.estimate.sum(0) / attr.n_tokens.sum(),
        "attribution dloss/ds_par (nats)": attr.d_s_par[0].sum(0) / attr.n_tokens.sum(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--n-docs", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/out/precision")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stats, times = {}, {}
    for dtype in ("float32", args.dtype):
        model = load_model(args.model, dtype=getattr(torch, dtype))
        blocks = token_blocks(model, "wikipedia-en", n_docs=args.n_docs, seq_len=args.seq_len, seed=0)
        t0 = time.perf_counter()
        stats[dtype] = headline(model, blocks, batch_size=args.n_docs)
        times[dtype] = time.perf_counter() - t0
        del model
    rows = []
    for name, ref in stats["float32"].items():
        diff = np.abs(stats[args.dtype][name] - ref)
        rows.append(
            {
                "statistic": name,
                "max |diff|": diff.max(),
                "median |diff|": np.median(diff),
                "float32 spread (sd)": ref.std(),
                "max |diff| / spread": diff.max() / ref.std(),
                "spearman": sps.spearmanr(ref.ravel(), stats[args.dtype][name].ravel()).statistic,
            }
        )
    table = pd.DataFrame(rows)
    table.to_csv(out / f"{args.model}-{args.dtype}.csv", index=False)
    print(f"{args.model}, {args.n_docs} x {args.seq_len} tokens, {args.threads} threads: {args.dtype} vs float32")
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    print(f"wall time: float32 {times['float32']:.1f} s, {args.dtype} {times[args.dtype]:.1f} s")


if __name__ == "__main__":
    main()
