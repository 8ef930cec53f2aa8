"""The one set of checks for input values: choices (read from their ``Literal`` types), finite numbers, counts.

Each raises :class:`~lens_parallel.errors.LensParallelError` with what was wrong and what is accepted.
"""

from __future__ import annotations

import difflib
import math
import numbers
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

from lens_parallel.errors import LensParallelError, LibraryError

K = TypeVar("K")
V = TypeVar("V")


def literal_values(choice: Any) -> tuple[Any, ...]:
    """The accepted values of a ``Literal`` choice type, in their declared order."""
    return tuple(typing.get_args(choice))


def choice_table(choice: Any, table: Mapping[K, V]) -> Mapping[K, V]:
    """``table`` (read-only), once its keys are ``choice``'s values in their declared order: the ``Literal`` names a
    choice once, and the table that gives each name its behaviour is checked against it where it is built (at
    import), so that the two cannot drift apart. Raises :class:`~lens_parallel.errors.LibraryError` naming the
    missing, the unknown or the misplaced keys.

    Examples:
        >>> from typing import Literal
        >>> dict(choice_table(Literal["a", "b"], {"a": 1, "b": 2}))
        {'a': 1, 'b': 2}
    """
    names, keys = literal_values(choice), tuple(table)
    if keys != names:
        missing, unknown = [n for n in names if n not in table], [k for k in keys if k not in names]
        raise LibraryError(
            f"the table of {names} has keys {keys}: missing {missing}, unknown {unknown} (in the Literal's order)"
        )
    return types.MappingProxyType(dict(table))


@runtime_checkable
class Named(Protocol):
    """Anything with a ``name``: a space, a layer kind, an ablation."""

    @property
    def name(self) -> str: ...


N = TypeVar("N", bound=Named)


def named_table(choice: Any, entries: Iterable[N]) -> Mapping[str, N]:
    """:func:`choice_table` of ``entries`` by their own ``name``: each object of a choice's table names itself once.

    Examples:
        >>> from typing import Literal, NamedTuple
        >>> class Kind(NamedTuple):
        ...     name: str
        >>> list(named_table(Literal["a", "b"], [Kind("a"), Kind("b")]))
        ['a', 'b']
    """
    return choice_table(choice, {entry.name: entry for entry in entries})


def did_you_mean(value: object, accepted: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` naming the one of ``accepted`` closest to a misspelt ``value`` (difflib's ratio at
    least 0.6), or "" when none is close.

    Examples:
        >>> did_you_mean("valeu", ["value", "residual-attn"])
        " (did you mean 'value'?)"
    """
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, [str(a) for a in accepted], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_choice(what: str, value: object, choice: Any) -> Any:
    """``value`` if it is one of ``choice``'s values, else a :class:`LensParallelError` naming them (and the closest,
    for a misspelling)."""
    accepted = literal_values(choice)
    if not isinstance(value, str) or value not in accepted:
        raise LensParallelError(
            f"unknown {what} {value!r}{did_you_mean(value, accepted)}; accepted: {', '.join(accepted)}"
        )
    return value


def check_choices(what: str, values: Iterable[object], choice: Any) -> tuple[Any, ...]:
    """Each of ``values`` checked by :func:`check_choice` (at least one; repeats dropped, order kept)."""
    values = tuple(values)
    if not values:
        raise LensParallelError(f"give at least one {what}; accepted: {', '.join(literal_values(choice))}")
    return tuple(dict.fromkeys(check_choice(what, v, choice) for v in values))


def check_finite(name: str, value: object) -> float:
    """``value`` as a float if it is a finite real number (not a bool), else a :class:`LensParallelError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise LensParallelError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def check_eps(value: object) -> float:
    """``eps``, a guard on a norm or a denominator, as a float if it is finite and above 0 (a guard of 0 or below
    would let a vanishing reference divide), else a :class:`LensParallelError`."""
    eps = check_finite("eps", value)
    if eps <= 0:
        raise LensParallelError(f"eps must be above 0 (the guard on a norm: 1e-8 by default), got {value!r}")
    return eps


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is an integer >= 1 (not a bool), else a :class:`LensParallelError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise LensParallelError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_non_negative_int(name: str, value: object) -> int:
    """``value`` if it is an integer >= 0 (not a bool), else a :class:`LensParallelError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise LensParallelError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def check_bool(name: str, value: object, *, optional: bool = False) -> bool | None:
    """``value`` if it is True or False (or, with ``optional``, None), else a :class:`LensParallelError`: a string
    such as ``"no"`` or a number is never read as a truth value."""
    if isinstance(value, bool):
        return value
    if optional and value is None:
        return None
    accepted = "True, False or None" if optional else "True or False"
    raise LensParallelError(f"{name} must be {accepted}, got {value!r}")


def check_ray_address(address: object) -> str | None:
    """A Ray address (``auto``, ``host:6379``) or None, else a :class:`LensParallelError`."""
    if address is not None and (not isinstance(address, str) or not address.strip()):
        raise LensParallelError(f"ray_address must be a Ray address such as 'auto' or 'host:6379', got {address!r}")
    return address


def as_indices(values: object, *, what: str = "layers") -> tuple[int, ...] | None:
    """Layer or head indices (``what`` names them in the error) as a tuple: an int is one index, None stays None
    (every one). One rule everywhere: a negative index counts from the end (-1 the last), read when the indices meet
    a model (:func:`lens_parallel.hooks.check_indices` for an analysis, :meth:`lens_parallel.edits.EditBase.resolved`
    for an edit), where one out of range is refused."""
    if values is None:
        return None
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable | numbers.Integral):
        raise LensParallelError(f"{what} must be an index, a list of indices or None, got {values!r}")
    found = (values,) if isinstance(values, numbers.Integral) else tuple(values)
    if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in found):
        raise LensParallelError(f"{what} must be integer indices, got {list(found)!r}")
    return tuple(int(i) for i in found)


def as_tuple(values: object) -> tuple[Any, ...]:
    """A value or several as a tuple: a string, a number or anything not iterable is one value (``space="all"``,
    ``s_par=0.5``); a list, a range or another iterable gives its items."""
    if isinstance(values, (str, bytes, numbers.Number)) or not isinstance(values, Iterable):
        return (values,)
    return tuple(values)
