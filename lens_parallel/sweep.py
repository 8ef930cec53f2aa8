"""The sweep engine: many edited forwards over one set of documents, batched, prefix-reusing and resumable.

A sweep is a list of *jobs* (plain, frozen data: which edit, from which layer), the documents, and a metric: the
per-document next-token NLL sum of each job's edited forward. :func:`run_sweep` alone owns

(a) **batching documents**: ``batch_size`` documents per forward;
(b) **prefix reuse**: one unedited forward per batch gives the base losses and caches ``resid_pre`` of every layer a
    job starts at; each edited forward resumes there (``start_at_layer``; earlier blocks are not computed). A sweep
    of whole-model edits only (every job starts at layer 0, none removes heads) skips that pass;
(c) **several jobs per forward**: jobs that stack (:class:`AblationJob` of one layer) share a forward, each batch of
    documents tiled once per job with its own head mask, up to ``rows_per_forward`` rows;
(d) **a crash-safe resumable store**: a JSON-lines file whose first line is the run's fingerprint and each further
    line one finished job. A rerun with the same store skips finished jobs; a last line cut by a kill mid-write is
    dropped (that job is recomputed), as is, with a warning, any row that is not ``n_docs`` finite numbers; a store
    written by a run whose numbers would differ (another model or other weights, hashed exactly; tokens, edit kind,
    batch size, dtype, ...) is refused with what differs. Creation and appends hold a file lock;
(e) a progress bar.

Analyses whose metric is captured activations rather than losses batch through :func:`capture` (streamed hooks,
reduced per batch); every loop over documents uses :func:`lens_parallel.data.document_batches`.

Jobs are plain data, so they can be handed to other workers; equal jobs are run once. Results equal the naive loop
(one full forward with the edit's hooks per job) to float rounding (tested to 1e-5).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import einops
import numpy as np
import torch
from filelock import FileLock
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.data import TokenBlocks, document_batches
from lens_parallel.distributed import TaskContext, check_workers, run_tasks
from lens_parallel.edits import ABLATIONS, ComponentScale, DiagonalEdit, HeadEdit, check_positions, compile_hooks
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import LayerStream, check_indices, hook_name, softmax_layers
from lens_parallel.losses import DocLosses, batch_nll, next_token_nll
from lens_parallel.models import ModelInfo, model_info, weights_digest
from lens_parallel.paths import add_suffix
from lens_parallel.results import as_tokens, serializable

STORE_FORMAT = "lens_parallel.sweep/1"


@serializable
@dataclass(frozen=True)
class AblationJob:
    """Remove query ``heads`` of ``layer`` together (how: the sweep's ``edit``, one of :data:`ABLATIONS`)."""

    layer: int
    heads: tuple[int, ...]

    @property
    def key(self) -> str:
        return f"L{self.layer}H" + "+".join(map(str, self.heads))

    @property
    def start_layer(self) -> int:
        return self.layer


@dataclass(frozen=True)
class EditJob:
    """Run ``edits`` (:class:`ComponentScale` / :class:`DiagonalEdit`, frozen data) from ``start_layer`` on: no
    edit may touch an earlier layer. ``key`` names the job in the store."""

    key: str
    edits: tuple[ComponentScale | DiagonalEdit, ...]
    start_layer: int = 0


Job = AblationJob | EditJob


@dataclass(frozen=True)
class SweepRun:
    """Per-document losses of every job and, when the sweep has ablation jobs or resumes at a later layer, of the
    unedited model (``base``; None for a sweep of whole-model edits, which carries its own matched no-op job)."""

    base: DocLosses | None
    edited: dict[str, DocLosses]

    def __getitem__(self, job: Job) -> DocLosses:
        return self.edited[job.key]


def head_means(
    model: TransformerBridge, tokens: Int[Tensor, "batch pos"], layers: Sequence[int], *, batch_size: int = 8
) -> dict[int, Float[Tensor, "head_index d_head"]]:
    """Mean of hook_z per layer and head over all documents and positions (for mean ablation), streamed."""
    info = model_info(model)
    sums = {layer: torch.zeros(info.n_heads, info.d_head, dtype=torch.float64) for layer in layers}

    def reduce(layer: int, t: dict[str, Tensor]) -> None:
        sums[layer] += einops.reduce(t["z"], "b p h d -> h d", "sum")

    stream = LayerStream(info, layers, ["z"], reduce)
    for _, batch in document_batches(tokens, batch_size):
        stream.run(model, batch)
    return {layer: (s / tokens.numel()).float() for layer, s in sums.items()}


def capture(
    model: TransformerBridge,
    tokens: TokenBlocks | Int[Tensor, "batch pos"],
    layers: Sequence[int],
    roles: Sequence[str] | dict[int, Sequence[str]],
    reduce: Callable[[slice, int, dict[str, Tensor]], None],
    *,
    batch_size: int = 8,
    dtype: torch.dtype = torch.float64,
    progress: bool = False,
    desc: str = "capture",
) -> None:
    """Captured-activation metric: stream ``roles`` at ``layers`` (:class:`~lens_parallel.hooks.LayerStream`, each
    forward stopped after the last layer needed) over batches of documents; ``reduce(rows, layer, tensors)`` gets
    each layer's tensors of the documents ``rows`` as soon as they are complete."""
    info, toks = model_info(model), as_tokens(tokens)
    for rows, batch in document_batches(toks, batch_size, progress=progress, desc=desc):
        LayerStream(info, layers, roles, partial(reduce, rows), dtype=dtype).run(model, batch)


def _validate(jobs: Sequence[Job], info: ModelInfo, edit: str | None) -> list[Job]:
    if not jobs:
        raise LensParallelError("no sweep jobs given")
    for job in jobs:
        if isinstance(job, AblationJob):
            if edit not in ABLATIONS:
                raise LensParallelError(f"unknown ablation edit {edit!r}; accepted: {', '.join(ABLATIONS)}")
            if not job.heads:
                raise LensParallelError(f"job at layer {job.layer} has an empty head set: give at least one query head")
            softmax_layers(info, [job.layer], what="head ablation")
            check_indices("heads", job.heads, info.n_heads)
        elif isinstance(job, EditJob):
            check_indices("start layer", job.start_layer, info.n_layers)
            for e in job.edits:
                first = min(e.layers) if e.layers is not None else 0
                if first < job.start_layer:
                    raise LensParallelError(
                        f"job {job.key!r} edits layer {first}, before its start layer {job.start_layer}"
                    )
        else:
            raise LensParallelError(f"a sweep job is an AblationJob or an EditJob, got {type(job).__name__}")
    unique = list(dict.fromkeys(jobs))
    keys = [job.key for job in unique]
    if len(set(keys)) != len(keys):
        raise LensParallelError("two different jobs share a key; give each EditJob its own key")
    return unique


def job_digest(job: Job) -> str:
    """A short hash of everything a job is (its edits with every field), so that a store never hands back a result
    computed for a job that shares the key but not the content."""
    return hashlib.sha256(repr(job).encode()).hexdigest()[:16]


STORE_ADVICE = "delete it to recompute, or give another store (store= in Python, --store on the command line)"


class SweepStore:
    """The JSON-lines store of a sweep: line 1 ``{"format", "fingerprint"}``, then one ``{"job", "digest",
    "loss_sum"}`` per finished job, each written with one ``write`` and flushed to disk. Opening (header written or
    checked) and every append hold the store's file lock (``<store>.lock``), so two processes never both write a
    header, and rows are appended whole."""

    def __init__(self, path: str | Path, fingerprint: dict, n_docs: int) -> None:
        self.path, self.fingerprint, self.n_docs = Path(path), fingerprint, n_docs
        self.lock = FileLock(str(add_suffix(self.path, ".lock")))

    def open(self, jobs: Sequence[Job]) -> dict[str, list[float]]:
        """Finished jobs, after writing the header of a new (or empty) store or checking an existing one's: refuses
        a store of another run, or one holding a job under the key of one of ``jobs`` with other content. A row
        that is not a finished job of this sweep (cut by a kill, or not ``n_docs`` finite numbers) is dropped with
        a warning, so that job is recomputed."""
        if self.path.is_dir():
            raise LensParallelError(f"store {self.path} is a folder; give a file path for the sweep store")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.lock:
            raw = self.path.read_bytes() if self.path.is_file() else b""
            lines = raw.split(b"\n")
            complete, tail = lines[:-1], lines[-1]  # tail: text after the last newline (a cut line, or empty)
            if not complete:  # new, or the header itself was cut: nothing was finished
                self._rewrite([])
                return {}
            self._check_header(complete[0])
            done, digests, kept, dropped = {}, {}, [], []
            for i, line in enumerate(complete[1:], start=2):
                row, problem = self._row(line)
                if problem:
                    dropped.append(f"line {i}: {problem}")
                    continue
                done[row["job"]], digests[row["job"]] = row["loss_sum"], row["digest"]
                kept.append(line)
            for job in jobs:
                if job.key in digests and digests[job.key] != job_digest(job):
                    raise LensParallelError(
                        f"{self.path} holds a job {job.key!r} computed with other settings than {job!r}; {STORE_ADVICE}"
                    )
            if dropped:
                warnings.warn(
                    f"{self.path}: dropped {len(dropped)} row(s) that are not finished jobs of this sweep "
                    f"({'; '.join(dropped[:3])}); those jobs are recomputed",
                    stacklevel=3,
                )
            if dropped or tail.strip():  # a line cut by a kill mid-write is dropped silently: its job reruns
                self._rewrite(kept)
            return done

    def _row(self, line: bytes) -> tuple[dict, str]:
        """The row of one line, or why it is not a finished job: the NLL metric is ``n_docs`` finite numbers."""
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return {}, f"not JSON ({exc})"
        if not isinstance(row, dict) or not isinstance(row.get("job"), str) or not isinstance(row.get("digest"), str):
            return {}, "no job key and digest"
        values = row.get("loss_sum")
        if not isinstance(values, list) or len(values) != self.n_docs:
            return {}, f"loss_sum is not a list of {self.n_docs} values (one per document)"
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            return {}, "loss_sum holds a value that is not a finite number"
        return row, ""

    def _check_header(self, line: bytes) -> None:
        try:
            header = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise LensParallelError(f"{self.path}: first line is not a sweep header ({exc}); {STORE_ADVICE}") from exc
        if not isinstance(header, dict) or header.get("format") != STORE_FORMAT:
            found = header.get("format") if isinstance(header, dict) else None
            raise LensParallelError(
                f"{self.path} is not a sweep store of format {STORE_FORMAT} (found {found!r}); {STORE_ADVICE}"
            )
        found = header.get("fingerprint") if isinstance(header.get("fingerprint"), dict) else {}
        keys = dict.fromkeys([*self.fingerprint, *found])  # both ways: a key only one side has differs too
        differ = {k: (found.get(k), self.fingerprint.get(k)) for k in keys if found.get(k) != self.fingerprint.get(k)}
        if differ:
            what = "; ".join(f"{k}: store has {a!r}, this run {b!r}" for k, (a, b) in differ.items())
            raise LensParallelError(
                f"{self.path} was written by a run whose numbers differ ({what}); {STORE_ADVICE}, or rerun with the "
                "store's settings"
            )

    def _rewrite(self, rows: list[bytes]) -> None:
        """Replace the store by its header and ``rows`` in one rename (the lock is held)."""
        header = json.dumps({"format": STORE_FORMAT, "fingerprint": self.fingerprint}).encode()
        tmp = add_suffix(self.path, f".tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(b"\n".join([header, *rows]) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def append(self, job: Job, values: list[float]) -> None:
        line = json.dumps({"job": job.key, "digest": job_digest(job), "loss_sum": values}, allow_nan=False)
        with self.lock, open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


def fingerprint(
    model: TransformerBridge,
    tokens: Int[Tensor, "batch pos"],
    *,
    edit: str | None,
    batch_size: int,
    rows: int,
    positions: str = "all",
    weights: str | None = None,
) -> dict:
    """Everything that changes a sweep's numbers: model name, config and the exact digest of its weights
    (:func:`~lens_parallel.models.weights_digest`; ``weights`` when the caller computed it), dtype, device type, the
    documents, the ablation edit (and its positions, when not ``all``), the batch size and the rows per forward
    (batch composition changes float rounding)."""
    info = model_info(model)
    param = next(model.parameters())
    extra = {} if positions == "all" else {"positions": positions}
    return extra | {
        "model": info.name,
        "config": info.config_hash,
        "weights": weights or weights_digest(model),
        "dtype": str(param.dtype),
        "device": param.device.type,
        "tokens": hashlib.sha256(tokens.cpu().numpy().tobytes()).hexdigest()[:16],
        "edit": edit,
        "batch_size": batch_size,
        "rows_per_forward": rows,
    }


def _chunks(todo: list[Job], per_forward: int) -> list[list[Job]]:
    """Group jobs into forwards: AblationJobs of one layer stack up to ``per_forward``; an EditJob runs alone."""
    chunks: list[list[Job]] = []
    for layer in sorted({job.start_layer for job in todo}):
        heads = [j for j in todo if isinstance(j, AblationJob) and j.layer == layer]
        chunks += [heads[i : i + per_forward] for i in range(0, len(heads), per_forward)]
        chunks += [[j] for j in todo if isinstance(j, EditJob) and j.start_layer == layer]
    return chunks


def _prefix_pass(
    model: TransformerBridge, toks: Tensor, layers: list[int], batch_size: int
) -> tuple[Tensor, list[tuple[Tensor, dict[int, Tensor]]]]:
    """One unedited forward per batch: per-document base NLL sums and ``resid_pre`` of every start layer > 0."""
    names = [hook_name(layer, "resid_pre") for layer in layers]
    batches, base = [], []
    for _, batch in document_batches(toks, batch_size):
        with torch.inference_mode():
            logits, cache = model.run_with_cache(batch, names_filter=names)
        base.append(next_token_nll(logits, batch))
        batches.append((batch, {layer: cache[name] for layer, name in zip(layers, names, strict=True)}))
    return torch.cat(base), batches


def _run_chunk(model, info, chunk: list[Job], batches, edit: str | None, means, positions: str) -> np.ndarray:
    """Per-document NLL sums ``[job, document]`` of one chunk of jobs, over every batch."""
    layer, k = chunk[0].start_layer, len(chunk)
    if isinstance(chunk[0], EditJob):
        hooks = compile_hooks(model, chunk[0].edits)
    sums = []
    for batch, prefix in batches:
        resid = prefix.get(layer)
        if isinstance(chunk[0], AblationJob):
            mask = torch.zeros(k, len(batch), info.n_heads, dtype=torch.bool, device=batch.device)
            for i, job in enumerate(chunk):
                mask[i, :, list(job.heads)] = True
            rows = einops.rearrange(mask, "k b h -> (k b) h")
            hooks = HeadEdit(edit, layer, rows, means.get(layer), positions=positions).hooks(model, info)
            batch = einops.repeat(batch, "b p -> (k b) p", k=k)
            resid = None if resid is None else einops.repeat(resid, "b p d -> (k b) p d", k=k)
        nll = batch_nll(model, batch, hooks, resid=resid, start_at_layer=layer if resid is not None else None)
        sums.append(einops.rearrange(nll, "(k b) -> k b", k=k))
    return torch.cat(sums, dim=1).double().cpu().numpy()


@dataclass(frozen=True)
class _SweepInput:
    """What every chunk of a sweep needs (sent once to each worker)."""

    tokens: Tensor
    starts: tuple[int, ...]
    batch_size: int
    kind: str | None
    means: dict[int, Tensor]
    positions: str


def _sweep_task(context: TaskContext, plan: _SweepInput, chunk: list[Job]) -> np.ndarray:
    """One chunk of jobs; the prefixes (or plain batches) are computed once per worker."""

    def batches():
        if plan.starts or plan.kind is not None:
            return _prefix_pass(context.model, plan.tokens, list(plan.starts), plan.batch_size)[1]
        return [(batch, {}) for _, batch in document_batches(plan.tokens, plan.batch_size)]

    prefixes = context.cached("batches", batches)
    return _run_chunk(context.model, context.info, chunk, prefixes, plan.kind, plan.means, plan.positions)


def run_sweep(
    model: TransformerBridge,
    tokens: TokenBlocks | Int[Tensor, "batch pos"],
    jobs: Sequence[Job],
    *,
    edit: str | None = None,
    positions: str = "all",
    batch_size: int = 8,
    rows_per_forward: int = 8,
    store: str | Path | None = None,
    progress: bool = True,
    desc: str = "sweep",
    workers: int = 1,
    ray_address: str | None = None,
) -> SweepRun:
    """Run every job (see the module docstring). ``edit``: how :class:`AblationJob` s remove their heads (zero, mean,
    parallel-value, parallel-residual), at ``positions`` (``all`` or ``after-first``). ``store``: a JSON-lines file
    that makes the sweep resumable. ``workers`` / ``ray_address``: run the chunks of jobs on Ray actors that each
    load the model by its spec (:mod:`lens_parallel.distributed`); this process writes the store, so a run killed
    midway resumes with or without workers, and the numbers equal a single-process run's exactly."""
    distributed = check_workers(workers, ray_address, model)
    info = model_info(model)
    tokens = as_tokens(tokens)
    jobs = _validate(jobs, info, edit)
    check_positions(positions)
    if batch_size < 1 or rows_per_forward < 1:
        raise LensParallelError(f"batch_size and rows_per_forward must be >= 1, got {batch_size}, {rows_per_forward}")
    kind = edit if any(isinstance(j, AblationJob) for j in jobs) else None
    sweep_store, digest = None, None
    done: dict[str, list[float]] = {}
    if store is not None:
        digest = weights_digest(model)
        fp = fingerprint(
            model, tokens, edit=kind, batch_size=batch_size, rows=rows_per_forward, positions=positions, weights=digest
        )
        sweep_store = SweepStore(store, fp, len(tokens))
        done = sweep_store.open(jobs)
    todo = [job for job in jobs if job.key not in done]
    head_layers = sorted({j.layer for j in todo if isinstance(j, AblationJob)})
    means = head_means(model, tokens, head_layers, batch_size=batch_size) if kind == "mean" and head_layers else {}
    starts = sorted({job.start_layer for job in todo} - {0})
    plan = _SweepInput(tokens, tuple(starts), batch_size, kind, means, positions)
    memo = {}
    if starts or kind is not None:  # the unedited pass gives the base losses (and, in this process, the prefixes)
        base, memo["batches"] = _prefix_pass(model, tokens, [] if distributed else starts, batch_size)
    else:  # whole-model edits from the tokens: no unedited forward needed
        base = None
    per_forward = max(1, rows_per_forward // min(batch_size, len(tokens)))
    chunks = _chunks(todo, per_forward)
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc=desc, unit="job", disable=not progress)
    finished = run_tasks(
        model, _sweep_task, plan, chunks, workers=workers, ray_address=ray_address, memo=memo, digest=digest
    )
    for i, rows in finished:
        bad = [job.key for job, row in zip(chunks[i], rows, strict=True) if not np.isfinite(row).all()]
        for job, row in zip(chunks[i], rows, strict=True):
            if job.key not in bad:
                done[job.key] = row.tolist()
                if sweep_store is not None:
                    sweep_store.append(job, done[job.key])
        if bad:
            raise LensParallelError(
                f"job(s) {', '.join(bad)} gave a loss that is not finite (the edited forward overflowed or produced "
                f"NaN, e.g. in {next(model.parameters()).dtype}); the next-token loss needs finite values: run in "
                "float32, or change the edit"
            )
        bar.update(len(chunks[i]))
    bar.close()
    n_tokens = np.full(len(tokens), tokens.shape[1] - 1, dtype=np.int64)
    return SweepRun(
        base=None if base is None else DocLosses(base.double().cpu().numpy(), n_tokens),
        edited={job.key: DocLosses(np.asarray(done[job.key]), n_tokens) for job in jobs},
    )
