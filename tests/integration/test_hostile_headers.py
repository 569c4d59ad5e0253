"""Hostile and broken headers give one line naming the file, never a traceback or a wrong answer.

Every case starts from a real checkpoint (``safetensors.torch.save_file``, ``dcp.save``,
``torch.save`` or the ``hf_sharded`` producer), damages its header, and checks that inspect and
consolidate refuse it with a one-line :class:`CkptError` naming the file, that verify reports it,
that no output was left behind and that the source is unchanged. For safetensors headers the
library's own loader (``safetensors.safe_open``) must refuse the same file, so that ckptools'
rules are the specification's, no stricter and no looser.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ckptools
from ckptools.cli.main import cli
from ckptools.errors import CkptError, CorruptCheckpointError
from tests.conftest import Produced

# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def _tree_digest(path: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _refused(src: Path, tmp_path: Path, *names: str) -> str:
    """inspect and consolidate refuse ``src`` with one line naming each of ``names``; verify
    reports it; nothing is written and ``src`` is unchanged. Returns the message."""
    before = _tree_digest(src)
    out = tmp_path / "out"
    with pytest.raises(CkptError) as inspect_error:
        ckptools.inspect(str(src))
    with pytest.raises(CkptError) as consolidate_error:
        ckptools.consolidate(str(src), str(out))
    message = str(inspect_error.value)
    for e in (inspect_error.value, consolidate_error.value):
        assert "\n" not in str(e), str(e)
        for name in names:
            assert name in str(e), str(e)
    assert not ckptools.verify(str(src), quiet=True).ok
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))
    assert _tree_digest(src) == before
    result = CliRunner().invoke(cli, ["inspect", str(src)])
    assert result.exit_code == 1 and result.output.startswith("error: ")
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
    return message


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(19)
    return {
        "a.f32": torch.randn(3, 5, generator=g),
        "b.bf16": torch.randn(4, 2, generator=g).to(torch.bfloat16),
        "c.i64": torch.arange(7, dtype=torch.int64),
        "d.bool": torch.tensor([True, False, True]),
        "e.u8": torch.arange(5, dtype=torch.uint8),
        "f.f16": torch.randn(2, 2, 2, generator=g).half(),
        "g.scalar": torch.tensor(2.5),
        "h.empty": torch.empty(0, 3),
        "i.f64": torch.randn(3, generator=g, dtype=torch.float64),
    }


@pytest.fixture
def st_file(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "model.safetensors"
    path.parent.mkdir()
    save_file(_tensors(), str(path), metadata={"format": "pt"})
    return path


def _split(path: Path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _write(path: Path, header: Any, body: bytes, *, length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + raw + body)


def _library_refuses(path: Path) -> None:
    with pytest.raises(Exception), safe_open(str(path), framework="pt") as f:  # noqa: B017
        for k in f.keys():  # noqa: SIM118
            f.get_tensor(k)


# --------------------------------------------------------------------------------------------------
# safetensors headers: the library's rules (item 7)
# --------------------------------------------------------------------------------------------------


#: A damage to a header: (header dict, data bytes) -> (new header, new data bytes).
Edit = Callable[[dict[str, Any], bytes], tuple[Any, bytes]]


def _retype(field: str, value: Any) -> Edit:
    def edit(h: dict[str, Any], body: bytes) -> tuple[Any, bytes]:
        h["a.f32"][field] = value
        return h, body

    return edit


def _offsets(name: str, begin: int, end: int) -> Edit:
    def edit(h: dict[str, Any], body: bytes) -> tuple[Any, bytes]:
        h[name]["data_offsets"] = [begin, end]
        return h, body

    return edit


def _overlap(h: dict[str, Any], body: bytes) -> tuple[Any, bytes]:
    # two tensors of the same size sharing one byte range, the file length unchanged
    h["e.u8"]["data_offsets"] = list(h["d.bool"]["data_offsets"])
    h["d.bool"]["shape"] = [5]
    return h, body


def _hole(h: dict[str, Any], body: bytes) -> tuple[Any, bytes]:
    # every tensor moved 8 bytes up: the first 8 bytes of data belong to no tensor
    for k, v in h.items():
        if k != "__metadata__":
            v["data_offsets"] = [o + 8 for o in v["data_offsets"]]
    return h, b"\0" * 8 + body


def _shape_disagrees(h: dict[str, Any], body: bytes) -> tuple[Any, bytes]:
    h["a.f32"]["shape"] = [5, 3, 1, 2]
    return h, body


def _negative_shape(h: dict[str, Any], body: bytes) -> tuple[Any, bytes]:
    h["a.f32"]["shape"] = [-3, -5]
    return h, body


def _last(h: dict[str, Any]) -> str:
    return max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])


def _past_end(h: dict[str, Any], body: bytes) -> tuple[Any, bytes]:
    k = _last(h)
    h[k]["data_offsets"][1] += 4
    h[k]["shape"] = [h[k]["shape"][0] + 1]
    return h, body


def _trailing(h: dict[str, Any], body: bytes) -> tuple[Any, bytes]:
    return h, body + b"\0" * 8


def _set(key: str, value: Any) -> Edit:
    def edit(h: dict[str, Any], body: bytes) -> tuple[Any, bytes]:
        h[key] = value
        return h, body

    return edit


HOSTILE_HEADERS: dict[str, Edit] = {
    "dtype_not_string": _retype("dtype", 7),
    "dtype_unknown": _retype("dtype", "F99"),
    "shape_not_list": _retype("shape", "15"),
    "shape_of_floats": _retype("shape", [3.0, 5.0]),
    "shape_of_bools": _retype("shape", [True, 15]),
    "shape_negative": _negative_shape,
    "shape_disagrees_with_bytes": _shape_disagrees,
    "offsets_missing": _retype("data_offsets", None),
    "offsets_three": _retype("data_offsets", [0, 30, 60]),
    "offsets_negative": _offsets("a.f32", -60, 0),
    "offsets_reversed": _offsets("c.i64", 56, 0),
    "offsets_overlap": _overlap,
    "offsets_hole": _hole,
    "offsets_past_end": _past_end,
    "trailing_bytes": _trailing,
    "entry_not_object": _set("a.f32", [1, 2]),
    "metadata_not_map": _set("__metadata__", ["format", "pt"]),
    "metadata_value_not_string": _set("__metadata__", {"format": 1}),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_HEADERS))
def test_hostile_safetensors_header(st_file: Path, tmp_path: Path, case: str) -> None:
    header, body = _split(st_file)
    _write(st_file, *HOSTILE_HEADERS[case](header, body))
    _library_refuses(st_file)
    message = _refused(st_file, tmp_path, "model.safetensors")
    assert "Traceback" not in message


@pytest.mark.parametrize(
    "case",
    [
        "length_minus_one",
        "length_past_file",
        "length_over_limit",
        "not_json",
        "not_object",
        "nested_too_deep",
    ],
)
def test_hostile_safetensors_header_bytes(st_file: Path, tmp_path: Path, case: str) -> None:
    header, body = _split(st_file)
    raw = json.dumps(header).encode()
    if case == "length_minus_one":
        _write(st_file, raw, body, length=2**64 - 1)
    elif case == "length_past_file":
        _write(st_file, raw, body, length=len(raw) + len(body) + 1)
    elif case == "length_over_limit":
        _write(st_file, raw, body, length=100_000_001)
    elif case == "not_json":
        _write(st_file, raw[:-1] + b"]", body)
    elif case == "nested_too_deep":  # Python's parser recurses: a RecursionError, not a line
        _write(st_file, b'{"a.f32":' + b"[" * 200_000 + b"]" * 200_000 + b"}", body)
    else:
        _write(st_file, b'["a.f32"]' + b" " * (len(raw) - 9), body)
    _library_refuses(st_file)
    _refused(st_file, tmp_path, "model.safetensors")


def test_negative_offsets_name_the_tensor(st_file: Path, tmp_path: Path) -> None:
    header, body = _split(st_file)
    _write(st_file, *_offsets("a.f32", -60, 0)(header, body))
    with pytest.raises(CorruptCheckpointError) as e:
        ckptools.inspect(str(st_file))
    assert e.value.fqn == "a.f32" and "a.f32" in str(e.value) and "data_offsets" in str(e.value)


def test_valid_file_with_many_dtypes_is_bit_exact(st_file: Path, tmp_path: Path) -> None:
    # The other side of the rules: what safetensors writes (0-dim, empty, 1-byte dtypes, the
    # header padded with spaces) is accepted, and comes through consolidate unchanged.
    out = tmp_path / "out"
    ckptools.consolidate(str(st_file), str(out), weights_only=True)
    assert ckptools.verify(str(st_file), quiet=True).ok
    want, got = load_file(str(st_file)), load_file(str(out / "model.safetensors"))
    assert set(want) == set(got)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape
        assert torch.equal(got[k].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), k


def test_header_we_write_is_one_safetensors_reads(tmp_path: Path) -> None:
    from ckptools.formats.safetensors_header import header_bytes, parse_header

    entries = [
        ("w", "float32", (2, 3), 0, 24),
        ("s", "int8", (), 24, 25),
        ("e", "bfloat16", (0,), 25, 25),
    ]
    head = header_bytes(entries)
    path = tmp_path / "x.safetensors"
    path.write_bytes(head + bytes(25))
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == ["e", "s", "w"]
    parsed = parse_header(head[8:], path=str(path), file_size=len(head) + 25)
    assert [(t.name, t.dtype, t.shape, t.begin, t.end) for t in parsed.tensors] == entries
    assert parsed.metadata == {"format": "pt"}


# --------------------------------------------------------------------------------------------------
# index.json of the wrong shape; stray and missing shards (items 8, 9)
# --------------------------------------------------------------------------------------------------


def _hf(produced: Callable[..., Produced], tmp_path: Path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(produced("hf_sharded").path, dst)
    return dst


@pytest.mark.parametrize(
    "edit",
    ["missing_weight_map", "weight_map_list", "value_not_string", "value_empty", "root_list"],
)
def test_index_of_wrong_json_types(
    produced: Callable[..., Produced], tmp_path: Path, edit: str
) -> None:
    src = _hf(produced, tmp_path)
    path = src / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    first = next(iter(index["weight_map"]))
    if edit == "missing_weight_map":
        del index["weight_map"]
    elif edit == "weight_map_list":
        index["weight_map"] = list(index["weight_map"].items())
    elif edit == "value_not_string":
        index["weight_map"][first] = 1
    elif edit == "value_empty":
        index["weight_map"][first] = ""
    else:
        index = [index]
    path.write_text(json.dumps(index))
    _refused(src, tmp_path, "model.safetensors.index.json")


def test_verify_lists_stray_shard(produced: Callable[..., Produced], tmp_path: Path) -> None:
    src = _hf(produced, tmp_path)
    shutil.copy(src / "model-00001-of-00002.safetensors", src / "leftover.safetensors")
    report = ckptools.verify(str(src), quiet=True)
    assert not report.ok
    stray = [f for f in report.findings if f.file == "leftover.safetensors"]
    assert len(stray) == 1 and stray[0].kind == "index" and "stray" in stray[0].message


def test_index_naming_missing_shards_names_them_all(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    src = _hf(produced, tmp_path)
    path = src / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    names = list(index["weight_map"])
    index["weight_map"][names[0]] = "gone-1.safetensors"
    index["weight_map"][names[1]] = "gone-2.safetensors"
    path.write_text(json.dumps(index))
    _refused(src, tmp_path, "gone-1.safetensors", "gone-2.safetensors")
    report = ckptools.verify(str(src), quiet=True)
    assert [f.kind for f in report.findings] == ["missing_file"]


# --------------------------------------------------------------------------------------------------
# DCP and torch.save: short items, truncated archives, fields of the wrong type (items 6, 9)
# --------------------------------------------------------------------------------------------------


def _dcp(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "src"
    dcp.save({"w": torch.arange(16.0).reshape(4, 4), "b": torch.ones(3)}, checkpoint_id=str(src))
    return src


def _edit_metadata(src: Path, edit: Callable[[Any], None]) -> None:
    path = src / ".metadata"
    with path.open("rb") as f:
        md = pickle.load(f)  # our own dcp.save output, in a test
    edit(md)
    with path.open("wb") as f:
        pickle.dump(md, f)


def _storage(md: Any, fqn: str) -> Any:
    return next(v for k, v in md.storage_data.items() if k.fqn == fqn)


@pytest.mark.parametrize(("fqn", "delta"), [("w", -1), ("b", -1), ("b", 1)])
def test_distcp_item_one_byte_off(tmp_path: Path, fqn: str, delta: int) -> None:
    # An item's recorded length one byte short: its zip end record no longer ends where the item
    # does (once a struct.error traceback); one byte long at the end of the file: truncated.
    src = _dcp(tmp_path)

    def edit(md: Any) -> None:
        _storage(md, fqn).length += delta

    _edit_metadata(src, edit)
    before = _tree_digest(src)
    with pytest.raises(CkptError) as e:
        ckptools.consolidate(str(src), str(tmp_path / "out"), weights_only=True)
    assert "__0_0.distcp" in str(e.value) and "\n" not in str(e.value)
    assert not ckptools.verify(str(src), quiet=True).ok
    assert _tree_digest(src) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [-1, 1.5, "0", None, True])
def test_distcp_storage_offset_of_wrong_type(tmp_path: Path, value: Any) -> None:
    src = _dcp(tmp_path)

    def edit(md: Any) -> None:
        _storage(md, "b").offset = value

    _edit_metadata(src, edit)
    message = _refused(src, tmp_path, ".metadata")
    assert "'b'" in message


def test_negative_chunk_sizes_are_refused(tmp_path: Path) -> None:
    # (-4) * (-4) == 16 == 4 * 4: an element count cannot tell; coverage can (item 6).
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    src = _dcp(tmp_path)

    def edit(md: Any) -> None:
        chunk = md.state_dict_metadata["w"].chunks[0]
        md.state_dict_metadata["w"].chunks[0] = ChunkStorageMetadata(
            offsets=chunk.offsets, sizes=torch.Size([-4, -4])
        )

    _edit_metadata(src, edit)
    before = _tree_digest(src)
    for run in (
        lambda: ckptools.consolidate(str(src), str(tmp_path / "out")),
        lambda: ckptools.reshard(str(src), str(tmp_path / "out"), world_size=2),
    ):
        with pytest.raises(CorruptCheckpointError, match=r"'w'.*\[-4, -4\]"):
            run()
    report = ckptools.verify(str(src), quiet=True)
    # Refused where the manifest is built (layouts.dcp), so verify reports the metadata as
    # unreadable, naming the tensor and its sizes.
    assert not report.ok and any(
        "'w'" in f.message and "[-4, -4]" in f.message for f in report.findings
    ), report.findings
    assert _tree_digest(src) == before and not (tmp_path / "out").exists()


def test_truncated_torch_save_file(produced: Callable[..., Produced], tmp_path: Path) -> None:
    # one byte short: the zip end record is cut; once a struct.error traceback
    src = tmp_path / "src" / "model.pt"
    src.parent.mkdir()
    shutil.copy(produced("torch_save").path, src)
    data = src.read_bytes()
    src.write_bytes(data[:-1])
    _refused(src, tmp_path, "model.pt")
