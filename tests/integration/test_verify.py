"""``ckpt verify`` / ``ckptools.verify`` / ``ckpt checksum`` on real checkpoints written by torch.

Clean checkpoints from every producer verify clean; each kind of damage is found and named (file,
FQN, rank, chunk); malicious checkpoints never run their payload.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckptools.cli.exit_codes import EXIT_DIFFERENCES
from ckptools.cli.main import cli
from ckptools.core.manifest import Chunk, Manifest, TensorEntry
from ckptools.engine.reader import resolve_chunk
from ckptools.errors import CorruptCheckpointError
from ckptools.io.storage import LocalReader
from ckptools.producers import read_manifest
from ckptools.verify import Finding, verify
from ckptools.verify.checksums import CHECKSUM_FILE, write_checksums
from ckptools.verify.scan import BLOCK_BYTES_ENV
from tests.conftest import Produced
from tests.support import producers


def _copy(p: Produced, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    if p.path.is_dir():
        shutil.copytree(p.path, dst)
        return dst
    dst.mkdir()
    shutil.copy(p.path, dst / p.path.name)
    return dst / p.path.name


def _root(path: Path) -> str:
    return str(path if path.is_dir() else path.parent)


def _raw(manifest: Manifest, root: str, fqn: str, index: int = 0) -> tuple[TensorEntry, Chunk]:
    tensor = manifest.tensors[fqn]
    with LocalReader(root) as reader:
        return tensor, resolve_chunk(reader, tensor, tensor.chunks[index])


def _kinds(findings: tuple[Finding, ...]) -> list[str]:
    return [f.kind for f in findings]


def _cli(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(cli, args)
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


# --------------------------------------------------------------------------------------------------
# Clean checkpoints
# --------------------------------------------------------------------------------------------------

_LOCAL = ["single", "torch_save", "hf_sharded"]
_DISTRIBUTED = [
    pytest.param(name, marks=pytest.mark.distributed)
    for name in ("fsdp2", "fsdp1", "hsdp", "accelerate")
]


@pytest.mark.parametrize("name", [*_LOCAL, *_DISTRIBUTED])
def test_clean_checkpoints_verify_clean(
    produced: Callable[..., Produced], tmp_path: Path, name: str
) -> None:
    p = produced(name)
    report = verify(str(p.path), quiet=True)
    assert report.findings == (), [f.message for f in report.findings]
    assert report.ok and report.tensors > 0 and report.bytes_read > 0
    assert verify(str(p.path), quick=True).ok
    # The checksum manifest round trip: written (on a copy: fixtures are shared), then checked.
    ckpt = _copy(p, tmp_path)
    sums = write_checksums(str(ckpt), quiet=True)
    assert os.path.exists(sums.path)
    assert not [n for n in os.listdir(_root(ckpt)) if ".tmp-" in n]
    again = verify(str(ckpt), quiet=True)
    assert again.checksums_checked and again.ok, [f.message for f in again.findings]
    code, out = _cli(["verify", str(ckpt)])
    assert code == 0 and "OK: no problems found" in out


def test_check_finite_matches_the_reference(produced: Callable[..., Produced]) -> None:
    p = produced("single")
    ref = p.reference()["model"]

    def flat(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        for k, v in items:
            if isinstance(v, torch.Tensor):
                out[f"{prefix}{k}"] = v
            else:
                out.update(flat(v, f"{prefix}{k}."))
        return out

    expected = {}
    for k, t in flat(ref).items():
        if t.is_floating_point() or t.is_complex():
            parts = torch.view_as_real(t) if t.is_complex() else t.float()
            nan, inf = int(torch.isnan(parts).sum()), int(torch.isinf(parts).sum())
            if nan or inf:
                expected[f"model.{k}"] = (nan, inf)
    assert expected  # the producer stores NaN and Inf on purpose
    report = verify(str(p.path), check_finite=True, quiet=True)
    got = {}
    for f in report.findings:
        assert f.kind == "nonfinite" and f.file == "__0_0.distcp" and f.rank == 0
        assert f.fqn is not None
        counts = f.message.split(": ", 1)[1]
        got[f.fqn] = (int(counts.split(" NaN")[0]), int(counts.split(" and ")[1].split(" Inf")[0]))
    assert got == expected


@pytest.mark.parametrize("block", ["64", "192", "4096"])
def test_small_blocks_give_the_same_result(
    produced: Callable[..., Produced], monkeypatch: pytest.MonkeyPatch, block: str
) -> None:
    # Elements, records and archives straddle block boundaries; results must not change.
    p = produced("single")
    base = verify(str(p.path), check_finite=True, quiet=True)
    monkeypatch.setenv(BLOCK_BYTES_ENV, block)
    small = verify(str(p.path), check_finite=True, quiet=True, workers=2)
    assert small.findings == base.findings
    assert small.bytes_read == base.bytes_read


# --------------------------------------------------------------------------------------------------
# Damage
# --------------------------------------------------------------------------------------------------


def test_missing_rank_file(produced: Callable[..., Produced], tmp_path: Path) -> None:
    ckpt = _copy(produced("single"), tmp_path)
    removed = producers.remove_rank_file(ckpt, 0)
    report = verify(str(ckpt), quiet=True)
    assert _kinds(report.findings) == ["missing_file"]
    f = report.findings[0]
    assert f.file == os.path.basename(removed[0]) and f.rank == 0 and f.fqn
    assert "rank 0" in f.message and "missing" in f.message
    code, out = _cli(["verify", str(ckpt)])
    assert code == EXIT_DIFFERENCES and "__0_0.distcp" in out


@pytest.mark.distributed
def test_missing_rank_file_sharded(produced: Callable[..., Produced], tmp_path: Path) -> None:
    ckpt = _copy(produced("fsdp2"), tmp_path)
    producers.remove_rank_file(ckpt, 1)
    report = verify(str(ckpt), quiet=True)
    assert _kinds(report.findings) == ["missing_file"]
    assert report.findings[0].rank == 1 and report.findings[0].file == "__1_0.distcp"


@pytest.mark.parametrize("where", ["empty", "header", "middle", "last-byte"])
def test_truncated_at_several_points(
    produced: Callable[..., Produced], tmp_path: Path, where: str
) -> None:
    ckpt = _copy(produced("single"), tmp_path)
    target = ckpt / "__0_0.distcp"
    size = target.stat().st_size
    keep = {"empty": 0, "header": 100, "middle": size // 2, "last-byte": size - 1}[where]
    producers.truncate(target, keep)
    report = verify(str(ckpt), quiet=True)
    assert "truncated" in _kinds(report.findings)
    f = next(f for f in report.findings if f.kind == "truncated")
    assert f.file == "__0_0.distcp" and f.rank == 0 and f.fqn is not None
    assert f"{keep} bytes" in f.message
    # the items that still fit are read and checked: no spurious CRC findings
    assert set(_kinds(report.findings)) == {"truncated"}


def test_garbled_metadata(produced: Callable[..., Produced], tmp_path: Path) -> None:
    ckpt = _copy(produced("single"), tmp_path)
    producers.garble_metadata(ckpt)
    report = verify(str(ckpt), quiet=True)
    assert _kinds(report.findings) == ["metadata"]
    assert ".metadata" in report.findings[0].message
    code, out = _cli(["verify", str(ckpt), "--json"])
    assert code == EXIT_DIFFERENCES
    data = json.loads(out)
    assert data["ok"] is False and data["findings"][0]["kind"] == "metadata"


def test_uncommitted_directory(produced: Callable[..., Produced], tmp_path: Path) -> None:
    ckpt = _copy(produced("single"), tmp_path)
    (ckpt / ".metadata").unlink()
    report = verify(str(ckpt), quiet=True)
    assert _kinds(report.findings) == ["no_marker"]


@pytest.mark.parametrize(
    ("fqn", "index", "element"),
    [
        ("model.dtypes.bfloat16", 0, 7),
        ("model.dtypes.float8_e4m3fn", 0, 0),
        ("model.transposed", 0, 23),  # a strided chunk
        ("model.scalar_i64", 0, 0),
    ],
)
def test_flipped_bit_is_found_and_named(
    produced: Callable[..., Produced], tmp_path: Path, fqn: str, index: int, element: int
) -> None:
    ckpt = _copy(produced("single"), tmp_path)
    tensor, raw = _raw(read_manifest(str(ckpt)), str(ckpt), fqn, index)
    producers.flip_bit(ckpt / raw.file, raw.offset + element * tensor.itemsize, 5)
    report = verify(str(ckpt), quiet=True)
    assert _kinds(report.findings) == ["crc"]
    f = report.findings[0]
    assert (f.file, f.fqn, f.rank, f.chunk) == (raw.file, fqn, 0, tensor.chunks[index].offsets)
    assert "CRC-32 mismatch in the tensor data" in f.message and repr(fqn) in f.message
    assert verify(str(ckpt), quick=True).ok  # structure is intact: only content finds it


@pytest.mark.distributed
def test_flipped_bit_in_a_sharded_chunk(produced: Callable[..., Produced], tmp_path: Path) -> None:
    ckpt = _copy(produced("fsdp2"), tmp_path)
    manifest = read_manifest(str(ckpt))
    fqn = "model.model.layers.1.mlp.up_proj.weight"
    tensor = manifest.tensors[fqn]
    index = next(i for i, c in enumerate(tensor.chunks) if c.rank == 1)
    _, raw = _raw(manifest, str(ckpt), fqn, index)
    producers.flip_bit(ckpt / raw.file, raw.offset + 5 * tensor.itemsize + 1, 0)
    report = verify(str(ckpt), quiet=True)
    assert _kinds(report.findings) == ["crc"]
    f = report.findings[0]
    assert (f.file, f.fqn, f.rank, f.chunk) == (
        "__1_0.distcp",
        fqn,
        1,
        tensor.chunks[index].offsets,
    )


def test_flipped_bit_in_torch_save_file(produced: Callable[..., Produced], tmp_path: Path) -> None:
    ckpt = _copy(produced("torch_save"), tmp_path)
    manifest = read_manifest(str(ckpt))
    fqn = "model.layers.0.self_attn.q_proj.weight"
    _, raw = _raw(manifest, _root(ckpt), fqn)
    producers.flip_bit(ckpt, raw.offset + 3, 2)
    report = verify(str(ckpt), quiet=True)
    assert _kinds(report.findings) == ["crc"]
    assert report.findings[0].fqn == fqn and repr(fqn) in report.findings[0].message


def test_flipped_bit_in_safetensors_needs_the_checksum_manifest(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    ckpt = _copy(produced("hf_sharded"), tmp_path)
    write_checksums(str(ckpt), quiet=True)
    manifest = read_manifest(str(ckpt))
    fqn = "model.norm.weight"
    _, raw = _raw(manifest, str(ckpt), fqn)
    producers.flip_bit(ckpt / raw.file, raw.offset + 2, 1)
    report = verify(str(ckpt), quiet=True)
    assert _kinds(report.findings) == ["checksum"]
    assert report.findings[0].fqn == fqn and report.findings[0].file == raw.file
    (ckpt / CHECKSUM_FILE).unlink()
    assert verify(str(ckpt), quiet=True).ok  # safetensors carries no checksum of its own


def _swap(path: Path, a: Chunk, b: Chunk) -> None:
    with open(path / a.file, "r+b") as fa, open(path / b.file, "r+b") as fb:
        fa.seek(a.offset)
        da = fa.read(a.length)
        fb.seek(b.offset)
        db = fb.read(b.length)
        fa.seek(a.offset)
        fa.write(db)
        fb.seek(b.offset)
        fb.write(da)


def test_swapped_same_size_chunks_caught_by_checksums(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """Two DCP items of the same size swap places: each archive is self-consistent (its CRCs
    travel with it, and dtype/shape match), so only the per-chunk hashes can tell."""
    ckpt = _copy(produced("single"), tmp_path)
    manifest = read_manifest(str(ckpt))
    by_shape: dict[tuple[Any, ...], list[tuple[str, Chunk]]] = {}
    for t in manifest.tensors.values():
        c = t.chunks[0]
        by_shape.setdefault((t.dtype, c.sizes, c.length), []).append((t.fqn, c))
    (fqn_a, a), (fqn_b, b) = next(v for v in by_shape.values() if len(v) >= 2)[:2]
    write_checksums(str(ckpt), quiet=True)
    _swap(ckpt, a, b)
    sums = (ckpt / CHECKSUM_FILE).read_bytes()
    (ckpt / CHECKSUM_FILE).unlink()
    assert verify(str(ckpt), quiet=True).ok  # CRCs alone cannot see it
    (ckpt / CHECKSUM_FILE).write_bytes(sums)
    report = verify(str(ckpt), quiet=True)
    assert sorted(_kinds(report.findings)) == ["checksum", "checksum"]
    assert {f.fqn for f in report.findings} == {fqn_a, fqn_b}
    assert all(f.file == "__0_0.distcp" and f.rank == 0 for f in report.findings)
    code, out = _cli(["verify", str(ckpt)])
    assert code == EXIT_DIFFERENCES and fqn_a in out and fqn_b in out


def test_checksum_refuses_a_damaged_checkpoint(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    ckpt = _copy(produced("single"), tmp_path)
    _, raw = _raw(read_manifest(str(ckpt)), str(ckpt), "model.dtypes.float32")
    producers.flip_bit(ckpt / raw.file, raw.offset, 0)
    with pytest.raises(CorruptCheckpointError, match="not writing checksums"):
        write_checksums(str(ckpt), quiet=True)
    assert not (ckpt / CHECKSUM_FILE).exists()
    assert not [n for n in os.listdir(ckpt) if ".tmp-" in n]
    code, out = _cli(["checksum", str(ckpt)])
    assert code == 1 and out.startswith("error: ") and "model.dtypes.float32" in out


def test_checksum_runs_the_scanner_itself(
    produced: Callable[..., Produced], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # write_checksums checks and hashes through the structure check and the scanner, which
    # return digests as data: no hidden mode of verify(), no digests on the public report.
    import dataclasses
    import importlib

    from ckptools.verify import VerifyReport, verifier

    def no_verify(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("write_checksums must not call verify()")

    monkeypatch.setattr(verifier, "verify", no_verify)
    monkeypatch.setattr(importlib.import_module("ckptools.verify"), "verify", no_verify)
    ckpt = _copy(produced("single"), tmp_path)
    sums = write_checksums(str(ckpt), quiet=True)
    assert sums.items and sums.files and sums.extra == {"layout": read_manifest(str(ckpt)).layout}
    monkeypatch.undo()
    assert verify(str(ckpt), quiet=True).checksums_checked
    assert "digests" not in {f.name for f in dataclasses.fields(VerifyReport)}


def test_changed_file_outside_chunks_and_stale_manifest(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    ckpt = _copy(produced("single"), tmp_path)
    write_checksums(str(ckpt), quiet=True)
    data = json.loads((ckpt / CHECKSUM_FILE).read_text())
    fqn = next(iter(data["chunks"]))
    del data["chunks"][fqn]
    (ckpt / CHECKSUM_FILE).write_text(json.dumps(data))
    report = verify(str(ckpt), quiet=True)
    assert _kinds(report.findings) == ["checksum"] and report.findings[0].fqn == fqn
    (ckpt / CHECKSUM_FILE).write_text("{not json")
    report = verify(str(ckpt), quiet=True)
    assert _kinds(report.findings) == ["checksum"] and "not a usable" in report.findings[0].message


def test_index_naming_a_missing_shard(produced: Callable[..., Produced], tmp_path: Path) -> None:
    ckpt = _copy(produced("hf_sharded"), tmp_path)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (ckpt / shard).unlink()
    report = verify(str(ckpt), quiet=True)
    assert _kinds(report.findings) == ["missing_file"]
    assert shard in report.findings[0].message
    code, _ = _cli(["verify", str(ckpt)])
    assert code == EXIT_DIFFERENCES


def test_index_not_listing_a_tensor(produced: Callable[..., Produced], tmp_path: Path) -> None:
    ckpt = _copy(produced("hf_sharded"), tmp_path)
    path = ckpt / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    dropped = sorted(index["weight_map"])[0]
    del index["weight_map"][dropped]
    path.write_text(json.dumps(index))
    report = verify(str(ckpt), quiet=True)
    assert _kinds(report.findings) == ["index"] and report.findings[0].fqn == dropped


def test_truncated_safetensors_shard(produced: Callable[..., Produced], tmp_path: Path) -> None:
    ckpt = _copy(produced("hf_sharded"), tmp_path)
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    producers.truncate(shard, -3)
    report = verify(str(ckpt), quiet=True)
    assert [f.kind for f in report.findings] == ["truncated"]
    assert shard.name in report.findings[0].message


# --------------------------------------------------------------------------------------------------
# Malicious checkpoints
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["exec", "os.system"])
def test_malicious_metadata_never_runs(tmp_path: Path, how: str) -> None:
    sentinel = producers.malicious_metadata(tmp_path / "evil", how=how)  # type: ignore[arg-type]
    ckpt = str(tmp_path / "evil")
    report = verify(ckpt, quiet=True)
    assert (
        _kinds(report.findings) == ["unsafe"] and "refusing to load" in report.findings[0].message
    )
    for args in (["verify", ckpt], ["verify", ckpt, "--json"], ["checksum", ckpt]):
        code, _ = _cli(args)
        assert code in (1, EXIT_DIFFERENCES)
    code, out = _cli(["diff", ckpt, ckpt])
    assert code == 1 and "refusing to load" in out
    assert not os.path.exists(sentinel)


@pytest.mark.parametrize("how", ["exec", "os.system"])
def test_malicious_object_never_runs(tmp_path: Path, how: str) -> None:
    sentinel = producers.malicious_object(tmp_path / "evil", how=how)  # type: ignore[arg-type]
    ckpt = str(tmp_path / "evil")
    # Objects are CRC-checked, never unpickled: the checkpoint is intact, so verify is clean.
    assert verify(ckpt, check_finite=True, quiet=True).ok
    write_checksums(ckpt, quiet=True)
    assert verify(ckpt, quiet=True).ok
    code, _ = _cli(["diff", ckpt, ckpt])
    assert code == 0
    code, _ = _cli(["verify", ckpt, "--against", ckpt])
    assert code == 0
    assert not os.path.exists(sentinel)


# --------------------------------------------------------------------------------------------------
# One tiling check: consolidate, reshard and verify agree
# --------------------------------------------------------------------------------------------------


def _grid_boxes(overlap: bool) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """300 boxes of 2 x 2 tiling (30, 40) on both dims; with ``overlap``, the first grows into the
    second, which shrinks: the element count still adds up, but column 2 is covered twice and
    column 3 not at all."""
    boxes = [((2 * i, 2 * j), (2, 2)) for i in range(15) for j in range(20)]
    if overlap:
        boxes[0] = ((0, 0), (2, 3))
        boxes[1] = ((0, 2), (2, 1))
    return boxes


def _dcp_of_boxes(path: Path, fqn: str, boxes: list[Any]) -> torch.Tensor:
    """A real DCP checkpoint whose tensor ``fqn`` is stored as ``boxes`` (each a torch.save item
    of that box of the reference tensor): torch saves one tensor per box, then the metadata is
    rewritten to describe them as chunks of one tensor, as a 2-D sharding would."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    full = torch.arange(30 * 40, dtype=torch.float32).reshape(30, 40)
    pieces = {
        f"p{k}": full[o[0] : o[0] + s[0], o[1] : o[1] + s[1]].clone()
        for k, (o, s) in enumerate(boxes)
    }
    dcp.save(pieces, checkpoint_id=str(path))
    meta = pickle.loads((path / ".metadata").read_bytes())
    storage = {
        MetadataIndex(fqn, torch.Size(o), 0): meta.storage_data[
            MetadataIndex(f"p{k}", torch.Size([0, 0]), 0)
        ]
        for k, (o, _) in enumerate(boxes)
    }
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
    tensor = TensorStorageMetadata(meta.state_dict_metadata["p0"].properties, full.shape, chunks)
    rewritten = Metadata({fqn: tensor}, planner_data={fqn: (fqn,)}, storage_data=storage)
    (path / ".metadata").write_bytes(pickle.dumps(rewritten))
    return full


def test_consolidate_reshard_and_verify_agree_on_a_300_chunk_tiling(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    import ckptools

    good = tmp_path / "good"
    full = _dcp_of_boxes(good, "model.w", _grid_boxes(overlap=False))
    assert verify(str(good), quiet=True).ok
    ckptools.consolidate(str(good), str(tmp_path / "good-hf"), quiet=True, weights_only=True)
    assert torch.equal(load_file(str(tmp_path / "good-hf" / "model.safetensors"))["model.w"], full)
    ckptools.reshard(str(good), str(tmp_path / "good-2"), world_size=2, quiet=True)
    assert verify(str(tmp_path / "good-2"), quiet=True).ok

    # Beyond the 256 chunks that the planner once checked pairwise, an overlap hidden by an
    # element count that adds up was written out as a wrong tensor; now all three refuse it.
    bad = tmp_path / "bad"
    _dcp_of_boxes(bad, "model.w", _grid_boxes(overlap=True))
    report = verify(str(bad), quiet=True)
    assert [(f.kind, f.fqn) for f in report.findings] == [("tiling", "model.w")]
    assert "overlap" in report.findings[0].message
    for name, run in [
        ("bad-hf", lambda out: ckptools.consolidate(str(bad), out, quiet=True, weights_only=True)),
        ("bad-2", lambda out: ckptools.reshard(str(bad), out, world_size=2, quiet=True)),
    ]:
        out = tmp_path / name
        with pytest.raises(CorruptCheckpointError, match="do not tile") as caught:
            run(str(out))
        assert caught.value.fqn == "model.w" and "'model.w'" in str(caught.value)
        assert "overlap" in str(caught.value)
        assert not out.exists()
        assert not [p for p in os.listdir(tmp_path) if p.startswith(f"{name}.tmp")]
