"""Named protocols: a published study's settings, saved once, used by name (``protocol="..."`` on any analysis it
covers, ``--protocol`` on the command line, ``lens-parallel protocols`` lists them).

A protocol (:class:`NamedProtocol`) holds one settings object per analysis it covers, and how
its documents are made (the command line's defaults for ``--texts``, ``--n-docs``, ``--seq-len``); keyword
shortcuts given beside it change single fields. Today's defaults are the package's own; each protocol says here
where the study differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from lens_parallel.analyses.compression import CompressionSettings
from lens_parallel.analyses.dominance import DominanceSettings
from lens_parallel.analyses.head_statistics import HeadStatisticsSettings
from lens_parallel.analyses.nulls import NullSettings
from lens_parallel.analyses.reliability import SanitySettings
from lens_parallel.analyses.scaling import ScaleSettings
from lens_parallel.analyses.sensitivity import SensitivitySettings
from lens_parallel.errors import LensParallelError
from lens_parallel.training.factorial import Design
from lens_parallel.validate import did_you_mean

S = TypeVar("S")


@dataclass(frozen=True)
class NamedProtocol:
    """A published protocol as saved settings: the settings object of each analysis it covers (``settings``), how
    its documents are made (``documents``: plain data, see the guides; empty: the caller's), what it reproduces
    (``source``), and a one-line ``description``. Listed by ``lens-parallel protocols``."""

    name: str
    description: str
    source: str
    settings: tuple[Any, ...] = ()
    documents: dict[str, Any] = field(default_factory=dict)

    def settings_for(self, cls: type[S]) -> S:
        for s in self.settings:
            if type(s) is cls:
                return s
        covered = ", ".join(type(s).__name__ for s in self.settings) or "no analysis settings"
        raise LensParallelError(f"protocol {self.name!r} has no {cls.__name__}; it covers: {covered}")


SANITY_CHECKS = NamedProtocol(
    name="sanity-checks",
    description="the frozen-model sanity checks: sampled causal null (first token excluded), GQA groups, "
    "split-half reliability of single-head parallel-value removal with the first token untouched, "
    "64 documents x 128 tokens per half",
    source="the sanity-checks paper, arXiv 2611.13543 (Checks 1 and 3)",
    settings=(
        SanitySettings(ablation="parallel-value", positions="after-first", null="sampled"),
        NullSettings(null="sampled"),
        SensitivitySettings(ablation="parallel-value", positions="after-first"),
    ),
    documents={"texts": "wikipedia-en", "n_docs": 128, "seq_len": 128},
)
DOMINANCE_STUDY = NamedProtocol(
    name="dominance-study",
    description="next-layer head dominance on four 32-token texts (two English, two Chinese; "
    "lens_parallel.analyses.dominance.study_texts), receiving query tokens 7..31, halves ranked on Q/K/V",
    source="the Qwen3.5 head-dominance study (seed 003)",
    settings=(DominanceSettings(query_start=7, query_stop=32, mask_scales=("qkv",)),),
    documents={"texts": "study", "seq_len": 32},
)
XSA_CONTROLS = NamedProtocol(
    name="xsa-controls",
    description="the paired factorial of Check 2: baseline, XSA (gated, learned from 0) and RANDOM (the same gated "
    "edit along a fixed random direction), 8 seeds, primary RANDOM - baseline, XSA - baseline secondary, the "
    "contrast XSA - RANDOM; the 50.9M model at 399,900,672 tokens per run",
    source="the sanity-checks paper, arXiv 2611.13543 (Check 2)",
    settings=(
        Design(
            preset="xsa-controls-51m",
            arms=("baseline", "xsa-gated", "random-direction-gated"),
            seeds=(7, 42, 99, 512, 1337, 2024, 8191, 31337),
            primary="random-direction-gated",
            secondary=("xsa-gated",),
            contrasts=(("xsa-gated", "random-direction-gated"),),
        ),
    ),
)

DIRECTIONAL_DECOMPOSITION = NamedProtocol(
    name="directional-decomposition",
    description="the directional-decomposition paper's component scaling (its Fig. 3): exclude-self value space, "
    "residual attention and residual MLP; every layer but the first; s_par in {-1, -0.5, 0, 0.25, 0.5, 0.75, 1, "
    "1.5, 2, 2.5, 3}, s_perp 0..2 (value) and 0..1.5 (residual) step 0.25; |r|^2 clamped at 1e-6; the matched "
    "no-op checked against the unedited model to 1e-9; lm-eval's word perplexity of whole texts (TextWindows; "
    "the paper: WikiText-2's 62 test documents, --texts wikitext online); head sensitivity (Fig. 7) of value "
    "s_par = 0 with 5,000 bootstrap resamples and 10,000 token-weighted sign flips, seed 2026 (head_statistics, "
    "sensitivity_correlations and compare_sensitivity give its statistics and BH across models; sample_texts "
    "its C4 text selection); compression error (Fig. 6) at each prompt's last token, one layer swapped at a "
    "time (mode local; global beside), Wanda layer by layer at 50%, 4:8 and 2:4 and 4-bit quantization "
    "(compression_prompts: 12 prompts, no boundary token; compressed= for the AWQ checkpoint)",
    source="the directional-decomposition paper, arXiv 2609.15975 (Fig. 3; code: Shwai-He/Transformer-Geometry)",
    settings=(
        ScaleSettings(
            space=("value-exclude-self", "residual-attn", "residual-mlp"),
            s_par=(-1.0, -0.5, 0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0),
            s_perp=tuple(0.25 * i for i in range(9)),
            residual_s_perp=tuple(0.25 * i for i in range(7)),
            skip_first_layers=1,
            guard="clamp",
            eps=1e-3,
            unedited_check=True,
            metric="word_perplexity",
        ),
        SensitivitySettings(
            ablation="parallel-value", n_resamples=5000, n_permutations=10000, seed=2026, sign_flip_weights="tokens"
        ),
        HeadStatisticsSettings(ablation="parallel-value", positions="all", eps=1e-3),
        CompressionSettings(method=("int4-g128", "wanda-seq-50%", "wanda-seq-4:8", "wanda-seq-2:4"), scored="last"),
    ),
)


PROTOCOLS: dict[str, NamedProtocol] = {
    p.name: p for p in (SANITY_CHECKS, DOMINANCE_STUDY, XSA_CONTROLS, DIRECTIONAL_DECOMPOSITION)
}
"""Every named protocol by name: defined here, whole, whichever module imports it first."""


def protocol_settings(name: str, cls: type[S]) -> S:
    """The settings object of ``cls`` that protocol ``name`` holds; an unknown name is one line naming the closest
    known one, a protocol that does not cover ``cls`` one line naming what it covers."""
    if name not in PROTOCOLS:
        raise LensParallelError(
            f"unknown protocol {name!r}{did_you_mean(name, PROTOCOLS)}; known: {', '.join(PROTOCOLS)}"
        )
    return PROTOCOLS[name].settings_for(cls)


def designs() -> dict[str, Design]:
    """Every protocol that is a training design (:class:`~lens_parallel.training.factorial.Design`), by name."""
    return {name: s for name, p in PROTOCOLS.items() for s in p.settings if isinstance(s, Design)}
