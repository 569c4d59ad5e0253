"""What both writers run on (:mod:`ckptools.engine.runtime`), and the purity of the DCP plan."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ckptools.engine import runtime
from ckptools.engine.runtime import BLOCK_BYTES, Scratch, pwrite_all, run_all


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
