"""Loss under an intervention, and its effect against the matched no-op, on the engine.

:func:`document_losses`: per-document NLL sums under ``edits`` (one :class:`~lens_parallel.sweep.EditJob`);
:func:`evaluate`: the edited and the matched no-op runs in one sweep, their difference with paired bootstrap CIs
(:class:`~lens_parallel.losses.EditEffect`). Both take any documents the engine takes (ragged included) and any
edit following :class:`~lens_parallel.edits.Edit` (user-defined included).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.documents import Documents
from lens_parallel.edits import Edit, as_edits, describe_edit, noop
from lens_parallel.losses import DocLosses, EditEffect, edit_effect
from lens_parallel.models import model_info
from lens_parallel.options import RunOptions, resolve_options
from lens_parallel.results import Provenance
from lens_parallel.sweep import EditJob, run_sweep


def document_losses(
    model: TransformerBridge,
    documents: object,
    edits: Edit | Sequence[Edit] = (),
    *,
    options: RunOptions | None = None,
    **changes: Any,
) -> DocLosses:
    """Per-document NLL sums of the model under ``edits`` (validated before the first forward): one job of the
    engine, one full forward per batch. ``options`` / keywords: :class:`~lens_parallel.options.RunOptions`
    (default here: no progress bar)."""
    opts = resolve_options(options, {"progress": False, **changes})
    job = EditJob("edited", as_edits(edits))
    return run_sweep(model, documents, [job], options=opts, desc="loss")[job]


def evaluate(
    model: TransformerBridge,
    documents: object,
    edits: Edit | Sequence[Edit],
    *,
    n_resamples: int = 2000,
    seed: int = 0,
    options: RunOptions | None = None,
    **changes: Any,
) -> EditEffect:
    """Loss and perplexity under ``edits`` minus the matched no-op (:func:`~lens_parallel.edits.noop`), both run in
    one sweep, with paired bootstrap CIs over documents (``n_resamples``, ``seed``)."""
    opts = resolve_options(options, {"progress": False, **changes})
    edits = as_edits(edits)
    edited, matched = EditJob("edited", edits), EditJob("noop", noop(edits))
    run = run_sweep(model, documents, [matched, edited], options=opts, desc="evaluate")
    effect = edit_effect(run[matched], run[edited], n_resamples=n_resamples, seed=seed)
    provenance = Provenance.collect(
        model_info(model),
        Documents.of(documents),
        analysis="evaluate",
        edits=[describe_edit(e) for e in edits],
        n_resamples=n_resamples,
        seed=seed,
        options=run.record(),
    )
    return dataclasses.replace(effect, provenance=provenance)
