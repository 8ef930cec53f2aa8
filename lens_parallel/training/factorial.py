"""Every arm x seed, paired by seed, and the paired analysis of final validation loss against ``baseline``.

For arm a and seed k, delta_k = L_final(a, k) - L_final(baseline, k) (nats/token; negative = the arm helps).
Reported per arm: mean delta, 95% percentile-bootstrap CI over seeds, two-sided paired t-test
(``scipy.stats.ttest_1samp`` on the deltas, equal to ``ttest_rel``), Cohen's d_z = mean / sd, sigma_paired = sd(delta),
MDE = 2.9 sigma_paired / sqrt(n). The *primary* arm (default ``value-parallel-removal``) is tested on its own; the
other (secondary) arms' p-values are Holm-corrected as one family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from lens_parallel import stats
from lens_parallel.errors import LensParallelError
from lens_parallel.plots.training import factorial_figure, gates_figure
from lens_parallel.results import Provenance, ResultMixin, serializable
from lens_parallel.training.arms import check_arms
from lens_parallel.training.config import TrainConfig
from lens_parallel.training.loop import TrainRun, runtime, train

BASELINE = "baseline"


def paired_table(finals: pd.DataFrame, *, primary: str, baseline: str = BASELINE, seed: int = 0) -> pd.DataFrame:
    """The paired analysis of ``finals`` (columns arm, seed, final_val_loss): one row per non-baseline arm."""
    wide = finals.pivot(index="seed", columns="arm", values="final_val_loss")
    rows = []
    for arm in [a for a in dict.fromkeys(finals["arm"]) if a != baseline]:
        pair = wide[[baseline, arm]].dropna()
        d = (pair[arm] - pair[baseline]).to_numpy()
        test = stats.paired_t(d)
        lo, hi = stats.bootstrap_mean_ci(d[:, None], seed=seed)
        rows.append(
            {
                "arm": arm,
                "role": "primary" if arm == primary else "secondary",
                "n_seeds": test.n,
                "baseline_loss": pair[baseline].mean(),
                "arm_loss": pair[arm].mean(),
                "mean_delta": test.mean,
                "ci_lo": float(lo[0]),
                "ci_hi": float(hi[0]),
                "t": test.t,
                "p": test.p,
                "cohens_dz": test.cohens_dz,
                "sigma_paired": test.sigma_paired,
                "mde": test.mde,
            }
        )
    table = pd.DataFrame(rows)
    secondary = table["role"] == "secondary"
    table["p_holm"] = table["p"]
    if secondary.any():
        table.loc[secondary, "p_holm"] = stats.holm(table.loc[secondary, "p"].to_numpy())
    return table


@serializable
@dataclass(frozen=True)
class FactorialResult(ResultMixin):
    """All runs of a factorial; ``to_dataframe()`` the final loss of every (arm, seed) with its paired delta,
    ``paired_table()`` the paired statistics per arm, ``curves()`` the validation curves."""

    runs: tuple[TrainRun, ...]
    arms: tuple[str, ...]
    seeds: tuple[int, ...]
    primary: str
    provenance: Provenance

    def curves(self) -> pd.DataFrame:
        """Validation loss per arm, seed and evaluation step."""
        return pd.concat([run.to_dataframe() for run in self.runs], ignore_index=True)

    def finals(self) -> pd.DataFrame:
        return pd.DataFrame([{"arm": r.arm, "seed": r.seed, "final_val_loss": r.final_val_loss} for r in self.runs])

    def to_dataframe(self) -> pd.DataFrame:
        """Full resolution: one row per (arm, seed): final validation loss and its delta to the same seed's
        baseline (nats/token)."""
        finals = self.finals()
        base = finals[finals.arm == BASELINE].set_index("seed")["final_val_loss"]
        return finals.assign(model=self.info.name, delta=finals.final_val_loss - finals.seed.map(base))

    def paired_table(self) -> pd.DataFrame:
        """One row per arm against the baseline: paired t, bootstrap CI, Holm, d_z, sigma_paired, MDE."""
        return paired_table(self.finals(), primary=self.primary)

    def summary(self) -> pd.DataFrame:
        """One row: the primary arm's mean paired delta, its CI and p, and the number of seeds."""
        table = self.paired_table().set_index("arm")
        primary = table.loc[self.primary]
        return pd.DataFrame(
            [
                {
                    "model": self.info.name,
                    "primary": self.primary,
                    "n_seeds": len(self.seeds),
                    "arms": ",".join(self.arms),
                    "mean_delta": primary["mean_delta"],
                    "ci_lo": primary["ci_lo"],
                    "ci_hi": primary["ci_hi"],
                    "p": primary["p"],
                    "mde": primary["mde"],
                }
            ]
        )

    def figures(self) -> dict[str, go.Figure]:
        return {"train": self.figure(), "gates": self.gates_figure()}

    def gates(self) -> pd.DataFrame:
        """Learned gates per arm, seed, layer and head (g = tanh(alpha), or the mean learned s_par and its std)."""
        rows = [
            {
                "arm": r.arm,
                "seed": r.seed,
                "layer": layer,
                "head": head,
                "label": f"L{layer}H{head}",
                "gate": float(r.gates[layer, head]),
                "gate_std": float(r.gate_std[layer, head]) if r.gate_std is not None else np.nan,
            }
            for r in self.runs
            if r.gates is not None
            for layer in range(r.gates.shape[0])
            for head in range(r.gates.shape[1])
        ]
        return pd.DataFrame(rows, columns=["arm", "seed", "layer", "head", "label", "gate", "gate_std"])

    def figure(self) -> go.Figure:
        return factorial_figure(self.curves(), self.finals(), self.paired_table())

    def gates_figure(self) -> go.Figure:
        return gates_figure(self.gates())


def run_factorial(
    config: TrainConfig,
    arms: Sequence[str],
    seeds: Sequence[int],
    *,
    out: str | Path,
    primary: str | None = None,
    progress: bool = True,
) -> FactorialResult:
    """Train every arm with every seed into ``out/<arm>/seed<k>`` (finished runs are read back, interrupted ones
    resume), seed by seed so that an interrupted factorial holds complete pairs; save the result to
    ``out/factorial.json`` and return it. ``arms`` must include ``baseline``; at least 2 distinct seeds."""
    arms = check_arms(tuple(arms))
    seeds = tuple(int(s) for s in seeds)
    if BASELINE not in arms or len(arms) < 2:
        raise LensParallelError(
            f"a factorial compares arms with {BASELINE!r}: give it and at least one other arm, got {arms}"
        )
    if len(set(seeds)) < 2 or len(set(seeds)) != len(seeds):
        raise LensParallelError(f"a paired analysis needs at least 2 distinct seeds, got {list(seeds)}")
    others = [a for a in arms if a != BASELINE]
    primary = primary or ("value-parallel-removal" if "value-parallel-removal" in others else others[0])
    if primary not in others:
        raise LensParallelError(f"primary arm {primary!r} is not among the compared arms {others}")
    runtime(config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = tuple(
        train(config, arm, seed, out=out / arm / f"seed{seed}", progress=progress) for seed in seeds for arm in arms
    )
    settings = {"config": config.to_dict(), "arms": list(arms), "seeds": list(seeds), "primary": primary}
    provenance = dataclasses.replace(runs[0].provenance, settings=settings)
    result = FactorialResult(runs=runs, arms=arms, seeds=seeds, primary=primary, provenance=provenance)
    result.save(out / "factorial")
    return result
