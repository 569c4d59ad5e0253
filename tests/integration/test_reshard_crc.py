"""The reshard writer's CRCs: split records get their last range's CRC derived from the record's
stored CRC (never reading those bytes); every output record must still check out against its
own bytes, a damaged source must not give an output that verifies, and a failing piece must
not leave a deriving piece waiting forever."""

from __future__ import annotations

import shutil
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

import ckptools
from ckptools.core.crc32 import crc32
from ckptools.engine import crc_segments
from ckptools.engine import dcp_writer as dcp_write
from ckptools.engine.reader import SourceCache, resolve_chunk
from ckptools.errors import CkptError
from ckptools.io.storage import LocalReader
from ckptools.layouts.dcp import read_dcp
from ckptools.plan.dcp import DcpPlan, plan_dcp
from tests.conftest import Produced
from tests.support.producers import flip_bit


def _segment_modes(src: str, world_size: int) -> Counter[str]:
    """How the writer would source each output range's CRC for ``src`` -> ``world_size``."""
    manifest = read_dcp(src)
    plan = plan_dcp(manifest, world_size)
    tasks = sorted([*plan.objects, *plan.tensors], key=lambda item: (item.rank, item.offset))
    with LocalReader(src) as reader:
        segments, _ = crc_segments.resolve_segments(tasks, SourceCache(reader, manifest))
    return Counter(seg.mode for segs in segments.values() for seg in segs)


def _record_crcs_match(out: Path) -> None:
    """Every output record's stored CRC equals zlib's CRC of its bytes (independent of ours)."""
    manifest = read_dcp(str(out))
    checked = 0
    with LocalReader(str(out)) as reader:
        for tensor in manifest.tensors.values():
            for chunk in tensor.chunks:
                raw = resolve_chunk(reader, tensor, chunk)
                data = reader.read(raw.file, raw.offset, raw.length)
                assert raw.crc32 == zlib.crc32(data), (tensor.fqn, chunk.offsets)
                checked += 1
    assert checked


@pytest.mark.parametrize(("src_ws", "dst_ws"), [(2, 4), (2, 3), (3, 2), (2, 16), (4, 2)])
def test_output_crcs_are_those_of_the_bytes(
    produced: Callable[..., Produced], tmp_path: Path, src_ws: int, dst_ws: int
) -> None:
    p = produced("fsdp2", world_size=src_ws, optimizer=True)
    modes = _segment_modes(str(p.path), dst_ws)
    # The cases exercise the paths under test: split records derive (the tiny model's uneven
    # rows split records even when merging), merges move whole records.
    assert modes["derive"] > 0, modes
    assert modes["whole"] > 0 or dst_ws > src_ws, modes
    out = tmp_path / "out"
    ckptools.reshard(str(p.path), str(out), world_size=dst_ws, quiet=True)
    _record_crcs_match(out)
    report = ckptools.verify(str(out), quiet=True)
    assert report.ok, report.findings


def test_fast_crc_equals_zlib() -> None:
    data = bytes(range(256)) * 4099
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[1000:], crc32(data[:1000])) == zlib.crc32(data)


def test_damaged_source_never_verifies_after_reshard(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    p = produced("fsdp2", world_size=2, optimizer=True)
    src = tmp_path / "src"
    shutil.copytree(p.path, src)
    manifest = read_dcp(str(src))
    # The largest record: its second half is a derived range in a 2 -> 4 reshard.
    tensor, chunk = max(
        ((t, c) for t in manifest.tensors.values() for c in t.chunks), key=lambda tc: tc[1].length
    )
    with LocalReader(str(src)) as reader:
        raw = resolve_chunk(reader, tensor, chunk)
    flip_bit(src / raw.file, raw.offset + raw.length - 3)
    out = tmp_path / "out"
    ckptools.reshard(str(src), str(out), world_size=4, quiet=True)
    report = ckptools.verify(str(out), quiet=True)
    assert not report.ok
    assert {f.fqn for f in report.findings} == {tensor.fqn}, report.findings


@pytest.mark.timeout(60)
def test_failing_piece_releases_deriving_pieces(
    produced: Callable[..., Produced], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = produced("fsdp2", world_size=2, optimizer=True)
    real = LocalReader.crc32
    calls = {"n": 0}

    def failing_crc(self: LocalReader, rel: str, offset: int, length: int) -> int | None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(5, "injected read failure")
        return real(self, rel, offset, length)

    monkeypatch.setattr(LocalReader, "crc32", failing_crc)
    out = tmp_path / "out"
    with pytest.raises((OSError, CkptError)):
        ckptools.reshard(str(p.path), str(out), world_size=4, quiet=True, workers=2)
    assert not out.exists()
    assert not list(tmp_path.glob("out.tmp-*"))


def test_in_place_crc_windows_and_ranges_past_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mmap

    from ckptools.errors import CorruptCheckpointError
    from ckptools.io import readers

    data = bytes(range(256)) * 4096  # 1 MiB
    (tmp_path / "f").write_bytes(data)
    # windows smaller than the range, starting off the allocation granularity
    monkeypatch.setattr(readers, "CRC_WINDOW_BYTES", 2 * mmap.ALLOCATIONGRANULARITY)
    with LocalReader(str(tmp_path)) as reader:
        for offset, length in [(0, len(data)), (100, 50), (12345, 700_001), (len(data), 0)]:
            assert reader.crc32("f", offset, length) == zlib.crc32(data[offset : offset + length])
        # a file cut short after planning: an error naming it, never a SIGBUS from a mapping
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            reader.crc32("f", len(data) - 10, 200)


def test_reshard_truncated_source_is_a_clear_error(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    p = produced("fsdp2", world_size=2, optimizer=True)
    src = tmp_path / "src"
    shutil.copytree(p.path, src)
    victim = src / "__1_0.distcp"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(CkptError, match=r"__1_0\.distcp"):
        ckptools.reshard(str(src), str(tmp_path / "out"), world_size=4, quiet=True)
    assert not (tmp_path / "out").exists()


def test_rank_files_are_durable_before_metadata_and_fsync_errors_surface(
    produced: Callable[..., Produced], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    p = produced("fsdp2", world_size=2, optimizer=True)
    events: list[str] = []
    real_fsync = os.fsync
    real_metadata = dcp_write.write_metadata

    def fsync(fd: int) -> None:
        real_fsync(fd)
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if name.endswith(".distcp"):
            events.append(name)

    def metadata(out_dir: str, plan: DcpPlan) -> None:
        events.append(".metadata")
        real_metadata(out_dir, plan)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(dcp_write, "write_metadata", metadata)
    ckptools.reshard(str(p.path), str(tmp_path / "out"), world_size=5, quiet=True)
    # every rank file with items was fsynced (by the syncing thread), all before .metadata
    assert events[-1] == ".metadata"
    assert sorted(set(events[:-1])) == [f"__{r}_0.distcp" for r in range(5)]

    def failing_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="Input/output error"):
        ckptools.reshard(str(p.path), str(tmp_path / "out2"), world_size=5, quiet=True)
    assert not list(tmp_path.glob("out2*"))
