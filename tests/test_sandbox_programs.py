"""What ordinary programs use, in the sandbox: each of them passes; the standard library's pools take their defaults
from the CPUs the program is given, and a program that sees a host of 16 or 32 cores starts them within its limits;
the standard library's values cross; the watch costs the scorer a read a tick; and a trace of the datasets'
canonical solutions and these programs makes every call the allow-list names but those
:data:`~lens_parallel.sandbox.syscalls.UNTRACED` gives a reason for."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from lens_parallel.downstream import data as task_data
from lens_parallel.downstream import task_functions as tf
from lens_parallel.errors import LensParallelError
from lens_parallel.sandbox import fence, syscalls
from lens_parallel.sandbox.fence import ALLOW_ENV, Execution, Fence, SandboxLimits, run_program


@pytest.fixture(autouse=True)
def allowed(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")


ORDINARY = {  # name -> (program, tests): what a program may use of the standard library
    "threads and their locks": (
        """\
import threading
def f(n):
    lock, done, cond = threading.Lock(), threading.Event(), threading.Condition()
    out = []
    def work(i):
        with lock:
            out.append(i)
    ts = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    with cond:
        cond.wait(0.01)
    threading.Timer(0.01, done.set).start()
    done.wait(5)
    return sorted(out)
""",
        """\
assert f(4) == [0, 1, 2, 3]
""",
    ),
    "a thread pool": (
        """\
from concurrent.futures import ThreadPoolExecutor, wait
def f(xs):
    with ThreadPoolExecutor() as p:
        futures = [p.submit(abs, x) for x in xs]
        wait(futures, timeout=5)
        return list(p.map(abs, xs))
""",
        """\
assert f([-1, -2]) == [1, 2]
""",
    ),
    "a process pool": (
        """\
import multiprocessing
def f(xs):
    with multiprocessing.Pool() as p:
        return p.map(abs, xs)
""",
        """\
assert f([-1, -2]) == [1, 2]
""",
    ),
    "a process pool executor": (
        """\
from concurrent.futures import ProcessPoolExecutor
def f(xs):
    with ProcessPoolExecutor() as p:
        return list(p.map(abs, xs))
""",
        """\
assert f([-1, -2]) == [1, 2]
""",
    ),
    "a process and a queue": (
        """\
import multiprocessing
def put(q):
    q.put(7)
def f():
    q = multiprocessing.Queue()
    p = multiprocessing.Process(target=put, args=(q,))
    p.start()
    got = q.get(timeout=5)
    p.join()
    return got, p.exitcode
""",
        """\
assert f() == (7, 0)
""",
    ),
    "a manager": (
        """\
import multiprocessing
def f():
    with multiprocessing.Manager() as m:
        d = m.dict()
        d['a'] = 1
        return dict(d)
""",
        """\
assert f() == {'a': 1}
""",
    ),
    "a subprocess": (
        """\
import subprocess, sys
def f():
    out = subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True, timeout=20)
    return out.stdout.strip(), out.returncode
""",
        """\
assert f() == ('42', 0)
""",
    ),
    "a shell": (
        """\
import os, subprocess
def f():
    out = subprocess.run('echo hi | cat', shell=True, capture_output=True)
    return out.stdout, os.system('true')
""",
        "assert f() == (b'hi\\n', 0)\n",
    ),
    "fork, wait, signals": (
        """\
import os, signal, time
def f():
    got = []
    signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
    os.kill(os.getpid(), signal.SIGUSR1)
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    return got, os.WTERMSIG(status)
""",
        """\
assert f() == ([1], 15)
""",
    ),
    "alarms and timers": (
        """\
import signal, time
def f():
    got = []
    signal.signal(signal.SIGALRM, lambda *a: got.append(1))
    signal.setitimer(signal.ITIMER_REAL, 0.01)
    time.sleep(0.05)
    signal.alarm(0)
    signal.getitimer(signal.ITIMER_REAL)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR2])
    return got
""",
        """\
assert f() == [1]
""",
    ),
    "files and folders": (
        """\
import glob, os, shutil, tempfile
def f():
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, 'a.txt')
        with open(p, 'w') as out:
            out.write('hello')
        shutil.copy(p, p + '.b')
        os.rename(p + '.b', p + '.c')
        os.symlink(p, p + '.l')
        os.link(p, p + '.h')
        os.chmod(p, 0o600)
        os.utime(p, (1, 1))
        os.truncate(p + '.c', 2)
        os.makedirs(os.path.join(d, 'x', 'y'))
        found = sorted(os.path.basename(x) for x in glob.glob(d + '/*'))
        walked = [len(files) for _, _, files in os.walk(d)]
        os.chdir(d)
        here = os.getcwd()
        os.umask(0o22)
        os.statvfs(d)
        os.access(p, os.R_OK)
        os.readlink(p + '.l')
        shutil.rmtree(os.path.join(d, 'x'))
        os.unlink(p + '.h')
        os.chdir('/tmp')
        return found, walked[0], here == d, open(p + '.c').read()
""",
        """\
assert f() == (['a.txt', 'a.txt.c', 'a.txt.h', 'a.txt.l', 'x'], 4, True, 'he')
""",
    ),
    "sqlite": (
        """\
import sqlite3
def f():
    db = sqlite3.connect('/tmp/trace.db')
    db.execute('create table if not exists t(a)')
    with db:
        db.execute('insert into t values (1)')
    other = sqlite3.connect('/tmp/trace.db', timeout=1)
    return other.execute('select count(*) from t').fetchone()[0] >= 1
""",
        """\
assert f() is True
""",
    ),
    "shared memory": (
        """\
from multiprocessing import shared_memory
def f():
    m = shared_memory.SharedMemory(create=True, size=1 << 20)
    m.buf[:3] = b'abc'
    other = shared_memory.SharedMemory(m.name)
    got = bytes(other.buf[:3])
    other.close()
    m.close()
    m.unlink()
    return got
""",
        """\
assert f() == b'abc'
""",
    ),
    "a mapped file": (
        """\
import mmap
def f():
    with open('/tmp/trace.map', 'w+b') as out:
        out.write(b'x' * 4096)
        out.flush()
        m = mmap.mmap(out.fileno(), 4096)
        m[:2] = b'ab'
        m.flush()
        m.resize(8192)
        return bytes(m[:2])
""",
        """\
assert f() == b'ab'
""",
    ),
    "sockets and selectors": (
        """\
import selectors, socket
def f():
    a, b = socket.socketpair()
    sel = selectors.DefaultSelector()
    sel.register(b, selectors.EVENT_READ)
    a.sendall(b'x')
    ready = sel.select(1)
    got = b.recv(1)
    a.shutdown(socket.SHUT_WR)
    return got, len(ready), b.recv(1)
""",
        """\
assert f() == (b'x', 1, b'')
""",
    ),
    "a UNIX socket server": (
        """\
import os, socket, threading
def f():
    path = '/tmp/trace.sock'
    if os.path.exists(path):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(path)
    s.listen()
    c = socket.socket(socket.AF_UNIX)
    c.connect(path)
    conn, _ = s.accept()
    r, w = os.pipe()
    socket.send_fds(c, [b'x'], [r])
    msg, fds, _, _ = socket.recv_fds(conn, 1, 1)
    c.settimeout(1)
    return msg, len(fds), conn.getsockname() == path, c.getpeername() == path
""",
        """\
assert f() == (b'x', 1, True, True)
""",
    ),
    "asyncio": (
        """\
import asyncio
async def g(x):
    await asyncio.sleep(0.001)
    return x
def f(xs):
    async def main():
        loop = asyncio.get_running_loop()
        y = await loop.run_in_executor(None, abs, -1)
        return [*await asyncio.gather(*map(g, xs)), y]
    return asyncio.run(main())
""",
        """\
assert f([1, 2]) == [1, 2, 1]
""",
    ),
    "resources and identity": (
        """\
import os, platform, resource, time
def f():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 1, hard))
    resource.getrusage(resource.RUSAGE_SELF)
    os.times()
    os.nice(0)
    ids = (os.getpid(), os.getppid(), os.getuid(), os.geteuid(), os.getgid(), os.getegid())
    os.getgroups()
    os.getpgrp()
    os.getsid(0)
    os.getresuid()
    os.getresgid()
    platform.uname()
    time.time()
    time.process_time()
    time.perf_counter()
    os.sched_getaffinity(0)
    os.sched_yield()
    os.sched_get_priority_max(os.SCHED_OTHER)
    return len(ids), os.cpu_count() >= 1
""",
        """\
assert f() == (6, True)
""",
    ),
    "randomness": (
        """\
import hashlib, os, random, secrets, uuid
def f():
    drawn = len(os.urandom(8)), len(secrets.token_hex(4)), len(str(uuid.uuid4()))
    return (*drawn, random.Random(1).random() < 1, len(hashlib.sha256(b'x').hexdigest()))
""",
        """\
assert f() == (8, 8, 36, True, 64)
""",
    ),
    "faulthandler and tracebacks": (
        """\
import faulthandler, traceback
def f():
    faulthandler.enable()
    try:
        1 / 0
    except ZeroDivisionError:
        text = traceback.format_exc()
    faulthandler.disable()
    return 'ZeroDivisionError' in text
""",
        """\
assert f() is True
""",
    ),
    "select and poll": (
        """\
import os, select
def f():
    r, w = os.pipe()
    os.write(w, b'x')
    a = select.select([r], [], [], 1)[0]
    p = select.poll()
    p.register(r, select.POLLIN)
    return len(a), len(p.poll(1000))
""",
        """\
assert f() == (1, 1)
""",
    ),
    "descriptors": (
        """\
import fcntl, os
def f():
    r, w = os.pipe()
    d = os.dup(r)
    os.dup2(w, d + 1)
    os.set_blocking(r, False)
    os.set_inheritable(r, True)
    flags = fcntl.fcntl(r, fcntl.F_GETFL)
    return os.isatty(r), os.get_blocking(r), bool(flags & os.O_NONBLOCK)
""",
        """\
assert f() == (False, False, True)
""",
    ),
    "compressed and serialised files": (
        """\
import bz2, csv, gzip, json, lzma, pickle, zlib
def f():
    with gzip.open('/tmp/t.gz', 'wt') as out:
        out.write('x')
    with lzma.open('/tmp/t.xz', 'wt') as out:
        out.write('y')
    with bz2.open('/tmp/t.bz2', 'wt') as out:
        out.write('z')
    with open('/tmp/t.csv', 'w', newline='') as out:
        csv.writer(out).writerow([1, 2])
    with open('/tmp/t.pkl', 'wb') as out:
        pickle.dump({'a': 1}, out)
    json.dump([1], open('/tmp/t.json', 'w'))
    return gzip.open('/tmp/t.gz', 'rt').read(), len(zlib.compress(b'a'))
""",
        """\
assert f() == ('x', 9)
""",
    ),
    "printing and reading standard input": (
        """\
import sys
def f():
    for i in range(1000):
        print(i)
    sys.stdout.flush()
    print('x', file=sys.stderr)
    return sys.stdin.read()
""",
        """\
assert f() == ''
""",
    ),
    "dates and numbers": (
        """\
import datetime, decimal, fractions, math, statistics, time
def f():
    datetime.datetime.now()
    time.localtime()
    return math.isqrt(17), decimal.Decimal('1.1') + 1, fractions.Fraction(1, 3) * 3, statistics.mean([1, 3])
""",
        """\
import decimal
assert f() == (4, decimal.Decimal('2.1'), 1, 2)
""",
    ),
    "many threads": (
        """\
import threading
def f():
    out = []
    ts = [threading.Thread(target=out.append, args=(i,)) for i in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    return len(out)
""",
        """\
assert f() == 8
""",
    ),
    "a spawned process": (
        """\
import multiprocessing
def f():
    ctx = multiprocessing.get_context('forkserver')
    p = ctx.Process(target=abs, args=(1,))
    p.start()
    p.join()
    return p.exitcode
""",
        """\
assert f() == 0
""",
    ),
    "sleeping": (
        """\
import time
def f():
    time.sleep(0.01)
    return True
""",
        """\
assert f() is True
""",
    ),
    "the os module's descriptor calls": (
        """\
import fcntl, os, signal, subprocess, sys, time
def f():
    d = os.open('/tmp', os.O_RDONLY)
    os.mkdir('fd-made', dir_fd=d)
    fd = os.open('fd-file', os.O_CREAT | os.O_RDWR, dir_fd=d)
    os.writev(fd, [b'ab', b'cd'])
    os.pwritev(fd, [b'x'], 0)
    os.pwritev(fd, [b'y'], 1, os.RWF_DSYNC)
    os.lseek(fd, 0, 0)
    got = [bytes(b) for b in [bytearray(2), bytearray(2)]]
    bufs = [bytearray(2), bytearray(2)]
    os.readv(fd, bufs)
    os.preadv(fd, [bytearray(1)], 0)
    os.preadv(fd, [bytearray(1)], 0, os.RWF_HIPRI)
    os.posix_fallocate(fd, 0, 8)
    os.fchmod(fd, 0o644)
    os.fstatvfs(fd)
    out = os.open('/tmp/fd-copy', os.O_CREAT | os.O_WRONLY)
    os.copy_file_range(fd, out, 4, 0)
    os.rename('fd-file', 'fd-file2', src_dir_fd=d, dst_dir_fd=d)
    os.symlink('fd-file2', 'fd-link', dir_fd=d)
    os.link('fd-file2', 'fd-hard', src_dir_fd=d, dst_dir_fd=d)
    os.readlink('fd-link', dir_fd=d)
    os.chmod('fd-file2', 0o600, dir_fd=d)
    os.access('fd-file2', os.R_OK, dir_fd=d, effective_ids=True)
    os.listxattr('/tmp/fd-copy')
    try:
        os.getxattr('/tmp/fd-copy', 'user.x')
    except OSError:
        pass
    os.dup2(fd, 20, inheritable=False)
    os.fchdir(d)
    os.getpgid(0)
    p = subprocess.Popen([sys.executable, '-c', 'pass'], start_new_session=True)
    os.waitid(os.P_PID, p.pid, os.WEXITED)
    q = subprocess.Popen(['true'], process_group=0)
    q.wait()
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    os.kill(os.getpid(), signal.SIGUSR1)
    pending = signal.sigpending()
    signal.sigtimedwait([signal.SIGUSR1], 1)
    signal.signal(signal.SIGUSR2, lambda *a: None)
    signal.pthread_kill(__import__('threading').get_ident(), signal.SIGUSR2)
    signal.signal(signal.SIGALRM, lambda *a: None)
    signal.setitimer(signal.ITIMER_REAL, 0.01)
    signal.pause()
    time.clock_getres(time.CLOCK_MONOTONIC)
    time.get_clock_info('process_time')
    fcntl.flock(fd, fcntl.LOCK_EX)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.sched_getparam(0)
    os.sched_getscheduler(0)
    os.sched_get_priority_min(os.SCHED_OTHER)
    return bytes(bufs[0]), signal.SIGUSR1 in pending
""",
        """\
assert f() == (b'xy', True)
""",
    ),
}


@pytest.mark.parametrize("name", sorted(ORDINARY))
def test_an_ordinary_program_passes(name):
    program, tests = ORDINARY[name]
    assert run_program(program, tests, limits=SandboxLimits(timeout=30.0)) == Execution(True, "passed")


POOLS = (
    "import concurrent.futures as cf, multiprocessing, os\n"
    "def f(xs):\n    out = {}\n"
    "    with multiprocessing.Pool() as p:\n        out['pool'] = (p._processes, p.map(abs, xs))\n"
    "    with cf.ProcessPoolExecutor() as p:\n        out['processes'] = (p._max_workers, list(p.map(abs, xs)))\n"
    "    with cf.ThreadPoolExecutor() as p:\n        out['threads'] = (p._max_workers, list(p.map(abs, xs)))\n"
    "    return out\n"
)


def test_the_program_sees_the_cpus_it_is_given_and_the_pools_agree():
    """One CPU by default: ``os.cpu_count()``, its affinity and the pools' defaults say 1 (five threads for a
    ``ThreadPoolExecutor``); the CPU is one of the scorer's, and the program cannot widen it."""
    program = POOLS + (
        "def seen():\n    import ctypes\n    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    mask = ctypes.c_ulong((1 << 64) - 1)\n    widened = libc.sched_setaffinity(0, 8, ctypes.byref(mask))\n"
        "    return os.cpu_count(), sorted(os.sched_getaffinity(0)), widened, ctypes.get_errno()\n"
    )
    mine = sorted(os.sched_getaffinity(0))
    tests = (
        "assert f([-1, -2]) == {'pool': (1, [1, 2]), 'processes': (1, [1, 2]), 'threads': (5, [1, 2])}\n"
        f"count, cpus, widened, errno = seen()\nassert count == 1 and len(cpus) == 1 and cpus[0] in {mine!r}\n"
        "assert (widened, errno) == (-1, 1)\n"
    )
    assert run_program(program, tests) == Execution(True, "passed")


@pytest.mark.parametrize("cores", [16, 32])
def test_the_pools_defaults_start_on_a_host_of_16_and_32_cores(cores):
    """The host simulated by the program's own view of its CPUs (``os.cpu_count`` and its affinity say ``cores``),
    with ``cpus=cores`` (on this machine the sandbox gets what CPUs it has): a ``multiprocessing.Pool()``, a
    ``ProcessPoolExecutor()`` and a ``ThreadPoolExecutor()`` start with their defaults (``cores`` processes,
    ``min(32, cores + 4)`` threads) within the processes and open files the limits derive from ``cpus``."""
    view = f"os.cpu_count = lambda: {cores}\nos.sched_getaffinity = lambda pid: set(range({cores}))\n"
    limits = SandboxLimits(timeout=60.0, cpus=cores)
    assert (limits.max_processes, limits.open_files) == {16: (50, 64), 32: (80, 96)}[cores]
    want = {"pool": (cores, [1, 2]), "processes": (cores, [1, 2]), "threads": (min(32, cores + 4), [1, 2])}
    got = run_program(POOLS + view, f"assert f([-1, -2]) == {want!r}\n", limits=limits)
    assert got == Execution(True, "passed")


def test_limits_that_cannot_hold_the_pools_are_refused_before_anything_runs():
    with pytest.raises(LensParallelError, match=r"processes=10 cannot hold .* cpus=8 .* at least 17, or None for 34"):
        SandboxLimits(cpus=8, processes=10)
    assert SandboxLimits(cpus=8).max_processes == 34 and SandboxLimits().max_processes == 20


STDLIB_VALUES = (
    "import collections, datetime, decimal, enum, fractions, uuid\n"
    "class Color(enum.Enum):\n    RED = 1\n"
    "Point = collections.namedtuple('Point', 'x y')\n"
    "def f():\n    return [fractions.Fraction(1, 3), decimal.Decimal('2.50'), datetime.date(2026, 12, 7),\n"
    "            datetime.datetime(2026, 12, 7, 1, tzinfo=datetime.timezone.utc), datetime.timedelta(hours=1),\n"
    "            Color.RED, Point(1, 2), collections.deque([1]), bytearray(b'x'), range(3), uuid.UUID(int=1)]\n"
)


def test_the_standard_librarys_values_cross_as_the_tests_compare_them():
    """A right answer of the standard library's value types passes where it would fail as "cannot be checked": the
    tests compare them as they compare their own (the prompt's enum and named tuple are the tests' own)."""
    tests = (
        "import collections, datetime, decimal, fractions, uuid\n"
        "got = f()\nassert got[:5] == [fractions.Fraction(1, 3), decimal.Decimal('2.50'), datetime.date(2026, 12, 7),"
        " datetime.datetime(2026, 12, 7, 1, tzinfo=datetime.timezone.utc), datetime.timedelta(hours=1)]\n"
        "assert got[5] is Color.RED and type(got[6]) is Point and got[6].y == 2\n"
        "assert got[7:] == [collections.deque([1]), bytearray(b'x'), range(3), uuid.UUID(int=1)]\n"
        "assert str(got[1]) == '2.50' and isinstance(got[0], fractions.Fraction)\n"
    )
    prompt = STDLIB_VALUES.split("def f")[0]
    assert run_program(STDLIB_VALUES, tests, prompt=prompt, entry_point="f") == Execution(True, "passed")


TRICKLE = """\
import os, time
def f(x):
    end, written = time.monotonic() + 1.5, 0
    while time.monotonic() < end and written < 900_000:
        written += os.write(1, b'x')
    return 2 * x
"""


def test_a_program_writing_a_byte_at_a_time_costs_the_scorer_a_read_a_tick(monkeypatch):
    """The watch reads the kernel's counts once a tick (20 ms) and, after a read under 4 KB, the output again only
    at the next tick: up to 1.5 s of one-byte writes (900,000 at most, under the output limit) cost the scorer's
    watch at most two reads of the output and one of the counts a tick (its CPU time: ``benchmarks/sandbox.py``)."""
    reads, counts = [], []
    real_read, real_killed = os.read, fence._killed
    monkeypatch.setattr(fence.os, "read", lambda fd, n: reads.append(fd) or real_read(fd, n))
    monkeypatch.setattr(fence, "_killed", lambda *a: counts.append(1) or real_killed(*a))
    started = fence.time.monotonic()
    got = run_program(TRICKLE, "assert f(1) == 2\n", limits=SandboxLimits(timeout=10.0))
    ticks = (fence.time.monotonic() - started) / fence._POLL_S + 2
    assert got == Execution(True, "passed")
    assert len(counts) <= ticks and len(reads) <= 2 * ticks + 8, (len(counts), len(reads), ticks)


LOCKS_HOST_FILE = (
    "import fcntl, os, time\ndef f(path):\n    fd = os.open(path, os.O_RDONLY)\n"
    "    fcntl.lockf(fd, fcntl.LOCK_SH)\n    fcntl.flock(fd, fcntl.LOCK_SH)\n    time.sleep(30)\n"
)


def test_a_lock_on_a_host_file_ends_with_the_program():
    """Locks are allowed for sqlite's sake; a read lock on a file of the host the sandbox can read (its
    interpreter's ``os.py``) blocks the host's write lock only while the program runs: after its verdict (timed
    out) the host locks the file at once."""
    import fcntl

    target = os.path.join(os.path.dirname(os.__file__), "os.py")
    got = run_program(LOCKS_HOST_FILE, f"f({target!r})\n", limits=SandboxLimits(timeout=1.0))
    assert got == Execution(False, "timed out after 1 s")
    with open(target, "rb+") as host:
        fcntl.lockf(host, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(host, fcntl.LOCK_EX | fcntl.LOCK_NB)


# -- the trace ------------------------------------------------------------------------------------------------------

TRACER = (
    "import json\nCASES = json.loads({cases!r})\n"
    "def run_all():\n    failed = []\n    for i, (program, tests) in enumerate(CASES):\n        try:\n"
    "            exec(compile(program + '\\n' + tests, f'<case {{i}}>', 'exec'), {{'__name__': '__main__'}})\n"
    "        except BaseException as error:\n            failed.append((i, type(error).__name__))\n"
    "    return failed\n"
)
"""The program the trace runs: every case, in one sandbox, one after the other (each in a namespace of its own)."""

TRIED = {"fadvise64": "coreutils' cat advises the kernel it reads in sequence, and goes on when refused"}
"""Calls a traced program makes that the filter refuses, and why the program passes anyway."""

_CALL = re.compile(r"^(\d+)\s+(?:<\.\.\. (\w+) resumed>|(\w+)\()")


def _traced_calls(trace: str) -> set[str]:
    """The system calls made after the sandbox's server loaded the filter: by the server itself from that line on,
    and by every process or thread it or the program started (those first seen after it)."""
    lines = trace.splitlines()
    start = next(i for i, line in enumerate(lines) if "PR_SET_SECCOMP" in line and line.endswith("= 0"))
    root = int(_CALL.match(lines[start])[1])
    before = {int(m[1]) for line in lines[:start] if (m := _CALL.match(line))}
    used = set()
    for line in lines[start + 1 :]:
        if (m := _CALL.match(line)) and (int(m[1]) == root or int(m[1]) not in before):
            used.add(m[2] or m[3])
    return used


def test_the_allow_list_is_what_programs_use(tmp_path):
    """strace (outside the sandbox) of one sandbox running HumanEval's 164 and MBPP's 500 canonical solutions with
    their tests, then the ordinary programs (threads, processes and their pools, a subprocess and a shell, signals,
    files, sqlite, shared memory, sockets, asyncio, ...): every call the allow-list names is made, but those
    :data:`~lens_parallel.sandbox.syscalls.UNTRACED` names with why each stays (and the guide shows); every call
    made is allowed, answered without effect or ENOSYS, or one :data:`TRIED` explains."""
    strace = shutil.which("strace")
    assert strace is not None, "install strace (Debian/Ubuntu: apt-get install strace; make test installs it)"
    folder = task_data.task_data_folder()
    humaneval = [json.loads(line) for line in (folder / "humaneval.jsonl").read_text().splitlines()]
    mbpp = [json.loads(line) for line in (folder / "mbpp.jsonl").read_text().splitlines()]
    cases = [(d["prompt"] + d["canonical_solution"], tf.humaneval_tests(d)) for d in humaneval]
    cases += [(d["code"], tf.mbpp_tests(d)) for d in mbpp] + list(ORDINARY.values())
    here = fence.sandbox_fence()
    out = tmp_path / "trace.txt"
    traced = Fence(here.interpreter, here.prefix, here.privileged, here.cgroups, (strace, "-f", "-qq", "-o", str(out)))
    program = TRACER.format(cases=json.dumps(cases))
    unlucky = 164 + next(i for i, d in enumerate(mbpp) if d["task_id"] == 367)  # its asserts need test_setup_code
    limits = SandboxLimits(timeout=300.0, cpu_seconds=300, startup=120.0)
    got = run_program(program, f"assert run_all() == [({unlucky}, 'NameError')]\n", limits=limits, fence=traced)
    assert got == Execution(True, "passed")
    used, allowed = _traced_calls(out.read_text()), set(syscalls.allowed_calls())
    # restart_syscall is made only when a signal interrupts a sleep (strace's own stops can): the trace may see it
    by_chance, untraced = {"restart_syscall"}, allowed - used
    assert untraced <= set(syscalls.UNTRACED), "name why each stays in syscalls.UNTRACED"
    assert set(syscalls.UNTRACED) - by_chance <= untraced, "a call in syscalls.UNTRACED is made: take it off"
    answered = set(syscalls.NO_EFFECT_CALLS) | set(syscalls.ENOSYS_CALLS) | set(TRIED)
    assert used - allowed <= answered, used - allowed - answered
