"""Where lens_parallel keeps its bundled assets and its per-user cache, and how cache folders are built safely.

Every cached folder (unpacked tokenizers, toy models, dequantized real weights and their half-precision copies) is
built through :func:`cached_folder`, which several processes may call at once for the same folder:

- builders of one folder are serialised by a file lock (``.<name>.lock`` beside it), so a second process waits for
  the first and then uses its folder instead of building it again;
- a build writes into a private scratch folder ``.<name>.partial-<host>-<pid>-<random>`` and is renamed into place
  in one step, so no reader ever sees a half-written folder;
- a finished folder that verifies is never deleted or replaced (another process may be reading it); one that does
  not verify (an older layout, damaged files) is first renamed aside, then replaced, then deleted;
- scratch folders left by killed builds are removed, but only those whose process is dead (same host) or, for
  another host's, older than :data:`STALE_AFTER_S`: a live process's partial folder is never touched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from filelock import FileLock

from lens_parallel.errors import LensParallelError

if TYPE_CHECKING:
    import pandas as pd

ASSETS = Path(__file__).resolve().parent / "assets"
SPEC_PATH = ASSETS / "cli_spec.json"
"""The command line's saved spec: ``commands.write_spec`` writes it, ``cli.build_parser`` reads it."""
STALE_AFTER_S = 24 * 3600
"""A scratch folder written by another host is taken as abandoned once it is this old (its pid cannot be checked)."""


def cache_dir() -> Path:
    """``$LENS_PARALLEL_CACHE``, else ``$XDG_CACHE_HOME/lens_parallel``, else ``~/.cache/lens_parallel``."""
    if env := os.environ.get("LENS_PARALLEL_CACHE"):
        root = Path(env)
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lens_parallel"
    root.mkdir(parents=True, exist_ok=True)
    return root


def writer_lock(path: str | Path) -> FileLock:
    """The operating system's lock that one writer of the file at ``path`` holds (a store), kept in the cache folder
    (``<cache>/locks/<sha256 of the resolved path>.lock``) rather than beside the file, so that a run leaves nothing in
    the user's folder but its output (a lock file cannot be removed safely: a process waiting on it would lock a
    removed file while a third creates a new one). Processes of one machine, or of machines sharing the cache
    folder, exclude each other."""
    digest = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:32]
    folder = cache_dir() / "locks"
    folder.mkdir(exist_ok=True)
    return FileLock(str(folder / f"{digest}.lock"))


def check_writable(path: str | Path, what: str = "output") -> Path:
    """``path`` as a :class:`Path` once it is sure that a file can be written there, before any work: not a folder,
    writable if it exists, in a folder that exists (created here) and is writable. Otherwise one
    :class:`~lens_parallel.errors.LensParallelError` line naming ``what``, the path and why."""
    path = Path(path)
    if path.is_dir():
        raise LensParallelError(f"{what} {path} is a folder, where a file goes; remove it or give another path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LensParallelError(f"{what} {path}: cannot create its folder ({exc.strerror})") from exc
    if path.exists() and not os.access(path, os.W_OK):
        raise LensParallelError(f"{what} {path} exists and is not writable; make it writable or give another path")
    if not os.access(path.parent, os.W_OK):
        raise LensParallelError(f"{what} {path}: its folder is not writable")
    try:  # what os.access cannot tell (root, /proc, a read-only mount): a file actually opened for writing, never
        # the target created and removed (another process may be creating it now)
        if path.exists():
            with open(path, "ab"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}."):
                pass
    except OSError as exc:
        raise LensParallelError(f"{what} {path} cannot be written ({exc.strerror}); give another path") from exc
    return path


def add_suffix(stem: Path, suffix: str) -> Path:
    """``stem`` with ``suffix`` appended: unlike ``Path.with_suffix``, a dot already in the name stays
    (``toy-qwen3.5_scaling`` + ``.json``, not ``toy-qwen3.json``)."""
    return stem.parent / f"{stem.name}{suffix}"


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write(file)`` into a temporary file beside ``path``, flushed to disk, then renamed onto ``path``: a kill or
    an error never leaves ``path`` half-written (it holds the old file, or none, or the whole new one)."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_table(table: pd.DataFrame, path: str | Path) -> Path:
    """``table`` as CSV at ``path`` (no index column), written whole or not at all (:func:`write_atomic`)."""
    text = table.to_csv(index=False).encode()
    write_atomic(Path(path), lambda f: f.write(text))
    return Path(path)


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _host() -> str:
    return socket.gethostname().replace("-", "_") or "host"


def scratch_folder(target: Path) -> Path:
    """A new private folder beside ``target`` (``.<name>.partial-<host>-<pid>-<random>``) to build it in."""
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.parent / f".{target.name}.partial-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    scratch.mkdir()
    return scratch


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def is_abandoned(scratch: Path) -> bool:
    """Whether a scratch folder of :func:`scratch_folder` was left by a process that is gone (see the module
    docstring); a name this package did not write is never taken as abandoned."""
    try:
        host, pid, _ = scratch.name.rsplit(".partial-", 1)[1].rsplit("-", 2)
        pid_number = int(pid)
    except (IndexError, ValueError):
        return False
    if host == _host():
        return not _alive(pid_number)
    try:
        return time.time() - scratch.stat().st_mtime > STALE_AFTER_S
    except FileNotFoundError:
        return False


def remove_abandoned(target: Path) -> None:
    """Delete the scratch folders of ``target`` left by dead processes (never a live one's)."""
    for scratch in target.parent.glob(f".{target.name}.partial-*"):
        if is_abandoned(scratch):
            shutil.rmtree(scratch, ignore_errors=True)


def install_folder(scratch: Path, target: Path, valid: Callable[[Path], bool]) -> Path:
    """Rename the finished ``scratch`` into place as ``target`` in one step. If ``target`` already exists and is
    ``valid``, it is kept (a concurrent builder finished first) and ``scratch`` is deleted; an invalid one is
    renamed aside, replaced, then deleted."""
    for _ in range(8):
        try:
            scratch.rename(target)
            return target
        except OSError:
            if not target.exists():
                raise  # nothing in the way: the rename itself failed
        if valid(target):
            shutil.rmtree(scratch, ignore_errors=True)
            return target
        aside = target.parent / f".{target.name}.stale-{uuid.uuid4().hex[:8]}"
        try:
            target.rename(aside)
        except FileNotFoundError:
            continue  # moved away by another process meanwhile: try again
        shutil.rmtree(aside, ignore_errors=True)
    raise OSError(f"could not install {scratch} as {target}: the folder keeps changing under concurrent builders")


def cached_folder(target: Path, build: Callable[[Path], None], valid: Callable[[Path], bool]) -> Path:
    """``target`` if it is ``valid``, else built by ``build(scratch)`` and installed (see the module docstring)."""
    if valid(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if valid(target):  # built by the process we waited for
            return target
        remove_abandoned(target)
        scratch = scratch_folder(target)
        try:
            build(scratch)
            return install_folder(scratch, target, valid)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)  # gone already once installed
