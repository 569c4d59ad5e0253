"""What both writers run on (:mod:`ckptools.engine.runtime`), and the purity of the DCP plan."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckptools.core.sizes import human_size
from ckptools.engine import collective, runtime
from ckptools.engine.runtime import BLOCK_BYTES, Scratch, pwrite_all, run_all
from ckptools.errors import CkptError, DiskFullError, PieceAbortedError
from ckptools.io import space


@pytest.mark.parametrize("kind", [bytes, memoryview])
def test_pwrite_all_finishes_short_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: type
) -> None:
    real = os.pwrite
    calls = []

    def short(fd: int, data: memoryview, offset: int) -> int:
        calls.append(offset)
        return real(fd, data[:3], offset)  # a filesystem may write less than asked

    monkeypatch.setattr(runtime.os, "pwrite", short)
    data = bytes(range(10))
    path = tmp_path / "f"
    path.write_bytes(b"\xff" * 20)
    fd = os.open(path, os.O_WRONLY)
    try:
        pwrite_all(fd, kind(data), 5)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"\xff" * 5 + data + b"\xff" * 5
    assert calls == [5, 8, 11, 14]


def test_scratch_reuses_one_buffer_of_at_least_a_block() -> None:
    scratch = Scratch()
    small = scratch.view(10)
    assert len(small) == 10 and small.obj is scratch.view(BLOCK_BYTES).obj
    big = scratch.view(BLOCK_BYTES + 1)
    assert len(big) == BLOCK_BYTES + 1 and big.obj is not small.obj


@pytest.mark.parametrize("workers", [1, 3])
def test_run_all_stops_and_reraises_the_first_error(workers: int) -> None:
    stopped = threading.Event()
    done: list[int] = []

    def task(i: int) -> None:
        if i == 2:
            raise ValueError(i)
        done.append(i)

    with pytest.raises(ValueError):
        run_all(task, list(range(5)), workers, stopped.set)
    if workers == 1:
        assert done == [0, 1]  # in order, nothing after the failure
    else:
        assert stopped.is_set()


def test_dcp_plan_imports_neither_torch_nor_the_engine() -> None:
    code = (
        "import sys\n"
        "import ckptools.plan.dcp\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('ckptools.engine')]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_run_all_raises_the_real_error_not_a_piece_that_gave_up_first() -> None:
    """A failing piece releases the pieces waiting for it (as the DCP writer's split CRCs do)
    before its own error reaches the pool; the waiter's "another piece failed" is recorded
    first, and must not be what the run reports."""
    released = threading.Event()

    def task(i: int) -> None:
        if i == 0:
            try:
                raise OSError(errno.EIO, "Input/output error")
            except OSError:
                released.set()  # the waiters give up now...
                time.sleep(0.3)  # ...while this piece still cleans up
                raise
        released.wait(5)
        raise PieceAbortedError("another piece of the reshard failed (see its error)")

    with pytest.raises(OSError) as info:
        run_all(task, [0, 1, 2], 3, released.set)
    assert info.value.errno == errno.EIO and not isinstance(info.value, PieceAbortedError)


def test_run_all_raises_the_first_of_two_real_errors() -> None:
    def task(i: int) -> None:
        time.sleep(0.05 if i == 1 else 0.3)
        raise ValueError(i)

    with pytest.raises(ValueError) as info:
        run_all(task, [0, 1], 2, lambda: None)
    assert info.value.args == (1,)


def test_ranks_report_the_rank_whose_real_error_came_first() -> None:
    """Across ranks the same rule: the earliest real failure, whatever the rank order."""
    failures = [
        (0, "PieceAbortedError", "another piece failed", False, True, 1.0),
        (1, "DiskFullError", "x: no space left on device", False, False, 3.0),
        (2, "ValueError", "later", False, False, 4.0),
    ]
    with pytest.raises(CkptError, match=r"rank 1 and 2 more\): DiskFullError: x: no space"):
        collective._raise_for(failures, "reshard")


def test_a_full_disk_in_a_write_names_the_file_and_the_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staging = tmp_path / "out.tmp-1"
    staging.mkdir()
    (staging / "a").write_bytes(b"x" * 8192)  # already written: not needed any more
    space.reserve(str(staging), 10**6)
    path = staging / "model-00002-of-00004.safetensors"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)

    def full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runtime.os, "pwrite", full)
    try:
        with pytest.raises(DiskFullError) as info:
            pwrite_all(fd, b"abc", 0)
    finally:
        os.close(fd)
        space.release(str(staging))
    e = info.value
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    assert e.path == str(path) and e.errno == errno.ENOSPC and isinstance(e, OSError)
    assert e.needed_bytes == 10**6 - 8192
    assert e.free_bytes is not None and abs(e.free_bytes - free) < 2**30
    assert str(e) == (
        f"{path}: no space left on device: this run needs {human_size(10**6 - 8192)} more, "
        f"{human_size(e.free_bytes)} free on {e.mount}"
    )
    assert e.mount is not None and os.path.ismount(e.mount)


def test_a_file_finished_after_the_stop_is_synced_but_not_reported(tmp_path: Path) -> None:
    """A piece told to stop returns early, so the file it completes may lack its bytes: it
    must never reach the journal (a resumed run would keep it)."""
    stop = threading.Event()
    reported: list[str] = []
    syncer: runtime.FileSyncer[str] = runtime.FileSyncer(reported.append, stop=stop)
    fds = [os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT) for name in ("a", "b")]
    syncer.submit("a", fds[0])
    syncer.drain()
    stop.set()
    syncer.submit("b", fds[1])
    syncer.drain()
    syncer.shutdown()
    assert reported == ["a"]
    for fd in fds:  # closed by the syncer, reported or not
        with pytest.raises(OSError):
            os.fstat(fd)


def test_pwrite_all_writes_at_most_write_bytes_per_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large block goes to the kernel in writes of at most ``WRITE_BYTES`` (one 8 MiB write
    cost 5-12x the CPU of eight 1 MiB ones on the dev VM), in order, each where it belongs."""
    real = os.pwrite
    calls: list[tuple[int, int]] = []

    def recorded(fd: int, data: memoryview, offset: int) -> int:
        calls.append((offset, len(data)))
        return real(fd, data, offset)

    monkeypatch.setattr(runtime.os, "pwrite", recorded)
    data = os.urandom(runtime.WRITE_BYTES * 2 + 7)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        pwrite_all(fd, memoryview(data), 3)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"\0" * 3 + data
    w = runtime.WRITE_BYTES
    assert calls == [(3, w), (3 + w, w), (3 + 2 * w, 7)]
