"""Weight compression applied to a copy of a loaded model: round-to-nearest quantization and pruning.

Method specs (:meth:`Compression.parse`):

- ``int8``, ``int4``: symmetric round-to-nearest per output channel; ``int4-g128``: per group of 128 input weights
  of each output channel. w' = s * clamp(round(w / s), -2^(b-1), 2^(b-1) - 1), s = max|w| / (2^(b-1) - 1) over the
  channel or group (quantize-dequantize in float: the error analysed is the rounding itself, on any device).
- ``magnitude-50%``: unstructured magnitude pruning, the smallest |w| of each weight matrix set to 0.
- ``wanda-50%``: Wanda's score |w_ij| * ||X_j||_2 with X_j input feature j over calibration tokens, every norm
  taken in one forward of the dense model (a single pass); the lowest-scoring weights of each output row are set to
  0.
- ``wanda-seq-50%``: Wanda as its paper (Sun et al. 2023) and its code (``prune_wanda``) compute it, layer by layer:
  the input norms of block l's linear maps are taken with blocks 0..l-1 already pruned (block l itself dense while
  its norms are measured), then block l is pruned; the directional-decomposition paper's Wanda checkpoints were
  made so. Calibration texts default to a corpus apart from the analysed prompts
  (:func:`lens_parallel.analyses.compression.compression_error`).
- ``magnitude-2:4``, ``wanda-4:8``, ``wanda-seq-2:4``, ...: N:M semi-structured: in every group of M consecutive
  input weights of a row, only the N highest-scoring survive.
- ``torchao-int8``: torchao's ``Int8WeightOnlyConfig`` (symmetric int8 per output channel, the ``Int8Tensor``
  subclass); ``torchao-intxB-gG``: ``IntxWeightOnlyConfig(weight_dtype=intB, granularity=PerGroup(G))`` (B = 1..8,
  symmetric, ``IntxUnpackedToInt8Tensor``: the CPU and edge path); ``torchao-int4-gG``: ``Int4WeightOnlyConfig``
  (asymmetric, tinygemm; CUDA kernels only, refused on a CPU model). These keep torchao's quantized tensor
  subclasses as the weights, so the forward runs torchao's own kernels, and need ``torchao``
  (``pip install 'lens_parallel[quantization]'``). torchao's ``quantize_`` takes ``nn.Linear`` only: models
  whose blocks use GPT-2's ``Conv1D`` are refused for them.
- ``torchao-awq-int8``: AWQ (Lin et al. 2024) through torchao's ``AWQConfig`` over ``Int8WeightOnlyConfig``: per
  linear map, input-channel scales s = x_max^a / sqrt(max x_max^a * min x_max^a), x_max_j = mean_t |X_tj| over the
  calibration tokens, a searched on the grid 0, 1/20, ..., 19/20 for the least ||X W^T - (X / s) Q(W s)^T||^2; the
  weight is Q(W s) and 1/s is kept as its activation pre-scale (a = 0 is plain ``torchao-int8``, so AWQ's output
  error on the calibration tokens is never larger). As AWQ (and AutoAWQ) each layer's activations come from the
  dense model; calibrated apart from the analysed prompts by default, like ``wanda-seq-*``. ``torchao-awq-int4-gG``:
  the same over ``Int4WeightOnlyConfig`` (AWQ's own 4-bit groups; torchao's int4 kernels, from the ``mslk``
  package, run on CUDA only: refused on a CPU model). torchao's AWQ differs from the AWQ paper's code in three
  ways: one scale per linear map (the paper's q, k, v and gate, up share one, folded into the preceding norm), the
  error measured at each linear's output (the paper's at the block's attention or MLP output), and no search over
  weight clipping.
- ``none``: no change (the check that e = 0).

Compressed: every linear map inside the transformer blocks (attention q, k, v, o and the MLP; ``nn.Linear`` and
GPT-2's ``Conv1D``); embeddings, norms and the unembedding stay dense, as in the methods' papers. The RTN and
pruning methods are these few lines of torch (the methods' definitions); the ``torchao-*`` methods are the kernels
deployed in practice.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import cast

import einops
import torch
import transformers
from jaxtyping import Float, Int
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from transformer_lens.model_bridge import TransformerBridge
from transformers.pytorch_utils import Conv1D

from lens_parallel.bridges import check_model
from lens_parallel.errors import LensParallelError
from lens_parallel.models import export_hf_model, load_model, wrap_hf_model

_SPEC = re.compile(r"^(?:(none)|int(\d+)(?:-g(\d+))?|(magnitude|wanda-seq|wanda)-(?:(\d+(?:\.\d+)?)%|(\d+):(\d+)))$")
_TORCHAO_SPEC = re.compile(r"^torchao-(awq-)?(?:(int8)|(int4)-g(\d+))$|^torchao-intx(\d)-g(\d+)$")
SPEC_HELP = (
    "none, int8, int4, int4-g128, magnitude-50%, wanda-50%, wanda-seq-50%, magnitude-2:4, wanda-seq-2:4, "
    "torchao-int8, torchao-intx4-g128, torchao-int4-g128 (CUDA), torchao-awq-int8, torchao-awq-int4-g128 (CUDA)"
)


@dataclass(frozen=True)
class Compression:
    """One compression method (see the module docstring); build it with :meth:`parse`. What the method does is its
    ``kind``'s :class:`_Method` (:data:`METHODS`).

    Examples:
        >>> import lens_parallel as lp
        >>> lp.Compression.parse("wanda-2:4").kind
        'wanda'
    """

    kind: str  # a key of METHODS: none, int, magnitude, wanda, wanda-seq, torchao-int8, -int4, -intx, -awq
    bits: int | None = None
    group_size: int | None = None
    sparsity: float | None = None
    n: int | None = None
    m: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Compression:
        torchao = _TORCHAO_SPEC.match(spec.strip().lower()) if isinstance(spec, str) else None
        if torchao is not None:
            awq, int8, int4, int4_group, bits, group = torchao.groups()
            if int8:
                return cls("torchao-awq" if awq else "torchao-int8", bits=8)
            if int4:
                return cls("torchao-awq" if awq else "torchao-int4", bits=4, group_size=int(int4_group))
            if not 1 <= int(bits) <= 8:
                raise LensParallelError(f"torchao's intx takes 1..8 bits, got {bits} in {spec!r}")
            return cls("torchao-intx", bits=int(bits), group_size=int(group))
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
    def method(self) -> _Method:
        """What this ``kind`` of compression does (:data:`METHODS`)."""
        return METHODS[self.kind]

    @property
    def name(self) -> str:
        return self.method.name(self)

    @property
    def calibrated(self) -> bool:
        """Whether the method reads calibration tokens (Wanda's input norms, AWQ's activation magnitudes)."""
        return self.method.calibrated

    @property
    def calibrated_apart(self) -> bool:
        """Whether the method is calibrated on texts apart from the analysed prompts by default (``wanda-seq-*``
        and ``torchao-awq-*``; ``wanda-*`` keeps its calibration on the prompts, as before)."""
        return self.method.calibrated_apart

    def apply(self, hf_model: transformers.PreTrainedModel, calibration: Int[Tensor, "batch pos"] | None) -> None:
        """Compress ``hf_model``'s block linear maps in place (Wanda and AWQ measure the inputs of their linear maps
        on ``calibration``)."""
        if self.calibrated and calibration is None:
            raise LensParallelError(f"{self.name} needs calibration tokens (calibration=) to measure its inputs")
        self.method.apply(self, hf_model, dict(block_linears(hf_model)), calibration)

    def _compress(self, modules: Mapping[str, nn.Linear | Conv1D], norms: Mapping[str, Tensor] | None) -> None:
        """Quantize or prune each of ``modules`` in place (:meth:`_Method.weight`; Wanda's score with the input
        ``norms``)."""
        with torch.no_grad():
            for name, module in modules.items():
                w = _as_out_in(module)
                _set_out_in(module, self.method.weight(self, w, None if norms is None else norms[name].to(w)))


Linears = Mapping[str, nn.Linear | Conv1D]
"""A model's block linear maps by name (:func:`block_linears`)."""
Calibration = Int[Tensor, "batch pos"] | None
"""Calibration tokens, or None."""


@dataclass(frozen=True)
class _Method:
    """What one kind of compression does: its spec's name, whether it reads calibration tokens (and on texts apart
    from the analysed prompts by default), and how it compresses a model's block linear maps."""

    calibrated: bool = False
    calibrated_apart: bool = False

    def name(self, c: Compression) -> str:
        return c.kind

    def apply(self, c: Compression, hf_model: nn.Module, modules: Linears, calibration: Calibration) -> None:
        """Compress ``modules`` (the block linear maps of ``hf_model``) in place: each weight by :meth:`weight`."""
        c._compress(modules, None)

    def weight(
        self, c: Compression, w: Float[Tensor, "d_out d_in"], norms: Float[Tensor, " d_in"] | None
    ) -> Float[Tensor, "d_out d_in"]:
        """The compressed weight ``[out, in]`` (``norms``: Wanda's input norms, or None), for a method whose
        :meth:`apply` compresses weight by weight."""
        raise NotImplementedError(f"{type(self).__name__} compresses no weight alone")


@dataclass(frozen=True)
class _Unchanged(_Method):
    """``none``: the check that e = 0."""

    def apply(self, c: Compression, hf_model: nn.Module, modules: Linears, calibration: Calibration) -> None:
        return


@dataclass(frozen=True)
class _RoundToNearest(_Method):
    """``intB[-gG]``: symmetric round-to-nearest per output channel or group (:func:`quantize_rtn`)."""

    def name(self, c: Compression) -> str:
        return f"int{c.bits}" + (f"-g{c.group_size}" if c.group_size else "")

    def weight(
        self, c: Compression, w: Float[Tensor, "d_out d_in"], norms: Float[Tensor, " d_in"] | None
    ) -> Float[Tensor, "d_out d_in"]:
        assert c.bits is not None  # parse sets bits for int
        return quantize_rtn(w, bits=c.bits, group_size=c.group_size)


@dataclass(frozen=True)
class _Pruning(_Method):
    """Magnitude or Wanda pruning, unstructured (a sparsity: per matrix, or per output row where ``per_row``) or
    N:M; Wanda's norms from one forward of the dense model, or layer by layer (``sequential``)."""

    per_row: bool = True
    sequential: bool = False

    def name(self, c: Compression) -> str:
        if c.n:
            return f"{c.kind}-{c.n}:{c.m}"
        assert c.sparsity is not None  # parse sets N:M or a sparsity for pruning
        return f"{c.kind}-{c.sparsity * 100:g}%"

    def apply(self, c: Compression, hf_model: nn.Module, modules: Linears, calibration: Calibration) -> None:
        if not self.calibrated or calibration is None:
            c._compress(modules, None)
        elif self.sequential:
            _sequential(c, hf_model, modules, calibration)
        else:  # every norm from one forward of the dense model
            c._compress(modules, linear_input_norms(hf_model, modules, calibration))

    def weight(
        self, c: Compression, w: Float[Tensor, "d_out d_in"], norms: Float[Tensor, " d_in"] | None
    ) -> Float[Tensor, "d_out d_in"]:
        score = w.abs() if norms is None else w.abs() * norms[None, :]
        if c.n and c.m:
            return w * nm_mask(score, c.n, c.m)
        assert c.sparsity is not None  # parse sets N:M or a sparsity for pruning
        return w * sparsity_mask(score, c.sparsity, per_row=self.per_row)


@dataclass(frozen=True)
class _Torchao(_Method):
    """torchao's ``quantize_`` on each block linear map (its quantized tensor subclass becomes the weight): int8,
    int4 (CUDA only), intx, or AWQ over int8 / int4 (``awq``)."""

    awq: bool = False
    intx: bool = False

    def name(self, c: Compression) -> str:
        width = f"intx{c.bits}" if self.intx else f"int{c.bits}"
        return f"torchao-{'awq-' if self.awq else ''}{width}" + (f"-g{c.group_size}" if c.group_size else "")

    def apply(self, c: Compression, hf_model: nn.Module, modules: Linears, calibration: Calibration) -> None:
        try:
            import torchao.quantization as tq
            from torchao.quantization.granularity import PerGroup
        except ImportError as exc:
            raise LensParallelError(
                f"{c.name} needs torchao: pip install 'lens_parallel[quantization]' ({exc})"
            ) from exc
        conv = [name for name, m in modules.items() if isinstance(m, Conv1D)]
        if conv:
            raise LensParallelError(
                f"{c.name}: torchao's quantize_ takes nn.Linear layers, and this model's blocks use GPT-2's Conv1D "
                f"({conv[0]}, ...); use int8 / int4-g128 (round-to-nearest) for it"
            )
        device = next(hf_model.parameters()).device
        if c.bits == 4 and not self.intx and device.type != "cuda":  # torchao-(awq-)int4
            instead = "torchao-awq-int8" if self.awq else f"torchao-intx4-g{c.group_size}"
            raise LensParallelError(
                f"{c.name} (torchao's Int4WeightOnlyConfig) runs on CUDA only and this model is on "
                f"{device}; on CPU use {instead}"
            )
        widths = {int(_as_out_in(m).shape[1]) for m in modules.values()}
        ragged = sorted(w for w in widths if c.group_size and w % c.group_size)
        if ragged:
            raise LensParallelError(
                f"{c.name}: torchao's groups must divide every input width, and this model has widths {ragged} "
                f"(not multiples of {c.group_size}); use a group that divides them, or int{c.bits}-g"
                f"{c.group_size} (round-to-nearest with a shorter last group)"
            )
        if self.intx:
            dtype = getattr(torch, f"int{c.bits}")
            config: object = tq.IntxWeightOnlyConfig(weight_dtype=dtype, granularity=PerGroup(c.group_size))
        elif c.bits == 8:
            config = tq.Int8WeightOnlyConfig()
        else:
            config = tq.Int4WeightOnlyConfig(group_size=c.group_size)
        if self.awq:
            assert calibration is not None  # apply refuses a calibrated method without tokens
            _awq(hf_model, modules, config, calibration)
            return
        for module in modules.values():
            tq.quantize_(module, config)


METHODS: Mapping[str, _Method] = {
    "none": _Unchanged(),
    "int": _RoundToNearest(),
    "magnitude": _Pruning(per_row=False),
    "wanda": _Pruning(calibrated=True),
    "wanda-seq": _Pruning(calibrated=True, calibrated_apart=True, sequential=True),
    "torchao-int8": _Torchao(),
    "torchao-int4": _Torchao(),
    "torchao-intx": _Torchao(intx=True),
    "torchao-awq": _Torchao(calibrated=True, calibrated_apart=True, awq=True),
}
"""Every kind of compression (:attr:`Compression.kind`) and what it does (the module docstring's methods)."""


def _sequential(
    c: Compression,
    hf_model: nn.Module,
    modules: Mapping[str, nn.Linear | Conv1D],
    calibration: Int[Tensor, "batch pos"],
) -> None:
    """Wanda layer by layer in one forward of the calibration tokens: each block runs dense while pre-hooks sum
    its linear maps' squared inputs (which come from the blocks before it, already pruned), is then pruned, and
    runs again on the same inputs to hand the next block the pruned output (2 block forwards a layer, as the
    Wanda code's ``prune_wanda``: not a forward of every earlier layer per layer)."""
    sums: dict[str, Tensor] = {}
    rerun = [False]

    def accumulate(module: nn.Module, args: tuple[Tensor, ...], *, name: str) -> None:
        if not rerun[0]:
            _add_squares(sums, name, args[0])

    def prune_and_rerun(
        block: nn.Module, args: tuple[object, ...], kwargs: dict[str, object], output: object, *, names: list[str]
    ) -> object:
        if rerun[0]:
            return output
        c._compress({n: modules[n] for n in names}, {n: sums.pop(n).sqrt() for n in names})
        rerun[0] = True
        try:
            return block(*args, **kwargs)
        finally:
            rerun[0] = False

    handles = [m.register_forward_pre_hook(partial(accumulate, name=n)) for n, m in modules.items()]
    for block, names in _by_block(modules).items():
        hook = partial(prune_and_rerun, names=names)
        handles.append(hf_model.get_submodule(block).register_forward_hook(hook, with_kwargs=True))
    _hooked_forward(hf_model, calibration, handles)  # no KV cache: a block's rerun must not see its first keys


def _awq(
    hf_model: nn.Module, modules: Mapping[str, nn.Module], base: object, calibration: Int[Tensor, "batch pos"]
) -> None:
    """torchao's AWQ over ``base`` on ``modules`` in one forward of the dense model on ``calibration``: every module
    is observed (its inputs kept), and each block is converted (its scales searched, its weights quantized) as soon as
    it has run, so that one block's inputs are held at a time; the observed forward is the dense one throughout, so
    this equals observing the whole model and converting it afterwards (torchao's own recipe)."""
    from torchao.prototype.awq import AWQConfig
    from torchao.quantization import quantize_

    names = set(modules)
    quantize_(hf_model, AWQConfig(base, step="prepare"), filter_fn=lambda _, fqn: fqn in names)

    def convert(block: nn.Module, args: tuple[object, ...], output: object) -> None:
        quantize_(block, AWQConfig(base, step="convert"))

    handles = [hf_model.get_submodule(block).register_forward_hook(convert) for block in _by_block(modules)]
    # not inference mode: the converted weights are new parameters, used after this forward
    _hooked_forward(hf_model, calibration, handles, inference=False)


def _hooked_forward(
    hf_model: nn.Module, tokens: Int[Tensor, "batch pos"], handles: list[RemovableHandle], *, inference: bool = True
) -> None:
    """One forward of the plain Hugging Face model on calibration ``tokens`` (no gradients, no KV cache) while the
    torch hooks of ``handles`` run; they are removed afterwards, whatever happens."""
    try:
        with torch.inference_mode() if inference else torch.no_grad():
            hf_model(tokens, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()


_BLOCK = re.compile(r"^(.*?(?:^|\.)(?:h|layers)\.\d+)\.")


def block_linears(hf_model: nn.Module) -> Iterator[tuple[str, nn.Linear | Conv1D]]:
    """The linear maps inside the transformer blocks (names with a layer index; not embeddings or lm_head)."""
    for name, module in hf_model.named_modules():
        if isinstance(module, (nn.Linear, Conv1D)) and _BLOCK.match(name):
            yield name, module


def _by_block(modules: Mapping[str, nn.Module]) -> dict[str, list[str]]:
    """Module names grouped by the block that holds them (``model.layers.3``), blocks in forward order."""
    blocks: dict[str, list[str]] = {}
    for name in modules:
        match = _BLOCK.match(name)
        assert match is not None  # block_linears keeps only names inside a block
        blocks.setdefault(match.group(1), []).append(name)
    return dict(sorted(blocks.items(), key=lambda item: int(item[0].rsplit(".", 1)[1])))


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


def _add_squares(sums: dict[str, Tensor], name: str, x: Float[Tensor, "... d_in"]) -> None:
    """Add sum_t x_tj^2 of one module input (float64) to ``sums[name]``, for Wanda's ||X_j||_2."""
    x = x.detach().double()
    square = einops.reduce(x * x, "... d_in -> d_in", "sum")
    sums[name] = square if name not in sums else sums[name] + square


def linear_input_norms(
    hf_model: nn.Module, modules: Mapping[str, nn.Module], tokens: Int[Tensor, "batch pos"]
) -> dict[str, Float[Tensor, " d_in"]]:
    """||X_j||_2 of every input feature j of each module over all calibration tokens (one forward of the plain
    Hugging Face model, torch pre-hooks that only read their input)."""
    sums: dict[str, Tensor] = {}

    def accumulate(module: nn.Module, args: tuple[Tensor, ...], *, name: str) -> None:
        _add_squares(sums, name, args[0])

    handles = [m.register_forward_pre_hook(partial(accumulate, name=n)) for n, m in modules.items()]
    _hooked_forward(hf_model, tokens, handles)
    return {name: s.sqrt() for name, s in sums.items()}


def compress(
    model: TransformerBridge, method: MethodLike, *, calibration: Int[Tensor, "batch pos"] | None = None
) -> TransformerBridge:
    """A compressed copy of ``model`` (the original is not touched): its weights exported to a plain Hugging Face
    model, compressed there (a spec, a :class:`Compression`, or a function editing the HF model in place), and
    wrapped in a new bridge.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> small = lp.compress(model, "int8")
        >>> small is model
        False
    """
    check_model(model)
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


ARCHITECTURE_FREE_FIELDS = frozenset(
    {"quantization_config", "torch_dtype", "dtype", "transformers_version", "name_or_path"}
    | {"output_attentions", "output_hidden_states", "use_cache", "return_dict", "torchscript"}
)
"""Config fields a compressed checkpoint may change without being another architecture (also every ``_``-field):
its quantization and precision, and run-time flags (the bridge asks its model for attentions)."""


def _architecture(model: TransformerBridge) -> dict[str, object]:
    config = cast(transformers.PretrainedConfig, model.original_model.config).to_dict()
    return {k: v for k, v in config.items() if k not in ARCHITECTURE_FREE_FIELDS and not k.startswith("_")}


def _quant_method(spec: str) -> str | None:
    """The ``quantization_config.quant_method`` of a folder's config.json, if any."""
    config_path = Path(spec) / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    quant = config.get("quantization_config") or {}
    return quant.get("quant_method") if isinstance(quant, dict) else None


def checked_compressed(model: TransformerBridge, compressed: TransformerBridge | str) -> TransformerBridge:
    """``compressed`` (a bridge, or a folder / spec loaded on ``model``'s device) after checking that it is
    ``model`` compressed: the same config up to :data:`ARCHITECTURE_FREE_FIELDS` and the same tokenizer
    vocabulary. A checkpoint whose quantization kernels cannot run here is refused in one line."""
    name = compressed if isinstance(compressed, str) else compressed.cfg.model_name
    if isinstance(compressed, str):
        device = str(model.cfg.device)
        try:
            compressed = load_model(compressed, device=device)
        except LensParallelError:
            raise
        except (ImportError, RuntimeError, ValueError, OSError, NotImplementedError) as exc:
            quant = _quant_method(name)
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise LensParallelError(
                f"the compressed model {name!r}{f' ({quant})' if quant else ''} cannot run on {device} with the "
                f"installed kernels: {why}"
            ) from exc
    ours, theirs = _architecture(model), _architecture(compressed)
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if differ:
        shown = ", ".join(f"{k} {ours.get(k)!r} vs {theirs.get(k)!r}" for k in differ[:4])
        raise LensParallelError(
            f"the compressed model {name!r} is not {model.cfg.model_name}'s architecture: its config differs in "
            f"{shown}{' ...' if len(differ) > 4 else ''}"
        )
    if model.tokenizer.get_vocab() != compressed.tokenizer.get_vocab():
        raise LensParallelError(f"the compressed model {name!r} has another tokenizer than {model.cfg.model_name}")
    return compressed
