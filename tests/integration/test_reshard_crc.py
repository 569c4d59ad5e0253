"""CRC-32 checks while copying: consolidate and reshard check every source record against its
stored CRC from the bytes they copy (in place over the page cache before a kernel copy, or over
the block buffer) and stop with one line naming the file and tensor; every output record's CRC
is that of its bytes; a failing piece leaves no output."""

from __future__ import annotations

import hashlib
import shutil
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptools
from ckptools.cli.main import cli as cli_main
from ckptools.core.crc32 import crc32
from ckptools.core.manifest import Chunk, TensorEntry
from ckptools.engine import crc_segments
from ckptools.engine import dcp_writer as dcp_write
from ckptools.engine.reader import SourceCache, resolve_chunk
from ckptools.errors import CkptError, CorruptCheckpointError
from ckptools.io.storage import LocalReader
from ckptools.plan.dcp import DcpPlan, plan_dcp
from ckptools.producers.dcp.layout import read_dcp
from tests.conftest import Produced
from tests.support.producers import ModelConfig, flip_bit

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def _segment_checks(src: str, world_size: int) -> Counter[str]:
    """How the writer would check each source range it copies for ``src`` -> ``world_size``."""
    manifest = read_dcp(src)
    plan = plan_dcp(manifest, world_size)
    tasks = sorted([*plan.objects, *plan.tensors], key=lambda item: (item.rank, item.offset))
    with LocalReader(src) as reader:
        segments, _ = crc_segments.resolve_segments(tasks, SourceCache(reader, manifest))
    return Counter(seg.check for segs in segments.values() for seg in segs)


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
    checks = _segment_checks(str(p.path), dst_ws)
    # The cases exercise the paths under test: split records are checked from their ranges
    # (the tiny model's uneven rows split records even when merging), merges copy whole records.
    assert checks["part"] > 0, checks
    assert checks["whole"] > 0 or dst_ws > src_ws, checks
    out = tmp_path / "out"
    ckptools.reshard(str(p.path), str(out), world_size=dst_ws, quiet=True)
    _record_crcs_match(out)
    report = ckptools.verify(str(out), quiet=True)
    assert report.ok, report.findings


def test_fast_crc_equals_zlib() -> None:
    data = bytes(range(256)) * 4099
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[1000:], crc32(data[:1000])) == zlib.crc32(data)


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


def _damage(src: Path, pick: Callable[[TensorEntry, Chunk, Chunk], bool], where: str) -> str:
    """Flip one bit in the largest record ``pick`` accepts (first, middle or last byte);
    return its tensor's FQN."""
    manifest = read_dcp(str(src))
    with LocalReader(str(src)) as reader:
        found = [
            (t, raw)
            for t in manifest.tensors.values()
            for c in t.chunks
            if pick(t, c, raw := resolve_chunk(reader, t, c)) and raw.crc32 is not None
        ]
    tensor, raw = max(found, key=lambda tr: tr[1].length)
    at = {"first": 0, "middle": raw.length // 2, "last": raw.length - 1}[where]
    flip_bit(src / raw.file, raw.offset + at, 4)
    return tensor.fqn


def _any(tensor: TensorEntry, chunk: Chunk, raw: Chunk) -> bool:
    return True


def _sharded_on_dim1(tensor: TensorEntry, chunk: Chunk, raw: Chunk) -> bool:
    return len(chunk.sizes) == 2 and chunk.sizes[1] != tensor.shape[1]


def _refused(args: list[str], src: Path, out: Path, fqn: str) -> None:
    """The CLI stops with one line naming the damaged file and tensor; no output, source intact."""
    before = _tree_digest(src)
    result = CliRunner().invoke(cli_main, [*args[:1], str(src), str(out), *args[1:], "-q"])
    assert result.exit_code != 0, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert "CRC-32" in lines[0] and repr(fqn) in lines[0] and ".distcp" in lines[0], lines
    assert not out.exists() and not list(out.parent.glob(f"{out.name}.tmp-*"))
    assert _tree_digest(src) == before


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize(
    ("verb", "extra"),
    [
        ("consolidate", ["--weights-only"]),  # whole dim-0 shards: kernel copies, checked in place
        ("reshard", ["--world-size", "4"]),  # records split in two: ranges combined
        ("reshard", ["--world-size", "1"]),  # merged: whole records
    ],
)
def test_damaged_record_stops_the_copy(
    produced: Callable[..., Produced], tmp_path: Path, verb: str, extra: list[str], where: str
) -> None:
    src = tmp_path / "src"
    shutil.copytree(produced("fsdp2", world_size=2, optimizer=True).path, src)
    fqn = _damage(src, _any, where)
    _refused([verb, *extra], src, tmp_path / "out", fqn)


@pytest.mark.parametrize(
    ("verb", "extra", "budget"),
    [
        ("consolidate", ["--weights-only"], None),
        # blocks of one or two rows: each record read in parts, their CRCs combined
        ("consolidate", ["--weights-only"], "512"),
        ("reshard", ["--world-size", "2"], None),
    ],
)
def test_damaged_record_sharded_on_dim1_stops_the_copy(
    produced: Callable[..., Produced],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    verb: str,
    extra: list[str],
    budget: str | None,
) -> None:
    if budget is not None:
        monkeypatch.setenv("CKPTOOLS_MEMORY_BUDGET", budget)
    # TP shards split dim 1: consolidate assembles whole rows from every rank's part, a block
    # of rows at a time, and reshard fills its pieces from parts of them (each record checked
    # whole, once).
    src = tmp_path / "src"
    shutil.copytree(produced("tp_fsdp", world_size=4).path, src)
    fqn = _damage(src, _sharded_on_dim1, "middle")
    _refused([verb, *extra], src, tmp_path / "out", fqn)


def test_damaged_record_cast_on_the_way(produced: Callable[..., Produced], tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(produced("fsdp2", world_size=2, optimizer=True).path, src)
    fqn = _damage(src, lambda t, c, r: t.dtype == "float32" and t.fqn.startswith("model."), "last")
    _refused(["consolidate", "--dtype", "bfloat16", "--weights-only"], src, tmp_path / "out", fqn)


def test_damaged_record_copied_in_part_by_this_process(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    # Under torchrun each process writes some rank files; a source record split between two
    # processes is checked whole, in place, by the one copying its first range.
    p = produced("fsdp2", world_size=2, optimizer=True)
    src = tmp_path / "src"
    shutil.copytree(p.path, src)
    manifest = read_dcp(str(src))
    plan = plan_dcp(manifest, 4)
    with LocalReader(str(src)) as reader:
        tasks = sorted(plan.tensors, key=lambda item: (item.rank, item.offset))
        segments, _ = crc_segments.resolve_segments(
            [t for t in tasks if t.rank == 0], SourceCache(reader, manifest)
        )
    first = next(s for segs in segments.values() for s in segs if s.check == "record")
    # damage the part of that record that this process (file 0 only) does NOT copy
    flip_bit(src / first.raw.file, first.raw.offset + first.raw.length - 1)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CorruptCheckpointError, match="CRC-32"):
        dcp_write.write_dcp(manifest, plan, str(out), source_root=str(src), only_files=[0])


@pytest.mark.timeout(60)
def test_failing_piece_leaves_no_output(
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
    monkeypatch.setattr(readers, "CRC_READ_BYTES", 4096)  # short tails are read, not mapped
    ranges = [(0, len(data)), (100, 50), (12345, 700_001), (len(data), 0), (7, 4097)]
    with LocalReader(str(tmp_path)) as reader:
        for offset, length in ranges:
            assert reader.crc32("f", offset, length) == zlib.crc32(data[offset : offset + length])

    # no descriptor left for a mapping (mmap duplicates the file's): the range is read instead
    def no_descriptor(*args: object, **kwargs: object) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(mmap, "mmap", no_descriptor)
    with LocalReader(str(tmp_path)) as reader:
        for offset, length in ranges:
            assert reader.crc32("f", offset, length) == zlib.crc32(data[offset : offset + length])
    monkeypatch.undo()
    monkeypatch.setattr(readers, "CRC_READ_BYTES", 4096)
    # a file cut short after planning: an error naming it, never a SIGBUS from a mapping
    with (
        LocalReader(str(tmp_path)) as reader,
        pytest.raises(CorruptCheckpointError, match="truncated"),
    ):
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


@pytest.mark.parametrize("verb", ["consolidate", "reshard"])
def test_damaged_torch_save_record_stops_the_copy(
    produced: Callable[..., Produced], tmp_path: Path, verb: str
) -> None:
    # a torch.save file's tensor that is its whole storage record carries the record's zip CRC
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(produced("torch_save").path, src / "model.pt")
    manifest = ckptools.read_manifest(str(src / "model.pt"))
    tensor = max(manifest.tensors.values(), key=lambda t: t.nbytes)
    chunk = tensor.chunks[0]
    assert chunk.crc32 is not None
    flip_bit(src / "model.pt", chunk.offset + chunk.length // 2, 2)
    before = _tree_digest(src)
    extra = ["--world-size", "2"] if verb == "reshard" else ["--weights-only"]
    out = tmp_path / "out"
    result = CliRunner().invoke(cli_main, [verb, str(src / "model.pt"), str(out), *extra, "-q"])
    assert result.exit_code == 1, result.output
    assert "CRC-32" in result.output and repr(tensor.fqn) in result.output, result.output
    assert not out.exists() and _tree_digest(src) == before


@pytest.mark.parametrize(
    ("verb", "extra"),
    [("consolidate", ["--weights-only"]), ("reshard", ["--world-size", "2"]), ("diff", [])],
)
def test_a_damaged_record_read_through_a_view_stops_the_run(
    tmp_path: Path, verb: str, extra: list[str]
) -> None:
    # dcp_single stores a sliced view: its bytes are part of a record, with no CRC of their
    # own; the record is checked whole before they are read (they went through unchecked)
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "dcp_single", src)
    manifest = read_dcp(str(src))
    with LocalReader(str(src)) as reader:
        (tensor, raw), *_ = [
            (t, raw)
            for t in manifest.tensors.values()
            for c in t.chunks
            if (raw := resolve_chunk(reader, t, c)).record is not None
        ]
    flip_bit(src / raw.file, raw.offset + raw.length // 2, 1)
    if verb == "diff":  # against the undamaged fixture: the damage, not a difference
        out = FIXTURES / "dcp_single"
        result = CliRunner().invoke(cli_main, ["diff", str(src), str(out)])
        assert result.exit_code == 1, result.output
        assert "CRC-32" in result.output and repr(tensor.fqn) in result.output, result.output
        return
    _refused([verb, *extra], src, tmp_path / "out", tensor.fqn)


@pytest.mark.parametrize("side", ["before", "after"])
def test_damage_at_a_window_boundary_is_caught(
    produced: Callable[..., Produced],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    side: str,
) -> None:
    """consolidate checks a kernel-copied record window by window (each window's CRC computed in
    place, mapped piecewise): a flipped byte on either side of a window's edge is caught, and the
    same small windows copy an undamaged source bit-exactly."""
    import mmap

    from safetensors.torch import load_file

    from ckptools.engine import checked_copy
    from ckptools.io import readers

    granule = mmap.ALLOCATIONGRANULARITY
    monkeypatch.setattr(checked_copy, "WINDOW_BYTES", 2 * granule)
    monkeypatch.setattr(readers, "CRC_WINDOW_BYTES", granule)  # each window mapped in two
    monkeypatch.setattr(readers, "CRC_READ_BYTES", 4096)
    # the tiny Llama scaled up (test_disk_full's): records of up to 512 KiB, many windows each
    cfg = ModelConfig(vocab=2048, hidden=128, n_heads=8, n_kv_heads=2, head_dim=16,
                      intermediate=301, n_layers=2)  # fmt: skip
    p = produced("fsdp2", world_size=2, optimizer=True, cfg=cfg)
    src = tmp_path / "src"
    shutil.copytree(p.path, src)
    manifest = read_dcp(str(src))
    with LocalReader(str(src)) as reader:
        tensor, raw = max(
            (
                (t, raw)
                for t in manifest.tensors.values()
                if t.fqn.startswith("model.")
                for c in t.chunks
                if (raw := resolve_chunk(reader, t, c)).crc32 is not None
            ),
            key=lambda tr: tr[1].length,
        )
    assert raw.length > 2 * checked_copy.WINDOW_BYTES, raw  # several windows, so an edge inside

    windows: list[int] = []
    real_crc = LocalReader.crc32

    def spy(self: LocalReader, rel: str, offset: int, length: int) -> int | None:
        if rel == raw.file and raw.offset <= offset < raw.offset + raw.length:
            windows.append(offset - raw.offset)
        return real_crc(self, rel, offset, length)

    monkeypatch.setattr(LocalReader, "crc32", spy)
    clean = tmp_path / "clean"
    ckptools.consolidate(str(src), str(clean), quiet=True, weights_only=True)
    assert checked_copy.WINDOW_BYTES in windows  # the record went through the windowed path
    ref = p.reference()
    got = load_file(str(clean / "model.safetensors"))
    assert got.keys() == ref["model"].keys()
    assert all(got[k].equal(ref["model"][k]) for k in got)

    edge = checked_copy.WINDOW_BYTES  # the second window's first byte
    flip_bit(src / raw.file, raw.offset + (edge - 1 if side == "before" else edge), 3)
    with pytest.raises(CorruptCheckpointError, match="CRC-32") as caught:
        ckptools.consolidate(str(src), str(tmp_path / "out"), quiet=True, weights_only=True)
    assert raw.file in str(caught.value) and repr(tensor.fqn) in str(caught.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))
