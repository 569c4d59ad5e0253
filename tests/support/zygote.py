"""Start short-lived Python processes (``python -m ckptools ...``, ``python -c CODE``) without
paying torch's import in each: a *zygote* process imports torch and the other heavy third-party
modules once, then forks one child per request.

The kill sweeps and SIGKILL soaks start dozens of processes that the test kills; each spent most
of its life importing torch (~2.5 s of CPU each, docs/testing.md). A forked child is still a
separate process with its own pid, started in the test's environment, working directory and
``sys.argv``, with its stdout/stderr where the test asks; it runs the same code a fresh
interpreter would (``runpy.run_module("ckptools", run_name="__main__")`` for ``-m ckptools``, the
``-c`` code as ``__main__``) and is killed by a real signal. ckptools itself and this repository's
modules are never preloaded: every child imports them afresh from ``sys.path``, so module-level
state and environment read at import are the child's own. What differs from a fresh interpreter
is only that torch and the other modules of :data:`PRELOAD` are already in ``sys.modules``; a
request whose environment differs from the zygote's in a variable those libraries read when
imported (:func:`import_time_env`) gets a zygote of its own, started under that environment.
``tests/integration/test_kill_sweep.py`` keeps one test that starts the real ``python -m
ckptools``, so the entry point itself stays covered.

Protocol: requests and replies are JSON datagrams on a ``SOCK_SEQPACKET`` socket pair; each
request carries the child's stdin/stdout/stderr as file descriptors (``SCM_RIGHTS``). The zygote
replies with the child's pid, and once it has reaped a child (``SIGCHLD``), with its wait status.

Example:
    >>> from tests.support.zygote import start
    >>> child = start([sys.executable, "-m", "ckptools", "inspect", path], env=env, cwd=root)
    >>> child.send_signal(signal.SIGKILL); child.wait()  # doctest: +SKIP
    -9
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import gc
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from typing import IO, Any

__all__ = [
    "PRELOAD", "SIBLINGS_FD", "Child", "fork_torchrun_workers", "import_time_env", "run", "start",
]  # fmt: skip

#: Imported once by the zygote. Third-party only: never ckptools or tests.* (the children import
#: those themselves, from the tree on their ``sys.path``). These are what ``ckpt consolidate`` /
#: ``reshard`` into a local directory or S3, and the training soak, import beyond the standard
#: library; importing them cost each child ~2.5 s of CPU. None starts a thread when imported
#: (the zygote checks), so forking after them is safe.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint.state_dict",
    "torch._dynamo",  # the optimizers' first step imports it
    "safetensors.torch",
    "xxhash",
    "numpy",
    "click",
    "fsspec",
    "s3fs",
)
# Environment that the preloaded libraries (and the interpreter) read at start-up or import: a
# request that differs here runs in a zygote started under its own environment.
# (huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE when imported; not TORCHINDUCTOR_*, which
# torch sets in the test process once inductor loads, and which it reads at compile time.)
_IMPORT_TIME_PREFIXES = (
    "PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "TORCH_", "FSSPEC", "HF_", "HUGGINGFACE_",
    "TRANSFORMERS_", "ACCELERATE_", "PEFT_",
)  # fmt: skip
_IMPORT_TIME_NAMES = ("HOME", "XDG_CACHE_HOME", "LD_PRELOAD", "LD_LIBRARY_PATH")
_MAX_MESSAGE = 1 << 20
#: The name under which the zygote's own module stays in ``sys.modules`` (see :func:`_main`).
_SELF = "_ckptools_tests_zygote"
_DEVNULL = subprocess.DEVNULL
_PIPE = subprocess.PIPE


def import_time_env(
    env: dict[str, str],
    prefixes: tuple[str, ...] = _IMPORT_TIME_PREFIXES,
    names: tuple[str, ...] = _IMPORT_TIME_NAMES,
) -> dict[str, str]:
    """The part of ``env`` that a preloaded library or the interpreter reads when it starts
    (by default; ``prefixes`` and ``names`` choose another part, as ``run_ranks`` does)."""
    return {k: v for k, v in env.items() if k.startswith(prefixes) or k in names}


# ------------------------------------------------------------------------------- the test's side


class Child:
    """A forked child, with the part of :class:`subprocess.Popen`'s interface the tests use."""

    def __init__(
        self, zygote: _Connection, pid: int, stdout: IO[Any] | None, stderr: IO[Any] | None
    ):
        self._zygote = zygote
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.status(self.pid, timeout=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._zygote.status(self.pid, timeout=timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout or 0.0)
            self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            # it may have exited since (reaped by the zygote, its status not read yet)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[bytes, bytes]:
        """Read stdout and stderr (those given as ``PIPE``) to their end, then wait."""
        streams = [f for f in (self.stdout, self.stderr) if f is not None]
        pipes = {f.fileno(): f for f in streams}
        chunks: dict[int, list[bytes]] = {id(f): [] for f in streams}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pipes:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout or 0.0)
            ready = _readable(list(pipes), left)
            for fd in ready:
                data = os.read(fd, 1 << 16)
                if data:
                    chunks[id(pipes[fd])].append(data)
                else:
                    pipes.pop(fd).close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out = [b"".join(chunks[id(f)]) if f else b"" for f in (self.stdout, self.stderr)]
        return out[0], out[1]


def _readable(fds: list[int], timeout: float | None) -> list[int]:
    """The fds of ``fds`` ready to read (or at their end) within ``timeout`` seconds (None:
    wait). ``poll``, not ``select``: a pytest worker late in the suite holds over 1,024 fds, and
    ``select`` refuses any fd numbered above that."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ms = None if timeout is None else max(0, int(timeout * 1000))
    return [fd for fd, _ in poller.poll(ms)]


class _Connection:
    """One end of a zygote's socket: asks the zygote to fork, and reads the wait statuses of the
    children it forked on this connection's request."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._statuses: dict[int, int] = {}
        self._next_id = 0

    def _receive(self, timeout: float | None) -> dict[str, Any] | None:
        self._sock.settimeout(timeout)
        try:
            data = self._sock.recv(_MAX_MESSAGE)
        except (TimeoutError, BlockingIOError):
            return None
        if not data:
            raise EOFError("the zygote closed this connection")
        message: dict[str, Any] = json.loads(data)
        if "status" in message:
            self._statuses[int(message["pid"])] = int(message["status"])
        return message

    def spawn(self, request: dict[str, Any], fds: list[int]) -> int:
        with self._lock:
            self._next_id += 1
            request["id"] = self._next_id
            socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
            while True:
                reply = self._receive(timeout=60.0)
                if reply is None:
                    raise RuntimeError("the zygote did not answer a request within 60 s")
                if reply.get("id") == request["id"]:
                    if "error" in reply:
                        raise RuntimeError(f"the zygote could not fork: {reply['error']}")
                    return int(reply["pid"])

    def status(self, pid: int, timeout: float | None) -> int | None:
        """The child's return code (negative: killed by that signal), or None if it is still
        running after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while pid not in self._statuses:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                # (with no time left, still read what has arrived)
                if self._receive(timeout=left) is None and left == 0.0:
                    return None
            return os.waitstatus_to_exitcode(self._statuses.pop(pid))


class _Zygote(_Connection):
    """The test's handle on one zygote process."""

    def __init__(self, env: dict[str, str], cwd: str, preload: tuple[str, ...]) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        super().__init__(mine)
        # run as a script, so that not even the tests package is imported in the zygote
        argv = [sys.executable, os.path.abspath(__file__), str(theirs.fileno())]
        self.proc = subprocess.Popen(
            [*argv, *preload],
            env=env,
            cwd=cwd,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        # a zygote importing transformers and peft, with its first ranks, took 99 s at load 14
        ready = self._receive(timeout=240.0)
        if ready != {"ready": True}:
            raise RuntimeError(f"the zygote did not start: {ready}")

    def _receive(self, timeout: float | None) -> dict[str, Any] | None:
        try:
            return super()._receive(timeout)
        except EOFError:
            raise RuntimeError(f"the zygote exited (code {self.proc.wait()})") from None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self._sock.close()  # the zygote leaves when its socket reaches EOF
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10.0)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_zygotes: dict[tuple[Any, ...], _Zygote] = {}
# A test process keeps this many zygotes (~0.3-0.6 GB each), the least recently used closed first:
# tests that set a fresh HF_HUB_CACHE each need one of their own.
_MAX_ZYGOTES = 3


@atexit.register
def _close_all() -> None:
    for z in _zygotes.values():
        z.close()
    _zygotes.clear()


def _zygote_for(env: dict[str, str], cwd: str, preload: tuple[str, ...]) -> _Zygote:
    """One zygote per import-time environment and preload per test process, started on first
    use."""
    key = (preload, *sorted(import_time_env(env).items()))
    z = _zygotes.pop(key, None)
    if z is None or not z.alive():
        if z is not None:
            z.close()
        while len(_zygotes) >= _MAX_ZYGOTES:
            _zygotes.pop(next(iter(_zygotes))).close()
        z = _Zygote(env, cwd, preload)
    _zygotes[key] = z  # the most recently used last
    return z


def _fd_for(spec: int | IO[Any] | None, default: int, mode: int) -> tuple[int, IO[Any] | None]:
    """The descriptor the child gets for one stream, and the test's end of a ``PIPE``."""
    if spec is None:
        return os.dup(default), None
    if spec == _DEVNULL:
        return os.open(os.devnull, mode), None
    if spec == _PIPE:
        r, w = os.pipe()
        return w, open(r, "rb")
    if isinstance(spec, int):
        return os.dup(spec), None
    return os.dup(spec.fileno()), None


def _stream_fds(
    stdout: int | IO[Any] | None, stderr: int | IO[Any] | None
) -> tuple[list[int], list[IO[Any] | None]]:
    """The child's stdin (``/dev/null``), stdout and stderr descriptors (the caller closes them
    once sent), and the test's ends of those given as ``PIPE``."""
    fds = [os.open(os.devnull, os.O_RDONLY)]
    ends: list[IO[Any] | None] = []
    try:
        for spec, default in ((stdout, 1), (stderr, 2)):
            fd, end = _fd_for(spec, default, os.O_WRONLY)
            fds.append(fd)
            ends.append(end)
    except BaseException:
        _close_all_of(fds, ends)
        raise
    return fds, ends


def _close_all_of(fds: list[int], ends: list[IO[Any] | None]) -> None:
    for fd in fds:
        os.close(fd)
    for end in ends:
        if end is not None:
            end.close()


def start(
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    preload: tuple[str, ...] = PRELOAD,
    siblings: bool = False,
) -> Child:
    """Like ``subprocess.Popen(argv, env=env, cwd=cwd, stdout=..., stderr=...)`` for ``argv`` =
    ``[python, "-m", MODULE, *args]`` or ``[python, "-c", CODE, *args]``, forked from a zygote.

    stdin is ``/dev/null``; ``stdout``/``stderr`` take ``None`` (the test's), ``DEVNULL``,
    ``PIPE`` (binary) or a file. ``stderr=STDOUT`` is not supported. ``preload``: the modules
    the zygote imports (third-party only). ``siblings``: the child gets, as file descriptor 3,
    a connection of its own to the zygote, through which it can have processes forked too
    (:func:`fork_torchrun_workers`).
    """
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] not in ("-m", "-c"):
        raise ValueError(f"only [sys.executable, '-m' | '-c', ...] can be forked: {argv[:2]}")
    zygote = _zygote_for(env, cwd, preload)
    fds, ends = _stream_fds(stdout, stderr)
    try:
        request = {"argv": argv[1:], "env": env, "cwd": cwd, "siblings": siblings}
        pid = zygote.spawn(request, fds)
    except BaseException:
        _close_all_of([], ends)
        raise
    finally:
        _close_all_of(fds, [])
    return Child(zygote, pid, ends[0], ends[1])


#: The descriptor on which a child started with ``siblings=True`` reaches its zygote.
SIBLINGS_FD = 3


def fork_torchrun_workers() -> None:
    """In a child started with ``siblings=True``, before it runs torchrun's launcher
    (``torch.distributed.run``): the launcher's workers (``python -u -m ckptools ...``) are
    forked from the zygote, as its own siblings, instead of started as fresh interpreters that
    import torch again (~3 s of CPU each).

    Each worker is what ``subprocess.Popen`` would have started in torchrun's
    ``SubprocessHandler``: torchrun's argv (``-u``: unbuffered stdout and stderr) and
    environment (``RANK``, ``MASTER_PORT``, ...), a session of its own (torchrun stops workers
    with ``os.killpg``), its stdout and stderr in torchrun's log files. The zygote refuses a
    worker whose environment differs from its own in what is read at import."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as handler,
    )

    connection = _Connection(socket.socket(fileno=SIBLINGS_FD))

    def _popen(self: Any, args: tuple[str, ...], env: dict[str, str]) -> Child:
        executable, *argv = args
        if executable != sys.executable or argv[:2] not in (["-u", "-m"], ["-u", "-c"]):
            raise ValueError(f"not a worker the zygote can fork: {list(args[:3])}")
        fds, _ = _stream_fds(self._stdout, self._stderr)
        try:
            request = {"argv": argv, "env": env, "cwd": os.getcwd(), "new_session": True}
            pid = connection.spawn(request, fds)
        finally:
            _close_all_of(fds, [])
        return Child(connection, pid, None, None)

    handler.SubprocessHandler._popen = _popen


def run(
    argv: list[str], *, env: dict[str, str], cwd: str, timeout: float, siblings: bool = False
) -> subprocess.CompletedProcess[str]:
    """Like ``subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=
    timeout)``, forked from a zygote (``siblings``: as :func:`start`'s)."""
    child = start(argv, env=env, cwd=cwd, stdout=_PIPE, stderr=_PIPE, siblings=siblings)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        raise
    assert child.returncode is not None
    return subprocess.CompletedProcess(argv, child.returncode, out.decode(), err.decode())


# ----------------------------------------------------------------------------- the zygote's side


# torchrun sets this for every worker; torch reads it when a NCCL process group is made, not
# when imported. (Every other variable torchrun adds is outside import_time_env.)
_READ_AFTER_IMPORT = ("TORCH_NCCL_ASYNC_ERROR_HANDLING",)


def _read_at_import(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in import_time_env(env).items() if k not in _READ_AFTER_IMPORT}


def _child_main(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become ``python ARGV`` and leave with its exit code. Never returns."""
    code = 1
    try:
        # fds[i] becomes descriptor i (stdin, stdout, stderr, and a siblings connection): first
        # out of the way of every target, so that none is overwritten before it is moved
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64) for fd in fds]
        for fd in fds:
            os.close(fd)
        for target, fd in enumerate(high):
            os.dup2(fd, target, inheritable=target <= 2)
            os.close(fd)
        if request.get("new_session"):
            os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = list(request["argv"])
        if argv[0] == "-u":
            # as `python -u`: stdout and stderr unbuffered, text written through
            argv.pop(0)
            for name, fd in (("stdout", 1), ("stderr", 2)):
                old = getattr(sys, name)
                new = io.TextIOWrapper(
                    io.FileIO(fd, "w", closefd=False),
                    encoding=old.encoding,
                    errors=old.errors,
                    write_through=True,
                )
                setattr(sys, name, new)
                setattr(sys, f"__{name}__", new)
        flag, what, *args = argv
        if flag == "-m":
            # as `python -m`: the working directory first on sys.path, argv[0] the module's file
            sys.path[0] = os.getcwd()
            sys.argv = [what, *args]
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = ""
            sys.argv = ["-c", *args]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(what, "<string>", "exec"), main.__dict__)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        # as the interpreter does: the traceback, then die by SIGINT itself
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


class _Server:
    """The zygote's loop: the test's connection, and one more per child started with
    ``siblings=True``; each child's wait status goes to the connection that asked for it."""

    def __init__(self, main: socket.socket, env_at_start: dict[str, str]) -> None:
        self.main = main
        self.connections = {main.fileno(): main}
        self.owners: dict[int, socket.socket] = {}  # child pid -> the connection that asked
        self.read_at_import = _read_at_import(env_at_start)
        self.wake_r, self.wake_w = os.pipe()

    def _send(self, conn: socket.socket, message: dict[str, Any]) -> None:
        try:
            conn.send(json.dumps(message).encode())
        except OSError:
            if conn is self.main:
                os._exit(0)
            self._drop(conn)  # a sibling connection whose process has gone

    def _drop(self, conn: socket.socket) -> None:
        if self.connections.pop(conn.fileno(), None) is not None:
            conn.close()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.owners.pop(pid, None)
            if conn is not None and conn.fileno() in self.connections:
                self._send(conn, {"pid": pid, "status": status})

    def _fork(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
        wanted = _read_at_import(request["env"])
        mine = self.read_at_import
        differs = sorted(k for k in {*mine, *wanted} if mine.get(k) != wanted.get(k))
        if differs:
            for fd in fds:
                os.close(fd)
            error = f"its environment differs from the zygote's where read at import: {differs}"
            self._send(conn, {"id": request["id"], "error": error})
            return
        siblings = None
        if request.get("siblings"):
            siblings, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            fds = [*fds, theirs.detach()]
        try:
            pid = os.fork()
        except OSError as e:
            for fd in fds:
                os.close(fd)
            if siblings is not None:
                siblings.close()
            self._send(conn, {"id": request["id"], "error": str(e)})
            return
        if pid == 0:
            for c in self.connections.values():
                c.close()
            if siblings is not None:
                siblings.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _child_main(request, fds)
        for fd in fds:
            os.close(fd)
        if siblings is not None:
            self.connections[siblings.fileno()] = siblings
        self.owners[pid] = conn
        self._send(conn, {"id": request["id"], "pid": pid})

    def serve(self) -> None:
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self._send(self.main, {"ready": True})
        while True:
            ready = _readable([*self.connections, self.wake_r], None)
            if self.wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self.wake_r, 512):
                        pass
                self._reap()
            for fd in ready:
                conn = self.connections.get(fd)
                if conn is None:
                    continue
                try:
                    data, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 4)
                except OSError:
                    data, fds = b"", []
                if not data:
                    if conn is self.main:
                        # The test process has gone. Nothing to flush: skip the interpreter's
                        # shutdown, which with torch loaded took 6 s on the loaded 2-core
                        # machine.
                        os._exit(0)
                    self._drop(conn)
                    continue
                self._fork(conn, json.loads(data), fds)


def _main() -> None:
    import importlib

    # A child runs its code below these frames of the zygote's (the fork keeps the stack). For
    # a frame whose file no module in sys.modules names, inspect.getmodule walks every module on
    # each call, and torchrun's launcher calls inspect.stack() on every rendezvous step it logs
    # (torch.distributed.elastic.rendezvous.dynamic_rendezvous.get_method_name): with the
    # zygote's frames unnamed (it was started as `-c` code running this file, which a child's
    # `python -m` then replaced as __main__), a forked launcher spent 26 ms in each call against
    # a fresh one's 2 ms, ~90 s of the suite's CPU. Kept under a private name, this file is a
    # module's file; the zygote is a script (no `-c` frame below it).
    sys.modules[_SELF] = sys.modules["__main__"]
    env_at_start = dict(os.environ)
    # numpy's OpenBLAS (torch imports numpy) starts a native thread server when loaded, unless
    # told to use one thread; a fork is safe only from a process of one thread. (Children get
    # the request's environment: only the zygote's own BLAS is held to one thread.)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in sys.argv[2:]:
        importlib.import_module(name)
    preloaded = [n for n in sys.modules if n.split(".")[0] in ("ckptools", "tests")]
    if preloaded:
        raise RuntimeError(f"the zygote must not import {preloaded}: children import them")
    # native threads too (an OpenMP or BLAS pool), which threading does not list
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["main"]
    if threading.active_count() != 1 or len(tasks) != 1:
        raise RuntimeError(
            f"a preloaded module started a thread: {threading.enumerate()}, {len(tasks)} tasks"
        )
    # Out of the collector's reach in every child (tests/support/freeze_heap.py says why).
    gc.freeze()
    _Server(sock, env_at_start).serve()


if __name__ == "__main__":
    # as under `python -c`: the working directory first on sys.path, not this file's directory
    sys.path[0] = ""
    _main()
