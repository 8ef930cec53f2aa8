"""The values that cross the channel between a program and its judge (:mod:`~lens_parallel.sandbox.channel`), as
JSON, and what reading one may cost the reader.

Standard library only, and run from its source inside the sandbox and the judge (``fence._channel_code``): each
standard-library module a tag needs is imported when a value needs it. :func:`encode_value` writes a value as a
tree of JSON values; :func:`decode_value` reads it back equal, of the same type, as the dataset's tests compare it:

- JSON's own: ``None``, ``bool``, ``int``, ``float`` (``inf``, ``nan`` included), ``str``, ``list``, and ``dict``
  with string keys;
- one-key objects whose key is a tag (:data:`TAGS`): ``tuple``, ``set``, ``frozenset``, other dicts (and
  ``OrderedDict``, ``defaultdict``, ``Counter`` as their dict), ``bytes``, ``bytearray``, ``complex``, long integers,
  ``deque``, ``range``, ``Fraction``, ``Decimal``, ``date``, ``time``, ``datetime``, ``timedelta``, ``timezone``,
  ``UUID``, named tuples (with their fields: the prompt's or the tests' own class where one of that name and fields
  exists) and enum members (the prompt's or the tests' own member where that class defines it, else an
  :class:`EnumMember` that compares as the member does).

Types are matched exactly: a subclass of ``int`` or ``str`` that is not an enum does not cross; anything else raises
:class:`Uncheckable` naming its type.

**The reader's cost is bounded by the reply's size, for every shape.** JSON is parsed by the C parser, each tagged
object once. What could cost more is a set (or a dict's keys) whose elements hash alike: each is compared with every
one before it of its hash, and two containers that hash alike are compared element by element, at any depth. Each
reply has a budget (:data:`BUDGET` units): the j-th element of a hash already in its set costs j
times its weight (its elements at every depth, each element of a set counted once per element there sharing its
hash: :meth:`_Reader.weight`), and normalising a ``Fraction`` costs its gcd. Past the budget the reply is one that
cannot be checked (:class:`HashedAlike`).
"""

from __future__ import annotations

import math
import sys

TYPE_CHECKING = False  # typing costs milliseconds at every start: read by type checkers only
if TYPE_CHECKING:
    from typing import Any

MAX_DEPTH = 100
"""Containers nested deeper than this do not cross (an honest answer is never that deep; a cycle would be endless)."""

BUDGET = 200_000
"""Units one reply may cost its reader beyond parsing it: comparisons of elements that hash alike (a unit: one
element compared, and weighed beforehand by :meth:`_Reader.weight`, about 0.5 µs in all), gcds of fractions, named
tuple classes made."""

MAX_FRACTION_BITS = 1 << 14
"""The numerator and denominator of a ``Fraction`` that crosses: their gcd takes 0.2 ms at this length, and grows
with its square."""

_HEX_BITS = 13_000
"""Integers longer than this cross in hex: decimal text past 4,300 digits is refused by Python's int parser."""

_MAPPINGS = ("builtins.dict", "collections.OrderedDict", "collections.defaultdict", "collections.Counter")
"""Cross as plain dicts: each compares equal to a dict exactly as the dict of its items does."""


def _enum_type() -> Any:
    """``enum.Enum`` where a program or the tests have imported it (an enum member exists only then), else None:
    importing enum costs milliseconds at every start of the sandbox and the judge."""
    module = sys.modules.get("enum")
    return None if module is None else module.Enum


def _module(name: str) -> Any:
    __import__(name)
    return sys.modules[name]


class Uncheckable(TypeError):
    """A value that cannot cross; its message names the type (``generator``, ``Random``, ...)."""


class HashedAlike(ValueError):
    """A reply whose reading would cost past :data:`BUDGET` (values hashing alike, huge fractions)."""


class EnumMember:
    """A member of the program's own enum class that neither the prompt nor the tests define: equal to a member of
    that name of a class of that name (and to another such stand-in), and, where the class mixes in ``int``,
    ``str`` or ``float`` (``IntEnum``, ``StrEnum``), to its value, as the member itself is."""

    __slots__ = ("cls", "mixed", "name", "value")

    def __init__(self, cls: str, name: str, value: Any, mixed: bool) -> None:
        self.cls, self.name, self.value, self.mixed = cls, name, value, mixed

    def __repr__(self) -> str:
        return f"<{self.cls}.{self.name}: {self.value!r}>"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, EnumMember):
            return (self.cls, self.name) == (other.cls, other.name)
        enum = _enum_type()
        if enum is not None and isinstance(other, enum):
            return (type(other).__name__, other.name) == (self.cls, self.name)
        return bool(self.mixed and self.value == other)

    def __hash__(self) -> int:
        return hash(self.value) if self.mixed else hash(self.name)


def _stdlib(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _tz(value: Any, depth: int) -> Any:
    """A ``tzinfo`` as it crosses: None or a fixed-offset ``timezone`` (others have no value to send)."""
    return None if value is None else _plain(value, depth + 1)


_WRITERS: dict[str, Any] = {
    "builtins.bytearray": lambda v, d: {"!B": v.hex()},
    "collections.deque": lambda v, d: {"!q": [[_plain(x, d + 1) for x in v], v.maxlen]},
    "builtins.range": lambda v, d: {"!r": [_plain(v.start, d), _plain(v.stop, d), _plain(v.step, d)]},
    "fractions.Fraction": lambda v, d: {"!F": [_plain(v.numerator, d), _plain(v.denominator, d)]},
    "decimal.Decimal": lambda v, d: {"!D": str(v)},
    "datetime.date": lambda v, d: {"!date": [v.year, v.month, v.day]},
    "datetime.time": lambda v, d: {"!time": [v.hour, v.minute, v.second, v.microsecond, _tz(v.tzinfo, d), v.fold]},
    "datetime.datetime": lambda v, d: {
        "!datetime": [v.year, v.month, v.day, v.hour, v.minute, v.second, v.microsecond, _tz(v.tzinfo, d), v.fold]
    },
    "datetime.timedelta": lambda v, d: {"!timedelta": [v.days, v.seconds, v.microseconds]},
    "datetime.timezone": lambda v, d: {"!timezone": [_plain(v.utcoffset(None), d + 1), v.tzname(None)]},
    "uuid.UUID": lambda v, d: {"!uuid": v.hex},
}
"""The standard library's value types that are not JSON's, by their type's module and name."""


def _plain(value: Any, depth: int) -> Any:
    """``value`` as a tree of JSON values (:func:`encode_value`)."""
    if depth > MAX_DEPTH:
        raise Uncheckable(f"nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is float:
        return value
    if kind is int:
        return {"!i": hex(value)} if value.bit_length() > _HEX_BITS else value
    if kind is complex:
        return {"!c": [value.real, value.imag]}
    if kind is bytes:
        return {"!b": value.hex()}
    if kind is list:
        return [_plain(v, depth + 1) for v in value]
    if kind is tuple:
        return {"!t": [_plain(v, depth + 1) for v in value]}
    if kind is set or kind is frozenset:
        return {"!s" if kind is set else "!f": [_plain(v, depth + 1) for v in value]}
    if _stdlib(kind) in _MAPPINGS:
        items = dict.items(value)
        if all(type(k) is str for k, _ in items) and not (len(value) == 1 and next(iter(value)).startswith("!")):
            return {k: _plain(v, depth + 1) for k, v in items}
        return {"!d": [[_plain(k, depth + 1), _plain(v, depth + 1)] for k, v in items]}
    enum = _enum_type()
    if enum is not None and isinstance(value, enum):
        mixed = isinstance(value, (int, str, float))
        return {"!e": [kind.__name__, value.name, _plain(value._value_, depth + 1), mixed]}
    fields = getattr(kind, "_fields", None)
    if issubclass(kind, tuple) and type(fields) is tuple:
        return {"!n": [kind.__name__, list(fields), [_plain(v, depth + 1) for v in tuple.__iter__(value)]]}
    writer = _WRITERS.get(_stdlib(kind))
    if writer is None:
        raise Uncheckable(kind.__name__)
    return writer(value, depth)


def encode_value(value: Any) -> Any:
    """``value`` as JSON text's tree that :func:`decode_value` reads back equal (module docstring). Raises
    :class:`Uncheckable` naming the type of what cannot cross."""
    return _plain(value, 0)


def _ints(values: Any, n: int) -> bool:
    return type(values) is list and len(values) == n and all(type(x) is int for x in values)


class _Reader:
    """One reply's reading: its budget, and the classes the judge trusts (the prompt's and the tests' names)."""

    def __init__(self, classes: dict[str, Any]) -> None:
        self.left, self.classes = BUDGET, classes
        self.weights: dict[int, int] = {}

    def spend(self, units: int) -> None:
        self.left -= units
        if self.left < 0:
            raise HashedAlike(f"reading it would cost over {BUDGET:,} comparisons")

    def weight(self, value: Any) -> int:
        """What comparing ``value`` with another value of its hash costs at most, in units: its elements at every
        depth (strings, bytes and long integers by their length), each element of a set (or a dict's key) counted
        once per element of that set sharing its hash, which a lookup compares it with. Kept by container (the
        reply's tree lives while it is read); stops past the budget left."""
        kind = type(value)
        if kind is str or kind is bytes:
            return 1 + len(value) // 64
        if kind is int:
            return 1 + int(value.bit_length()) // 512
        if kind not in (tuple, list, set, frozenset, dict):
            return 1
        known = self.weights.get(id(value))
        if known is not None:
            return known
        if kind is set or kind is frozenset or kind is dict:
            alike: dict[int, int] = {}
            for key in value:
                alike[hash(key)] = alike.get(hash(key), 0) + 1
            total = sum(alike[hash(k)] * self.weight(k) for k in value)
            total += sum(map(self.weight, value.values())) if kind is dict else 0
        else:
            total = sum(map(self.weight, value))
        if total > self.left:
            raise HashedAlike(f"reading it would cost over {BUDGET:,} comparisons")
        self.weights[id(value)] = total + 1
        return total + 1

    def apart(self, items: list[Any]) -> list[Any]:
        """``items`` (a set's elements, a dict's keys), after charging what building their set costs: the j-th
        element of a hash already seen is compared with the j before it."""
        seen: dict[int, int] = {}
        for item in items:
            key = hash(item)
            earlier = seen.get(key, 0)
            seen[key] = earlier + 1
            if earlier:
                self.spend(earlier * self.weight(item))
        return items

    def pairs(self, items: Any) -> tuple[dict[Any, Any]] | None:
        if not (type(items) is list and all(type(p) is list and len(p) == 2 for p in items)):
            return None
        self.apart([k for k, _ in items])
        return (dict(items),)

    def untag(self, pairs: dict[str, Any]) -> Any:
        if len(pairs) != 1:
            return pairs
        ((key, inner),) = pairs.items()
        if not key.startswith("!"):
            return pairs
        read = _READERS.get(key)
        value = read(self, inner) if read is not None else None
        if value is None:
            raise ValueError(f"not a value: {key!r}")
        return value[0]


def _member(reader: _Reader, inner: Any) -> tuple[Any] | None:
    if not (type(inner) is list and len(inner) == 4 and type(inner[0]) is str and type(inner[1]) is str):
        return None
    cls = reader.classes.get(inner[0])
    enum, members = _enum_type(), getattr(cls, "__members__", {})
    if isinstance(cls, type) and enum is not None and issubclass(cls, enum) and inner[1] in members:
        return (members[inner[1]],)
    return (EnumMember(inner[0], inner[1], inner[2], inner[3] is True),)


_NAMED: dict[tuple[str, tuple[str, ...]], type] = {}
"""Named tuple classes made for replies, by name and fields (one judge scores one program: a few at most)."""


def _named(reader: _Reader, inner: Any) -> tuple[Any] | None:
    if not (type(inner) is list and len(inner) == 3 and type(inner[0]) is str and type(inner[2]) is list):
        return None
    name, fields, values = inner
    if not (type(fields) is list and all(type(f) is str for f in fields) and len(fields) == len(values)):
        return None
    key = (name, tuple(fields))
    trusted = reader.classes.get(name)
    if isinstance(trusted, type) and issubclass(trusted, tuple) and getattr(trusted, "_fields", None) == key[1]:
        return (trusted(*values),)
    if key not in _NAMED:
        reader.spend(1000 + len(name) + sum(map(len, fields)))
        _NAMED[key] = _module("collections").namedtuple(name, fields)
    return (_NAMED[key](*values),)


def _fraction(reader: _Reader, inner: Any) -> tuple[Any] | None:
    if not (type(inner) is list and len(inner) == 2 and all(type(x) is int for x in inner) and inner[1] > 0):
        return None
    bits = max(abs(inner[0]).bit_length(), inner[1].bit_length())
    if bits > MAX_FRACTION_BITS:
        raise HashedAlike(f"a fraction of over {MAX_FRACTION_BITS} bits")
    reader.spend((bits // 256 + 1) ** 2)
    import fractions

    return (fractions.Fraction(*inner),)


def _tzinfo(value: Any) -> Any:
    import datetime

    if value is None or type(value) is datetime.timezone:
        return value
    raise ValueError("not a time zone")


def _decimal(text: Any) -> tuple[Any] | None:
    decimal = _module("decimal")
    try:
        return (decimal.Decimal(text),) if type(text) is str else None
    except decimal.InvalidOperation:
        return None


_READERS: dict[str, Any] = {
    "!t": lambda r, x: (tuple(x),) if type(x) is list else None,
    "!s": lambda r, x: (set(r.apart(x)),) if type(x) is list else None,
    "!f": lambda r, x: (frozenset(r.apart(x)),) if type(x) is list else None,
    "!d": _Reader.pairs,
    "!b": lambda r, x: (bytes.fromhex(x),) if type(x) is str else None,
    "!B": lambda r, x: (bytearray.fromhex(x),) if type(x) is str else None,
    "!c": lambda r, x: (
        (complex(*x),) if type(x) is list and len(x) == 2 and all(type(v) in (int, float) for v in x) else None
    ),
    "!i": lambda r, x: (int(x, 16),) if type(x) is str else None,
    "!q": lambda r, x: (
        (_module("collections").deque(x[0], x[1]),)
        if type(x) is list and len(x) == 2 and type(x[0]) is list and (x[1] is None or type(x[1]) is int)
        else None
    ),
    "!r": lambda r, x: (range(*x),) if _ints(x, 3) else None,
    "!F": _fraction,
    "!D": lambda r, x: _decimal(x),
    "!date": lambda r, x: (_module("datetime").date(*x),) if _ints(x, 3) else None,
    "!time": lambda r, x: (
        (_module("datetime").time(*x[:4], _tzinfo(x[4]), fold=x[5]),)
        if type(x) is list and len(x) == 6 and _ints(x[:4] + x[5:], 5)
        else None
    ),
    "!datetime": lambda r, x: (
        (_module("datetime").datetime(*x[:7], _tzinfo(x[7]), fold=x[8]),)
        if type(x) is list and len(x) == 9 and _ints(x[:7] + x[8:], 8)
        else None
    ),
    "!timedelta": lambda r, x: (_module("datetime").timedelta(*x),) if _ints(x, 3) else None,
    "!timezone": lambda r, x: (
        (_module("datetime").timezone(*x),)
        if type(x) is list and len(x) == 2 and type(x[0]) is _module("datetime").timedelta and type(x[1]) is str
        else None
    ),
    "!uuid": lambda r, x: (_module("uuid").UUID(hex=x),) if type(x) is str else None,
    "!e": _member,
    "!n": _named,
}
"""Each tag's reader: the value in a one-tuple, or None where the tag's content is not one of its values."""

TAGS = tuple(_READERS)
"""The tags a one-key object may carry (:data:`_READERS`)."""


class _Parsing:
    """What the C scanner of the standard library's json reads of its context, as ``json.loads`` sets it."""

    strict = True
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.__getitem__

    def __init__(self, object_hook: Any) -> None:
        self.object_hook = object_hook


def loads(text: str | bytes, object_hook: Any = None) -> Any:
    """``json.loads(text, object_hook=object_hook)``, through json's C accelerator (``_json``) where this Python
    has it: ``import json`` costs 10 ms (``re``, ``enum``) at every start of the sandbox and the judge, ``_json``
    microseconds. Raises ``ValueError`` for text that is not one JSON value."""
    if _json is None:
        import json

        return json.loads(text, object_hook=object_hook)
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogatepass")
    start = len(text) - len(text.lstrip(" \t\n\r"))
    try:
        value, end = _json.make_scanner(_Parsing(object_hook))(text, start)
    except StopIteration as error:
        raise ValueError(f"not JSON at {error.value}") from None
    if text[end:].strip(" \t\n\r"):
        raise ValueError(f"not one JSON value: more after {end}")
    return value


def dumps(value: Any) -> str:
    """``json.dumps(value, ensure_ascii=False, separators=(",", ":"))`` of a tree of JSON values, through ``_json``
    where this Python has it (:func:`loads`)."""
    if _json is None:
        import json

        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return "".join(
        _json.make_encoder(None, _not_json, _json.encode_basestring, None, ":", ",", False, False, True)(value, 0)
    )


def _not_json(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not JSON")


try:
    import _json as _accelerator
except ImportError:  # not CPython: json itself
    _accelerator = None  # type: ignore[assignment]
_json: Any = _accelerator
"""The standard library's json's C accelerator, where this Python has one (:func:`loads`, :func:`dumps`)."""


def decode_value(text: str | bytes, classes: dict[str, Any] | None = None) -> Any:
    """The value of JSON ``text`` written from :func:`encode_value`; enum members and named tuples of a class
    ``classes`` names (the prompt's and the tests' namespace) read as that class's. Anything else raises
    ``ValueError`` (:class:`HashedAlike` past the budget; or ``TypeError``, ``RecursionError``, ``MemoryError`` for
    text built to break the parser)."""
    return loads(text, _Reader(classes or {}).untag)
