"""Examples run as users run them, each in a process of its own that has never imported lens_parallel, started fast.

A fresh ``python`` spends about 5 of the 7 seconds it takes to load a toy model importing the libraries underneath
(torch, transformers, TransformerLens); the users tier runs some forty examples. So each runs in a child of
multiprocessing's fork server, which is a fresh interpreter of its own that imported those libraries and nothing of
lens_parallel (or of the suite): every example imports lens_parallel, builds its registries and loads its models
afresh, as in a new interpreter, and gets its own working folder, standard output and error, and exit status.
:data:`ENV` is the environment the server starts with: one thread, the hub offline (the examples that need it must
say so in one line), and no browser for PNGs (a command then keeps the HTML and says so once; PNG export has its own
tests).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRELOAD = (
    "torch",
    "transformers",
    "transformer_lens.model_bridge",
    "numpy",
    "pandas",
    "scipy.stats",
    "plotly.graph_objects",
    "einops",
    "tqdm",
    "tests.fresh",
)
"""What the fork server imports before it forks: the libraries underneath, never lens_parallel."""
ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "BROWSER_PATH": "/nonexistent/chromium",
}
"""The environment every example runs in (read by the libraries at their import, so the server starts with it)."""


@dataclass(frozen=True)
class Ran:
    """What an example did: its exit status, standard output and error."""

    returncode: int
    stdout: str
    stderr: str


def compile_package() -> None:
    """Write the package's bytecode where Python looks for it (``lens_parallel/**/__pycache__``), as a first import
    does where writing it is allowed: every fresh process of the suite (the examples, notebook kernels, commands, Ray
    workers) then reads it instead of compiling about a hundred modules from source (0.15 s each time; never cached
    where ``PYTHONDONTWRITEBYTECODE`` is set, as on the machines this was built on). Reading bytecode is unaffected
    by that setting; a source changed since is compiled afresh, as always."""
    import compileall

    compileall.compile_dir(Path(__file__).resolve().parents[1] / "lens_parallel", quiet=2)


@contextlib.contextmanager
def _environment(changes: dict[str, str]) -> Iterator[None]:
    before = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _context() -> Any:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    with _environment(ENV):
        multiprocessing.forkserver.ensure_running()
    return context


def _child(target: Callable[..., int | None], args: tuple[Any, ...], cwd: str, out: str, err: str) -> None:
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    code = target(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code or 0)


def start(target: Callable[..., int | None], *args: Any, cwd: Path) -> tuple[Any, Path]:
    """Start ``target(*args)`` (a function of an importable module) in a fresh process in ``cwd``; returns the
    process and the folder its output goes to."""
    logs = cwd / ".example"
    logs.mkdir(exist_ok=True)
    process = _context().Process(target=_child, args=(target, args, str(cwd), str(logs / "out"), str(logs / "err")))
    process.start()
    return process, logs


def finish(process: Any, logs: Path, *, timeout: float = 600) -> Ran:
    """Wait for ``process`` (killed past ``timeout``) and read what it wrote."""
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
        raise TimeoutError(f"the example ran past {timeout} s")
    return Ran(process.exitcode, (logs / "out").read_text(), (logs / "err").read_text())


def run(target: Callable[..., int | None], *args: Any, cwd: Path, timeout: float = 600) -> Ran:
    """``target(*args)`` in a fresh process in ``cwd`` (module docstring), to its end."""
    return finish(*start(target, *args, cwd=cwd), timeout=timeout)


def interrupt_when(process: Any, ready: Callable[[], bool], *, timeout: float = 300) -> None:
    """Send SIGINT to ``process`` once ``ready()`` holds (polled: never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not ready() and process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.is_alive(), "the example ended before it was ready to be interrupted: give it more work"
    os.kill(process.pid, signal.SIGINT)


def command(argv: list[str]) -> int:
    """``lens-parallel ARGV``, as its console script runs it."""
    sys.argv = ["lens-parallel", *argv]
    from lens_parallel.cli import main

    return main(argv)


def code(text: str) -> None:
    """Python source, as ``python -c`` runs it."""
    exec(compile(text, "<example>", "exec"), {"__name__": "__main__"})
