"""Every analysis that runs on workers gives the numbers of one process, checked without a Ray cluster: the sweep
engine's executor is replaced by workers in this process that do what a Ray actor does (each loads the model afresh
by its recipe, receives the run's shared plan and its chunks of jobs pickled as Ray ships them, and keeps its own
cache) and return the chunks in reverse order, as workers that finish out of order would. ``test_distributed`` runs
the real cluster once per property that needs one (equal numbers, a killed worker, a killed driver, a killed
training run, other weights refused)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import cloudpickle
import numpy as np
import pandas as pd
import pytest
import torch

import lens_parallel as lp
from lens_parallel import distributed, sweep
from lens_parallel.data import token_blocks

from .conftest import get_model

SPEC = "toy-qwen2"


@pytest.fixture
def shipped(monkeypatch) -> list[tuple[int, str | None]]:
    """Replaces the sweep engine's executor by in-process workers (loaded afresh by the first run of a recipe and
    kept, as long-lived actors keep their model and cache); records ``(workers, ray_address)`` per run."""
    runs: list[tuple[int, str | None]] = []
    pools: dict[distributed.ModelRecipe, list[distributed._Worker]] = {}
    in_process = sweep.run_tasks

    def run_tasks(
        model: Any, task: Any, shared: Any, items: Sequence[Any], *, workers: int, ray_address: str | None, **rest: Any
    ) -> Iterator[tuple[int, Any]]:
        if not distributed.check_workers(workers, ray_address):
            yield from in_process(model, task, shared, items, workers=workers, ray_address=ray_address, **rest)
            return
        runs.append((workers, ray_address))
        recipe = distributed.ModelRecipe.of(model)
        if recipe not in pools:
            pools[recipe] = [distributed._Worker(recipe, torch.get_num_threads()) for _ in range(workers)]
            assert all(w.digest() == recipe.digest for w in pools[recipe])
        pool = pools[recipe]
        shared, items = cloudpickle.loads(cloudpickle.dumps((shared, list(items))))
        for i in reversed(range(len(items))):
            yield pool[i % workers].run(task, shared, i, items[i])

    monkeypatch.setattr(sweep, "run_tasks", run_tasks)
    return runs


def _frames_equal(here: Any, there: Any) -> None:
    pd.testing.assert_frame_equal(here.to_dataframe(), there.to_dataframe(), check_exact=True)


def test_every_analysis_on_workers_equals_one_process(shipped):
    model = get_model(SPEC)
    blocks = token_blocks(model, "wikipedia-en", n_docs=4, seq_len=16)
    remote = {"workers": 2, "ray_address": "10.0.0.1:6379"}
    kw = {"layers": [0, 2], "n_resamples": 200, "n_permutations": 200, "progress": False}
    _frames_equal(lp.head_sensitivity(model, blocks, **kw), lp.head_sensitivity(model, blocks, **kw, **remote))
    kw = {"space": ["value", "residual-attn"], "s_par": [0.0, 1.5], "s_perp": [0.5], "n_resamples": 200}
    _frames_equal(lp.scale_sweep(model, blocks, **kw), lp.scale_sweep(model, blocks, **kw, **remote))
    kw = {"progress": False}
    _frames_equal(
        lp.split_half_reliability(model, blocks, **kw), lp.split_half_reliability(model, blocks, **kw, **remote)
    )
    kw = {"query_positions": slice(4, 12), "batch_size": 2, "progress": False}
    here, there = lp.head_dominance(model, blocks, **kw), lp.head_dominance(model, blocks, **kw, **remote)
    _frames_equal(here, there)
    pd.testing.assert_frame_equal(here.joint_table(), there.joint_table(), check_exact=True)
    kw = {"method": ["int8", "magnitude-50%"], "batch_size": 2}
    here, there = lp.compression_error(model, blocks, **kw), lp.compression_error(model, blocks, **kw, **remote)
    _frames_equal(here, there)
    np.testing.assert_array_equal(here.delta_loss, there.delta_loss)
    assert len(shipped) >= 5 and set(shipped) == {(2, "10.0.0.1:6379")}


def test_the_cli_hands_its_workers_and_address_to_the_sweep(shipped, tmp_path, capsys):
    from lens_parallel import cli

    args = ["sensitivity", "--model", "toy-gpt2", "--n-docs", "3", "--seq-len", "12", "--layers", "1", "--out"]
    assert cli.main([*args, str(tmp_path / "here")]) == 0
    assert cli.main([*args, str(tmp_path / "there"), "--workers", "2", "--ray-address", "10.0.0.1:6379"]) == 0
    assert shipped == [(2, "10.0.0.1:6379")]
    here, there = (pd.read_csv(tmp_path / d / "sensitivity.csv") for d in ("here", "there"))
    pd.testing.assert_frame_equal(here, there, check_exact=True)
    lines = (tmp_path / "there" / "sensitivity_store.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 5  # the header, 4 heads and the joint ablation
    capsys.readouterr()
    assert cli.main([*args, str(tmp_path / "x"), "--method", "attribution", "--workers", "2"]) == 2
    assert "runs here, without --workers" in capsys.readouterr().err
