"""Weight compression applied to a copy of a loaded model: round-to-nearest quantization and pruning.

Method specs (:meth:`Compression.parse`):

- ``int8``, ``int4``: symmetric round-to-nearest per output channel; ``int4-g128``: per group of 128 input weights
  of each output channel. w' = s * clamp(round(w / s), -2^(b-1), 2^(b-1) - 1), s = max|w| / (2^(b-1) - 1) over the
  channel or group (quantize-dequantize in float: the error analysed is the rounding itself, on any device).
- ``magnitude-50%``: unstructured magnitude pruning, the smallest |w| of each weight matrix set to 0.
- ``wanda-50%``: Wanda (Sun et al. 2023), score |w_ij| * ||X_j||_2 with X_j input feature j over calibration
  tokens; the lowest-scoring weights of each output row are set to 0.
- ``magnitude-2:4``, ``wanda-4:8``, ...: N:M semi-structured: in every group of M consecutive input weights of a
  row, only the N highest-scoring survive.
- ``none``: no change (the check that e = 0).

Compressed: every linear map inside the transformer blocks (attention q, k, v, o and the MLP; ``nn.Linear`` and
GPT-2's ``Conv1D``); embeddings, norms and the unembedding stay dense, as in the methods' papers. These few lines
of torch are the methods' definitions; libraries such as torchao pack weights for fast kernels, which this
analysis of the error does not need.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import cast

import einops
import torch
import transformers
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.model_bridge import TransformerBridge
from transformers.pytorch_utils import Conv1D

from lens_parallel.errors import LensParallelError
from lens_parallel.models import export_hf_model, wrap_hf_model

_SPEC = re.compile(r"^(?:(none)|int(\d+)(?:-g(\d+))?|(magnitude|wanda)-(?:(\d+(?:\.\d+)?)%|(\d+):(\d+)))$")
SPEC_HELP = "none, int8, int4, int4-g128, magnitude-50%, wanda-50%, magnitude-2:4, wanda-4:8"


@dataclass(frozen=True)
class Compression:
    """One compression method (see the module docstring); build it with :meth:`parse`."""

    kind: str  # "none", "int", "magnitude" or "wanda"
    bits: int | None = None
    group_size: int | None = None
    sparsity: float | None = None
    n: int | None = None
    m: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Compression:
        match = _SPEC.match(spec.strip().lower()) if isinstance(spec, str) else None
        if match is None:
            raise LensParallelError(f"unknown compression {spec!r}; accepted forms: {SPEC_HELP}")
        none, bits, group, prune, pct, n, m = match.groups()
        if none:
            return cls("none")
        if bits:
            if not 2 <= int(bits) <= 16:
                raise LensParallelError(f"int quantization needs 2..16 bits, got {bits} in {spec!r}")
            return cls("int", bits=int(bits), group_size=int(group) if group else None)
        if pct is not None:
            if not 0 < float(pct) < 100:
                raise LensParallelError(f"sparsity must be strictly between 0% and 100%, got {pct}% in {spec!r}")
            return cls(prune, sparsity=float(pct) / 100)
        if not 0 < int(n) < int(m):
            raise LensParallelError(f"N:M pruning needs 0 < N < M, got {n}:{m} in {spec!r}")
        return cls(prune, n=int(n), m=int(m))

    @property
    def name(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "int":
            return f"int{self.bits}" + (f"-g{self.group_size}" if self.group_size else "")
        if self.n:
            return f"{self.kind}-{self.n}:{self.m}"
        assert self.sparsity is not None  # parse sets N:M or a sparsity for pruning
        return f"{self.kind}-{self.sparsity * 100:g}%"

    def apply(self, hf_model: transformers.PreTrainedModel, calibration: Int[Tensor, "batch pos"] | None) -> None:
        """Compress ``hf_model``'s block linear maps in place (Wanda reads input norms from ``calibration``)."""
        layers = dict(block_linears(hf_model))
        if self.kind == "none":
            return
        norms = None
        if self.kind == "wanda":
            if calibration is None:
                raise LensParallelError("Wanda needs calibration tokens to measure input-feature norms")
            norms = linear_input_norms(hf_model, layers, calibration)
        with torch.no_grad():
            for name, module in layers.items():
                w = _as_out_in(module)
                if self.kind == "int":
                    assert self.bits is not None  # parse sets bits for int
                    new = quantize_rtn(w, bits=self.bits, group_size=self.group_size)
                else:
                    score = w.abs() if norms is None else w.abs() * norms[name].to(w)[None, :]
                    if self.n and self.m:
                        keep = nm_mask(score, self.n, self.m)
                    else:
                        assert self.sparsity is not None  # parse sets N:M or a sparsity for pruning
                        keep = sparsity_mask(score, self.sparsity, per_row=self.kind == "wanda")
                    new = w * keep
                _set_out_in(module, new)


def block_linears(hf_model: nn.Module) -> Iterator[tuple[str, nn.Linear | Conv1D]]:
    """The linear maps inside the transformer blocks (names with a layer index; not embeddings or lm_head)."""
    for name, module in hf_model.named_modules():
        if isinstance(module, (nn.Linear, Conv1D)) and re.search(r"\.(h|layers)\.\d+\.", f".{name}"):
            yield name, module


def _as_out_in(module: nn.Linear | Conv1D) -> Float[Tensor, "d_out d_in"]:
    return module.weight.T if isinstance(module, Conv1D) else module.weight  # Conv1D stores [in, out]


def _set_out_in(module: nn.Linear | Conv1D, w: Tensor) -> None:
    module.weight.copy_(w.T if isinstance(module, Conv1D) else w)


def quantize_rtn(w: Float[Tensor, "d_out d_in"], *, bits: int, group_size: int | None) -> Float[Tensor, "d_out d_in"]:
    """Symmetric round-to-nearest with one absmax scale per output row, or per ``group_size`` consecutive inputs of a
    row (the last group is shorter when ``group_size`` does not divide the width)."""
    d_in = w.shape[1]
    size = group_size or d_in
    if size < 1:
        raise LensParallelError(f"group size must be >= 1, got {group_size}")
    padded = torch.nn.functional.pad(w, (0, -d_in % size))  # zeros: a ragged last group keeps its own absmax
    qmax = 2 ** (bits - 1) - 1
    groups = einops.rearrange(padded, "o (g k) -> o g k", k=size)
    scale = groups.abs().amax(-1, keepdim=True) / qmax
    scale = torch.where(scale > 0, scale, 1.0)
    q = torch.clamp(torch.round(groups / scale), -qmax - 1, qmax) * scale
    return einops.rearrange(q, "o g k -> o (g k)")[:, :d_in]


def sparsity_mask(score: Float[Tensor, "d_out d_in"], sparsity: float, *, per_row: bool) -> Tensor:
    """Keep-mask zeroing the ``sparsity`` fraction of lowest scores, in each row or in the whole matrix."""
    flat = score if per_row else score.reshape(1, -1)
    k = int(flat.shape[1] * sparsity)
    drop = torch.zeros_like(flat, dtype=torch.bool)
    if k:
        drop.scatter_(1, flat.topk(k, dim=1, largest=False).indices, True)
    return ~drop.reshape(score.shape)


def nm_mask(score: Float[Tensor, "d_out d_in"], n: int, m: int) -> Tensor:
    """Keep-mask with exactly ``n`` survivors in every group of ``m`` consecutive input weights of a row."""
    if score.shape[1] % m:
        raise LensParallelError(f"N:M pruning with M={m} needs input widths divisible by {m}, got {score.shape[1]}")
    groups = einops.rearrange(score, "o (g m) -> o g m", m=m)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.topk(n, dim=-1).indices, True)
    return einops.rearrange(keep, "o g m -> o (g m)")


MethodLike = str | Compression | Callable[[transformers.PreTrainedModel], None]


def method_name(method: MethodLike) -> str:
    if isinstance(method, str):
        return Compression.parse(method).name
    if isinstance(method, Compression):
        return method.name
    return getattr(method, "__name__", type(method).__name__)


def linear_input_norms(
    hf_model: nn.Module, modules: Mapping[str, nn.Module], tokens: Int[Tensor, "batch pos"]
) -> dict[str, Float[Tensor, " d_in"]]:
    """||X_j||_2 of every input feature j of each module over all calibration tokens (one forward of the plain
    Hugging Face model, torch pre-hooks that only read their input)."""
    sums: dict[str, Tensor] = {}

    def accumulate(module: nn.Module, args: tuple[Tensor, ...], *, name: str) -> None:
        x = args[0].detach().double()
        square = einops.reduce(x * x, "... d_in -> d_in", "sum")
        sums[name] = square if name not in sums else sums[name] + square

    handles = [m.register_forward_pre_hook(partial(accumulate, name=n)) for n, m in modules.items()]
    try:
        with torch.inference_mode():
            hf_model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return {name: s.sqrt() for name, s in sums.items()}


def compress(
    model: TransformerBridge, method: MethodLike, *, calibration: Int[Tensor, "batch pos"] | None = None
) -> TransformerBridge:
    """A compressed copy of ``model`` (the original is not touched): its weights exported to a plain Hugging Face
    model, compressed there (a spec, a :class:`Compression`, or a function editing the HF model in place), and
    wrapped in a new bridge."""
    if isinstance(method, str):
        method = Compression.parse(method)
    copy = export_hf_model(cast(transformers.PreTrainedModel, model.original_model))
    if isinstance(method, Compression):
        method.apply(copy, calibration)
    else:
        with torch.no_grad():
            method(copy)
    return wrap_hf_model(
        copy,
        model.tokenizer,
        name=f"{model.cfg.model_name}+{method_name(method)}",
        device=str(model.cfg.device),
        dtype=next(model.parameters()).dtype,  # the original's precision (a bfloat16 model stays bfloat16)
    )
