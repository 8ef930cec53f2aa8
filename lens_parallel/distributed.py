"""Many workers, on one machine or a Ray cluster: the executor for the sweep engine's jobs and for training runs.

Ray is an optional extra (``pip install 'lens_parallel[distributed]'``); nothing here imports it unless asked to.

``workers=1`` and no ``ray_address`` (the default everywhere): tasks run in this process, one after another, on the
caller's model. Otherwise :func:`run_tasks` connects to Ray (``ray_address``: a running cluster such as
``"auto"`` or ``"10.0.0.1:6379"``; none: a local Ray started on this machine), starts ``workers`` actors, each of
which **loads the model once by its spec** (:class:`ModelRecipe`: a worker on another node loads it from its own
cache, a real model being fetched there on first use) and checks that its weights are the caller's
(:func:`~lens_parallel.models.weights_digest`: every value, hashed exactly), then hands them whole chunks of
jobs. Results come back to the caller, which alone writes
the resumable store, so a cluster run killed midway resumes in one process, or on a cluster, from the same store.

An actor asks Ray for one GPU when the model is on CUDA, else for an equal share of the cluster's cores
(``torch.set_num_threads`` set to that share). An actor whose process dies is restarted by Ray (it loads the model
again) and its unfinished task is retried, so a sweep survives a killed worker with the same results.

Results equal a single-process run exactly: every worker computes the same chunks with the same batch composition
on the same weights, dtype and device type as the caller (the store's fingerprint names those).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.errors import EnvironmentFailure, LensParallelError
from lens_parallel.models import ModelInfo, ModelSpecError, check_spec, load_model, model_info, weights_digest
from lens_parallel.validate import check_positive_int, check_ray_address

INSTALL = "pip install 'lens_parallel[distributed]'"
MAX_RETRIES = 3
"""How often Ray restarts a dead worker and retries its task (and reruns a training run whose process died)."""


def check_workers(workers: int, ray_address: str | None, model: TransformerBridge | None = None) -> bool:
    """Whether this run uses Ray; raises (before any work) :class:`LensParallelError` for a bad ``workers`` or a
    ``model`` that workers cannot load by its spec, and :class:`EnvironmentFailure` when Ray is needed but not
    installed (saying what to install)."""
    check_positive_int("workers", workers)
    check_ray_address(ray_address)
    distributed = workers > 1 or ray_address is not None
    if distributed and importlib.util.find_spec("ray") is None:
        raise EnvironmentFailure(
            f"workers={workers}{f', ray_address={ray_address!r}' if ray_address else ''} "
            f"runs on Ray, which is not installed: {INSTALL}"
        )
    if distributed and model is not None:
        _check_loadable(model)
    return distributed


def _check_loadable(model: TransformerBridge) -> str:
    """The spec workers load ``model`` by; refuses a model they cannot load that way (built or changed in memory,
    or placed over devices by ``device_map``)."""
    spec = model.cfg.model_name
    try:
        check_spec(spec)
    except ModelSpecError as exc:
        raise LensParallelError(
            f"workers load the model by its spec, and {spec!r} is not one (a model built or changed in memory?): "
            "save it with save_pretrained and load_model the folder, or run with workers=1"
        ) from exc
    if len(set(getattr(model.original_model, "hf_device_map", {}).values())) > 1:
        raise LensParallelError(
            "a model placed by device_map over several devices (or disk) runs in one process: use workers=1 "
            "(workers load the model whole, one device each)"
        )
    return spec


@dataclass(frozen=True)
class ModelRecipe:
    """How a worker loads the caller's model: ``load_model(spec, device=..., dtype=...)``, then checks ``digest``."""

    spec: str
    dtype: str
    device_type: str
    digest: str

    @classmethod
    def of(cls, model: TransformerBridge, digest: str | None = None) -> ModelRecipe:
        """The recipe of ``model`` (``digest``: its :func:`~lens_parallel.models.weights_digest` when the caller
        computed it already); refuses a model that workers cannot load by its spec."""
        spec = _check_loadable(model)
        param = next(model.parameters())
        dtype = str(param.dtype).removeprefix("torch.")
        return cls(spec, dtype, param.device.type, digest or weights_digest(model))

    def load(self) -> TransformerBridge:
        device = "cuda" if self.device_type == "cuda" else "cpu"
        return load_model(self.spec, device=device, dtype=getattr(torch, self.dtype))


@dataclass
class TaskContext:
    """What a task sees: the model, its :class:`ModelInfo`, ``memo``, a per-worker cache of what every task of a
    run needs once (an unedited prefix pass, a dense capture), kept for the worker's life, and ``progress``, called
    with the units of work a task has just finished (in this process; None on a Ray worker, whose tasks are counted
    when their results arrive)."""

    model: TransformerBridge
    info: ModelInfo
    memo: dict[Any, Any] = field(default_factory=dict)
    progress: Callable[[int], object] | None = None

    def advance(self, units: int) -> None:
        if self.progress is not None:
            self.progress(units)

    def cached(self, key: Any, make: Callable[[], Any]) -> Any:
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]


Task = Callable[[TaskContext, Any, Any], Any]
"""``task(context, shared, item)``: a module-level function (shipped by reference), ``shared`` the same for every
item of a run (sent to the cluster once), ``item`` one chunk of jobs."""


class _Worker:
    """The Ray actor: loads the model once, then runs tasks."""

    def __init__(self, recipe: ModelRecipe, threads: int) -> None:
        torch.set_num_threads(threads)
        model = recipe.load()
        self.context = TaskContext(model, model_info(model))

    def digest(self) -> str:
        return weights_digest(self.context.model)

    def run(self, task: Task, shared: Any, index: int, item: Any) -> tuple[int, Any]:
        return index, task(self.context, shared, item)


def connect(ray_address: str | None) -> Any:
    """Ray, connected to ``ray_address`` (or a local Ray started on this machine when None); an existing connection
    is reused."""
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    return ray


def _actor_options(ray: Any, device_type: str, workers: int) -> tuple[dict[str, int], int]:
    if device_type == "cuda":
        return {"num_gpus": 1, "num_cpus": 1}, 1
    share = max(1, int(ray.cluster_resources().get("CPU", 1) // workers))
    return {"num_cpus": share}, share


def run_tasks(
    model: TransformerBridge,
    task: Task,
    shared: Any,
    items: Sequence[Any],
    *,
    workers: int = 1,
    ray_address: str | None = None,
    memo: dict[Any, Any] | None = None,
    digest: str | None = None,
    progress: Callable[[int], object] | None = None,
) -> Iterator[tuple[int, Any]]:
    """``(i, task(context, shared, items[i]))`` for every item: in order in this process (``workers=1``, no
    address), else in the order they finish on ``workers`` Ray actors (module docstring). ``memo``: what the caller
    already computed on its own model, seeding the context in this process (workers compute it themselves);
    ``digest``: the model's weights digest when the caller computed it already (for its store); ``progress``: the
    context's in this process (:class:`TaskContext`)."""
    if not check_workers(workers, ray_address):
        context = TaskContext(model, model_info(model), dict(memo or {}), progress)
        for i, item in enumerate(items):
            yield i, task(context, shared, item)
        return
    if not items:
        return
    recipe = ModelRecipe.of(model, digest)
    ray = connect(ray_address)
    from ray.util import ActorPool

    options, threads = _actor_options(ray, recipe.device_type, workers)
    actor = ray.remote(max_restarts=MAX_RETRIES, max_task_retries=MAX_RETRIES)(_Worker)
    actors = [actor.options(**options).remote(recipe, threads) for _ in range(min(workers, len(items)))]
    try:
        found = ray.get([a.digest.remote() for a in actors])
        if any(d != recipe.digest for d in found):
            raise LensParallelError(
                f"a worker loaded {recipe.spec!r} with other weights than this process's model (digest "
                f"{found[0]} vs {recipe.digest}): the model was changed in memory, or the worker's copy differs; "
                "save the model with save_pretrained and load_model the folder"
            )
        ref = ray.put(shared)
        pool = ActorPool(actors)
        yield from pool.map_unordered(lambda a, job: a.run.remote(task, ref, *job), list(enumerate(items)))
    finally:
        for a in actors:
            ray.kill(a)


def run_remote(
    function: Callable[..., Any],
    calls: Sequence[dict[str, Any]],
    *,
    workers: int,
    ray_address: str | None,
    device: str,
) -> Iterator[tuple[int, Any]]:
    """``(i, function(**calls[i]))`` as each finishes, at most ``workers`` at a time, each a Ray task (one GPU each
    when ``device`` is CUDA, or ``auto`` on a cluster with GPUs; else an equal share of the cores) that Ray reruns up
    to :data:`MAX_RETRIES` times if its process dies; ``function`` must make a rerun resume (a training run restarts
    from its last checkpoint)."""
    check_workers(workers, ray_address)
    ray = connect(ray_address)
    gpus = device.startswith("cuda") or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    options, threads = _actor_options(ray, "cuda" if gpus else "cpu", workers)
    remote = ray.remote(max_retries=MAX_RETRIES)(_call).options(**options)
    pending: dict[Any, int] = {}
    queue = list(enumerate(calls))
    while queue or pending:
        while queue and len(pending) < workers:
            i, kwargs = queue.pop(0)
            pending[remote.remote(function, threads, kwargs)] = i
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            yield pending.pop(ref), ray.get(ref)


def _call(function: Callable[..., Any], threads: int, kwargs: dict[str, Any]) -> Any:
    torch.set_num_threads(threads)
    return function(**kwargs)
