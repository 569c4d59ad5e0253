"""The same commands on ``memory://``, fsspec's in-process filesystem: a second backend
(synchronous, no S3 semantics) through the same code paths, byte-identical to local results."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

import ckptools
from ckptools.io import storage

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.fixture
def mem_root() -> Iterator[str]:
    root = f"memory://ckpt-{uuid.uuid4().hex[:8]}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root.removeprefix("memory://")):
        fs.rm(root.removeprefix("memory://"), recursive=True)


def _put(local: Path, url: str) -> None:
    fs = fsspec.filesystem("memory")
    for name in os.listdir(local):
        fs.pipe_file(f"{url.removeprefix('memory://')}/{name}", (local / name).read_bytes())


def _get(url: str) -> dict[str, bytes]:
    fs = fsspec.filesystem("memory")
    base = url.removeprefix("memory://").rstrip("/")
    return {k[len(base) + 1 :].lstrip("/"): fs.cat_file(k) for k in fs.find(base)}


def test_consolidate_and_reshard_on_memory_fs(mem_root: str, tmp_path: Path) -> None:
    src = f"{mem_root}/src"
    _put(FIXTURES / "fsdp2_ws2", src)
    assert ckptools.inspect(src).manifest.world_size == 2
    local = tmp_path / "hf"
    ckptools.consolidate(
        str(FIXTURES / "fsdp2_ws2"), str(local), max_shard_size=800, quiet=True, weights_only=True
    )
    ckptools.consolidate(src, f"{mem_root}/hf", max_shard_size=800, quiet=True, weights_only=True)
    got = _get(f"{mem_root}/hf")
    assert got == {p.name: p.read_bytes() for p in local.iterdir()}

    ckptools.reshard(src, f"{mem_root}/re3", world_size=3, quiet=True)
    assert ckptools.diff(f"{mem_root}/re3", str(FIXTURES / "fsdp2_ws2")).identical
    assert ckptools.verify(f"{mem_root}/re3").ok
    assert storage.is_url(mem_root) and not storage.is_url(str(local))
