"""Damaged checkpoints give one clear line naming the file; malicious ones never run their code."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptools
from ckptools.cli.main import cli
from ckptools.errors import UnsafeCheckpointError
from tests.conftest import Produced
from tests.support import producers


def _copy(p: Produced, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(p.path, dst)
    return dst


def _one_line_error(args: list[str]) -> str:
    """The error a command ends with: one ``error:`` line, or with ``--json`` one JSON object
    ``{"error": ..., "exit_code": 1}`` (returned as ``error: <message>``)."""
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    text = result.output.strip()
    assert "Traceback" not in text
    if "--json" in args:
        report = json.loads(text)
        assert report["exit_code"] == 1 and "\n" not in report["error"], report
        return f"error: {report['error']}"
    assert text.startswith("error: ") and "\n" not in text, text
    return text


def test_missing_rank_file(produced: Callable[..., Produced], tmp_path: Path) -> None:
    ckpt = _copy(produced("single"), tmp_path)
    removed = producers.remove_rank_file(ckpt, 0)
    msg = _one_line_error(["inspect", str(ckpt)])
    assert os.path.basename(removed[0]) in msg and "missing" in msg


@pytest.mark.parametrize("keep", [0, 100, -1])
def test_truncated_data_file(produced: Callable[..., Produced], tmp_path: Path, keep: int) -> None:
    ckpt = _copy(produced("single"), tmp_path)
    target = ckpt / "__0_0.distcp"
    producers.truncate(target, keep)
    msg = _one_line_error(["inspect", str(ckpt)])
    assert "__0_0.distcp" in msg and "truncated" in msg


def test_truncated_file_found_when_reading_chunks(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    # A reader that skipped the size check still names the file instead of a bare EOFError.
    from ckptools.errors import CorruptCheckpointError
    from ckptools.producers.dcp.layout import read_dcp

    ckpt = _copy(produced("single"), tmp_path)
    producers.truncate(ckpt / "__0_0.distcp", -1)
    manifest = read_dcp(str(ckpt), check_files=False)
    last = max((c for t in manifest.tensors.values() for c in t.chunks), key=lambda c: c.offset)
    fqn = next(t.fqn for t in manifest.tensors.values() if last in t.chunks)
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp"):
        ckptools.read_tensor(manifest, fqn)


def test_garbled_metadata(produced: Callable[..., Produced], tmp_path: Path) -> None:
    ckpt = _copy(produced("single"), tmp_path)
    producers.garble_metadata(ckpt)
    msg = _one_line_error(["inspect", str(ckpt)])
    assert ".metadata" in msg and "not a readable pickle" in msg


def test_uncommitted_dcp_directory(produced: Callable[..., Produced], tmp_path: Path) -> None:
    ckpt = _copy(produced("single"), tmp_path)
    (ckpt / ".metadata").unlink()
    msg = _one_line_error(["inspect", str(ckpt)])
    assert ".metadata" in msg and "never committed" in msg


def test_index_naming_missing_shard(produced: Callable[..., Produced], tmp_path: Path) -> None:
    ckpt = _copy(produced("hf_sharded"), tmp_path)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (ckpt / shard).unlink()
    msg = _one_line_error(["inspect", str(ckpt)])
    assert shard in msg and "missing" in msg


def test_truncated_safetensors_shard(produced: Callable[..., Produced], tmp_path: Path) -> None:
    ckpt = _copy(produced("hf_sharded"), tmp_path)
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    producers.truncate(shard, -3)
    msg = _one_line_error(["inspect", str(ckpt)])
    assert shard.name in msg


@pytest.mark.parametrize("how", ["exec", "os.system"])
def test_malicious_metadata_never_runs(tmp_path: Path, how: str) -> None:
    sentinel = producers.malicious_metadata(tmp_path / "evil", how=how)  # type: ignore[arg-type]
    for args in (["inspect"], ["inspect", "--json"], ["inspect", "--values"]):
        msg = _one_line_error([*args, str(tmp_path / "evil")])
        assert "refusing to load" in msg
    with pytest.raises(UnsafeCheckpointError):
        ckptools.read_manifest(str(tmp_path / "evil"))
    assert not os.path.exists(sentinel)


@pytest.mark.parametrize("how", ["exec", "os.system"])
def test_malicious_object_never_runs(tmp_path: Path, how: str) -> None:
    sentinel = producers.malicious_object(tmp_path / "evil", how=how)  # type: ignore[arg-type]
    ckpt = str(tmp_path / "evil")
    # Metadata-only commands do not touch the object; decoding it is refused, naming the global.
    result = CliRunner().invoke(cli, ["inspect", ckpt, "--values", "--json"])
    assert result.exit_code == 0, result.output
    objects = {o["fqn"]: o for o in json.loads(result.output)["objects"]}
    assert "refusing to load" in objects["extra.payload"]["value"]["error"]
    manifest = ckptools.read_manifest(ckpt)
    with pytest.raises(UnsafeCheckpointError) as info:
        ckptools.read_object(manifest, "extra.payload")
    assert info.value.global_name in {"builtins.exec", "posix.system", "os.system"}
    assert not os.path.exists(sentinel)


def _object_item(ckpt: Path) -> tuple[str, str, int, int]:
    """(FQN, file, offset, length) of the largest object item of a DCP checkpoint."""
    manifest = ckptools.read_manifest(str(ckpt))
    entry = max(manifest.objects.values(), key=lambda o: o.length)
    assert entry.file is not None
    return entry.fqn, entry.file, entry.offset, entry.length


@pytest.mark.parametrize("damage", ["one_byte_short", "flipped_bit"])
def test_damaged_object_item_is_not_copied(
    produced: Callable[..., Produced], tmp_path: Path, damage: str
) -> None:
    # issue 25, item 22: object items are copied byte for byte, never unpickled; they are checked
    # (zip structure, the CRC-32 of each record) as tensor items are, before they are copied.
    import io
    import pickle
    import zipfile

    ckpt = _copy(produced("single"), tmp_path)
    fqn, file, offset, length = _object_item(ckpt)
    if damage == "one_byte_short":
        with open(ckpt / ".metadata", "rb") as f:
            md = pickle.load(f)  # torch's own classes: this test wrote the file
        [info] = [v for k, v in md.storage_data.items() if k.fqn == fqn]
        info.length -= 1
        (ckpt / ".metadata").write_bytes(pickle.dumps(md, protocol=2))
    else:
        data = (ckpt / file).read_bytes()
        with zipfile.ZipFile(io.BytesIO(data[offset : offset + length])) as z:
            info_pkl = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
        # the last byte of data.pkl (pickle's STOP) inside the item's local record
        at = offset + info_pkl.header_offset + 30 + len(info_pkl.filename.encode())
        at += len(info_pkl.extra) + info_pkl.file_size - 1
        producers.flip_bit(ckpt / file, at, 1)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    out = tmp_path / "out"
    msg = _one_line_error(["reshard", str(ckpt), str(out), "--world-size", "2"])
    assert f"{ckpt}/{file}" in msg and repr(fqn) in msg and "no output was committed" in msg
    assert ("CRC-32" in msg) == (damage == "flipped_bit")
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
