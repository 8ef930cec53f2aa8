"""The least that proves distribution, on a real local Ray cluster (``ray start --head`` in a subprocess, two
worker actors): a sweep and a training factorial give the numbers of one process with a worker killed midway, a
killed driver's sweep resumes in one process from its store, a worker with other weights is refused. That every
analysis ships to workers and gives one process's numbers is checked without a cluster (``test_workers``)."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import ray
import torch

import lens_parallel as lp
from lens_parallel import distributed
from lens_parallel.data import token_blocks
from lens_parallel.sweep import EditJob, run_sweep
from lens_parallel.training.config import PRESETS

from .conftest import get_model

SPEC = "toy-qwen2"
pytestmark = pytest.mark.xdist_group("ray-cluster")  # one pytest worker runs them all: one Ray head


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_head(temp: Path) -> tuple[subprocess.Popen, int] | None:
    """``ray start --head --block`` on a free port: the running head and its port, or None when the head exited
    before its runtime started (under heavy load Ray's own start can fail: "Failed to get node info: RPC error:
    Deadline Exceeded"); its daemons are killed then."""
    port = _free_port()
    log = temp / "head.log"
    command = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={port}"]
    command += ["--num-cpus=2", "--object-store-memory=500000000", "--include-dashboard=false"]
    command += ["--disable-usage-stats", f"--temp-dir={temp}"]
    env = os.environ | {"RAY_AUTH_MODE": "disabled"}
    with open(log, "w") as out:
        head = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    deadline = time.monotonic() + 120
    while "Ray runtime started" not in log.read_text():  # a driver connecting earlier keeps failing
        if head.poll() is not None:
            subprocess.run(["pkill", "-9", "-f", str(temp)], check=False)
            return None
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    return head, port


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A Ray head with 2 CPUs on localhost, started as `ray start --head --block` would be on a cluster's head node
    (token authentication off: a cluster reachable by others keeps Ray's default, see the scale guide); a head whose
    own start fails is started again, three tries at most. One per session: pytest-xdist runs this module's tests on
    one worker, but not always one after another, and a module-scoped head would be started again after a break."""
    for _ in range(3):
        temp = tmp_path_factory.mktemp("ray")
        started = _start_head(temp)
        if started is not None:
            break
    assert started is not None, (temp / "head.log").read_text()[-3000:]
    head, port = started
    try:
        ray.init(address=f"127.0.0.1:{port}", include_dashboard=False, log_to_driver=False)
        assert ray.cluster_resources()["CPU"] == 2
        yield f"127.0.0.1:{port}"
    finally:
        ray.shutdown()
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(60)
        subprocess.run(["pkill", "-9", "-f", str(temp)], check=False)  # the head's daemons, named by its temp folder


def _blocks(model, n_docs: int = 4, seq_len: int = 32):
    return token_blocks(model, "wikipedia-en", n_docs=n_docs, seq_len=seq_len)


def _scale_jobs(n: int) -> list[EditJob]:
    return [EditJob(f"s{i}", (lp.ComponentScale("value", s_par=i / n),)) for i in range(n)]


def _pids(title: str) -> list[int]:
    """Processes whose title Ray set to ``title`` (an actor's class, or a task's function, while it runs)."""
    found = subprocess.run(["pgrep", "-f", title], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


def _kill_one_when(ready, title: str, killed: list[int], done: threading.Event) -> threading.Thread:
    """A thread that SIGKILLs one process titled ``title`` as soon as ``ready()``, until ``done`` is set."""

    def watch() -> None:
        while not killed and not done.is_set():
            if ready() and (pids := _pids(title)):  # ready() first: a file's check, not a process list (8 ms)
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
            time.sleep(0.005)

    thread = threading.Thread(target=watch)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def one_process():
    """The 40-job scale sweep of the sweep tests in one process, no cluster: the numbers a cluster must give."""
    model = get_model(SPEC)
    return run_sweep(model, _blocks(model), _scale_jobs(40), progress=False)


def _job_lines(path: Path) -> int:
    return max(0, len(path.read_text().splitlines()) - 1) if path.is_file() else 0


def test_a_killed_training_run_is_rerun_from_its_checkpoint_with_the_same_numbers(cluster, tmp_path):
    cfg = dataclasses.replace(PRESETS["tiny"], steps=16, eval_every=8, checkpoint_every=4)
    arms, seeds = ["baseline", "xsa-gated"], [0, 1]
    out = tmp_path / "there"
    killed: list[int] = []
    done = threading.Event()
    killer = _kill_one_when(lambda: any(out.rglob("checkpoint.pt")), "ray::_call", killed, done)
    try:
        there = lp.run_factorial(cfg, arms, seeds, out=out, workers=2, ray_address=cluster)
    finally:
        done.set()
        killer.join()
    assert killed
    here = lp.run_factorial(cfg, arms, seeds, out=tmp_path / "here", progress=False)
    pd.testing.assert_frame_equal(here.curves(), there.curves(), check_exact=True)
    pd.testing.assert_frame_equal(here.paired_table(), there.paired_table(), check_exact=True)
    assert [r.final_val_loss for r in here.runs] == [r.final_val_loss for r in there.runs]
    assert (out / "xsa-gated" / "seed1" / "run.json").is_file()


def test_a_killed_worker_is_replaced_and_the_sweep_ends_with_the_same_numbers(cluster, one_process, tmp_path):
    model = get_model(SPEC)
    blocks = _blocks(model)
    jobs = _scale_jobs(40)
    store = tmp_path / "sweep.jsonl"
    killed: list[int] = []
    done = threading.Event()
    killer = _kill_one_when(lambda: _job_lines(store) >= 1, "ray::_Worker", killed, done)
    try:
        there = run_sweep(model, blocks, jobs, store=store, progress=False, workers=2, ray_address=cluster)
    finally:
        done.set()
        killer.join()
    assert killed and _job_lines(store) == len(jobs)
    for job in jobs:
        np.testing.assert_array_equal(one_process[job].loss_sum, there[job].loss_sum)


DRIVER = """
import sys
from lens_parallel import ComponentScale, load_model
from lens_parallel.data import token_blocks
from lens_parallel.sweep import EditJob, run_sweep
model = load_model("{spec}")
blocks = token_blocks(model, "wikipedia-en", n_docs=4, seq_len=32)
jobs = [EditJob(f"s{{i}}", (ComponentScale("value", s_par=i / 40),)) for i in range(40)]
run_sweep(model, blocks, jobs, store=sys.argv[1], progress=False, workers=2, ray_address="{address}")
"""


def test_a_sweep_killed_on_the_cluster_resumes_in_one_process(cluster, one_process, tmp_path):
    store = tmp_path / "sweep.jsonl"
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER.format(spec=SPEC, address=cluster)))
    driver = subprocess.Popen([sys.executable, str(script), str(store)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while _job_lines(store) < 3:
        assert driver.poll() is None, driver.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the cluster sweep wrote no job in 300 s"
        time.sleep(0.01)
    driver.kill()
    driver.wait()
    finished = _job_lines(store)
    assert 3 <= finished < 40
    model = get_model(SPEC)
    blocks = _blocks(model)
    resumed = run_sweep(model, blocks, _scale_jobs(40), store=store, progress=False)
    assert _job_lines(store) == 40
    for job in _scale_jobs(40):
        np.testing.assert_array_equal(resumed[job].loss_sum, one_process[job].loss_sum)


def test_bad_worker_settings_are_refused_before_any_work(monkeypatch):
    model = get_model(SPEC)
    blocks = _blocks(model)
    for workers in (0, -1, True):
        with pytest.raises(lp.LensParallelError, match="workers must be a positive integer"):
            lp.head_sensitivity(model, blocks, workers=workers)
    with pytest.raises(lp.LensParallelError, match="ray_address must be a Ray address"):
        lp.scale_sweep(model, blocks, ray_address=" ")
    renamed = lp.load_model(SPEC)
    renamed.cfg.model_name = "my-edited-model"
    with pytest.raises(lp.LensParallelError, match="workers load the model by its spec, and 'my-edited-model'"):
        lp.head_dominance(renamed, blocks, workers=2)
    monkeypatch.setattr(distributed.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(lp.EnvironmentFailure, match=r"pip install 'lens_parallel\[distributed\]'"):
        lp.split_half_reliability(model, blocks, workers=2)
    assert distributed.check_workers(1, None, model) is False  # one process needs no Ray


def test_a_worker_whose_weights_differ_is_refused(cluster):
    """(that one changed value changes the digest: ``test_models.test_weights_digest_is_exact``)"""
    model = lp.load_model(SPEC)
    with torch.no_grad():
        model.original_model.lm_head.weight.mul_(1.01)
    with pytest.raises(lp.LensParallelError, match="a worker loaded 'toy-qwen2' with other weights"):
        run_sweep(model, _blocks(model), _scale_jobs(2), progress=False, workers=2, ray_address=cluster)
