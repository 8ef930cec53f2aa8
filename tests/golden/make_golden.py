"""Writes the reference outputs in this folder: the analyses as computed by lens_parallel 0.6.0 (commit 756b4f7),
before they moved onto the one engine. ``tests/test_golden.py`` compares today's outputs with them, computed by the
same calls (written in today's API: compression's ``positions`` is now ``scored``, dominance's 16 rows of 16 tokens
per forward are now ``tokens_per_forward=256``). Rerunning this script on later code overwrites the reference with
that code's output, so only rerun it on purpose.

    python tests/golden/make_golden.py
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pandas as pd

import lens_parallel as lp

SPACES_060 = ("value", "value-exclude-self", "residual-attn", "residual-mlp", "residual-block")
SUBLAYERS_060 = ("attn", "mlp")
"""Compression's sublayers in 0.6.0 (0.12.0 adds the whole block, which the reference does not have)."""
"""``space="all"`` of 0.6.0, which wrote the reference (value-merged came in 0.11.0)."""

HERE = Path(__file__).resolve().parent
LINEAR_060 = ("value", "value-exclude-self", "residual-attn")
"""What 0.6.0 skipped on toy-qwen3.5's linear-attention layers (0.17.0 covers them): the head-level spaces, the null
models; residual-mlp and residual-block covered every layer."""


def as_060(df: pd.DataFrame) -> pd.DataFrame:
    """A table of today's in 0.6.0's shape: without the rows of what 0.6.0 skipped on linear-attention layers
    (:data:`LINEAR_060`) and without the ``layer_type`` column it did not have."""
    if "layer_type" not in df:
        return df
    skipped = (df.layer_type == "linear") & (df.space.isin(LINEAR_060) if "space" in df else True)
    return df[~skipped].drop(columns="layer_type").reset_index(drop=True)


def blocks(model, n_docs: int = 3, seq_len: int = 16):
    return lp.token_blocks(model, "wikipedia-en", n_docs=n_docs, seq_len=seq_len, seed=1)


def frames() -> dict[str, pd.DataFrame]:
    out: dict[str, pd.DataFrame] = {}
    for spec in ("toy-gpt2", "toy-pythia", "toy-qwen2", "toy-qwen3.5", "toy-llama"):
        model = lp.load_model(spec)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[f"decompose_{spec}"] = as_060(
                lp.decompose(model, blocks(model), space=SPACES_060, progress=False).to_dataframe()
            )
        null = lp.causal_null(model, blocks(model, n_docs=4), n_resamples=200)
        out[f"null_sampled_{spec}"] = as_060(null.to_dataframe())
        exact = lp.causal_null(model, blocks(model, n_docs=4), null="exact", n_resamples=200)
        out[f"null_exact_{spec}"] = as_060(exact.to_dataframe())
    model = lp.load_model("toy-qwen2")
    out["gqa_toy-qwen2"] = lp.gqa_alignment(model, blocks(model, n_docs=4), n_resamples=200).to_dataframe()
    for spec in ("toy-gpt2", "toy-qwen2"):
        model = lp.load_model(spec)
        for positions in ("last", "all"):
            result = lp.compression_error(model, blocks(model), method=["int8", "wanda-2:4"], scored=positions)
            tidy, methods = result.to_dataframe(), result.method_table()
            out[f"compression_{positions}_{spec}"] = tidy[tidy.sublayer.isin(SUBLAYERS_060)].reset_index(drop=True)
            out[f"compression_methods_{positions}_{spec}"] = methods[methods.sublayer.isin(SUBLAYERS_060)].reset_index(
                drop=True
            )
        out[f"attribution_{spec}"] = lp.head_attribution(model, blocks(model), n_resamples=200).to_dataframe()
        out[f"sensitivity_{spec}"] = lp.head_sensitivity(
            model, blocks(model), n_resamples=200, n_permutations=200, progress=False
        ).to_dataframe()
    return out


def arrays() -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for spec, scales in (("toy-gpt2", ("qkv",)), ("toy-qwen3.5", ("qkv", "js")), ("toy-qwen2", ("qkv", "js"))):
        model = lp.load_model(spec)
        result = lp.head_dominance(
            model,
            blocks(model, n_docs=2),
            query_positions=slice(4, 12),
            mask_scales=scales,
            batch_size=1,
            tokens_per_forward=16 * 16,
            progress=False,
        )
        for field in ("qkv", "js", "rel_q", "rel_k", "rel_v", "joint_qkv", "joint_js"):
            out[f"dominance_{spec}_{field}"] = getattr(result, field)
    model = lp.load_model("toy-qwen2")
    explorer = lp.explore(model, blocks(model, n_docs=2))
    for space, layer, head, s_par, s_perp, all_heads in (
        ("value", 1, 2, 0.0, 1.0, False),
        ("value-exclude-self", 2, 0, 1.5, 0.5, False),
        ("residual-attn", 0, 3, 0.0, 1.0, False),
        ("value", 2, 1, 0.5, 1.0, True),
    ):
        view = explorer.update(space=space, layer=layer, head=head, s_par=s_par, s_perp=s_perp, all_heads=all_heads)
        out[f"explore_{space}_L{layer}H{head}_s{s_par}_{s_perp}_all{all_heads}"] = view.loss_change
    return out


def main() -> None:
    for name, df in frames().items():
        df.to_csv(HERE / f"{name}.csv", index=False, float_format="%.17g")
    np.savez_compressed(HERE / "arrays.npz", **arrays())


if __name__ == "__main__":
    main()
