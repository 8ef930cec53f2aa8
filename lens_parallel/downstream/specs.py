"""Edits written as text, for the command line: compact specs and settings files.

A spec is ``KIND`` or ``KIND:key=value,key=value``:

- ``KIND`` a space (:data:`lens_parallel.spaces.SPACES`), short for :class:`~lens_parallel.edits.ComponentScale`
  in it: ``value:s_par=0`` is ``ComponentScale("value", s_par=0.0)``;
- or a registered edit kind whose settings are all scalars (:data:`lens_parallel.edits.EDITS` entries with
  ``spec=True``: ``zero-diagonal``, ``random-direction:seed=1,norm_matched=true``, ``scale:space=value,s_par=0``);

values are numbers, ``true``/``false``, or layer / head lists joined by ``+`` (``layers=0+1+2``). A settings file
(YAML or JSON) maps each setting's name to one spec or a list of specs (applied together).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

from lens_parallel.choices import Space
from lens_parallel.edits import EDITS, ComponentScale, Edit
from lens_parallel.errors import LensParallelError
from lens_parallel.spaces import SPACES
from lens_parallel.validate import did_you_mean


def spec_kinds() -> tuple[str, ...]:
    """Every kind a spec can name: the spaces (short for a ComponentScale), then the registered spec edits."""
    return (*SPACES, *(name for name, kind in EDITS.items() if kind.spec))


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
    if kind not in spec_kinds():
        raise LensParallelError(
            f"edit spec {spec!r}: unknown kind {kind!r}{did_you_mean(kind, spec_kinds())}; accepted: "
            f"{', '.join(spec_kinds())}"
        )
    for name in ("s_par", "s_perp", "eps"):
        if isinstance(fields.get(name), int):
            fields[name] = float(fields[name])
    try:
        make: Callable[..., Edit] = partial(ComponentScale, cast(Space, kind)) if kind in SPACES else EDITS[kind].cls
        edit = make(**fields)
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
