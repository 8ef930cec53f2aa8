"""The values that cross between a program and its judge (``lens_parallel.sandbox.values``): each reads back equal and
of its own type, as the dataset's tests compare it; what is not a value is refused; and reading any reply costs the
judge a bounded number of comparisons, whatever its shape."""

from __future__ import annotations

import ast
import collections
import datetime
import decimal
import enum
import fractions
import math
import operator
import sys
import uuid
from pathlib import Path

import pytest

from lens_parallel.sandbox import channel, values
from lens_parallel.sandbox.values import EnumMember, HashedAlike, Uncheckable, decode_value, encode_value

ROUND_TRIP = [
    None,
    True,
    False,
    0,
    -7,
    10**5000,
    -(10**4400),
    1.5,
    -0.0,
    1e308,
    math.inf,
    -math.inf,
    2 + 3j,
    complex(math.inf, -1),
    "",
    "é\n'\"\\",
    b"\x00\xff",
    [],
    (),
    (1,),
    set(),
    frozenset(),
    {1: [2, (3,)], "a": {4.5}},
    {frozenset({1}): {(1, 2): None}},
    {"!t": [1]},
    {"a": 1, "!t": 2},
    "\ud800 lone surrogate",
    [[[[]]]],
    {"nested": [{"a": (1, 2.0, "b")}]},
    bytearray(b"\x00x"),
    collections.deque([1, (2,)]),
    collections.deque([1], maxlen=3),
    range(1, 10, 3),
    fractions.Fraction(-1, 3),
    fractions.Fraction(10**400, 3),
    decimal.Decimal("1.10"),
    decimal.Decimal("-0"),
    decimal.Decimal("-Infinity"),
    decimal.Decimal("1e999999"),
    datetime.date(2026, 12, 7),
    datetime.time(1, 2, 3, 4),
    datetime.time(1, 2, tzinfo=datetime.timezone(datetime.timedelta(hours=-5), "EST")),
    datetime.datetime(2026, 12, 7, 20, 30, 1, 5),
    datetime.datetime(2026, 12, 7, tzinfo=datetime.timezone.utc),
    datetime.datetime(2026, 11, 1, 1, 30, fold=1),
    datetime.timedelta(days=-1, seconds=5, microseconds=7),
    datetime.timezone(datetime.timedelta(minutes=90)),
    uuid.UUID(int=12345),
    {fractions.Fraction(1, 2): [decimal.Decimal("0.5"), datetime.date(2000, 1, 1)]},
]


def _cross(value, classes=None):
    """``value`` through the channel: encoded into a message's line, and read back."""
    return decode_value(channel._line({"value": encode_value(value)}), classes)["value"]


@pytest.mark.parametrize("value", ROUND_TRIP, ids=range(len(ROUND_TRIP)))
def test_a_value_crosses_equal_and_of_its_own_type(value):
    back = _cross(value)
    assert back == value and type(back) is type(value)
    if type(value) is not int:
        assert str(back) == str(value)  # Decimal's digits and sign, a time zone's name, a deque's maxlen
    assert math.isnan(_cross(math.nan))


def test_container_subclasses_cross_as_what_they_compare_equal_to():
    for mapping in (collections.Counter("aab"), collections.OrderedDict(a=1), collections.defaultdict(int, a=2)):
        back = _cross(mapping)
        assert back == dict(mapping) and type(back) is dict


def test_a_named_tuple_crosses_with_its_fields_as_the_tests_own_class_where_they_have_it():
    point_type = collections.namedtuple("Point", "x y")
    back = _cross(point_type(1, 2))
    assert back == (1, 2) and (back.x, back.y) == (1, 2) and type(back).__name__ == "Point"
    assert type(back) is not point_type and type(_cross(point_type(3, 4))) is type(back)  # made once
    assert type(_cross(point_type(1, 2), {"Point": point_type})) is point_type
    other_fields = collections.namedtuple("Point", "x z")
    assert type(_cross(point_type(1, 2), {"Point": other_fields})) is not other_fields


class Color(enum.Enum):
    RED = 1
    BLUE = 2


class Level(enum.IntEnum):
    LOW = 1


def test_an_enum_member_crosses_as_the_tests_own_member_or_compares_as_one():
    assert _cross(Color.RED, {"Color": Color}) is Color.RED
    assert _cross(Level.LOW, {"Level": Level}) is Level.LOW
    stand_in = _cross(Color.RED)
    assert type(stand_in) is EnumMember and stand_in == Color.RED and operator.eq(Color.RED, stand_in)
    assert stand_in != Color.BLUE and stand_in != 1 and stand_in == _cross(Color.RED)
    assert stand_in in {Color.RED} and (stand_in.name, stand_in.value) == ("RED", 1)
    low = _cross(Level.LOW)
    assert low == 1 and operator.eq(1, low) and low in {1} and repr(low) == "<Level.LOW: 1>"
    assert _cross(Color.BLUE, {"Color": int}) == Color.BLUE  # a name that is no enum: a stand-in


class _Int(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class _Str(str):
    pass


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ((x for x in ()), "generator"),
        (map(str, []), "map"),
        (_Int(1), "_Int"),
        ([_Int(1)], "_Int"),
        (_Str("x"), "_Str"),
        (object(), "object"),
        (len, "builtin_function_or_method"),
    ],
    ids=["generator", "map", "int-subclass", "nested-subclass", "str-subclass", "object", "function"],
)
def test_anything_else_cannot_cross_and_says_its_type(value, named):
    with pytest.raises(Uncheckable, match=f"^{named}$"):
        encode_value(value)


def test_a_time_zone_other_than_a_fixed_offset_cannot_cross():
    class Zone(datetime.tzinfo):
        def utcoffset(self, when):
            return datetime.timedelta(0)

    with pytest.raises(Uncheckable, match=r"^Zone$"):
        encode_value(datetime.datetime(2026, 1, 1, tzinfo=Zone()))


def test_a_cycle_or_a_deep_nest_cannot_cross():
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(Uncheckable, match="nested deeper than 100"):
        encode_value(cycle)


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",
        "f(1)",
        "x",
        "lambda: 1",
        "[" * 100_000 + "]" * 100_000,
        '{"!x": 1}',
        '{"!t": 1}',
        '{"!s": [[1]]}',
        '{"!d": [[[1], 2]]}',
        '{"!d": [[1, 2, 3]]}',
        '{"!c": ["a", 1]}',
        '{"!b": "zz"}',
        '{"!i": "0xg"}',
        "1" * 5000,
        '{"!F": [1, 0]}',
        '{"!F": [1, -2]}',
        '{"!F": [1.5, 2]}',
        '{"!D": 1}',
        '{"!D": "one"}',
        '{"!date": [2026, 13, 1]}',
        '{"!datetime": [2026, 1, 1, 0, 0, 0, 0, "UTC", 0]}',
        '{"!time": [25, 0, 0, 0, null, 0]}',
        '{"!timezone": [1, "x"]}',
        '{"!r": [1, 2, 0]}',
        '{"!q": [[1], -1]}',
        '{"!uuid": "xyz"}',
        '{"!n": ["Point", ["x", "class"], [1, 2]]}',
        '{"!n": ["Point", ["x"], [1, 2]]}',
        '{"!e": ["Color", 1, 1, false]}',
        '{"!B": "zz"}',
    ],
)
def test_only_values_are_read(text):
    with pytest.raises((ValueError, TypeError, RecursionError, MemoryError)):
        decode_value(text)


def test_an_honest_answer_at_the_value_limit_is_read_whole():
    """``[{}] * 250_000`` (1 MB as Python prints it): its line is under the 1 MB limit and reads back equal."""
    line = channel._line({"value": encode_value([{}] * 250_000)})
    assert len(line) < 1 << 20 and decode_value(line)["value"] == [{}] * 250_000


# -- what reading a reply costs ------------------------------------------------------------------------------------

ALIKE = [k * (2**61 - 1) for k in range(1, 1000)]
"""Distinct ints that all hash to 0."""


def nested_alike(width: int = 64, top: int = 8) -> str:
    """The issue's reply, as the program would write it on the channel (building it in Python costs what reading it
    would): ``top`` frozensets of ``width`` frozensets of ``width`` ints, every int hashing to 0. Sets of as many
    elements of one hash hash alike too, so every set at every depth holds ``width`` elements of one hash, and the
    sets of each level share all their elements but one: comparing two of them finds the difference late. At 64 and
    8: 707 KB, under the 1 MB a reply may have."""
    alike = 2**61 - 1

    def inner(i: int) -> dict:
        return {"!f": [k * alike for k in range(1, width)] + [(width + i) * alike]}

    def middle(m: int) -> dict:
        return {"!f": [inner(i) for i in range(width - 1)] + [inner(width + m)]}

    return channel._line({"value": {"!f": [middle(m) for m in range(top)]}}).decode()


def test_values_hashing_alike_are_weighed_in_sets_frozensets_and_dict_keys():
    """The j-th element of one hash costs j units (an int weighs one): 1 + 2 + ... + 631 = 199,396 units pass,
    632 elements (199,396 + 631 = 200,027) do not; alike elements in a dict's keys and in tuples count the same."""
    assert values.BUDGET == 200_000
    fits, over = ALIKE[:632], ALIKE[:633]
    for kind in (set, frozenset, dict.fromkeys):
        assert _cross(kind(fits)) == kind(fits)
        with pytest.raises(HashedAlike, match="over 200,000 comparisons"):
            _cross(kind(over))
    with pytest.raises(HashedAlike):
        _cross({(a, 1.5) for a in over})
    assert _cross({-1, -2, 0.0, 1}) == {-1, -2, 0.0, 1}  # -1 and -2 share a hash: one unit


def test_nested_sets_are_weighed_at_every_depth():
    """The issue's reply: nested frozensets, at most 64 of one hash per set, three levels. The per-set bound of 64
    let it through (4.8 s of the judge's CPU); each set here weighs its elements once per element of their hash, so
    comparing two alike sets of 64 alike ints weighs 64 * 64, and the reply is refused."""
    text = nested_alike()
    assert 700_000 < len(text) < 1 << 20
    with pytest.raises(HashedAlike):
        decode_value(text)
    small = decode_value(nested_alike(width=6, top=2))["value"]
    assert len(small) == 2 and all(len(m) == 6 and all(len(s) == 6 for s in m) for m in small)


def test_the_weight_of_a_set_counts_its_alike_elements_per_lookup():
    """Kept by container while the reply lives: each weighed value here is held until the end."""
    reader = values._Reader({})
    weighed = [frozenset(ALIKE[:8]), frozenset(range(8)), (1, "x" * 640, [2]), {ALIKE[0]: 1, ALIKE[1]: 2}]
    assert [reader.weight(v) for v in weighed] == [8 * 8 + 1, 8 + 1, 1 + (1 + 10) + 2 + 1, 2 * 2 + 2 + 1]
    assert reader.weight(frozenset([weighed[0], frozenset(ALIKE[8:16])])) == 2 * 65 + 2 * 65 + 1


def test_a_fraction_is_refused_past_its_bits_and_its_gcd_is_charged():
    big = fractions.Fraction(2**values.MAX_FRACTION_BITS + 1, 3)
    with pytest.raises(HashedAlike, match="fraction of over"):
        _cross(big)
    reader = values._Reader({})
    values._fraction(reader, [2**8000 + 1, 3])
    assert reader.left == values.BUDGET - (8001 // 256 + 1) ** 2


def test_the_channel_modules_need_only_the_standard_library():
    """They run as ``python -I -S`` in the sandbox and the judge, nothing else importable there: values.py imports
    the standard library only; channel.py imports values.py's names from the package only where it is imported as
    a module (in the sandbox and the judge both run in one namespace)."""
    for module in (values, channel):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module != "lens_parallel.sandbox.values":
                imported.add(node.module.split(".")[0])
        assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported - set(sys.stdlib_module_names)
    guarded = next(n for n in ast.walk(ast.parse(Path(channel.__file__).read_text())) if isinstance(n, ast.If))
    assert ast.unparse(guarded.test) == "__name__ != '__main__'"
    assert isinstance(guarded.body[0], ast.ImportFrom) and guarded.body[0].module == "lens_parallel.sandbox.values"


@pytest.mark.parametrize("accelerated", [True, False], ids=["_json", "json"])
def test_the_channel_reads_and_writes_json_as_json_does(accelerated, monkeypatch):
    """Through json's C accelerator (``_json``: ``import json`` costs 10 ms at every start of the sandbox and the
    judge) or, where a Python has none, json itself: the same text, the same values, the same refusals."""
    import json

    if not accelerated:
        monkeypatch.setattr(values, "_json", None)
    for value in ROUND_TRIP:
        tree = {"value": encode_value(value), "é": [math.inf, -math.inf, 1e-300, -0.0, "\ud800"]}
        text = values.dumps(tree)
        assert text == json.dumps(tree, ensure_ascii=False, separators=(",", ":"))
        assert values.loads(text) == json.loads(text) and values.loads(" \n" + text + "\r\n ") == json.loads(text)
        assert values.loads(text.encode("utf-8", "surrogatepass")) == json.loads(text)
    assert math.isnan(values.loads("NaN"))
    for broken in ("", "{", '{"a": 1} x', "[1,]", '"\x01"', "nul", "1" * 5000, "[" * 100_000):
        with pytest.raises((ValueError, RecursionError)):
            json.loads(broken)
        with pytest.raises((ValueError, RecursionError)):
            values.loads(broken)
