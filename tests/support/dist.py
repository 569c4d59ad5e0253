"""Run a function on N real ``torch.distributed`` ranks (gloo, CPU) for tests.

Every distributed test goes through :func:`run_ranks`: it starts ``world_size`` fresh processes
(``forkserver`` start method: each rank is forked from a server that has only imported torch, the
other libraries ranks use and this repository's core modules, so no state leaks from the pytest
process or between tests; a run whose environment changes what those imports read is forked from
a zygote that imported the third-party ones under it instead), joins them into one gloo process
group through a file rendezvous in a fresh temporary directory, runs ``fn(rank, world_size, *args,
**kwargs)`` on each and pickles the per-rank return values back.

Results and failures travel through per-rank files rather than a ``multiprocessing.Queue``: a rank
leaves with ``os._exit`` (gloo sometimes aborts while tearing down), and ``os._exit`` would drop
data still sitting in a queue's feeder thread. A file renamed into place is either complete or
absent.

Example:
    >>> from tests.support.dist import run_ranks
    >>> run_ranks(my_module_level_fn, 2, "arg", timeout=30.0)  # doctest: +SKIP
    [result_of_rank_0, result_of_rank_1]
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing import get_context
from multiprocessing.connection import wait
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from typing import Any

from tests.support import zygote

__all__ = ["RankFailedError", "RanksTimeoutError", "run_ranks"]

# After every rank has reported its result, ranks still run a barrier and tear down the process
# group. That should take well under a second; past this, they are killed (their results are already
# safe).
_TEARDOWN_GRACE_S = 15.0
# How often the parent looks for new result/error files while no process has exited.
_POLL_INTERVAL_S = 0.05
# Imported once, in the fork server, before it forks any rank: every rank is still a fresh
# process (forked from a server that has run nothing but these imports), but does not pay them
# again. Importing torch and its distributed packages cost each spawned rank ~4 s of CPU, and
# transformers' Llama, peft and accelerate as much again, which made rank start-up the largest
# single cost of the suite on 2 cores (docs/testing.md). None of them starts a thread on import
# (checked: one thread after all of them), so forking after them is safe.
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "safetensors.torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "accelerate",
    "peft",
    "pytest",  # every test module imports it: 0.08 s of CPU in each of ~390 ranks a run
)
# Imported by the fork server after :data:`_PRELOAD`: the modules of this repository that most
# ranks import (measured over a run of tests/distributed: 385 ranks, each of which imported the
# ckptools core, the test support modules and, through the test module that defines its
# function, pytest; 0.2 s of CPU per rank, ~75 s a run). A forked rank has its own copy of them,
# fresh from the server, which ran nothing but these imports; ckptools reads no environment
# when imported (its overrides are read when called: ckptools/tunables.py, checked by
# tests/unit/test_import_environment.py), so a run's own CKPTOOLS_* settings still apply. Ranks
# forked from a zygote import these themselves (a zygote serves the CLI too, which must import
# ckptools afresh).
_SERVER_PRELOAD = (
    "tests.support.dist",
    "tests.support.producers",
    "tests.support.reference",
    "ckptools.verbs.consolidate",
    "ckptools.verbs.reshard",
    "ckptools.training",
    "tests.support.freeze_heap",  # last: the whole preloaded heap out of the ranks' collections
)
# Variables these libraries read when imported (huggingface_hub's HF_HUB_CACHE / HF_HUB_OFFLINE,
# ...). The ranks of a run whose environment differs here from the fork server's are forked from
# a zygote (tests/support/zygote.py) that imported them under the run's environment, as spawned
# ranks would have (test_load_pretrained sets HF_HUB_CACHE: a spawned rank paid 7-8 s of imports).
# (Not TORCH*: torch sets TORCHINDUCTOR_CACHE_DIR in the pytest process once inductor loads, and
# reads nothing a test sets when imported.)
_IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "ACCELERATE_", "PEFT_")
_IMPORT_TIME_NAMES = (
    "XDG_CACHE_HOME", "HOME", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
)  # fmt: skip
# The environment of the pytest process when this module was imported (before any fixture or
# monkeypatch): the fork server starts with it, whatever test happens to start it.
_BASE_ENV = dict(os.environ)
_server_env: dict[str, str] | None = None
# The fork server starts with these (OpenMP reads them once, when torch's libraries load there).
# One thread each for the ranks' math libraries. OpenBLAS (numpy's, which torch imports) starts
# its thread server when loaded unless told one thread: a fork server or zygote that imported
# numpy under another setting held a second, native thread (invisible to threading), and a
# process is forked safely only from one thread.
_RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


class RankFailedError(RuntimeError):
    """A rank raised (or died) while running the function given to :func:`run_ranks`.

    Attributes:
        rank: the rank that failed first (the others usually failed because it did: a peer's
            collective errors out once its partner has gone).
        rank_traceback: that rank's formatted traceback (or a note on how the process died).
        failures: every failed rank seen at the time, mapped to its traceback.
    """

    def __init__(self, failures: dict[int, str], first: int | None = None) -> None:
        self.failures = dict(sorted(failures.items()))
        self.rank = next(iter(self.failures)) if first is None else first
        self.rank_traceback = self.failures[self.rank]
        parts = [f"rank {self.rank} failed; all ranks were killed."]
        for rank in [self.rank, *(r for r in self.failures if r != self.rank)]:
            parts.append(f"--- traceback of rank {rank} ---\n{self.failures[rank].rstrip()}")
        super().__init__("\n".join(parts))


class RanksTimeoutError(TimeoutError):
    """The ranks did not all finish within the timeout given to :func:`run_ranks`."""

    def __init__(self, timeout: float, pending: list[int], finished: list[int]) -> None:
        self.timeout = timeout
        self.pending = pending
        self.finished = finished
        super().__init__(
            f"ranks {pending} did not finish within {timeout:.1f} s (finished: {finished}); "
            "all ranks were killed. A collective that only some ranks entered, or a deadlock, "
            "is the usual cause."
        )


def _result_path(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"rank{rank}.result")


def _error_path(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"rank{rank}.error")


def _write_atomically(path: str, payload: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(payload)
    os.replace(tmp, path)


def _rank_main(
    rank: int,
    world_size: int,
    init_method: str,
    workdir: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    env: dict[str, str],
) -> None:
    """Entry point of one rank. Never returns: leaves with ``os._exit``."""
    # A forked rank has the fork server's environment, not the test's: take the test's, as a
    # spawned process would (the S3 endpoint, HF_HUB_OFFLINE and CKPTOOLS_* overrides).
    os.environ.clear()
    os.environ.update(env)
    code = 0
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            backend="gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        result = fn(rank, world_size, *args, **kwargs)
        _write_atomically(_result_path(workdir, rank), pickle.dumps(result))
    except BaseException:
        code = 1
        with contextlib.suppress(BaseException):
            _write_atomically(_error_path(workdir, rank), traceback.format_exc().encode())
    if code == 0:
        # A finished rank must never fail the test: teardown errors are swallowed.
        with contextlib.suppress(BaseException):
            dist.barrier()
        with contextlib.suppress(BaseException):
            dist.destroy_process_group()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Set environment variables while children are spawned (they copy ``os.environ``)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return zygote.import_time_env(env, _IMPORT_TIME_PREFIXES, _IMPORT_TIME_NAMES)


class _ZygoteRank:
    """A rank forked from a zygote (``tests/support/zygote.py``) that imported :data:`_PRELOAD`
    under the run's own environment: what :func:`run_ranks` uses of a ``Process``."""

    def __init__(self, task: str, env: dict[str, str]) -> None:
        self._task = task
        self._env = env
        self._child: zygote.Child | None = None
        self._pidfd = -1
        self.pid: int | None = None

    def start(self) -> None:
        self._child = zygote.start(
            [sys.executable, "-c", _RANK_BOOT, self._task],
            env=self._env,
            cwd=os.getcwd(),
            preload=_PRELOAD,
        )
        self.pid = self._child.pid
        # readable once the process has exited, as a Process's sentinel is
        self._pidfd = os.pidfd_open(self.pid)

    @property
    def sentinel(self) -> int:
        return self._pidfd

    @property
    def exitcode(self) -> int | None:
        if self._child is None:
            return None
        code = self._child.poll()
        if code is None and self._pidfd >= 0 and select.select([self._pidfd], [], [], 0)[0]:
            # it has exited: the zygote reports its status as soon as it has reaped it
            code = self._child.wait(timeout=30.0)
        return code

    def is_alive(self) -> bool:
        return self._child is not None and self._child.poll() is None

    def kill(self) -> None:
        if self._child is not None:
            self._child.kill()

    def join(self, timeout: float | None = None) -> None:
        if self._child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._child.wait(timeout)
            if self._child.returncode is not None and self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = -1


# A zygote child's program: the rank's arguments, pickled by run_ranks, then _rank_main, with the
# test process's sys.path (as multiprocessing's spawn gives its children).
_RANK_BOOT = """
import pickle, sys
with open(sys.argv[1], "rb") as f:
    sys.path[:] = pickle.load(f)
    task = pickle.load(f)
from tests.support.dist import _rank_main
_rank_main(*task)
"""


def _zygote_ranks(
    workdir: str, env: dict[str, str], tasks: list[tuple[Any, ...]]
) -> list[_ZygoteRank]:
    ranks = []
    for rank, task in enumerate(tasks):
        path = os.path.join(workdir, f"rank{rank}.task")
        with open(path, "wb") as f:
            pickle.dump(list(sys.path), f)  # first: unpickling the task imports its module
            pickle.dump(task, f)
        ranks.append(_ZygoteRank(path, env))
    return ranks


def _context(env: dict[str, str]) -> ForkServerContext | None:
    """The fork server (started once, under :data:`_BASE_ENV`), or None for a run whose
    environment would change what the preloaded modules read when imported: its ranks are forked
    from a zygote that imported them under that environment."""
    global _server_env
    if _server_env is None:
        from multiprocessing import forkserver

        get_context("forkserver").set_forkserver_preload([*_PRELOAD, *_SERVER_PRELOAD])
        server_env = {**_BASE_ENV, **_RANK_ENV}
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(server_env)
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _server_env = _import_time_env(server_env)
    if _import_time_env(env) != _server_env:
        return None
    return get_context("forkserver")


def _kill_all(procs: list[BaseProcess] | list[_ZygoteRank]) -> None:
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if p.is_alive():
            p.kill()
    for p in started:
        p.join(timeout=10.0)


def _died(rank: int, code: int, failures: dict[int, str], failed_at: dict[int, int]) -> None:
    """Record a rank that exited without reporting: it counts as the first failure (-1), since
    a peer's failure makes a rank raise, never die."""
    failures[rank] = (
        f"process exited with code {code} without reporting a result "
        "(killed by a signal if negative)"
    )
    failed_at[rank] = -1


#: how long a rank that raised waits for its peers' deaths to be reported before all are killed
_DEATH_GRACE_S = 1.0


def _deaths_reported(
    procs: list[Any],
    workdir: str,
    done: list[bool],
    failures: dict[int, str],
    failed_at: dict[int, int],
) -> None:
    """When every failure seen is a rank that raised, wait briefly for the other unfinished
    ranks' exits to be reported: a rank blocked in a collective raises as soon as a peer dies
    (gloo sees the connection close), sometimes before the fork server has reported that peer's
    death, and the death is the cause the report must name."""
    if any(at < 0 for at in failed_at.values()):
        return  # a death is already in the report
    others = [r for r in range(len(procs)) if r not in failures and not done[r]]
    deadline = time.monotonic() + _DEATH_GRACE_S
    while others and time.monotonic() < deadline:
        for rank in list(others):
            p = procs[rank]
            if os.path.exists(_error_path(workdir, rank)) or os.path.exists(
                _result_path(workdir, rank)
            ):
                others.remove(rank)  # it reported: the main loop's look is the one that counts
            elif p.exitcode is not None:
                _died(rank, p.exitcode, failures, failed_at)
                others.remove(rank)
        alive = [procs[r].sentinel for r in others if procs[r].exitcode is None]
        if alive:
            wait(alive, timeout=0.05)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned gloo ranks.

    Called by the test process only (it must not itself be a rank). Each rank initialises a gloo
    process group through a ``file://`` rendezvous, runs ``fn``, saves its return value, then runs
    ``dist.barrier()`` and ``dist.destroy_process_group()`` (errors there are ignored).

    Args:
        fn: a module-level (picklable) function.
        world_size: number of ranks to spawn.
        *args: extra positional arguments for ``fn`` (picklable).
        timeout: seconds for the whole run; also the process group's collective timeout.
        **kwargs: keyword arguments for ``fn`` (picklable).

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        RankFailedError: a rank raised; carries its rank and traceback. Other ranks are killed.
        RanksTimeoutError: not every rank finished in ``timeout`` seconds; all ranks are killed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise TypeError(f"fn must be a picklable module-level function, got {fn!r}") from e

    workdir = tempfile.mkdtemp(prefix="ckptools-ranks-")
    init_method = f"file://{os.path.join(workdir, 'rendezvous')}"
    env = {**os.environ, **_RANK_ENV}
    ctx = _context(env)
    tasks = [
        (rank, world_size, init_method, workdir, timeout, fn, args, kwargs, env)
        for rank in range(world_size)
    ]
    procs: list[Any] = (  # Processes of the fork server, or ranks forked from a zygote
        _zygote_ranks(workdir, env, tasks)
        if ctx is None
        else [
            ctx.Process(target=_rank_main, args=task, name=f"rank{task[0]}", daemon=True)
            for task in tasks
        ]
    )
    try:
        with _env(**_RANK_ENV):
            for p in procs:
                p.start()
        deadline = time.monotonic() + timeout
        failures: dict[int, str] = {}
        # when each failure happened: its error file's mtime; a rank that died without reporting
        # (a signal, os._exit) counts as first, since a peer's failure makes a rank raise, never
        # die. Ranks forked from the fork server start within milliseconds, so a rank blocked in
        # a collective sees its peer's exit at once and may report in the same poll: the first
        # to fail is the cause.
        failed_at: dict[int, int] = {}
        while True:
            done = [os.path.exists(_result_path(workdir, r)) for r in range(world_size)]
            for rank, p in enumerate(procs):
                if os.path.exists(_error_path(workdir, rank)):
                    with open(_error_path(workdir, rank), encoding="utf-8", errors="replace") as f:
                        failures[rank] = f.read()
                    failed_at[rank] = os.stat(_error_path(workdir, rank)).st_mtime_ns
                elif (
                    not done[rank]
                    and p.exitcode is not None
                    # Recheck: the result may have landed between the two looks.
                    and not os.path.exists(_result_path(workdir, rank))
                ):
                    _died(rank, p.exitcode, failures, failed_at)
            if failures:
                _deaths_reported(procs, workdir, done, failures, failed_at)
                _kill_all(procs)
                raise RankFailedError(failures, first=min(failed_at, key=failed_at.__getitem__))
            if all(done):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _kill_all(procs)
                pending = [r for r in range(world_size) if not done[r]]
                finished = [r for r in range(world_size) if done[r]]
                raise RanksTimeoutError(timeout, pending, finished)
            alive = [p.sentinel for p in procs if p.exitcode is None]
            if alive:
                wait(alive, timeout=min(_POLL_INTERVAL_S, remaining))
            else:
                time.sleep(min(_POLL_INTERVAL_S, remaining))

        results: list[Any] = []
        for rank in range(world_size):
            with open(_result_path(workdir, rank), "rb") as f:
                results.append(pickle.load(f))
        grace_deadline = time.monotonic() + _TEARDOWN_GRACE_S
        for p in procs:
            p.join(timeout=max(0.0, grace_deadline - time.monotonic()))
        return results
    finally:
        _kill_all(procs)
        shutil.rmtree(workdir, ignore_errors=True)
