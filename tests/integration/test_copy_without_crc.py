"""Bytes whose container stores no CRC-32 (a safetensors source) are copied without computing
one: consolidate computed the CRC of every kernel-copied window and threw it away (~0.2 CPU s per
GB, bench/deepspeed.py); records that store a CRC are still checked, and bytes that are only a
part of one (a DeepSpeed master partition's parameters) through their whole record
(tests/integration/test_reshard_crc.py, tests/distributed/test_deepspeed.py)."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ckptools
from ckptools.core.manifest import Chunk
from ckptools.engine import checked_copy
from ckptools.io import readers
from ckptools.io.storage import LocalReader
from tests.conftest import Produced


def _no_crc(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Record every in-place CRC the local reader is asked for."""
    asked: list[tuple[str, int, int]] = []
    real = readers.LocalReader.crc32

    def counting(self: readers.LocalReader, rel: str, offset: int, length: int) -> int | None:
        asked.append((rel, offset, length))
        return real(self, rel, offset, length)

    monkeypatch.setattr(readers.LocalReader, "crc32", counting)
    return asked


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("checksum", [True, False])
def test_copy_range_checksum_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: bool, checksum: bool
) -> None:
    data = bytes(range(251)) * 40_000  # ~10 MB: several windows once they are made small
    (tmp_path / "src").write_bytes(data)
    monkeypatch.setattr(checked_copy, "WINDOW_BYTES", 1 << 20)
    asked = _no_crc(monkeypatch)
    raw = Chunk(offsets=(0,), sizes=(len(data),), file="src", offset=0, length=len(data))
    start, length = 12_345, len(data) - 20_000
    out = tmp_path / "out"
    with LocalReader(str(tmp_path)) as reader, open(out, "wb") as f:
        crc, in_kernel = checked_copy.copy_range(
            reader, raw, start, length, f.fileno(), 7, lambda n: None,
            memoryview(bytearray(1 << 16)), kernel=kernel, checksum=checksum,
        )  # fmt: skip
    assert out.read_bytes()[7:] == data[start : start + length]
    assert in_kernel == (length if kernel else 0)
    if checksum:
        assert crc == zlib.crc32(data[start : start + length])
        assert len(asked) == (length + (1 << 20) - 1) // (1 << 20) if kernel else not asked
    else:
        assert crc == 0 and not asked


def test_consolidate_of_a_source_without_crcs_computes_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(0)
    state = {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=g),
        "model.norm.weight": torch.randn(64, generator=g),
        "lm_head.weight": torch.randn(300, 64, generator=g).to(torch.bfloat16),
    }
    src = tmp_path / "src"
    src.mkdir()
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    asked = _no_crc(monkeypatch)
    out = tmp_path / "out"
    ckptools.consolidate(str(src), str(out), quiet=True, weights_only=True)
    assert not asked
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(state)
        for k, v in state.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and torch.equal(got.view(-1), v.view(-1)), k


def test_kernel_copies_make_no_block_buffer(
    produced: Callable[..., Produced], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consolidate whose chunks all move in the kernel (FSDP2: dim-0 shards) checks every
    CRC in place and never makes a copy buffer: each thread's 16 MiB block, zero-filled, was
    made for nothing and counted in the resident set (bench/RESULTS.md, issue 27)."""
    from ckptools.engine import chunk_copier

    p = produced("fsdp2", world_size=2, optimizer=True)
    made: list[int] = []
    real = chunk_copier.ChunkCopier.buffer

    def counting(self: chunk_copier.ChunkCopier) -> memoryview:
        made.append(self.block)
        return real(self)

    monkeypatch.setattr(chunk_copier.ChunkCopier, "buffer", counting)
    asked = _no_crc(monkeypatch)
    out = tmp_path / "out"
    ckptools.consolidate(str(p.path), str(out), quiet=True, workers=2, weights_only=True)
    assert not made
    assert asked  # the CRCs were checked, in place
    got = load_file(str(out / "model.safetensors"))
    ref = p.reference()["model"]
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in got)
