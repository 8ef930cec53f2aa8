"""Head ablations on the sweep engine: per-document losses with sets of heads removed, as a saveable result.

For every job (a layer and a set of query heads) it measures per-document next-token NLL with those heads
ablated (:class:`lens_parallel.edits.HeadEdit`: zero, mean, parallel-value, parallel-residual). The engine
(:func:`lens_parallel.sweep.run_sweep`) reuses the unedited prefix, stacks several jobs per forward, streams each
finished job to ``store`` and resumes from it. Results equal the naive loop to float rounding (tested to 1e-5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.bridges import check_model
from lens_parallel.choices import Ablation, EditPositions
from lens_parallel.documents import Documents, DocumentsLike
from lens_parallel.edits import check_positions
from lens_parallel.errors import long_call
from lens_parallel.losses import DocLosses
from lens_parallel.models import model_info
from lens_parallel.options import RunOptions, resolve
from lens_parallel.plots.ablation import ablation_figure
from lens_parallel.results import Provenance, ResultMixin
from lens_parallel.sweep import AblationJob, run_sweep
from lens_parallel.validate import check_choice


@dataclass(frozen=True, repr=False)
class AblationRun(ResultMixin):
    """Per-document NLL sums of the unedited model (``base_loss_sum [document]``) and of every job
    (``loss_sum [job, document]``), ``n_tokens [document]`` scored tokens; ``run[job]`` gives a job's
    :class:`DocLosses`.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> run = lp.run_ablations(model, docs, [lp.AblationJob(1, (2,))], progress=False)
        >>> type(run).__name__
        'AblationRun'
    """

    columns: ClassVar[str] = (
        "model ablation label layer heads document delta_loss n_jobs n_docs loss_base mean_delta_loss "
        "max_delta_loss max_delta_label"
    )

    ablation: Ablation
    jobs: tuple[AblationJob, ...]
    base_loss_sum: np.ndarray
    loss_sum: np.ndarray
    n_tokens: np.ndarray
    provenance: Provenance

    @property
    def base(self) -> DocLosses:
        return DocLosses(self.base_loss_sum, self.n_tokens)

    def __getitem__(self, job: AblationJob) -> DocLosses:
        return DocLosses(self.loss_sum[self.jobs.index(job)], self.n_tokens)

    def delta(self) -> np.ndarray:
        """Token-weighted delta loss (nats/token) of every job, ablated minus unedited."""
        n = self.n_tokens.sum()
        delta: np.ndarray = self.loss_sum.sum(1) / n - self.base_loss_sum.sum() / n
        return delta

    def to_dataframe(self) -> pd.DataFrame:
        """One row per (job, document): the per-document delta loss (nats/token)."""
        per_doc = (self.loss_sum - self.base_loss_sum) / self.n_tokens
        return pd.DataFrame(
            [
                {
                    "model": self.info.name,
                    "ablation": self.ablation,
                    "label": job.key,
                    "layer": job.layer,
                    "heads": "+".join(map(str, job.heads)),
                    "document": d,
                    "delta_loss": per_doc[i, d],
                }
                for i, job in enumerate(self.jobs)
                for d in range(per_doc.shape[1])
            ]
        )

    def summary(self) -> pd.DataFrame:
        delta = self.delta()
        worst = int(np.argmax(delta))
        return pd.DataFrame(
            [
                {
                    "model": self.info.name,
                    "ablation": self.ablation,
                    "n_jobs": len(self.jobs),
                    "n_docs": self.loss_sum.shape[1],
                    "loss_base": self.base.loss,
                    "mean_delta_loss": float(delta.mean()),
                    "max_delta_loss": float(delta[worst]),
                    "max_delta_label": self.jobs[worst].key,
                }
            ]
        )

    def figures(self) -> dict[str, go.Figure]:
        return {"ablation": self.figure()}

    def figure(self) -> go.Figure:
        return ablation_figure(self)


@dataclass(frozen=True, kw_only=True)
class AblationSettings:
    """What an ablation run computes: how heads are removed (``ablation``: zero, mean, parallel-value,
    parallel-residual) and at which positions (``positions``: all, or after-first: the boundary token untouched).

    Examples:
        >>> import lens_parallel as lp
        >>> lp.AblationSettings(ablation="mean").ablation
        'mean'
    """

    ablation: Ablation = field(default="parallel-value", metadata={"help": "how heads are removed"})
    positions: EditPositions = field(default="all", metadata={"help": "after-first: leave the boundary token"})

    def __post_init__(self) -> None:
        check_choice("ablation", self.ablation, Ablation)
        check_positions(self.positions)


@long_call
def run_ablations(
    model: TransformerBridge,
    documents: DocumentsLike,
    jobs: Sequence[AblationJob | tuple[int, int | Sequence[int]]],
    *,
    settings: AblationSettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> AblationRun:
    """Run every ablation job on the sweep engine (:class:`AblationSettings`: ``ablation``, ``positions``; run options:
    :class:`~lens_parallel.options.RunOptions`, e.g. ``store=`` to make it resumable, ``workers=`` for Ray); both as
    keyword shortcuts too.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> run = lp.run_ablations(model, docs, [lp.AblationJob(0, (0, 1))], ablation="zero", progress=False)
        >>> run.to_dataframe()["label"].unique().tolist()
        ['L0H0+1']
        >>> lp.run_ablations(model, docs, [(1, 2)], progress=False).jobs  # (layer, head) pairs too
        (AblationJob(layer=1, heads=(2,)),)
    """
    check_model(model)
    s, opts = resolve(AblationSettings, settings, options, protocol, changes)
    docs = Documents.of(documents, model)
    unique = tuple(dict.fromkeys(AblationJob.of(job) for job in jobs))
    run = run_sweep(
        model, docs, unique, ablation=s.ablation, positions=s.positions, options=opts, desc=f"ablate ({s.ablation})"
    )
    assert run.base is not None
    return AblationRun(
        ablation=s.ablation,
        jobs=unique,
        base_loss_sum=run.base.loss_sum,
        loss_sum=np.stack([run[job].loss_sum for job in unique]),
        n_tokens=run.n_tokens,
        provenance=Provenance.of(model_info(model), docs, "run_ablations", s, run),
    )
