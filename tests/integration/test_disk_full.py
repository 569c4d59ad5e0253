"""A full disk while writing: consolidate, reshard, shard and ``save_pretrained`` fail with one line
naming the output file being written, the bytes the run still needed and the bytes free on the
output's filesystem, and leave nothing behind; the check before writing refuses a run that the
free space cannot hold, before a byte is written, unless ``CKPTOOLS_SPACE_CHECK=0``.

Mounting a small filesystem needs root, so the disk fills in two other real ways:
``RLIMIT_FSIZE``, the kernel's own limit on the file size a process writes (past it ``write``,
``ftruncate`` and ``copy_file_range`` fail with ``EFBIG``; ``SIGXFSZ`` ignored as the CLI's
parent shell would), set in a subprocess running ``python -m ckptools``; and ``os.pwrite`` /
``os.copy_file_range`` raising ``ENOSPC`` or ``EDQUOT`` once a byte budget is spent, as a
filling disk does (the writes before it succeed). Sources are real FSDP2 saves.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ckptools
from ckptools.errors import DiskFullError
from tests.conftest import Produced
from tests.support.producers import ModelConfig, TinyLlama

ROOT = Path(__file__).resolve().parents[2]
FILE_SIZE_LIMIT = 8192  # bytes: below every output file of the tiny model, above the journal's


#: the tiny Llama scaled to output files of ~1 MB (how much was written is counted in disk
#: blocks, which a 2 KB file would round up to all of it)
CONFIG = ModelConfig(vocab=2048, hidden=128, n_heads=8, n_kv_heads=2, head_dim=16,
                     intermediate=301, n_layers=2)  # fmt: skip
SHARD = "1MB"


@pytest.fixture
def tiny(produced: Callable[..., Produced]) -> Produced:
    return produced("fsdp2", world_size=2, optimizer=True)


@pytest.fixture
def src(produced: Callable[..., Produced]) -> Produced:
    return produced("fsdp2", world_size=2, optimizer=True, cfg=CONFIG)


def _nothing_left(tmp_path: Path, name: str = "out") -> None:
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(name)) == []


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))


@pytest.mark.parametrize(
    ("argv", "written"),
    [
        (["consolidate", "--weights-only"], "model.safetensors"),  # final size at once: ftruncate
        (["reshard", "--world-size", "1"], "__0_0.distcp"),  # grows: copy_file_range, pwrite
    ],
)
def test_a_file_size_limit_is_one_line_naming_the_file(
    tiny: Produced, tmp_path: Path, argv: list[str], written: str
) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "ckptools", argv[0], str(tiny.path), str(out), "-q", *argv[1:]],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=120, preexec_fn=_limit_file_size,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    pattern = (
        rf"error: {re.escape(str(out))}\.tmp-[0-9a-f]+/{re.escape(written)}: file too large for "
        r"this filesystem or this process's file size limit \(ulimit -f\): this run needs "
        r"[\d.]+ [KM]?B more, [\d.]+ [KMGT]?B free on /\S*\n"
    )
    assert re.fullmatch(pattern, proc.stderr), proc.stderr
    _nothing_left(tmp_path)


class _FillingDisk:
    """``os.pwrite`` and ``os.copy_file_range`` that fail with ``code`` once ``budget`` bytes
    were written, on every thread, as a disk that fills up does."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, budget: int, code: int) -> None:
        self.left = budget
        self.code = code
        self.failures = 0
        self.calls = 0
        self._lock = threading.Lock()
        self._pwrite, self._copy = os.pwrite, os.copy_file_range
        monkeypatch.setattr(os, "pwrite", self.pwrite)
        monkeypatch.setattr(os, "copy_file_range", self.copy_file_range)

    def _take(self, n: int) -> None:
        with self._lock:
            self.calls += 1
            if n > self.left:
                self.failures += 1
                raise OSError(self.code, os.strerror(self.code))
            self.left -= n

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        self._take(len(data))
        return self._pwrite(fd, data, offset)

    def copy_file_range(self, src: int, dst: int, count: int, *offsets: Any) -> int:
        self._take(count)
        return self._copy(src, dst, count, *offsets)


def _consolidate(src: Produced, out: Path) -> object:
    return ckptools.consolidate(
        str(src.path), str(out), max_shard_size=SHARD, quiet=True, weights_only=True
    )


def _reshard(src: Produced, out: Path) -> object:
    return ckptools.reshard(str(src.path), str(out), world_size=4, quiet=True)


def _shard(src: Produced, out: Path) -> object:
    hf = out.parent / "hf"
    if not hf.exists():
        ckptools.consolidate(str(src.path), str(hf), quiet=True, weights_only=True)
    return ckptools.shard(str(hf), str(out), world_size=3, quiet=True)


def _save_pretrained(src: Produced, out: Path) -> object:
    return ckptools.save_pretrained(TinyLlama(CONFIG), str(out), max_shard_size=SHARD)


WRITERS = {
    "consolidate": _consolidate,
    "reshard": _reshard,
    "shard": _shard,
    "save_pretrained": _save_pretrained,
}


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_disk_that_fills_midway_names_the_file_and_the_space(
    src: Produced, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str, code: int
) -> None:
    run = WRITERS[writer]
    clean = tmp_path / "clean"
    run(src, clean)
    total = sum(p.stat().st_size for p in clean.rglob("*") if p.is_file())
    monkeypatch.setenv("CKPTOOLS_WORKERS", "2")  # two pieces in flight: both hit the full disk
    disk = _FillingDisk(monkeypatch, total // 2, code)
    out = tmp_path / "out"
    with pytest.raises(DiskFullError) as info:
        run(src, out)
    e = info.value
    assert e.errno == code and isinstance(e, OSError) and disk.failures >= 1
    assert e.path is not None
    assert re.fullmatch(rf"{re.escape(str(out))}\.tmp-[0-9a-f]+/[^/]+", e.path), e.path
    assert e.needed_bytes is not None and 0 < e.needed_bytes <= total
    assert e.free_bytes is not None and e.free_bytes > 0 and e.mount is not None
    what = "no space left on device" if code == errno.ENOSPC else "disk quota exceeded"
    assert str(e).startswith(f"{e.path}: {what}: this run needs "), str(e)
    assert "\n" not in str(e)
    _nothing_left(tmp_path)


def _lying_statvfs(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    real = os.statvfs

    def statvfs(path: Any) -> Any:
        st = real(path)
        fields = list(st)
        fields[4] = free // st.f_frsize  # f_bavail
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", statvfs)


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_too_little_free_space_is_refused_before_a_byte_is_written(
    src: Produced, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    run = WRITERS[writer]
    if writer == "shard":
        _consolidate(src, tmp_path / "hf")  # its source, written while the disk had space
    _lying_statvfs(monkeypatch, 4096)
    disk = _FillingDisk(monkeypatch, 2**40, errno.ENOSPC)
    out = tmp_path / "out"
    with pytest.raises(DiskFullError) as info:
        run(src, out)
    e = info.value
    assert disk.calls == 0  # nothing written
    _nothing_left(tmp_path)
    assert e.free_bytes == 4096 and e.needed_bytes is not None and e.needed_bytes > 4096
    assert re.fullmatch(
        rf"{re.escape(str(out))}\.tmp-[0-9a-f]+: not enough space: this run writes [\d.]+ [KM]B, "
        r"4\.1 KB free on /\S*; free some space or write elsewhere \(CKPTOOLS_SPACE_CHECK=0 "
        r"skips this check, for a filesystem that reports less than it holds\)",
        str(e),
    ), str(e)

    # The way around it, for a filesystem that reports less than it has.
    monkeypatch.setenv("CKPTOOLS_SPACE_CHECK", "0")
    run(src, out)
    assert out.is_dir() and disk.calls > 0


_MANAGER_SAVE = """
import sys
import torch
import ckptools
from ckptools.errors import DiskFullError
mgr = ckptools.CheckpointManager(sys.argv[1])
try:
    mgr.save(1, torch.nn.Linear(64, 64))
except DiskFullError as e:
    print(f"{e.path}|{e}")
"""


def test_the_training_managers_save_on_a_full_disk_is_one_line(tmp_path: Path) -> None:
    """torch's own writer fails under the manager: its ``CheckpointException`` (a traceback per
    rank) becomes the one-line error naming the step's temporary directory."""
    root = tmp_path / "ckpts"
    proc = subprocess.run(
        [sys.executable, "-c", _MANAGER_SAVE, str(root)], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
        preexec_fn=_limit_file_size,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    path, message = proc.stdout.strip().split("|")
    assert re.fullmatch(rf"{re.escape(str(root))}/\.tmp-step-1-[0-9a-f]+", path), path
    assert re.fullmatch(
        rf"{re.escape(path)}: file too large for this filesystem or this process's file size "
        r"limit \(ulimit -f\): [\d.]+ [KMGT]?B free on /\S*",
        message,
    ), message
    # the output protocol discards the failed save's staging location: nothing is left behind
    assert not os.path.exists(path) and sorted(os.listdir(root)) == []
