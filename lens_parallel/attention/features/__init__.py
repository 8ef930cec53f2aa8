"""The features of an attention layer, each one object that recognises itself and applies itself
(:mod:`lens_parallel.attention.features.base`)."""

from __future__ import annotations

from lens_parallel.attention.features.alibi import Alibi
from lens_parallel.attention.features.base import Feature, Source
from lens_parallel.attention.features.gates import GATES, AttentionGate, QueryGate
from lens_parallel.attention.features.qk_norm import QKNorm
from lens_parallel.attention.features.sinks import Sinks
from lens_parallel.attention.features.softcap import SoftCap
from lens_parallel.attention.features.window import SlidingWindow

FEATURES: tuple[type[Feature], ...] = (SlidingWindow, SoftCap, Alibi, Sinks, QKNorm, AttentionGate)
"""Every attention feature, in the support matrix's order (a layer has at most one of each)."""

__all__ = ["FEATURES", "GATES", "Alibi", "AttentionGate", "Feature", "QKNorm", "QueryGate", "Sinks", "SlidingWindow"]
__all__ += ["SoftCap", "Source"]
