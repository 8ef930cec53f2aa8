"""Sliding-window attention: a query sees the keys at most ``size`` positions back."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from lens_parallel.attention.features.base import Feature, Source


@dataclasses.dataclass(frozen=True)
class SlidingWindow(Feature):
    """A sliding window of ``size`` keys, recognised from the module's ``sliding_window`` (none on a layer the
    module marks full, ``is_sliding`` false), else the config's, else a local layer of a config's
    ``attention_layers`` (GPT-Neo's ``window_size``); handed to the attention interface as ``sliding_window``.

    The window itself is in the mask Hugging Face builds, which every path reads; lens_parallel's kernels use
    ``size`` only to skip the keys a block of queries cannot see
    (:func:`~lens_parallel.attention.kernels.spans`)."""

    size: int

    name: ClassVar[str] = "sliding-window"
    title: ClassVar[str] = "sliding-window attention on some or all layers"
    handling: ClassVar[str] = (
        "lens_parallel's attention path reads Hugging Face's mask and, per block of queries, only the keys the "
        "window reaches; cached decoding keeps the window (Hugging Face's cache)"
    )
    keyword: ClassVar[str | None] = "sliding_window"

    @classmethod
    def recognise(cls, source: Source) -> SlidingWindow | None:
        module, config = source.module, source.config
        if getattr(module, "is_sliding", True) is False or not source.hands("sliding_window"):
            return None
        own = "sliding_window" in vars(module)  # a module that sets it (None on its full layers) says it alone
        size = vars(module)["sliding_window"] if own else getattr(config, "sliding_window", None)
        if size is None and getattr(module, "attention_type", None) == "local":
            size = getattr(config, "window_size", None)
        return cls(int(size)) if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None

    def agrees(self, handed: Any) -> bool:
        return bool(handed == self.size)
