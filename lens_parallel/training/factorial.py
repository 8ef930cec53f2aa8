"""Every arm x seed, paired by seed, and the paired analysis of final validation loss with declared endpoints.

For a contrast A - B and seed k, delta_k = L_final(A, k) - L_final(B, k) (nats/token; negative = A is better).
Reported per contrast: mean delta, 95% percentile-bootstrap CI over seeds, two-sided paired t-test
(``scipy.stats.ttest_1samp`` on the deltas, equal to ``ttest_rel``), Cohen's d_z = mean / sd, sigma_paired = sd(delta),
and the detectable effect three ways: the sanity-checks paper's realised MDE 2.9 sigma_paired / sqrt(n)
(``mde_paper``, its approximation "at 80% power, alpha 0.05") and the exact noncentral-t MDE at 80% and 90% power
(``mde_80``, ``mde_90``; :func:`lens_parallel.stats.mde`).

Endpoints are declared: the *primary* arm against baseline (its own family, never corrected); the *secondary* arms
against baseline (Holm within their family); direct *contrasts* between two arms (Holm within their family); any
other arm against baseline is *exploratory* (Holm within its family). The paper's factorial is the ``xsa-controls``
protocol (:mod:`lens_parallel.protocols`).
A frozen analysis plan (``plan=``) is written before the first run and checked on every later call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from lens_parallel import stats
from lens_parallel.choices import Arm, CurveLoss
from lens_parallel.distributed import check_workers, run_remote
from lens_parallel.errors import LensParallelError, long_call
from lens_parallel.models import head_label
from lens_parallel.options import RunOptions, resolve_options, split_changes
from lens_parallel.plots.training import factorial_figure, gates_figure
from lens_parallel.results import Provenance, ResultMixin
from lens_parallel.training.arms import check_arms
from lens_parallel.training.config import PRESETS, TrainConfig
from lens_parallel.training.loop import TrainRun, check_seed, runtime, train
from lens_parallel.validate import check_positive_int

BASELINE = "baseline"
PLAN_FORMAT = "lens_parallel.plan/2"
"""2: the plan records the folder of runs it governs (``out``); 1 did not (refused: it cannot say which runs are
its own)."""


@dataclass(frozen=True)
class Design:
    """A factorial as pre-specified: the config preset, arms, seeds and endpoints (see the module docstring); the
    published ones are protocols (:mod:`lens_parallel.protocols`)."""

    preset: str
    arms: tuple[str, ...]
    seeds: tuple[int, ...]
    primary: str
    secondary: tuple[str, ...]
    contrasts: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """What ``lens-parallel train`` trains: a factorial of ``arms`` x ``seeds`` on the config ``preset`` (or the
    protocol ``design``'s preset, arms, seeds and endpoints), with ``steps`` / ``tokens`` per run, ``texts`` and
    ``device`` overriding the preset's, the ``primary`` endpoint, and a frozen ``plan``. In Python,
    :func:`run_factorial` takes the config, arms and seeds themselves; these are the command line's defaults."""

    preset: str = field(default="cpu-small", metadata={"help": "training config preset", "choices": "presets"})
    design: str | None = field(
        default=None,
        metadata={
            "help": "a protocol's factorial (preset, arms, seeds, endpoints); --preset/--arms/--seeds ignored",
            "choices": "designs",
        },
    )
    arms: tuple[Arm, ...] = field(
        default=("baseline", "random-direction-gated", "xsa-gated"), metadata={"help": "arms (baseline first)"}
    )
    seeds: tuple[int, ...] = field(default=(0, 1, 2, 3), metadata={"help": "seeds (>= 2, distinct)"})
    primary: Arm | None = field(
        default=None, metadata={"help": "primary endpoint arm", "none": "the first after baseline"}
    )
    steps: int | None = field(default=None, metadata={"help": "optimiser steps per run", "none": "the preset's"})
    tokens: int | None = field(
        default=None,
        metadata={"help": "tokens per run, in whole batches (overrides steps)", "none": "steps x batch x length"},
    )
    texts: tuple[str, ...] | None = field(
        default=None, metadata={"help": "corpora to train on", "none": "the preset's"}
    )
    device: str = field(default="auto", metadata={"help": "auto (CUDA + bf16 when available), cpu or cuda"})
    gate_init: float | None = field(
        default=None,
        metadata={"help": "learned-gate-layer: the removal gate at init, in (0, 1)", "none": "the preset's (0.5)"},
    )
    plan: str | None = field(default=None, metadata={"help": "freeze the analysis plan to this JSON file first"})

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise LensParallelError(f"unknown preset {self.preset!r}; accepted: {', '.join(sorted(PRESETS))}")
        object.__setattr__(self, "arms", check_arms(self.arms))
        object.__setattr__(self, "seeds", tuple(check_seed(s) for s in self.seeds))
        for name in ("steps", "tokens"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))

    def config(self) -> TrainConfig:
        """The preset with this command's overrides."""
        changes: dict[str, Any] = {"device": self.device}
        changes |= {"steps": self.steps} if self.steps else {}
        changes |= {"texts": tuple(self.texts)} if self.texts else {}
        changes |= {"gate_init": self.gate_init} if self.gate_init is not None else {}
        config = dataclasses.replace(PRESETS[self.preset], **changes)
        return config.with_tokens(self.tokens) if self.tokens else config


def _endpoints(
    arms: Sequence[str],
    primary: str | None,
    secondary: Sequence[str] | None,
    contrasts: Sequence[Sequence[str]],
    baseline: str = BASELINE,
) -> tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Check and complete the declared endpoints: primary defaults to the first non-baseline arm, secondary to
    every other non-baseline arm; contrasts are pairs of distinct compared arms."""
    others = [a for a in arms if a != baseline]
    primary = primary or others[0]
    if primary not in others:
        raise LensParallelError(f"primary arm {primary!r} is not among the compared arms {others}")
    secondary = tuple(a for a in others if a != primary) if secondary is None else tuple(secondary)
    bad = [a for a in secondary if a not in others or a == primary]
    if bad:
        raise LensParallelError(f"secondary arms {bad} must be compared arms other than the primary {primary!r}")
    pairs = tuple((str(a), str(b)) for a, b in contrasts)
    bad_pairs = [pair for pair in pairs if pair[0] == pair[1] or not set(pair) <= set(arms)]
    if bad_pairs:
        raise LensParallelError(f"contrasts {bad_pairs} must be pairs of two different arms among {list(arms)}")
    return primary, secondary, pairs


def paired_table(
    finals: pd.DataFrame,
    *,
    primary: str,
    secondary: Sequence[str] | None = None,
    contrasts: Sequence[tuple[str, str]] = (),
    baseline: str = BASELINE,
    seed: int = 0,
) -> pd.DataFrame:
    """The paired analysis of ``finals`` (columns arm, seed, final_val_loss): one row per arm against ``baseline``
    and one per declared contrast ``(a, b)``, with ``contrast`` ("a - b"), ``role`` (primary / secondary /
    contrast / exploratory), ``family`` and ``p_holm`` (Holm within each family; the primary's own p)."""
    arms = list(dict.fromkeys(finals["arm"]))
    primary, secondary, contrasts = _endpoints(arms, primary, secondary, contrasts, baseline)
    diverged = finals[~np.isfinite(finals["final_val_loss"].to_numpy(dtype=np.float64))]
    if len(diverged):
        runs = ", ".join(f"{r.arm} seed {r.seed}" for r in diverged.itertuples())
        raise LensParallelError(
            f"final validation loss is not finite for {runs} (the run diverged); a paired analysis needs a finite "
            "loss for every run: retrain it (lower lr, or precision='float32') or leave its seed out"
        )
    wide = finals.pivot(index="seed", columns="arm", values="final_val_loss")
    pairs = [(arm, baseline) for arm in arms if arm != baseline] + list(contrasts)
    rows = []
    for arm, reference in pairs:
        if (arm, reference) in contrasts:
            role = "contrast"
        else:
            role = "primary" if arm == primary else "secondary" if arm in secondary else "exploratory"
        pair = wide[[reference, arm]].dropna()
        d = (pair[arm] - pair[reference]).to_numpy()
        what = f"{arm} - {reference}: per-seed delta of the final validation loss"
        test = stats.paired_t(d, what=what)
        lo, hi = stats.bootstrap_mean_ci(d[:, None], seed=seed, what=what)
        rows.append(
            {
                "contrast": f"{arm} - {reference}",
                "arm": arm,
                "reference": reference,
                "role": role,
                "family": role,
                "n_seeds": test.n,
                "reference_loss": pair[reference].mean(),
                "arm_loss": pair[arm].mean(),
                "mean_delta": test.mean,
                "ci_lo": float(lo[0]),
                "ci_hi": float(hi[0]),
                "t": test.t,
                "p": test.p,
                "cohens_dz": test.cohens_dz,
                "sigma_paired": test.sigma_paired,
                "mde_paper": test.mde_paper,
                "mde_80": test.mde_80,
                "mde_90": test.mde_90,
            }
        )
    table = pd.DataFrame(rows)
    table["p_holm"] = table["p"]
    for family in ("secondary", "contrast", "exploratory"):
        members = table["family"] == family
        if members.any():
            table.loc[members, "p_holm"] = stats.holm(table.loc[members, "p"].to_numpy())
    return table


def _plan(
    config: TrainConfig,
    arms: Sequence[str],
    seeds: Sequence[int],
    primary: str,
    secondary: Sequence[str],
    contrasts: Sequence[tuple[str, str]],
    alpha: float,
    out: Path,
) -> dict[str, Any]:
    return {
        "format": PLAN_FORMAT,
        "out": str(out.resolve()),
        "arms": list(arms),
        "seeds": list(seeds),
        "baseline": BASELINE,
        "endpoints": {
            "primary": {"contrast": f"{primary} - {BASELINE}", "family": "primary", "correction": "none"},
            "secondary": [{"contrast": f"{a} - {BASELINE}", "family": "secondary"} for a in secondary],
            "contrasts": [{"contrast": f"{a} - {b}", "family": "contrast"} for a, b in contrasts],
            "correction": "Holm within each family; the primary is not corrected",
        },
        "test": "two-sided paired t-test over seeds; 95% percentile bootstrap CI",
        "alpha": alpha,
        "tokens_per_run": config.tokens_per_run,
        "config": config.to_dict(),
        "config_hash": config.digest(),
    } | ({"gate_init": config.gate_init} if "learned-gate-layer" in arms else {})


def _plan_hash(plan: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


def _read_plan(path: Path) -> dict[str, Any]:
    """A plan file this package wrote, or a one-line error (unreadable, not JSON, not a plan, an older format)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise LensParallelError(f"--plan {path}: cannot read it ({exc})") from exc
    try:
        plan: dict[str, Any] = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LensParallelError(
            f"--plan {path} exists and is not a plan this package wrote (not JSON: {exc}); refusing to overwrite it: "
            "give a new path"
        ) from exc
    found = plan.get("format") if isinstance(plan, dict) else None
    if found == "lens_parallel.plan/1":
        raise LensParallelError(
            f"--plan {path} was written by an older lens_parallel (format lens_parallel.plan/1) and does not record "
            "the folder of runs it governs; freeze a new plan (a new --plan path) to train into a new folder"
        )
    if found != PLAN_FORMAT:
        raise LensParallelError(
            f"--plan {path} exists and is not a plan this package wrote (format {found!r}, expected {PLAN_FORMAT}); "
            "refusing to overwrite it: give a new path"
        )
    return plan


def _write_plan(path: Path, plan: dict[str, Any], digest: str) -> None:
    lock = path.with_name(path.name + ".sha256")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for target, text in ((path, json.dumps(plan, indent=1, sort_keys=True)), (lock, digest + "\n")):
            tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
            tmp.write_text(text)
            os.replace(tmp, target)
    except OSError as exc:
        raise LensParallelError(f"--plan {path}: cannot write the plan ({exc.strerror or exc})") from exc


def _freeze_plan(path: Path, plan: dict[str, Any], *, started: bool) -> str:
    """Freeze ``plan`` at ``path`` before the first run; afterwards refuse a plan that differs from the frozen one
    (or a frozen file edited since it was written). A plan is written only to a new path, or over a plan this
    package wrote for the same folder of runs (``out``) before any of them started; a plan governs one folder and
    refuses another. Returns the plan's hash."""
    digest = _plan_hash(plan)
    if path.is_dir():
        raise LensParallelError(f"--plan {path} is a folder; give a path for the plan's JSON file")
    if not path.exists():
        if started:
            raise LensParallelError(
                f"runs already exist in {plan['out']} but no plan was frozen before them: {path} cannot be "
                "pre-registered now"
            )
        _write_plan(path, plan, digest)
        return digest
    frozen = _read_plan(path)
    if frozen.get("out") != plan["out"]:
        raise LensParallelError(
            f"--plan {path} governs the runs in {frozen.get('out')}, not {plan['out']}: use that folder, or freeze a "
            "new plan (a new --plan path) for this one"
        )
    if not started:  # nothing trained under it yet: the plan may still change
        _write_plan(path, plan, digest)
        return digest
    lock = path.with_name(path.name + ".sha256")
    recorded = lock.read_text().strip() if lock.is_file() else None
    if recorded != _plan_hash(frozen):
        raise LensParallelError(f"{path} was edited after training started (its hash no longer matches {lock})")
    if frozen != plan:
        changed = sorted(k for k in plan.keys() | frozen.keys() if plan.get(k) != frozen.get(k))
        raise LensParallelError(
            f"the analysis plan changed after training started ({', '.join(changed)} differ from {path}); "
            "analyse these runs under the frozen plan, or train into a new folder"
        )
    return digest


@dataclass(frozen=True, repr=False)
class FactorialResult(ResultMixin):
    """All runs of a factorial; ``to_dataframe()`` the final loss of every (arm, seed) with its paired delta to
    baseline, ``paired_table()`` the declared endpoints' paired statistics, ``curves()`` the validation curves.
    ``plan_hash``: sha256 of the frozen analysis plan the runs were trained under (None without a plan).

    Examples:
        >>> import lens_parallel as lp
        >>> result = lp.run_design("xsa-small", out="runs/design")  # doctest: +SKIP
        >>> fig = result.figure()  # doctest: +SKIP
    """

    columns: ClassVar[str] = (
        "arm seed final_val_loss model delta primary n_seeds arms mean_delta ci_lo ci_hi p mde_paper mde_80 plan_hash"
    )

    runs: tuple[TrainRun, ...]
    arms: tuple[str, ...]
    seeds: tuple[int, ...]
    primary: str
    secondary: tuple[str, ...]
    contrasts: tuple[tuple[str, str], ...]
    plan_hash: str | None
    provenance: Provenance

    def curves(self, loss: CurveLoss = "validation") -> pd.DataFrame:
        """Validation loss per arm, seed and evaluation step (``val_loss``), or with ``loss="training"`` the
        training loss of every step (``train_loss``)."""
        return pd.concat([run.curve(loss) for run in self.runs], ignore_index=True)

    def finals(self) -> pd.DataFrame:
        return pd.DataFrame([{"arm": r.arm, "seed": r.seed, "final_val_loss": r.final_val_loss} for r in self.runs])

    def to_dataframe(self) -> pd.DataFrame:
        """Full resolution: one row per (arm, seed): final validation loss and its delta to the same seed's
        baseline (nats/token)."""
        finals = self.finals()
        base = finals[finals.arm == BASELINE].set_index("seed")["final_val_loss"]
        return finals.assign(model=self.info.name, delta=finals.final_val_loss - finals.seed.map(base))

    def paired_table(self) -> pd.DataFrame:
        """One row per endpoint: paired t, bootstrap CI, Holm within its family, d_z, sigma_paired, MDEs."""
        return paired_table(self.finals(), primary=self.primary, secondary=self.secondary, contrasts=self.contrasts)

    def summary(self) -> pd.DataFrame:
        """One row: the primary endpoint's mean paired delta, its CI, p and detectable effects, and the number of
        seeds."""
        table = self.paired_table()
        primary = table[table.role == "primary"].iloc[0]
        return pd.DataFrame(
            [
                {
                    "model": self.info.name,
                    "primary": primary["contrast"],
                    "n_seeds": len(self.seeds),
                    "arms": ",".join(self.arms),
                    **{k: primary[k] for k in ("mean_delta", "ci_lo", "ci_hi", "p", "mde_paper", "mde_80")},
                    "plan_hash": self.plan_hash,
                }
            ]
        )

    def figures(self) -> dict[str, go.Figure]:
        smooth = max(1, min(len(r.train_loss) for r in self.runs) // 50)  # about 50 points of running mean a curve
        train_loss = self.figure(loss="training", smooth=smooth)
        return {"train": self.figure(), "train_loss": train_loss, "gates": self.gates_figure()}

    def gates(self) -> pd.DataFrame:
        """Learned gates per arm, seed, layer and head (g = tanh(alpha), or the mean learned s_par and its std)."""
        rows = [
            {
                "arm": r.arm,
                "seed": r.seed,
                "layer": layer,
                "head": head,
                "label": head_label(layer, head),
                "gate": float(r.gates[layer, head]),
                "gate_std": float(r.gate_std[layer, head]) if r.gate_std is not None else np.nan,
            }
            for r in self.runs
            if r.gates is not None
            for layer in range(r.gates.shape[0])
            for head in range(r.gates.shape[1])
        ]
        return pd.DataFrame(rows, columns=["arm", "seed", "layer", "head", "label", "gate", "gate_std"])

    def figure(self, *, loss: CurveLoss = "validation", smooth: int = 1) -> go.Figure:
        """Left: the ``loss`` curves per arm (``training``: every step's batch loss, as the directional-decomposition
        paper's Fig. 8; ``smooth``: running mean over that many points); right: the paired final deltas."""
        return factorial_figure(self.curves(loss), self.finals(), self.paired_table(), smooth=smooth)

    def gates_figure(self) -> go.Figure:
        return gates_figure(self.gates())


@long_call
def run_factorial(
    config: TrainConfig,
    arms: Sequence[str],
    seeds: Sequence[int],
    *,
    out: str | Path,
    primary: str | None = None,
    secondary: Sequence[str] | None = None,
    contrasts: Sequence[tuple[str, str]] = (),
    alpha: float = 0.05,
    plan: str | Path | None = None,
    options: RunOptions | None = None,
    **changes: Any,
) -> FactorialResult:
    """Train every arm with every seed into ``out/<arm>/seed<k>`` (finished runs are read back, interrupted ones
    resume), all arms of a seed before the next seed, so that an interrupted factorial holds complete pairs; save
    the result to ``out/factorial.json`` and return it. ``arms`` must include ``baseline``; at least 2 distinct
    seeds. Endpoints: ``primary`` (default: the first non-baseline arm), ``secondary`` (default: the other arms),
    ``contrasts`` (pairs of arms compared directly). ``plan``: a JSON file the frozen analysis plan (arms, seeds,
    endpoints and families, alpha, tokens per run, config and its hash) is written to before the first run; a later
    call whose plan differs, after training started, is refused. The paper's design: the ``xsa-controls`` protocol.

    ``options`` (:class:`~lens_parallel.options.RunOptions`, or its fields as keywords): ``progress``; ``workers`` /
    ``ray_address``: each (arm, seed) run is a Ray task, ``workers`` at a time (one GPU each when the
    config trains on CUDA, or on ``auto`` with GPUs in the cluster; else an equal share of the cores), writing its
    checkpoints into its own folder as above; a run whose process dies is rerun by Ray and resumes from its last
    checkpoint. ``out`` must then be a folder every node sees (a shared file system), as must the plan. The paired
    analysis runs once every run is done, with the same numbers as the sequential factorial.

    Examples:
        >>> import lens_parallel as lp
        >>> config = lp.TrainConfig(n_layers=1, d_model=32, steps=2, warmup_steps=0)  # doctest: +SKIP
        >>> result = lp.run_factorial(config, ["baseline", "xsa"], [0, 1], out="runs/factorial")  # doctest: +SKIP
    """
    opts = resolve_options(options, changes)
    progress, workers, ray_address = opts.progress, opts.workers, opts.ray_address
    arms = check_arms(tuple(arms))
    seeds = tuple(check_seed(s) for s in seeds)
    if BASELINE not in arms or len(arms) < 2:
        raise LensParallelError(
            f"a factorial compares arms with {BASELINE!r}: give it and at least one other arm, got {arms}"
        )
    if len(set(seeds)) < 2 or len(set(seeds)) != len(seeds):
        raise LensParallelError(f"a paired analysis needs at least 2 distinct seeds, got {list(seeds)}")
    if not 0 < alpha < 1:
        raise LensParallelError(f"alpha must be in (0, 1), got {alpha}")
    primary, secondary, contrasts = _endpoints(arms, primary, secondary, contrasts)
    distributed = check_workers(workers, ray_address)
    if not distributed:  # on a cluster the device is the workers'
        runtime(config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plan_hash = None
    if plan is not None:
        started = any((out / arm).is_dir() and any((out / arm).iterdir()) for arm in arms)
        plan_hash = _freeze_plan(
            Path(plan), _plan(config, arms, seeds, primary, secondary, contrasts, alpha, out), started=started
        )
    calls: list[dict[str, Any]] = [
        {"config": config, "arm": a, "seed": k, "out": out / a / f"seed{k}"} for k in seeds for a in arms
    ]
    if distributed:
        finished = dict(run_remote(train, calls, workers=workers, ray_address=ray_address, device=config.device))
        runs = tuple(finished[i] for i in range(len(calls)))
    else:
        runs = tuple(train(**call, progress=progress) for call in calls)
    runtimes = {(r.device_type, r.precision) for r in runs}
    if len(runtimes) > 1:
        mixed = ", ".join(f"{r.arm} seed {r.seed}: {r.device_type} {r.precision}" for r in runs)
        raise LensParallelError(
            f"the runs were trained on different devices or precisions ({mixed}); a paired analysis compares runs "
            "trained alike: set the config's device and precision explicitly"
        )
    settings = {
        "config": config.to_dict(),
        "arms": list(arms),
        "seeds": list(seeds),
        "primary": primary,
        "secondary": list(secondary),
        "contrasts": [list(c) for c in contrasts],
        "alpha": alpha,
        "plan": None if plan is None else str(plan),
    }
    provenance = dataclasses.replace(runs[0].provenance, settings=settings)
    result = FactorialResult(
        runs=runs,
        arms=arms,
        seeds=seeds,
        primary=primary,
        secondary=secondary,
        contrasts=contrasts,
        plan_hash=plan_hash,
        provenance=provenance,
    )
    result.save(out / "factorial")
    return result


@long_call
def run_design(
    name: str,
    *,
    out: str | Path,
    plan: str | Path | None = None,
    options: RunOptions | None = None,
    **changes: Any,
) -> FactorialResult:
    """Run the factorial of the protocol ``name`` (a :class:`Design`: preset, arms, seeds and endpoints, e.g.
    ``xsa-controls``); ``changes`` replace config fields (e.g. ``texts``, ``device``; ``tokens=`` sets the tokens per
    run) or run options (``options``, as in :func:`run_factorial`: ``progress``, ``workers``, ``ray_address``).

    Examples:
        >>> import lens_parallel as lp
        >>> result = lp.run_design("xsa-small", out="runs/design")  # doctest: +SKIP
    """
    from lens_parallel.protocols import designs  # the registry imports this module

    known = designs()
    if name not in known:
        raise LensParallelError(f"unknown design {name!r}; known: {', '.join(known)}")
    design = known[name]
    tokens = changes.pop("tokens", None)
    config_changes, option_changes = split_changes(changes, tuple(f.name for f in dataclasses.fields(TrainConfig)))
    config = dataclasses.replace(PRESETS[design.preset], **config_changes)
    config = config.with_tokens(tokens) if tokens else config
    return run_factorial(
        config,
        design.arms,
        design.seeds,
        out=out,
        primary=design.primary,
        secondary=design.secondary,
        contrasts=design.contrasts,
        plan=plan,
        options=resolve_options(options, option_changes),
    )
