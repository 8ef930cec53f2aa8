"""Loss under an intervention, and its effect against the matched no-op, on the engine.

:func:`document_losses`: per-document NLL sums under ``edits`` (one :class:`~lens_parallel.sweep.EditJob`);
:func:`evaluate`: the edited and the matched no-op runs in one sweep, their difference with paired bootstrap CIs
(:class:`~lens_parallel.losses.EditEffect`). Both take any documents the engine takes (ragged included) and any
edit following :class:`~lens_parallel.edits.Edit` (user-defined included).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.bridges import check_model
from lens_parallel.distributed import TaskContext
from lens_parallel.documents import Documents, DocumentsLike
from lens_parallel.edits import Edit, Intervention, as_edits, compile_hooks, describe_edit, noop
from lens_parallel.errors import LensParallelError, long_call
from lens_parallel.losses import (
    DocLosses,
    EditEffect,
    chunked_divergence,
    distribution_shift,
    edit_effect,
    scored_sums,
    unembedding,
)
from lens_parallel.models import model_info
from lens_parallel.options import RunOptions, resolve, resolve_options
from lens_parallel.results import Provenance
from lens_parallel.stats import N_RESAMPLES
from lens_parallel.store import Values, ValueSpec
from lens_parallel.sweep import Batch, EditJob, Metric, SweepPlan, run_rows, run_sweep
from lens_parallel.validate import check_non_negative_int, check_positive_int


@long_call
def document_losses(
    model: TransformerBridge,
    documents: DocumentsLike,
    edits: Intervention = (),
    *,
    options: RunOptions | None = None,
    **changes: Any,
) -> DocLosses:
    """Per-document NLL sums of the model under ``edits`` (validated before the first forward): one job of the
    engine, one full forward per batch. ``options`` / keywords: :class:`~lens_parallel.options.RunOptions`
    (default here: no progress bar).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> losses = lp.document_losses(model, docs, progress=False)
        >>> losses.n_tokens.tolist()  # scored tokens per document
        [15, 15, 15, 15]
    """
    info = check_model(model)
    opts = resolve_options(options, changes, defaults={"progress": False})
    job = EditJob("edited", as_edits(edits, info))
    return run_sweep(model, documents, [job], options=opts, desc="loss")[job]


class DistributionShift(Metric[EditJob]):
    """Per document, the matched no-op and the edit run on the same rows (two forwards to the final residual): both
    NLL sums, the summed KL(no-op || edited) of the next-token distributions and the number of predicting
    positions whose top-1 tokens agree (:func:`~lens_parallel.losses.chunked_divergence`: no full logits)."""

    name = "distribution-shift"

    def __init__(self, matched: tuple[Edit, ...]) -> None:
        self.matched = matched

    def fingerprint(self) -> dict[str, Any]:
        return {"metric": self.name, "noop": [describe_edit(e) for e in self.matched]}

    def spec(self, job: EditJob) -> dict[str, ValueSpec]:
        return {k: ValueSpec(("docs",)) for k in ("loss_noop", "loss_edited", "kl_sum", "agree_sum")}

    def measure(self, context: TaskContext, plan: SweepPlan, jobs: Sequence[EditJob], batch: Batch) -> list[Values]:
        (job,) = jobs
        model, info = context.model, context.info
        finals = [
            run_rows(
                model, info, batch, hooks=compile_hooks(model, edits), start_layer=job.start_layer, keep_final=True
            )
            for edits in (self.matched, job.edits)
        ]
        final_p, final_q = finals[0].final, finals[1].final
        assert final_p is not None and final_q is not None
        docs = batch.docs
        with torch.inference_mode():  # both losses and the shift from one unembedding of each residual
            nll_p, nll_q, kl, agree = chunked_divergence(
                final_p, final_q, unembedding(model), docs.tokens, docs.lengths, first=docs.first
            )
        names = ("loss_noop", "loss_edited", "kl_sum", "agree_sum")
        values = (nll_p, nll_q, kl, agree)
        per_doc = {name: scored_sums(x, docs.lengths, docs.first) for name, x in zip(names, values, strict=True)}
        return [{k: v.double().cpu().numpy() for k, v in per_doc.items()}]


@dataclass(frozen=True, kw_only=True)
class EvaluateSettings:
    """How :func:`evaluate` states its effects: paired bootstrap CIs over documents from ``n_resamples`` resamples
    seeded by ``seed``.

    Examples:
        >>> import lens_parallel as lp
        >>> lp.EvaluateSettings(n_resamples=500).n_resamples
        500
    """

    n_resamples: int = field(default=N_RESAMPLES, metadata={"help": "bootstrap resamples of the CIs"})
    seed: int = field(default=0, metadata={"help": "seed of the bootstrap"})

    def __post_init__(self) -> None:
        check_positive_int("n_resamples", self.n_resamples)
        check_non_negative_int("seed", self.seed)


@long_call
def evaluate(
    model: TransformerBridge,
    documents: DocumentsLike,
    edits: Intervention,
    *,
    settings: EvaluateSettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> EditEffect:
    """Loss and perplexity under ``edits`` minus the matched no-op (:func:`~lens_parallel.edits.noop`), and how far
    the next-token distribution moves: KL(no-op || edited) per scored position and the fraction of positions whose
    top-1 token is unchanged, each with a paired bootstrap CI over documents (:class:`EvaluateSettings`); both runs
    on the same batches of one sweep (:class:`DistributionShift`). Run options
    :class:`~lens_parallel.options.RunOptions` (default here: no progress bar); both as keyword shortcuts.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> effect = lp.evaluate(model, docs, lp.ZeroDiagonal(layers=[0]), n_resamples=50, progress=False)
        >>> type(effect).__name__
        'EditEffect'
    """
    info = check_model(model)
    s, opts = resolve(EvaluateSettings, settings, options, protocol, changes, option_defaults={"progress": False})
    n_resamples, seed = s.n_resamples, s.seed
    edits = as_edits(edits, info)
    if not edits:
        raise LensParallelError(
            "evaluate: no edits (an empty list), so nothing to compare with the matched no-op; give at least one edit "
            "(document_losses gives the unedited losses)"
        )
    job = EditJob("edited", edits)
    docs = Documents.of(documents, model)
    run = run_sweep(model, docs, [job], metric=DistributionShift(noop(edits)), options=opts, desc="evaluate")
    values, n_tokens = run.value(job), run.n_tokens
    effect = edit_effect(
        DocLosses(values["loss_noop"], n_tokens),
        DocLosses(values["loss_edited"], n_tokens),
        n_resamples=n_resamples,
        seed=seed,
    )
    shift = distribution_shift(values["kl_sum"], values["agree_sum"], n_tokens, n_resamples=n_resamples, seed=seed)
    provenance = Provenance.of(model_info(model), docs, "evaluate", s, run, edits=[describe_edit(e) for e in edits])
    return dataclasses.replace(effect, **shift, provenance=provenance)
