"""Provenance and saving/loading of result dataclasses (JSON for fields, one ``.npz`` for arrays)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib.metadata
import json
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from lens_parallel.data import TokenBlocks
from lens_parallel.models import ModelInfo

_REGISTRY: dict[str, type] = {}
T = TypeVar("T")


def serializable(cls: type[T]) -> type[T]:
    """Register a dataclass so :func:`load_result` can rebuild it by name."""
    _REGISTRY[cls.__name__] = cls
    return cls


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@serializable
@dataclasses.dataclass(frozen=True)
class Provenance:
    """Where a result came from: enough to rerun it."""

    model: dict
    texts: dict
    weight_processing: str
    settings: dict
    versions: dict
    created: str

    @classmethod
    def collect(cls, info: ModelInfo, tokens: TokenBlocks | Tensor, **settings: Any) -> Provenance:
        texts = tokens.describe() if isinstance(tokens, TokenBlocks) else {
            "corpus": "caller-supplied token tensor", "shape": list(tokens.shape)
        }  # fmt: skip
        return cls(
            model=info.to_dict(),
            texts=texts,
            weight_processing="unprocessed: no LayerNorm folding, no centering, value biases not folded into b_O",
            settings=settings,
            versions={p: _version(p) for p in ("lens_parallel", "transformer-lens", "transformers", "torch")},
            created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        )


def as_tokens(tokens: object) -> Int[Tensor, "batch pos"]:
    """The token tensor of a :class:`TokenBlocks` or a tensor, checked to be ``[batch, pos]`` integers."""
    t = tokens.tokens if isinstance(tokens, TokenBlocks) else tokens
    if not isinstance(t, Tensor) or t.ndim != 2 or t.dtype not in (torch.int32, torch.int64):
        got = f"{type(t).__name__} {tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"tokens must be TokenBlocks or an integer tensor [batch, pos], got {got}")
    return t


class ResultMixin:
    """What every result dataclass shares: ``info`` from its ``provenance``, ``save`` and ``load``."""

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(**self.provenance.model)

    def save(self, path: str | Path) -> Path:
        """Write ``path.json`` (fields and provenance) and ``path.npz`` (arrays)."""
        return save_result(self, path)

    @classmethod
    def load(cls, path: str | Path):
        """Read a result written by :meth:`save`."""
        result = load_result(path)
        if not isinstance(result, cls):
            raise TypeError(f"{path} holds a {type(result).__name__}, not a {cls.__name__}")
        return result


def _encode(obj: Any, arrays: dict[str, np.ndarray], key: str) -> Any:
    if dataclasses.is_dataclass(obj):
        out = {"__class__": type(obj).__name__}
        for f in dataclasses.fields(obj):
            out[f.name] = _encode(getattr(obj, f.name), arrays, f"{key}.{f.name}")
        return out
    if isinstance(obj, np.ndarray):
        arrays[key] = obj
        return {"__array__": key}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(x, arrays, f"{key}.{i}") for i, x in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(x, arrays, f"{key}.{i}") for i, x in enumerate(obj)]
    if isinstance(obj, dict):
        return {k: _encode(v, arrays, f"{key}.{k}") for k, v in obj.items()}
    return obj


def _decode(obj: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(obj, dict):
        if "__array__" in obj:
            return arrays[obj["__array__"]]
        if "__tuple__" in obj:
            return tuple(_decode(x, arrays) for x in obj["__tuple__"])
        if "__class__" in obj:
            cls = _REGISTRY[obj["__class__"]]
            return cls(**{k: _decode(v, arrays) for k, v in obj.items() if k != "__class__"})
        return {k: _decode(v, arrays) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(x, arrays) for x in obj]
    return obj


def save_result(result: Any, path: str | Path) -> Path:
    """Write ``path.json`` (fields, provenance) and ``path.npz`` (arrays); returns the JSON path."""
    path = Path(path).with_suffix("")
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    payload = _encode(result, arrays, "root")
    np.savez_compressed(path.with_suffix(".npz"), **arrays)
    path.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=str))
    return path.with_suffix(".json")


def load_result(path: str | Path) -> Any:
    """Rebuild a result written by :func:`save_result`."""
    path = Path(path).with_suffix("")
    with np.load(path.with_suffix(".npz")) as data:
        arrays = {k: data[k] for k in data.files}
    return _decode(json.loads(path.with_suffix(".json").read_text()), arrays)
