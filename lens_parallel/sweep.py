"""The one engine: a sweep is (jobs, documents, metric), run by :func:`run_sweep`.

- A **job** is plain, frozen data naming what is changed: :class:`AblationJob` (heads of a layer removed),
  :class:`EditJob` (any edits, built-in or user-defined, from ``start_layer`` on), or an analysis's own job
  (a layer pair of head dominance, a compression method). Its ``key`` names it in the store.
- A **metric** (:class:`Metric`) says what is measured of each job's forward: next-token NLL per document
  (:class:`DocumentNLL`) or per token (:class:`TokenNLL`), captured activations reduced inside the forward
  (decomposition, null models, diagonal views), layer l+1's effective Q/K/V (dominance), per-layer update errors
  (compression), loss gradients (attribution). It evaluates a chunk of jobs on one batch of documents through the
  engine's forward primitive :func:`run_rows`, and declares the shapes of what it returns (:class:`ValueSpec`).
- The **documents** (:class:`~lens_parallel.documents.Documents`) may differ in length: batches are right-padded and
  only real tokens are scored and reduced.

:func:`run_sweep` alone owns

(a) **batching documents**: ``batch_size`` documents per batch (:func:`~lens_parallel.documents.document_batches`);
(b) **the reference pass**: one unedited forward per batch gives what the jobs and the metric share: the residual
    entering every layer a job starts at (each edited forward resumes there; earlier blocks are not computed), the
    unedited per-document losses, and the metric's reference captures. Skipped when nothing needs it;
(c) **stacking**: the metric groups jobs into chunks that share forwards (rows of ablation masks, per-row scales
    of one edit class), up to ``tokens_per_forward`` tokens a forward;
(d) **a crash-safe resumable store** (:mod:`lens_parallel.store`): a JSON-lines file whose first line is the run's
    fingerprint and each further line one finished job's value. A rerun with the same store skips finished jobs; a
    last line cut by a kill mid-write is dropped (that job is recomputed), as is, with a warning, any row whose value
    does not have the metric's shapes and types (numbers, NaN only where the metric defines it); a store written by
    a run whose numbers would differ (another model or other weights, hashed exactly; documents and their lengths,
    metric, edit kind, batch size, dtype, ...) is refused with what differs. Creation and appends hold a file lock;
(e) progress, and (f) Ray: each chunk is a unit of work for :mod:`lens_parallel.distributed` (the caller writes
    the store; the numbers equal one process's).

Results equal the naive loop (one full forward per job) to float rounding (tested to 1e-5): stacking and padding
change only the kernels' summation order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar, cast, runtime_checkable

import einops
import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.attention import attention_path
from lens_parallel.bridges import check_model
from lens_parallel.budget import choose_batch_size, default_budget, parse_bytes
from lens_parallel.choices import Ablation, EditPositions
from lens_parallel.distributed import TaskContext, check_workers, run_tasks
from lens_parallel.documents import DocBatch, Documents, DocumentsLike, document_batches
from lens_parallel.edits import (
    ABLATION_KINDS,
    PATTERN_PATHS,
    PATTERN_USES,
    Edit,
    EditBase,
    HeadEdit,
    as_edits,
    check_positions,
    compile_hooks,
    edit_footprint,
    edit_layers,
    stacked_hooks,
)
from lens_parallel.errors import (
    LensParallelError,
    LibraryError,
    NonFiniteError,
    interrupt_message,
    interrupted,
    long_call,
)
from lens_parallel.hooks import Hook, LayerStream, Reducer, check_heads, check_indices, forward
from lens_parallel.losses import DocLosses, chunked_token_nll, scored_sums, unembedding
from lens_parallel.models import ModelInfo, head_label, model_info, weights_digest
from lens_parallel.options import RunOptions, refuse_renamed, resolve_options
from lens_parallel.store import SweepStore, Values, ValueSpec
from lens_parallel.validate import check_choice

# -- jobs --------------------------------------------------------------------------------------------------------


@runtime_checkable
class Job(Protocol):
    """What a sweep runs: plain frozen data with a ``key`` (its name in the store) and the first layer it edits."""

    @property
    def key(self) -> str: ...

    @property
    def start_layer(self) -> int: ...


def _needs_means(kind: Ablation | None) -> bool:
    """Whether the sweep's head ablation fills heads with their means (computed once per sweep)."""
    return kind is not None and ABLATION_KINDS[kind].needs_means


@dataclass(frozen=True)
class AblationJob:
    """Remove query ``heads`` of ``layer`` together (how: the sweep's ``ablation``); ``heads`` one index or a tuple.

    Examples:
        >>> import lens_parallel as lp
        >>> lp.AblationJob(1, (0, 2)).key  # query heads 0 and 2 of layer 1, removed together
        'L1H0+2'
    """

    layer: int
    heads: tuple[int, ...]

    def __post_init__(self) -> None:
        heads: object = (self.heads,) if isinstance(self.heads, (int, np.integer)) else self.heads
        if isinstance(self.layer, bool) or not isinstance(self.layer, (int, np.integer)) or self.layer < 0:
            raise LensParallelError(
                f"AblationJob layer must be an integer >= 0 (a job says where its sweep starts before it meets a "
                f"model; the last layer is model.cfg.n_layers - 1), got {self.layer!r}"
            )
        if not isinstance(heads, (tuple, list)) or not all(
            isinstance(h, (int, np.integer)) and not isinstance(h, bool) and h >= 0 for h in heads
        ):
            raise LensParallelError(
                f"AblationJob heads must be a head index or a tuple of them (>= 0), got {self.heads!r}"
            )
        object.__setattr__(self, "heads", tuple(int(h) for h in cast("tuple[int, ...]", heads)))

    @property
    def key(self) -> str:
        return head_label(self.layer, self.heads)

    @property
    def start_layer(self) -> int:
        return self.layer

    @classmethod
    def of(cls, job: AblationJob | tuple[int, int | Sequence[int]]) -> AblationJob:
        """An ablation job from itself or a ``(layer, head)`` / ``(layer, heads)`` pair."""
        if isinstance(job, tuple) and len(job) == 2:
            layer, heads = job
            return cls(layer, (heads,) if isinstance(heads, (int, np.integer)) else tuple(heads))
        return job


@dataclass(frozen=True)
class EditJob:
    """Run ``edits`` (any :class:`~lens_parallel.edits.Edit`, built-in or user-defined: frozen data) from
    ``start_layer`` on: no edit may touch an earlier layer. ``key`` names the job in the store.

    Examples:
        >>> import lens_parallel as lp
        >>> lp.EditJob("no diagonal", (lp.ZeroDiagonal(),)).key
        'no diagonal'
    """

    key: str
    edits: tuple[Edit, ...]
    start_layer: int = 0


# -- values ------------------------------------------------------------------------------------------------------

# -- batches and the forward primitive ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """One batch of documents and what the reference (unedited) pass gave for it: ``prefix[k]`` the residual
    entering block k, ``base`` the per-document NLL sums, ``reference[layer][role]`` the metric's captures."""

    docs: DocBatch
    prefix: dict[int, Tensor] = field(default_factory=dict)
    base: Tensor | None = None
    reference: dict[int, dict[str, Tensor]] = field(default_factory=dict)


@dataclass(frozen=True)
class Forward:
    """What :func:`run_rows` gives: per-row NLL (per document summed, or per token with NaN where not scored),
    the captured activations ``captured[layer][role]`` and, when asked, the final normalised residual."""

    nll: Tensor | None
    captured: dict[int, dict[str, Tensor]]
    final: Tensor | None = None


def run_rows(
    model: TransformerBridge,
    info: ModelInfo,
    batch: Batch,
    *,
    rows: Int[Tensor, " row"] | None = None,
    hooks: Sequence[Hook] = (),
    start_layer: int = 0,
    capture: Mapping[int, Sequence[str]] | None = None,
    loss: Literal["document", "token"] | None = None,
    length: int | None = None,
    dtype: torch.dtype = torch.float64,
    reduce: Reducer | None = None,
    keep_final: bool = False,
) -> Forward:
    """The engine's forward primitive: rows ``rows`` of the batch (document indices within it, repeats allowed;
    default every document once) under ``hooks``, resumed at ``start_layer`` from the reference pass's residual,
    cut to ``length`` tokens; captures ``capture`` (roles per layer, as ``dtype``; the forward stops after the last
    layer unless a loss is asked for) and the next-token NLL of the real tokens. With ``reduce``, each layer's
    captures go to ``reduce(layer, tensors)`` as soon as the layer is complete, and are dropped (reduced inside the
    forward: only one layer's captures are ever held), instead of being returned. ``keep_final``: also return the
    final normalised residual (when nothing is captured, or a loss is asked for)."""
    docs = batch.docs
    index = torch.arange(len(docs.lengths), device=docs.tokens.device) if rows is None else rows
    tokens, lengths, first = docs.tokens[index], docs.lengths[index], docs.first[index]
    if length is not None:
        tokens, lengths = tokens[:, :length], lengths.clamp(max=length)
    resid, start = None, None
    if start_layer in batch.prefix:  # resume from the residual entering block start_layer
        resid, start = batch.prefix[start_layer][index][:, : tokens.shape[1]], start_layer
    elif start_layer > 0:
        raise LibraryError(f"no cached residual entering layer {start_layer}: the reference pass did not keep it")
    captured: dict[int, dict[str, Tensor]] = {}
    if capture:
        keep = reduce or (lambda layer, t: captured.update({layer: t}))
        stream = LayerStream(info, list(capture), dict(capture), keep, dtype=dtype)
        final = stream.run(model, tokens, edit_hooks=hooks, resid=resid, start_at_layer=start, final=loss is not None)
    else:
        final = forward(model, tokens, hooks, resid=resid, start_at_layer=start)
    nll = None
    if loss is not None:
        assert final is not None  # both forwards return the final residual when a loss is asked for
        with torch.inference_mode():
            per_token = chunked_token_nll(final, unembedding(model), tokens, lengths, first=first)
        nll = per_token if loss == "token" else scored_sums(per_token, lengths, first)
    return Forward(nll, captured, final if keep_final else None)


# -- metrics -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepPlan:
    """What every chunk of a sweep needs (sent once to each worker): the documents, the layers jobs start at, the
    batch size and token budget, how ablation jobs remove heads, and the metric."""

    documents: Documents
    starts: tuple[int, ...]
    batch_size: int
    tokens_per_forward: int
    ablation: Ablation | None
    positions: EditPositions
    means: dict[int, Tensor]
    metric: Metric[Any]

    def batches(self) -> list[DocBatch]:
        return list(document_batches(self.documents, self.batch_size))

    @property
    def jobs_per_forward(self) -> int:
        """How many jobs' rows one forward holds: the token budget over a batch's tokens (at least 1)."""
        tokens = min(self.batch_size, len(self.documents)) * self.documents.tokens.shape[1]
        return max(1, self.tokens_per_forward // tokens)


J = TypeVar("J", bound=Job)
"""The job type a metric measures."""


class Metric(Generic[J]):
    """What a sweep measures of each job (subclass it: the module docstring lists the package's metrics).

    ``name`` and :meth:`fingerprint` identify its numbers (in a store's fingerprint); ``base``: whether it needs
    the unedited per-document losses of the reference pass; :meth:`reference_roles`: activations the reference
    pass captures for it; :meth:`spec`: the arrays a job's value holds; :meth:`chunks`: which jobs share forwards
    (default: one job per chunk); :meth:`measure`: a chunk's values on one batch; :meth:`combine`: the batches'
    values of one job, concatenated along ``"docs"`` axes or summed.

    Examples:
        >>> import lens_parallel as lp
        >>> isinstance(lp.DocumentNLL(), lp.Metric)
        True
    """

    name = "metric"
    base = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "evaluate" in vars(cls):
            raise LensParallelError(f"{cls.__name__}.evaluate: a metric's method is now measure (same arguments)")

    def fingerprint(self) -> dict[str, Any]:
        return {"metric": self.name}

    def reference_roles(self, info: ModelInfo) -> dict[int, tuple[str, ...]]:
        return {}

    def spec(self, job: J) -> dict[str, ValueSpec]:
        raise NotImplementedError

    def chunks(self, jobs: Sequence[J], plan: SweepPlan) -> list[list[J]]:
        return [[job] for job in jobs]

    def measure(self, context: TaskContext, plan: SweepPlan, jobs: Sequence[J], batch: Batch) -> list[Values]:
        raise NotImplementedError

    def combine(self, job: J, parts: Sequence[Values]) -> Values:
        out: Values = {}
        for name, spec in self.spec(job).items():
            arrays = [np.asarray(p[name], dtype=np.float64) for p in parts]
            if "docs" in spec.shape:
                out[name] = np.concatenate(arrays, axis=spec.shape.index("docs"))
            else:
                out[name] = np.asarray(np.sum(arrays, axis=0))
        return out


class DocumentNLL(Metric[Job]):
    """Next-token NLL summed over each document's scored tokens (nats): ``loss_sum [docs]``.

    Chunks: :class:`AblationJob` s of one layer stack as rows with their own head masks; :class:`EditJob` s whose
    edits are one :class:`~lens_parallel.edits.ComponentScale` each, alike but for s_par / s_perp, stack as rows
    with their own scales; any other job runs alone.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> run = lp.run_sweep(model, docs, [lp.EditJob("none", ())], metric=lp.DocumentNLL(), progress=False)
    """

    name = "document-nll"

    def spec(self, job: Job) -> dict[str, ValueSpec]:
        return {"loss_sum": ValueSpec(("docs",))}

    def chunks(self, jobs: Sequence[Job], plan: SweepPlan) -> list[list[Job]]:
        per_forward, out = plan.jobs_per_forward, []
        groups: dict[Any, list[Job]] = {}
        for job in jobs:
            groups.setdefault(_stack_key(job), []).append(job)
        for key, group in groups.items():
            size = per_forward if key is not None else 1
            out += [group[i : i + size] for i in range(0, len(group), size)]
        return sorted(out, key=lambda chunk: chunk[0].start_layer)

    def measure(self, context: TaskContext, plan: SweepPlan, jobs: Sequence[Job], batch: Batch) -> list[Values]:
        nll = _stacked_nll(context, plan, jobs, batch, loss="document")
        host = torch.stack(nll).double().cpu().numpy()  # one read on the host per forward, not one per job
        return [{"loss_sum": row} for row in host]


class TokenNLL(DocumentNLL):
    """Next-token NLL of every scored token (nats): ``nll [docs, pos - 1]``, NaN where a document has no token to
    score (past its end).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> job = lp.EditJob("none", ())
        >>> run = lp.run_sweep(model, docs, [job], metric=lp.TokenNLL(16), progress=False)
    """

    name = "token-nll"

    def __init__(self, n_positions: int) -> None:
        self.n_positions = n_positions

    def fingerprint(self) -> dict[str, Any]:
        return {"metric": self.name, "positions": self.n_positions}

    def spec(self, job: Job) -> dict[str, ValueSpec]:
        return {"nll": ValueSpec(("docs", self.n_positions - 1), allow_nan=True)}

    def measure(self, context: TaskContext, plan: SweepPlan, jobs: Sequence[Job], batch: Batch) -> list[Values]:
        nll = _stacked_nll(context, plan, jobs, batch, loss="token")
        host = torch.stack(nll).double().cpu().numpy()  # one read on the host per forward, not one per job
        padded = np.full((*host.shape[:2], self.n_positions - 1), np.nan)
        padded[..., : host.shape[2]] = host
        return [{"nll": row} for row in padded]


def _stack_key(job: Job) -> Any:
    """Jobs with the same key (not None) can share forwards."""
    if isinstance(job, AblationJob):
        return ("ablation", job.layer)
    edit = job.edits[0] if isinstance(job, EditJob) and len(job.edits) == 1 else None
    if isinstance(edit, EditBase) and (signature := edit.stack_signature()) is not None:
        return ("scale", job.start_layer, signature)
    return None


def _stacked_nll(
    context: TaskContext, plan: SweepPlan, jobs: Sequence[Job], batch: Batch, *, loss: Literal["document", "token"]
) -> list[Tensor]:
    """Per job of a chunk, its rows' NLL on the batch (stacked rows share one forward)."""
    model, info, k = context.model, context.info, len(jobs)
    n = len(batch.docs.lengths)
    rows = einops.repeat(torch.arange(n, device=batch.docs.tokens.device), "b -> (k b)", k=k)
    first = jobs[0]
    if isinstance(first, AblationJob):
        mask = torch.zeros(k, n, info.output_heads(first.layer), dtype=torch.bool, device=batch.docs.tokens.device)
        for i, job in enumerate(cast(Sequence[AblationJob], jobs)):
            mask[i, :, list(job.heads)] = True
        head_rows = einops.rearrange(mask, "k b h -> (k b) h")
        assert plan.ablation is not None
        hooks = HeadEdit(plan.ablation, first.layer, head_rows, plan.means.get(first.layer), positions=plan.positions)
        compiled = hooks.hooks(model, info)
    elif k > 1:
        edits = [job.edits[0] for job in cast(Sequence[EditJob], jobs)]  # one stack key: one EditBase each
        compiled = stacked_hooks(model, cast(list[EditBase], edits), repeat=n)
    else:
        compiled = compile_hooks(model, cast(EditJob, first).edits)
    out = run_rows(model, info, batch, rows=rows, hooks=compiled, start_layer=first.start_layer, loss=loss)
    assert out.nll is not None
    return list(einops.rearrange(out.nll, "(k b) ... -> k b ...", k=k))


def model_fingerprint(model: TransformerBridge, *, weights: str | None = None) -> dict[str, Any]:
    """What identifies the model a stored number came from: name, config hash, the exact digest of its weights
    (:func:`~lens_parallel.models.weights_digest`; ``weights`` when the caller computed it), dtype, device type."""
    info = model_info(model)
    param = next(model.parameters())
    return {
        "model": info.name,
        "config": info.config_hash,
        "weights": weights or weights_digest(model),
        "dtype": str(param.dtype),
        "device": param.device.type,
    }


def fingerprint(
    model: TransformerBridge,
    documents: Documents,
    metric: Metric[Any],
    plan_fields: dict[str, Any],
    *,
    weights: str | None = None,
) -> dict[str, Any]:
    """Everything that changes a sweep's numbers: model name, config and the exact digest of its weights
    (:func:`~lens_parallel.models.weights_digest`; ``weights`` when the caller computed it), dtype, device type, the
    documents and their lengths, the metric, how ablation jobs remove heads, the batch size and the token budget
    (batch composition changes float rounding)."""
    return {
        **model_fingerprint(model, weights=weights),
        "documents": documents.digest(),
        **metric.fingerprint(),
        **plan_fields,
    }


# -- the reference pass and the run ------------------------------------------------------------------------------


def _reference_pass(model: TransformerBridge, info: ModelInfo, plan: SweepPlan, need_base: bool) -> list[Batch]:
    """One unedited forward per batch: the residual entering each start layer, the metric's reference captures and
    (when asked) the per-document NLL sums; plain batches when nothing is needed."""
    roles = plan.metric.reference_roles(info)
    if not (plan.starts or roles or need_base):
        return [Batch(docs) for docs in plan.batches()]
    capture: dict[int, list[str]] = {layer: list(rs) for layer, rs in roles.items()}
    for layer in plan.starts:
        capture.setdefault(layer, []).append("resid_pre")
    out = []
    for docs in plan.batches():
        got = run_rows(
            model,
            info,
            Batch(docs),
            capture=capture,
            loss="document" if need_base else None,
            dtype=next(model.parameters()).dtype,
        )
        prefix = {layer: got.captured[layer]["resid_pre"] for layer in plan.starts}
        reference = {layer: {r: got.captured[layer][r] for r in rs} for layer, rs in roles.items()}
        out.append(Batch(docs, prefix=prefix, base=got.nll, reference=reference))
    return out


def _sweep_task(context: TaskContext, plan: SweepPlan, chunk: list[Job]) -> list[Values]:
    """One chunk of jobs on every batch: the reference pass is computed once per worker and kept."""
    batches = context.cached(reference_key(plan), lambda: _reference_pass(context.model, context.info, plan, False))
    parts = []
    for batch in batches:
        parts.append(plan.metric.measure(context, plan, chunk, batch))
        context.advance(len(chunk))  # progress: one unit per job and batch
    return [plan.metric.combine(job, [part[i] for part in parts]) for i, job in enumerate(chunk)]


@dataclass(frozen=True)
class SweepRun:
    """Every job's value (``values[key]``) and, when the reference pass computed them, the unedited model's
    per-document losses (``base``). ``run[job]`` is a job's :class:`DocLosses` (NLL metrics) and
    ``run.value(job)`` its named arrays (any metric).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> run = lp.run_sweep(model, docs, [lp.EditJob("none", ())], progress=False)
        >>> isinstance(run, lp.SweepRun)
        True
    """

    base: DocLosses | None
    values: dict[str, Values]
    n_tokens: np.ndarray
    options: RunOptions
    auto_batch: dict[str, Any] | None

    def record(self) -> dict[str, Any]:
        """The run options as the run used them, for provenance: ``batch_size`` the number of documents per batch
        (with ``batch_size="auto"`` the chosen one, and under ``batch_size_auto`` how it was chosen)."""
        return self.options.record() | ({} if self.auto_batch is None else {"batch_size_auto": self.auto_batch})

    def value(self, job: Job) -> Values:
        return self.values[job.key]

    def __getitem__(self, job: Job) -> DocLosses:
        return DocLosses(self.values[job.key]["loss_sum"], self.n_tokens)


def _validate(jobs: Sequence[Job], info: ModelInfo, ablation: Ablation | None) -> list[Job]:
    """``jobs`` checked against the model, each EditJob's edits resolved on it (indices from the end counted), repeats
    dropped."""
    if not jobs:
        raise LensParallelError("no sweep jobs given")
    if bad := [job for job in jobs if not isinstance(job, Job)]:
        raise LensParallelError(
            f"a sweep job is an AblationJob(layer, heads) or an EditJob(key, edits), got {type(bad[0]).__name__} "
            f"{str(bad[0])[:40]!r}"
        )
    resolved = [dataclasses.replace(j, edits=as_edits(j.edits, info)) if isinstance(j, EditJob) else j for j in jobs]
    for job in resolved:
        if isinstance(job, AblationJob):
            if ablation is None:
                raise LensParallelError("ablation jobs need ablation= (how heads are removed), e.g. ablation='zero'")
            if not job.heads:
                raise LensParallelError(f"job at layer {job.layer} has an empty head set: give at least one query head")
            ABLATION_KINDS[ablation].layers(info, [job.layer], what=f"a {ablation} head ablation")
            check_indices("layers", job.layer, info.n_layers)
            check_heads(info, job.layer, job.heads)
        else:
            check_indices("start layer", job.start_layer, info.n_layers)
        for e in job.edits if isinstance(job, EditJob) else ():
            layers = edit_layers(e)
            if layers == "undeclared":
                if job.start_layer > 0:
                    raise LensParallelError(
                        f"job {job.key!r} starts at layer {job.start_layer}, but {type(e).__name__} does not say which "
                        "layers it edits (give it a layers attribute): it can only run from layer 0"
                    )
                continue
            first = min(layers) if layers else 0  # None: every layer
            if first < job.start_layer:
                raise LensParallelError(
                    f"job {job.key!r} edits layer {first}, before its start layer {job.start_layer}"
                )
    unique = list(dict.fromkeys(resolved))
    keys = [job.key for job in unique]
    if len(set(keys)) != len(keys):
        raise LensParallelError("two different jobs share a key; give each EditJob its own key")
    return unique


def head_means(
    model: TransformerBridge, documents: DocumentsLike, layers: Sequence[int], *, batch_size: int = 8
) -> dict[int, Float[Tensor, "head_index d_head"]]:
    """Mean of hook_z per layer and head over every real position of every document (for mean ablation)."""
    info = model_info(model)
    documents = Documents.of(documents, model)
    sums = {layer: torch.zeros(info.n_heads, info.d_head, dtype=torch.float64, device="cpu") for layer in layers}
    for docs in document_batches(documents, batch_size):
        got = run_rows(model, info, Batch(docs), capture={layer: ["z"] for layer in layers})
        real = docs.real.to(torch.float64)
        for layer in layers:
            sums[layer] += einops.einsum(got.captured[layer]["z"].cpu(), real.cpu(), "b p h d, b p -> h d")
    count = float(documents.lengths.sum())
    return {layer: (s / count).float() for layer, s in sums.items()}


def _auto_batch_size(
    model: TransformerBridge,
    info: ModelInfo,
    docs: Documents,
    metric: Metric[Any],
    jobs: Sequence[Job],
    opts: RunOptions,
    kind: Ablation | None,
    positions: EditPositions,
) -> tuple[RunOptions, dict[str, Any]]:
    """``opts`` with ``batch_size="auto"`` resolved (:mod:`lens_parallel.budget`): the size a store of the same run
    recorded, else the largest that fits ``memory_budget``, measured by running this sweep's own work (the reference
    pass and the metric's first chunk of jobs) on 1 and 2 of the longest documents. Returns the resolved options
    and how the size was chosen."""
    device = next(model.parameters()).device
    label = "default" if opts.memory_budget is None else str(opts.memory_budget)
    budget = default_budget(device) if opts.memory_budget is None else parse_bytes(opts.memory_budget)
    resolved = dataclasses.replace(opts, batch_size=1, memory_budget=None)
    stored = None if opts.store_path is None else SweepStore.stored_fingerprint(opts.store_path)
    if stored is not None and stored.get("batch_size_auto") == label and isinstance(stored.get("batch_size"), int):
        size = stored["batch_size"]  # a resumed run keeps the batch its finished jobs were computed with
        return dataclasses.replace(resolved, batch_size=size), {
            "memory_budget": label,
            "batch_size": size,
            "from": "store",
        }
    longest = torch.argsort(docs.lengths, descending=True, stable=True)
    starts = tuple(sorted({job.start_layer for job in jobs} - {0}))
    ablated = sorted({j.layer for j in jobs if isinstance(j, AblationJob)})
    means = (
        {layer: torch.zeros(info.n_heads, info.d_head, device="cpu") for layer in ablated} if _needs_means(kind) else {}
    )
    context = TaskContext(model, info)

    def probe(k: int) -> None:
        sub = Documents(docs.tokens[longest[:k]], docs.lengths[longest[:k]], docs.source, docs.first[longest[:k]])
        plan = SweepPlan(sub, starts, k, opts.tokens_per_forward, kind, positions, means, metric)
        (batch,) = _reference_pass(model, info, plan, metric.base or kind is not None)
        metric.measure(context, plan, metric.chunks(list(jobs), plan)[0], batch)

    chosen = choose_batch_size(probe, n_docs=len(docs), tokens=int(docs.lengths.max()), budget=budget, device=device)
    return dataclasses.replace(resolved, batch_size=chosen.batch_size), {"memory_budget": label, **chosen.record()}


@long_call
def run_sweep(
    model: TransformerBridge,
    documents: DocumentsLike,
    jobs: Sequence[Job],
    *,
    metric: Metric[Any] | None = None,
    ablation: Ablation | None = None,
    positions: EditPositions = "all",
    options: RunOptions | None = None,
    desc: str = "sweep",
    memo: dict[Any, Any] | None = None,
    **changes: Any,
) -> SweepRun:
    """Run every job and measure it with ``metric`` (default :class:`DocumentNLL`; see the module docstring).

    ``documents``: anything :meth:`Documents.of` takes. ``ablation`` / ``positions``: how :class:`AblationJob` s
    remove their heads (zero, mean, parallel-value, parallel-residual; at ``all`` positions or ``after-first``).
    ``options`` (:class:`~lens_parallel.options.RunOptions`, or its fields as keywords: ``batch_size``,
    ``tokens_per_forward``, ``store``, ``progress``, ``workers``, ``ray_address``): ``store`` makes the sweep
    resumable; ``workers`` / ``ray_address`` run the chunks of jobs on Ray actors that each load the model by its
    spec (this process writes the store, so a run killed midway resumes with or without workers, and the numbers
    equal a single-process run's exactly). ``memo``: a cache a caller keeps across sweeps on the same documents
    (the reference pass is computed once), e.g. an interactive explorer. Three steps: :func:`plan_sweep` (every
    check, the batch size), the store's session (:func:`_stored`), :func:`_execute`.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> jobs = [lp.EditJob("none", ()), lp.EditJob("zero-diag", (lp.ZeroDiagonal(),))]
        >>> run = lp.run_sweep(model, docs, jobs, progress=False)
        >>> sorted(run.values)
        ['none', 'zero-diag']
    """
    check_model(model)
    refuse_renamed(changes, {"edit": "ablation"}, where="run_sweep")
    setup = plan_sweep(
        model, documents, jobs, metric=metric, ablation=ablation, positions=positions, options=options, changes=changes
    )
    with _stored(model, setup) as (store, done, digest), _one_attention_path(setup):
        try:
            base = _execute(model, setup, store, done, digest, memo=memo, desc=desc)
        except KeyboardInterrupt as exc:
            raise _stopped(exc, setup.jobs, done, store, desc) from None
    n_tokens = setup.documents.n_tokens
    base_losses = None if base is None else DocLosses(base.double().cpu().numpy(), n_tokens)
    values = {job.key: done[job.key] for job in setup.jobs}
    return SweepRun(base=base_losses, values=values, n_tokens=n_tokens, options=setup.options, auto_batch=setup.auto)


def _one_attention_path(setup: SweepSetup) -> contextlib.AbstractContextManager[None]:
    """Every forward of a sweep on one attention path, so that the reference pass, the matched no-ops and the
    edited runs round alike and a no-op still reproduces the unedited losses bit for bit: the diagonal one when the
    edits that use the pattern use only its diagonal, the blocked one when one reads or rewrites whole rows (or
    says nothing of what it reads); else each layer's own choice (fused)."""
    uses = [
        "rows" if (footprint := edit_footprint(edit, setup.info)) is None else footprint.pattern
        for job in setup.jobs
        if isinstance(job, EditJob)
        for edit in job.edits
    ]
    path = PATTERN_PATHS[max(uses, key=PATTERN_USES.index, default="none")]
    return contextlib.nullcontext() if path is None else attention_path(path)


@dataclass(frozen=True)
class SweepSetup:
    """A checked sweep, before any forward: the model's info, the documents, the unique jobs, the metric, how
    ablation jobs remove heads (``ablation`` None when there are none), the run options with the batch size
    resolved (``auto``: how ``batch_size="auto"`` chose it) and whether chunks run on Ray."""

    info: ModelInfo
    documents: Documents
    jobs: list[Job]
    metric: Metric[Any]
    ablation: Ablation | None
    positions: EditPositions
    options: RunOptions
    auto: dict[str, Any] | None
    distributed: bool

    @property
    def batch_size(self) -> int:
        size = self.options.batch_size
        assert isinstance(size, int)  # "auto" is resolved by plan_sweep
        return size

    def plan_fields(self) -> dict[str, Any]:
        """What the store's fingerprint holds of the run besides the model, documents and metric."""
        out: dict[str, Any] = {"ablation": self.ablation, **self.options.numbers()}
        out |= {} if self.auto is None else {"batch_size_auto": self.auto["memory_budget"]}
        return out | ({} if self.positions == "all" else {"positions": self.positions})


def plan_sweep(
    model: TransformerBridge,
    documents: DocumentsLike,
    jobs: Sequence[Job],
    *,
    metric: Metric[Any] | None,
    ablation: Ablation | None,
    positions: EditPositions,
    options: RunOptions | None,
    changes: dict[str, Any],
) -> SweepSetup:
    """Every check of a sweep (options, workers, document lengths, jobs, every edit against the model) and its
    batch size (``batch_size="auto"`` measured here), before any forward of the run."""
    opts = resolve_options(options, changes)
    metric = DocumentNLL() if metric is None else metric
    distributed = check_workers(opts.workers, opts.ray_address, model)
    info = model_info(model)
    docs = Documents.of(documents, model)
    if int(docs.lengths.max()) > model.cfg.n_ctx:
        raise LensParallelError(
            f"a document of {int(docs.lengths.max())} tokens exceeds {info.name}'s context length n_ctx="
            f"{model.cfg.n_ctx}: cut the documents to at most {model.cfg.n_ctx} tokens"
        )
    if ablation is not None:
        check_choice("ablation", ablation, Ablation)
    unique = _validate(jobs, info, ablation)
    check_positions(positions)
    for job in unique:
        if isinstance(job, EditJob):
            compile_hooks(model, job.edits)  # every edit checked against the model before the first forward
    kind = ablation if any(isinstance(j, AblationJob) for j in unique) else None
    auto: dict[str, Any] | None = None
    if opts.batch_size == "auto":
        opts, auto = _auto_batch_size(model, info, docs, metric, unique, opts, kind, positions)
    return SweepSetup(info, docs, unique, metric, kind, positions, opts, auto, distributed)


@contextlib.contextmanager
def _stored(
    model: TransformerBridge, setup: SweepSetup
) -> Iterator[tuple[SweepStore | None, dict[str, Values], str | None]]:
    """The run's store (None without one), the values it already holds and the weights' digest; its writer lock
    is held from reading the finished jobs to the last row written."""
    if setup.options.store is None:
        yield None, {}, None
        return
    digest = weights_digest(model)
    print_ = fingerprint(model, setup.documents, setup.metric, setup.plan_fields(), weights=digest)
    store = SweepStore(setup.options.store, print_, len(setup.documents), setup.metric.spec)
    with store.session(setup.jobs) as done:
        yield store, done, digest


def reference_key(plan: SweepPlan) -> tuple[Any, ...]:
    """The key of a plan's reference pass in a memo or a worker's cache (documents, start layers, metric)."""
    return ("reference", plan.documents.digest(), plan.starts, json.dumps(plan.metric.fingerprint(), sort_keys=True))


def _execute(
    model: TransformerBridge,
    setup: SweepSetup,
    store: SweepStore | None,
    done: dict[str, Values],
    digest: str | None,
    *,
    memo: dict[Any, Any] | None,
    desc: str,
) -> Tensor | None:
    """Run the jobs ``done`` does not hold (adding each finished job's value to ``done`` and the store) and return
    the unedited per-document losses when the reference pass computed them."""
    docs, metric, kind, info = setup.documents, setup.metric, setup.ablation, setup.info
    todo = [job for job in setup.jobs if job.key not in done]
    head_layers = sorted({j.layer for j in todo if isinstance(j, AblationJob)})
    batch_size = setup.batch_size
    means = head_means(model, docs, head_layers, batch_size=batch_size) if _needs_means(kind) and head_layers else {}
    starts = tuple(sorted({job.start_layer for job in todo} - {0}))
    plan = SweepPlan(docs, starts, batch_size, setup.options.tokens_per_forward, kind, setup.positions, means, metric)
    memo = {} if memo is None else memo
    need_base = metric.base or kind is not None  # ablations are compared with the unedited model
    base = None
    if need_base or (starts and not setup.distributed):  # the caller's own reference pass: base losses, prefixes here
        key = reference_key(plan)
        if key not in memo or (need_base and any(b.base is None for b in memo[key])):
            memo[key] = _reference_pass(model, info, plan, need_base)
        batches = memo[key]
        if need_base and all(b.base is not None for b in batches):
            base = torch.cat([b.base for b in batches if b.base is not None])
    chunks = metric.chunks(todo, plan)
    n_jobs, n_batches = len(setup.jobs), len(range(0, len(docs), batch_size))  # the bar moves per job and batch
    desc = f"{desc} ({n_jobs} job{'s' * (n_jobs > 1)} x {n_batches} batch{'es' * (n_batches > 1)})"
    bar = tqdm(total=n_jobs * n_batches, desc=desc, unit="step", disable=not setup.options.progress)
    bar.update((n_jobs - len(todo)) * n_batches)
    finished = run_tasks(
        model,
        _sweep_task,
        plan,
        chunks,
        workers=setup.options.workers,
        ray_address=setup.options.ray_address,
        memo=memo,
        digest=digest,
        progress=bar.update,
    )
    try:
        for i, values in finished:
            bad = []
            for job, value in zip(chunks[i], values, strict=True):
                if any(spec.problem(value[n], len(docs)) for n, spec in metric.spec(job).items()):
                    bad.append(job.key)
                    continue
                done[job.key] = value
                if store is not None:
                    store.append(job, value)
            if bad:
                raise NonFiniteError(
                    f"job(s) {', '.join(bad)} gave a value that is not finite (from finite activations: e.g. a "
                    f"division by a near-zero norm in {next(model.parameters()).dtype}); {metric.name} needs finite "
                    "values: run in float32, or change the edit"
                )
            bar.update(len(done) * n_batches - bar.n)  # chunks from Ray workers: counted as they arrive
    finally:
        bar.close()
    return base


def _stopped(
    exc: KeyboardInterrupt, jobs: Sequence[Job], done: dict[str, Values], store: SweepStore | None, desc: str
) -> KeyboardInterrupt:
    """The one-line interrupt (:func:`~lens_parallel.errors.interrupted`) of a sweep that Ctrl-C stopped: how many of
    its jobs finished, and whether they are kept in its store (a rerun resumes from them) or lost (no store); an
    interrupt already said by a sweep inside this one, as it is."""
    if interrupt_message(exc) is not None:
        return exc
    kept = sum(job.key in done for job in jobs)
    if not kept:
        return interrupted(f"{desc}: stopped before any of its {len(jobs)} jobs finished; nothing was kept")
    where = (
        f"kept in {store.path}: run the same call again to resume from them"
        if store is not None
        else "none kept (store= makes a run resumable)"
    )
    return interrupted(f"{desc}: stopped after {kept} of {len(jobs)} jobs finished, {where}")
