"""Directional decomposition of compression error on real models: round-to-nearest vs torchao vs Wanda, local vs
global.

    python benchmarks/compression_error.py [--models smollm2-135m qwen2.5-coder-1.5b] [--modes local global]
                                           [--methods ...] [--calibration-tokens 128] [--out DIR]

The directional-decomposition paper's prompt protocol (``compression_prompts``: 12 short prompts, no boundary
token, each scored at its own last token). Methods: int8 and int4-g64 (symmetric round-to-nearest, ours),
torchao-int8 (torchao's Int8WeightOnlyConfig) and torchao-intx4-g64 (its IntxWeightOnlyConfig, int4 groups of 64:
the CPU path; groups of 64 because smollm2's 576-wide inputs are not a multiple of 128, which torchao requires; the
paper's AWQ checkpoint is CUDA-only), torchao-awq-int8 (torchao's AWQ over Int8WeightOnlyConfig, the AWQ that runs
on a CPU), wanda-50% (input norms from one dense forward) and
wanda-seq-50% / wanda-seq-2:4 (layer by layer, as the Wanda code and the paper's checkpoints). Every Wanda variant
and AWQ is calibrated on the same 16 blocks of ``--calibration-tokens`` tokens of austen (the Wanda paper: 128 x 2048
tokens of C4; shorter here to fit a CPU), apart from the prompts. ``mode=local``: each compressed block fed the
dense input (the paper's one-layer swap); ``global``: every layer compressed, errors compound.

Prints, per model, mode, method and sublayer (attn, mlp, block), the mean over layers of |e_perp|/|delta| and
|e_par|/|delta|, the share of squared error that is perpendicular, the mean drift of the blocks' inputs and the
end-to-end delta loss, beside the paper's Qwen3-4B shape. Each (model, mode) is written as it finishes and read back
on a rerun with the same methods (resumable); the per-method sweep store makes a killed run, or one with methods
added, compute only the methods it does not hold.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from lens_parallel import load_model, token_blocks
from lens_parallel.analyses.compression import CompressionResult, compression_error, compression_prompts
from lens_parallel.compression import method_name
from lens_parallel.plots import save_figure

METHODS = (
    "int8",
    "int4-g64",
    "torchao-int8",
    "torchao-intx4-g64",
    "torchao-awq-int8",
    "wanda-50%",
    "wanda-seq-50%",
    "wanda-seq-2:4",
)
PAPER = (
    "the paper, Qwen3-4B (AWQ 4-bit checkpoint, Wanda 50% / 4:8 / 2:4, dense fp32 vs compressed fp16, 12 prompts, "
    "last token): the perpendicular error dominates the parallel one at every layer and in every component "
    "(attn_out, mlp_out, block_out), first and last layers left out of its Fig. 6"
)


def run(model_spec: str, mode: str, methods: list[str], calibration_tokens: int, out: Path) -> CompressionResult:
    folder = out / f"{model_spec}-{mode}"
    if (folder / "result.json").is_file():
        saved = CompressionResult.load(folder / "result")
        if saved.methods == tuple(method_name(m) for m in methods):
            return saved
    folder.mkdir(parents=True, exist_ok=True)
    model = load_model(model_spec)
    prompts = compression_prompts(model)
    calibration = token_blocks(model, "austen", n_docs=16, seq_len=calibration_tokens, seed=0)
    t0 = time.perf_counter()
    result = compression_error(
        model, prompts, method=methods, mode=mode, calibration=calibration, store=folder / "store.jsonl"
    )
    print(f"{model_spec} {mode}: {time.perf_counter() - t0:.0f} s", flush=True)
    for sub in result.sublayers:
        save_figure(result.figure(sublayer=sub, drop_ends=True), folder / f"compression_{sub}")
    result.layer_table().to_csv(folder / "per_layer.csv", index=False)
    result.save(folder / "result")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-1.5b"])
    parser.add_argument("--modes", nargs="+", choices=("local", "global"), default=["local", "global"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--calibration-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/out/compression_error")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    rows = []
    for spec in args.models:
        for mode in args.modes:
            result = run(spec, mode, args.methods, args.calibration_tokens, out)
            table = result.method_table()
            drift = dict(zip(result.methods, np.nanmean(result.input_drift, axis=(1, 2)), strict=True))
            table.insert(0, "mode", mode)
            table.insert(0, "model", spec)
            table["input_drift"] = table["method"].map(drift)
            rows.append(table)
            pd.concat(rows).to_csv(out / "summary.csv", index=False)  # as it goes
    summary = pd.concat(rows, ignore_index=True)
    columns = ["model", "mode", "method", "sublayer", "perp_mean", "par_mean", "perp_share", "input_drift"]
    columns += ["delta_loss"]
    with pd.option_context("display.width", 250, "display.max_rows", 500, "display.float_format", "{:.4f}".format):
        print(summary[columns].to_string(index=False))
    print(f"   {PAPER}")


if __name__ == "__main__":
    main()
