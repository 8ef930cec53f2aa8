"""The sweep engine: equality with the naive loop for both job kinds, and a store that survives a kill, damaged rows,
changed weights and concurrent creation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lens_parallel import LensParallelError, load_model, sweep
from lens_parallel.analyses.evaluate import document_losses
from lens_parallel.data import token_blocks
from lens_parallel.edits import ComponentScale, HeadEdit
from lens_parallel.store import SweepStore, value_checksum
from lens_parallel.sweep import AblationJob, DocumentNLL, EditJob, run_sweep

from . import fresh
from .conftest import get_model

JOBS = [
    AblationJob(0, (1,)),
    AblationJob(2, (0, 3)),
    EditJob("value s_par=0 at L1", (ComponentScale("value", s_par=0.0, layers=1),), start_layer=1),
    EditJob("mlp s_perp=0.5, all", (ComponentScale("residual-mlp", s_perp=0.5),)),
]


def _setup(spec: str = "toy-qwen2"):
    model = get_model(spec)
    return model, token_blocks(model, "wikipedia-en", n_docs=5, seq_len=16, seed=1)


def test_mixed_jobs_equal_the_naive_loop():
    model, blocks = _setup()
    run = run_sweep(model, blocks, JOBS, ablation="zero", batch_size=2, tokens_per_forward=64, progress=False)
    np.testing.assert_allclose(run.base.loss_sum, document_losses(model, blocks).loss_sum, atol=1e-5)
    for job in JOBS:
        edits = HeadEdit("zero", job.layer, job.heads) if isinstance(job, AblationJob) else job.edits
        naive = document_losses(model, blocks, edits)
        np.testing.assert_allclose(run[job].loss_sum, naive.loss_sum, atol=1e-5, err_msg=job.key)
        assert np.abs(naive.loss_sum - run.base.loss_sum).max() > 1e-4, job.key  # each job does something
    whole = run_sweep(model, blocks, JOBS[3:], batch_size=2, progress=False)  # no unedited pass is needed
    assert whole.base is None
    np.testing.assert_array_equal(whole[JOBS[3]].loss_sum, run[JOBS[3]].loss_sum)


def test_a_store_cut_mid_line_is_repaired_and_gives_identical_results(tmp_path):
    model, blocks = _setup()
    store = tmp_path / "sweep.jsonl"
    kwargs = {"ablation": "zero", "batch_size": 2, "tokens_per_forward": 32, "progress": False}
    full = run_sweep(model, blocks, JOBS, store=store, **kwargs)
    lines = store.read_text().splitlines(keepends=True)
    assert len(lines) == 1 + len(JOBS)
    cut = "".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2]  # killed while writing the last job
    store.write_text(cut)
    resumed = run_sweep(model, blocks, JOBS, store=store, **kwargs)
    for job in JOBS:
        np.testing.assert_array_equal(resumed[job].loss_sum, full[job].loss_sum)
    assert store.read_text() == "".join(lines)  # the cut job was recomputed and rewritten, byte for byte
    store.write_text(lines[0][:10])  # killed while writing the header: nothing was finished
    again = run_sweep(model, blocks, JOBS, store=store, **kwargs)
    np.testing.assert_array_equal(again[JOBS[1]].loss_sum, full[JOBS[1]].loss_sum)


def test_a_store_from_another_batch_size_or_run_is_refused(tmp_path):
    model, blocks = _setup()
    store = tmp_path / "sweep.jsonl"
    run_sweep(model, blocks, JOBS[:2], ablation="zero", batch_size=2, store=store, progress=False)
    with pytest.raises(LensParallelError, match="batch_size: store has 2, this run 3"):
        run_sweep(model, blocks, JOBS[:2], ablation="zero", batch_size=3, store=store, progress=False)
    with pytest.raises(LensParallelError, match="ablation: store has 'zero', this run 'mean'"):
        run_sweep(model, blocks, JOBS[:2], ablation="mean", batch_size=2, store=store, progress=False)
    with pytest.raises(LensParallelError, match="positions: store has None, this run 'after-first'"):
        run_sweep(model, blocks, JOBS[:2], ablation="zero", positions="after-first", batch_size=2, store=store)
    first = tmp_path / "after-first.jsonl"
    run_sweep(
        model, blocks, JOBS[:2], ablation="zero", positions="after-first", batch_size=2, store=first, progress=False
    )
    with pytest.raises(LensParallelError, match="positions: store has 'after-first', this run None"):
        run_sweep(model, blocks, JOBS[:2], ablation="zero", batch_size=2, store=first, progress=False)
    other = token_blocks(model, "austen", n_docs=5, seq_len=16)
    with pytest.raises(LensParallelError, match="documents: store has"):
        run_sweep(model, other, JOBS[:2], ablation="zero", batch_size=2, store=store, progress=False)
    same_key = EditJob(JOBS[2].key, (ComponentScale("value", s_par=0.5, layers=1),), start_layer=1)
    run_sweep(model, blocks, [JOBS[2]], batch_size=2, store=tmp_path / "edits.jsonl", progress=False)
    with pytest.raises(LensParallelError, match="holds a job 'value s_par=0 at L1' computed with other settings"):
        run_sweep(model, blocks, [same_key], batch_size=2, store=tmp_path / "edits.jsonl", progress=False)


def _stored_run(tmp_path):
    """The first two jobs run into a new store: (model, blocks, the sweep's keywords, the run)."""
    model, blocks = _setup()
    kwargs = {"ablation": "zero", "batch_size": 2, "store": tmp_path / "sweep.jsonl", "progress": False}
    return model, blocks, kwargs, run_sweep(model, blocks, JOBS[:2], **kwargs)


def test_damaged_rows_are_dropped_with_a_warning_and_recomputed(tmp_path):
    """Store rows are validated on read (n_docs finite numbers under a job key and digest), not trusted: strings,
    nulls, NaN, a wrong count or a line that is not JSON are dropped, and their job is recomputed."""
    model, blocks, kwargs, fresh = _stored_run(tmp_path)
    store = kwargs["store"]
    header, first, second = store.read_text().splitlines()
    row = json.loads(first)
    values = row["value"]["loss_sum"]

    def checked(value: dict) -> str:  # a row with a matching checksum: its shapes and types are what is wrong
        return json.dumps(row | {"value": value, "sha256": value_checksum(value)})

    damaged = [
        "{not json}",
        '"a string"',
        checked({"loss_sum": [str(v) for v in values]}),
        checked({"loss_sum": [None] * 5}),  # null is NaN, which this metric does not define
        checked({"loss_sum": [True] * 5}),
        checked({"loss_sum": values[:3]}),
    ]
    store.write_text("\n".join([header, *damaged, second]) + "\n")
    with pytest.warns(UserWarning, match=r"dropped 6 row\(s\).*line 2: not JSON.*recomputed"):
        again = run_sweep(model, blocks, JOBS[:2], **kwargs)
    for job in JOBS[:2]:
        np.testing.assert_array_equal(again[job].loss_sum, fresh[job].loss_sum)
    assert sorted(store.read_text().splitlines()) == sorted([header, first, second])  # rewritten clean


def test_weights_changed_in_memory_make_the_store_refused(tmp_path):
    """The fingerprint holds an exact digest of every weight: one value changed between two runs is seen."""
    model = load_model("toy-qwen2")
    blocks = token_blocks(model, "wikipedia-en", n_docs=5, seq_len=16, seed=1)
    store = tmp_path / "sweep.jsonl"
    run_sweep(model, blocks, JOBS[:2], ablation="zero", batch_size=2, store=store, progress=False)
    model.original_model.model.embed_tokens.weight.data[1, 1] += 1e-3  # .data: no version counter sees it
    with pytest.raises(LensParallelError, match=r"weights: store has '[0-9a-f]+', this run '[0-9a-f]+'.*--store"):
        run_sweep(model, blocks, JOBS[:2], ablation="zero", batch_size=2, store=store, progress=False)
    fresh = run_sweep(model, blocks, JOBS[:2], ablation="zero", batch_size=2, progress=False)
    stored = run_sweep(
        model, blocks, JOBS[:2], ablation="zero", batch_size=2, store=tmp_path / "new.jsonl", progress=False
    )
    np.testing.assert_array_equal(stored[JOBS[0]].loss_sum, fresh[JOBS[0]].loss_sum)


_CREATE_SCRIPT = """
import json, multiprocessing, sys
from types import SimpleNamespace
import numpy as np
from lens_parallel.store import SweepStore, ValueSpec

def open_store(path, barrier, index):
    barrier.wait()
    job = SimpleNamespace(key=f"job{index}")
    store = SweepStore(path, {"run": 1}, 5, lambda job: {"loss_sum": ValueSpec(("docs",))})
    with store.session([job]):
        store.append(job, {"loss_sum": np.full(5, float(index))})

context = multiprocessing.get_context("fork")
codes = []
for trial in range(10):
    barrier = context.Barrier(6)
    path = f"{sys.argv[1]}/store{trial}.jsonl"
    procs = [context.Process(target=open_store, args=(path, barrier, i)) for i in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    codes.append([p.exitcode for p in procs])
print(json.dumps(codes))
"""


def test_concurrent_store_creation_writes_one_header(tmp_path):
    """Processes creating one store at the same moment, each finishing a job: the file lock lets exactly one write
    the header, and every row lands after it. Ten trials of six processes, forked from a fresh interpreter that
    imports the store alone (forked from this one, each fork copies a process that holds the suite's models)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CREATE_SCRIPT, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == [[0] * 6] * 10
    for trial in range(10):
        lines = (tmp_path / f"store{trial}.jsonl").read_text().splitlines()
        assert len(lines) == 7 and json.loads(lines[0])["fingerprint"] == {"run": 1}
        assert sorted(json.loads(line)["job"] for line in lines[1:]) == [f"job{i}" for i in range(6)]


def test_a_store_that_never_held_a_job_is_not_left_behind(tmp_path):
    """A session that creates a store and finishes no job (a run that failed or was interrupted first) removes it;
    one that opens an existing store leaves it."""
    path = tmp_path / "store.jsonl"
    with SweepStore(path, {"run": 1}, 5, DocumentNLL().spec).session([EditJob("a", ())]):
        assert path.is_file()  # the header, written at open
    assert not path.exists()
    job = EditJob("a", ())
    store = SweepStore(path, {"run": 1}, 5, DocumentNLL().spec)
    with store.session([job]):
        store.append(job, {"loss_sum": np.zeros(5)})
    with SweepStore(path, {"run": 1}, 5, DocumentNLL().spec).session([EditJob("b", ())]):
        pass
    assert len(path.read_text().splitlines()) == 2


def test_a_row_whose_numbers_were_changed_is_recomputed_with_a_warning(tmp_path):
    """Each row carries the sha256 of its value: one float edited by hand (valid JSON, right shape) no longer
    matches, so the row is dropped with a one-line warning naming it and its job computed again."""
    model, blocks, kwargs, fresh = _stored_run(tmp_path)
    store = kwargs["store"]
    header, first, second = store.read_text().splitlines()
    row = json.loads(first)
    row["value"]["loss_sum"][3] *= 10  # L0H1's fourth document, now ten times its loss
    store.write_text("\n".join([header, json.dumps(row), second]) + "\n")
    with pytest.warns(UserWarning, match=r"line 2 \(job L0H1\): its value does not match its checksum") as caught:
        again = run_sweep(model, blocks, JOBS[:2], **kwargs)
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    np.testing.assert_array_equal(again[JOBS[0]].loss_sum, fresh[JOBS[0]].loss_sum)  # not the edited number
    assert sorted(store.read_text().splitlines()) == sorted([header, first, second])


_SWEEP_SCRIPT = """
import json
from lens_parallel import load_model, token_blocks
from lens_parallel.sweep import AblationJob, run_sweep
model = load_model("toy-gpt2")
blocks = token_blocks(model, "wikipedia-en", n_docs=4, seq_len=16, seed=1)
jobs = [AblationJob(layer, (head,)) for layer in range(3) for head in range(4)]
run = run_sweep(model, blocks, jobs, ablation="zero", batch_size=2, store=STORE, progress=False)
print(json.dumps({key: value["loss_sum"].tolist() for key, value in run.values.items()}))
"""


@pytest.mark.slow
def test_two_processes_on_one_store_compute_each_job_once(tmp_path):
    """Two real processes started together on one store: the writer lock makes the second wait and read the first's
    rows, so each job is one row, and both print what one process alone computes. Each a child of the suite's fork
    server (:mod:`tests.fresh`): a fresh interpreter that never imported lens_parallel."""
    store = tmp_path / "shared.jsonl"
    script = f"STORE = {str(store)!r}\n{_SWEEP_SCRIPT}"
    started = []
    for i in range(2):
        (tmp_path / f"p{i}").mkdir()
        started.append(fresh.start(fresh.code, script, cwd=tmp_path / f"p{i}"))
    done = [fresh.finish(*process) for process in started]
    assert [d.returncode for d in done] == [0, 0], [d.stderr[-2000:] for d in done]
    outputs = [json.loads(d.stdout) for d in done]
    keys = [json.loads(line)["job"] for line in store.read_text().splitlines()[1:]]
    assert len(keys) == 12 and len(set(keys)) == 12  # every job once
    assert outputs[0] == outputs[1]
    model = load_model("toy-gpt2")  # one process alone (this one), on the same documents and jobs
    blocks = token_blocks(model, "wikipedia-en", n_docs=4, seq_len=16, seed=1)
    jobs = [AblationJob(layer, (head,)) for layer in range(3) for head in range(4)]
    alone = run_sweep(
        model, blocks, jobs, ablation="zero", batch_size=2, store=tmp_path / "alone.jsonl", progress=False
    )
    for key, value in alone.values.items():
        np.testing.assert_allclose(outputs[0][key], value["loss_sum"], rtol=1e-6, err_msg=key)


_HOLD_SCRIPT = """
import sys, time
from lens_parallel.store import SweepStore
with SweepStore(sys.argv[1], {"run": 1}, 4, lambda job: {}).session([]):
    print("holding", flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_a_killed_lock_holder_does_not_block_the_next_run(tmp_path):
    """The writer lock is the operating system's, kept in the cache folder: a holder killed with SIGKILL (no cleanup
    runs) leaves nothing beside the store, and the next run takes the lock at once and runs."""
    import subprocess
    import sys

    from lens_parallel.paths import writer_lock

    store = tmp_path / "sweep.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_SCRIPT, str(store)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    lock = writer_lock(store)
    with pytest.raises(TimeoutError):
        lock.acquire(timeout=0.2)  # held while the holder lives
    holder.kill()
    holder.wait(60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.jsonl"]  # no lock file beside the store
    with lock.acquire(timeout=5):  # and no longer held
        pass
    store.unlink()  # the holder's header is of another run
    model, blocks = _setup()
    run = run_sweep(model, blocks, JOBS[:2], ablation="zero", batch_size=2, store=store, progress=False)
    assert set(run.values) == {job.key for job in JOBS[:2]}


def test_a_non_finite_loss_is_refused_naming_the_job(tmp_path, monkeypatch):
    model, blocks = _setup()
    real = sweep._stacked_nll

    def overflowing(context, plan, jobs, batch, **kwargs):
        rows = real(context, plan, jobs, batch, **kwargs)
        return [row * np.nan if job == JOBS[1] else row for job, row in zip(jobs, rows, strict=True)]

    monkeypatch.setattr(sweep, "_stacked_nll", overflowing)
    store = tmp_path / "sweep.jsonl"
    with pytest.raises(LensParallelError, match=r"job\(s\) L2H0\+3 gave a value that is not finite"):
        run_sweep(model, blocks, JOBS[:2], ablation="zero", batch_size=2, store=store, progress=False)
    assert [json.loads(line)["job"] for line in store.read_text().splitlines()[1:]] == ["L0H1"]  # finished: kept


def test_bad_jobs_are_refused_before_any_forward():
    model, blocks = _setup()
    with pytest.raises(
        LensParallelError,
        match="unknown positions 'first' \\(did you mean 'after-first'\\?\\); accepted: all, after-first",
    ):
        run_sweep(model, blocks, JOBS[:2], ablation="zero", positions="first")
    with pytest.raises(LensParallelError, match="edits layer 0, before its start layer 2"):
        run_sweep(model, blocks, [EditJob("early", (ComponentScale("value", layers=0),), start_layer=2)])
    with pytest.raises(LensParallelError, match="share a key"):
        run_sweep(
            model, blocks, [EditJob("a", (ComponentScale("value"),)), EditJob("a", (ComponentScale("residual-mlp"),))]
        )
    with pytest.raises(LensParallelError, match="batch_size must be a positive integer or 'auto', got 0"):
        run_sweep(model, blocks, JOBS[:1], ablation="zero", batch_size=0)
    with pytest.raises(LensParallelError, match=r"^run_sweep: edit= is now ablation= \(give ablation='zero'\)$"):
        run_sweep(model, blocks, JOBS[:1], edit="zero")
