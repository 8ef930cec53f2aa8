"""How lens_parallel runs lm-evaluation-harness: its task index built once and reused, its evaluator quiet and its
prompt templates compiled once, its RULER module imported without a download. lm-eval's private names are read
through :mod:`lens_parallel.compat`."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.metadata
import os
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lens_parallel import compat


def task_manager_from_cache(cache: Path) -> Any:
    """lm-eval's ``TaskManager`` of its own tasks, its index (every task YAML parsed: about 6 s here, 11 s on a busy
    machine) read from a file in ``cache`` written by the first build, when that file was written for the same
    installed lm-eval: its version, its tasks folder and the name, size and modification time of every file there
    (about 0.1 s to read; any edit, addition or removal rebuilds it). The file is written atomically; one that cannot
    be read is rebuilt."""
    compat.check("lm_eval")
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    folder = Path(lm_eval.tasks.__file__).parent
    digest = hashlib.sha256(f"{importlib.metadata.version('lm_eval')}|{folder}".encode())
    for root, _, files in sorted(os.walk(folder)):
        for name in sorted(files):
            stat = os.stat(os.path.join(root, name))
            digest.update(f"{root}/{name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    path = cache / f"lm_eval_task_index-{digest.hexdigest()[:16]}.pickle"
    with contextlib.suppress(OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
        index = pickle.loads(path.read_bytes())  # this process's own cache, written below
        return compat.with_task_index(TaskManager(include_defaults=False), index)
    manager = TaskManager()
    with contextlib.suppress(OSError):
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_bytes(pickle.dumps(compat.task_index(manager), protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(tmp, path)
    return manager


def task_manager_with_include(manager: Any, include_path: str) -> Any:
    """lm-eval's ``TaskManager`` ``manager`` (its index of lm-eval's own task YAMLs) with the YAMLs of
    ``include_path`` added, as ``TaskManager(include_path=...)`` indexes them (later paths override): only the
    folder is scanned, not lm-eval's thousands of YAMLs again (about 10 s here)."""
    compat.check("lm_eval")
    from lm_eval.tasks import TaskManager

    added = TaskManager(include_path=include_path, include_defaults=False, metadata=manager.metadata)
    merged = compat.with_task_index(manager, {**compat.task_index(manager), **compat.task_index(added)})
    merged.include_path = include_path
    return merged


@contextlib.contextmanager
def lm_eval_quietly(*, progress: bool) -> Iterator[None]:
    """Inside, lm-eval's evaluator records no git commit (its ``get_git_commit_hash`` runs ``git describe`` in the
    working folder, which prints ``fatal: not a git repository`` outside a checkout: the run's provenance holds
    lens_parallel's version instead) and no environment (its ``add_env_info`` runs torch's ``collect_env``, which
    runs ``pip list`` and a dozen other commands: 0.6 s per evaluation, per setting; the provenance holds the
    versions that make the numbers), and without ``progress`` its tasks build their requests without a progress bar
    (``Task.build_all_requests`` draws one that no argument turns off). Its prompt templates are compiled once each
    (``lm_eval.utils.apply_template`` compiles its Jinja source at every call: for every document and every
    few-shot example of it, 2,387 compilations and 3.7 s of a 33 s profiled run of the general tasks), rendered as
    before."""
    compat.check("lm_eval")
    import lm_eval.api.task
    import lm_eval.evaluator
    import lm_eval.utils

    real = (
        lm_eval.evaluator.get_git_commit_hash,
        lm_eval.evaluator.add_env_info,
        lm_eval.api.task.tqdm,
        lm_eval.utils.apply_template,
    )
    lm_eval.evaluator.get_git_commit_hash = lambda: None
    lm_eval.evaluator.add_env_info = lambda results: None
    lm_eval.utils.apply_template = lambda template, doc: _template(template).render(**doc)
    if not progress:
        lm_eval.api.task.tqdm = functools.partial(real[2], disable=True)
    try:
        yield
    finally:
        (
            lm_eval.evaluator.get_git_commit_hash,
            lm_eval.evaluator.add_env_info,
            lm_eval.api.task.tqdm,
            lm_eval.utils.apply_template,
        ) = real


@functools.lru_cache(maxsize=4096)
def _template(source: str) -> Any:
    """lm-eval's prompt template ``source`` compiled in its own Jinja environment (``lm_eval.utils.env``)."""
    import lm_eval.utils

    return lm_eval.utils.env.from_string(source)


def import_ruler_without_download() -> None:
    """Import lm-eval's RULER haystack module, which on import downloads NLTK's ``punkt_tab`` when it is missing
    (and then prints that it did, even when the download failed offline), with that download skipped: ``punkt_tab``
    serves only the essay haystacks (Paul Graham's essays, a hub dataset), which
    :func:`lens_parallel.downstream.data.ruler_metadata` refuses without it."""
    name = "lm_eval.tasks.ruler.prepare_niah"
    if name in sys.modules:
        return
    compat.check("lm_eval")
    import nltk

    real = nltk.data.find

    def find(resource: str, *args: Any, **kwargs: Any) -> Any:
        return None if resource == "tokenizers/punkt_tab" else real(resource, *args, **kwargs)

    nltk.data.find = find
    try:
        importlib.import_module(name)
    finally:
        nltk.data.find = real
