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

__all__ = ["PRELOAD", "Child", "import_time_env", "run", "start"]

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
    "PYTHON", "OMP_", "MKL_", "KMP_", "TORCH_", "FSSPEC", "HF_", "HUGGINGFACE_", "TRANSFORMERS_",
    "ACCELERATE_", "PEFT_",
)  # fmt: skip
_IMPORT_TIME_NAMES = ("HOME", "XDG_CACHE_HOME", "LD_PRELOAD", "LD_LIBRARY_PATH")
_MAX_MESSAGE = 1 << 20
_BOOT = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
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

    def __init__(self, zygote: _Zygote, pid: int, stdout: IO[Any] | None, stderr: IO[Any] | None):
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


class _Zygote:
    """The test's handle on one zygote process."""

    def __init__(self, env: dict[str, str], cwd: str, preload: tuple[str, ...]) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()
        self._statuses: dict[int, int] = {}
        self._next_id = 0
        # run as a script, so that not even the tests package is imported in the zygote
        argv = [sys.executable, "-c", _BOOT, os.path.abspath(__file__), str(theirs.fileno())]
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

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _receive(self, timeout: float | None) -> dict[str, Any] | None:
        self._sock.settimeout(timeout)
        try:
            data = self._sock.recv(_MAX_MESSAGE)
        except (TimeoutError, BlockingIOError):
            return None
        if not data:
            raise RuntimeError(f"the zygote exited (code {self.proc.wait()})")
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


def start(
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    preload: tuple[str, ...] = PRELOAD,
) -> Child:
    """Like ``subprocess.Popen(argv, env=env, cwd=cwd, stdout=..., stderr=...)`` for ``argv`` =
    ``[python, "-m", MODULE, *args]`` or ``[python, "-c", CODE, *args]``, forked from a zygote.

    stdin is ``/dev/null``; ``stdout``/``stderr`` take ``None`` (the test's), ``DEVNULL``,
    ``PIPE`` (binary) or a file. ``stderr=STDOUT`` is not supported. ``preload``: the modules
    the zygote imports (third-party only).
    """
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] not in ("-m", "-c"):
        raise ValueError(f"only [sys.executable, '-m' | '-c', ...] can be forked: {argv[:2]}")
    zygote = _zygote_for(env, cwd, preload)
    fds: list[int] = []
    ends: list[IO[Any] | None] = []
    try:
        fds.append(os.open(os.devnull, os.O_RDONLY))
        for spec, default in ((stdout, 1), (stderr, 2)):
            fd, end = _fd_for(spec, default, os.O_WRONLY)
            fds.append(fd)
            ends.append(end)
        request = {"argv": argv[1:], "env": env, "cwd": cwd}
        pid = zygote.spawn(request, fds)
    except BaseException:
        for end in ends:
            if end is not None:
                end.close()
        raise
    finally:
        for fd in fds:
            os.close(fd)
    return Child(zygote, pid, ends[0], ends[1])


def run(
    argv: list[str], *, env: dict[str, str], cwd: str, timeout: float
) -> subprocess.CompletedProcess[str]:
    """Like ``subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=
    timeout)``, forked from a zygote."""
    child = start(argv, env=env, cwd=cwd, stdout=_PIPE, stderr=_PIPE)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        raise
    assert child.returncode is not None
    return subprocess.CompletedProcess(argv, child.returncode, out.decode(), err.decode())


# ----------------------------------------------------------------------------- the zygote's side


def _child_main(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become ``python ARGV`` and leave with its exit code. Never returns."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        flag, what, *args = request["argv"]
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


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"pid": pid, "status": status}).encode())


def _serve(sock: socket.socket) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sock.send(json.dumps({"ready": True}).encode())
    while True:
        ready = _readable([sock.fileno(), wake_r], None)
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
            _reap(sock)
        if sock.fileno() in ready:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
            if not data:
                # The test process has gone. Nothing to flush: skip the interpreter's shutdown,
                # which with torch loaded took 6 s on the loaded 2-core machine.
                os._exit(0)
            request = json.loads(data)
            try:
                pid = os.fork()
            except OSError as e:
                sock.send(json.dumps({"id": request["id"], "error": str(e)}).encode())
                for fd in fds:
                    os.close(fd)
                continue
            if pid == 0:
                sock.close()
                os.close(wake_r)
                os.close(wake_w)
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _child_main(request, fds)
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"id": request["id"], "pid": pid}).encode())


def _main() -> None:
    import importlib

    sock = socket.socket(fileno=int(sys.argv[2]))
    for name in sys.argv[3:]:
        importlib.import_module(name)
    preloaded = [n for n in sys.modules if n.split(".")[0] in ("ckptools", "tests")]
    if preloaded:
        raise RuntimeError(f"the zygote must not import {preloaded}: children import them")
    if threading.active_count() != 1:
        raise RuntimeError(f"a preloaded module started a thread: {threading.enumerate()}")
    _serve(sock)


if __name__ == "__main__":
    _main()
