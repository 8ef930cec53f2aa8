"""Edits written as text, for the command line: compact specs and settings files.

A spec is ``KIND`` or ``KIND:key=value,key=value``:

- ``KIND`` a space of :class:`~lens_parallel.edits.ComponentScale` (``value``, ``value-exclude-self``,
  ``residual-attn``, ``residual-mlp``, ``residual-block``): ``value:s_par=0`` is ``ComponentScale("value",
  s_par=0.0)``;
- ``zero-diagonal`` (:class:`~lens_parallel.edits.ZeroDiagonal`), ``random-direction``
  (:class:`~lens_parallel.edits.RandomDirectionRemoval`: ``random-direction:seed=1,norm_matched=true``);

values are numbers, ``true``/``false``, or layer / head lists joined by ``+`` (``layers=0+1+2``). A settings file
(YAML or JSON) maps each setting's name to one spec or a list of specs (applied together).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast, get_args

from lens_parallel.choices import Space
from lens_parallel.edits import ComponentScale, Edit, RandomDirectionRemoval, ZeroDiagonal
from lens_parallel.errors import LensParallelError

KINDS: dict[str, Any] = {"zero-diagonal": ZeroDiagonal, "random-direction": RandomDirectionRemoval}
"""The spec kinds besides the spaces of ComponentScale."""


def _value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if "+" in text:
        return tuple(int(x) for x in text.split("+"))
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> Edit:
    """One edit from ``KIND[:key=value,...]`` (module docstring)."""
    kind, _, rest = spec.partition(":")
    fields: dict[str, Any] = {}
    for part in filter(None, rest.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise LensParallelError(f"edit spec {spec!r}: {part!r} is not key=value")
        fields[key.strip().replace("-", "_")] = _value(value.strip())
    spaces = get_args(Space)
    if kind not in spaces and kind not in KINDS:
        raise LensParallelError(f"edit spec {spec!r}: unknown kind {kind!r}; accepted: {', '.join((*spaces, *KINDS))}")
    for name in ("s_par", "s_perp", "eps"):
        if isinstance(fields.get(name), int):
            fields[name] = float(fields[name])
    try:
        edit: Edit = ComponentScale(cast(Space, kind), **fields) if kind in spaces else KINDS[kind](**fields)
    except TypeError as exc:
        raise LensParallelError(f"edit spec {spec!r}: {exc}") from None
    return edit


def parse_settings(items: tuple[str, ...]) -> dict[str, tuple[Edit, ...]]:
    """The named settings of ``--settings``: each item a spec (named by itself) or a YAML / JSON file mapping
    names to a spec or a list of specs."""
    import yaml

    out: dict[str, tuple[Edit, ...]] = {}
    for item in items:
        path = Path(item)
        if path.suffix in (".yaml", ".yml", ".json"):
            if not path.is_file():
                raise LensParallelError(f"settings file {item} does not exist")
            loaded = yaml.safe_load(path.read_text())
            if not isinstance(loaded, dict) or not loaded:
                raise LensParallelError(f"settings file {item} must map each setting's name to a spec or a list")
            for name, specs in loaded.items():
                specs = [specs] if isinstance(specs, str) else specs
                if not isinstance(specs, list) or not all(isinstance(s, str) for s in specs):
                    raise LensParallelError(f"settings file {item}: {name!r} must be a spec or a list of specs")
                out[str(name)] = tuple(parse_spec(s) for s in specs)
        else:
            out[item] = (parse_spec(item),)
    if not out:
        raise LensParallelError("give at least one setting: an edit spec such as value:s_par=0, or a settings file")
    return out
