"""A property-based fuzzer over the bytes ckptools parses from strangers.

Starting from real checkpoints (``safetensors.torch.save_file``, a sharded Hugging Face directory,
``torch.save``, ``dcp.save``), hypothesis truncates, flips, splices and re-types their headers,
``model.safetensors.index.json`` and zip archives, then runs inspect, verify and consolidate
in-process. Each must end with a result or a one-line :class:`CkptError`, never another exception;
nothing may be written outside OUT and the source must be unchanged. For a single safetensors file
the library itself is the referee: when ckptools consolidates a damaged file, ``safetensors``
must load it too and the output must hold the same bytes.

Bounded: a fixed number of examples per target (about 40 s for the file here); a failure prints
the ``@reproduce_failure`` blob to replay it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import ckptools
from ckptools.errors import CkptError
from tests.conftest import Produced

FUZZ = settings(
    max_examples=50,
    deadline=20_000,  # ms per example: a hang fails the test instead of stalling it
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# --------------------------------------------------------------------------------------------------
# Sources, made once per module by real writers
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sources(
    tmp_path_factory: pytest.TempPathFactory, produced: Callable[..., Produced]
) -> Iterator[dict[str, Path]]:
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("fuzz-sources")
    g = torch.Generator().manual_seed(19)
    single = root / "st" / "model.safetensors"
    single.parent.mkdir()
    save_file(
        {
            "a": torch.randn(3, 5, generator=g),
            "b": torch.randn(4, generator=g).to(torch.bfloat16),
            "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
            "d": torch.tensor(1.5),
            "e": torch.empty(0, 2),
        },
        str(single),
    )
    dcp_dir = root / "dcp"
    dcp.save({"w": torch.randn(4, 4, generator=g), "b": torch.ones(3)}, checkpoint_id=str(dcp_dir))
    yield {
        "st": single,
        "hf": produced("hf_sharded").path,
        "pt": produced("torch_save").path,
        "dcp": dcp_dir,
    }


# --------------------------------------------------------------------------------------------------
# Damage
# --------------------------------------------------------------------------------------------------

#: JSON values of every type, for a field that expects another.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**66), max_value=2**66)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def byte_damage(draw: st.DrawFn, data: bytes, hot: int) -> bytes:
    """``data`` truncated, with bytes flipped (in its first ``hot`` bytes, its last KiB where a
    zip keeps its directory, or anywhere), or a slice spliced elsewhere."""
    kind = draw(st.sampled_from(["truncate", "flip", "splice"]))
    out = bytearray(data)
    if kind == "truncate":
        return bytes(out[: draw(st.integers(0, len(out) - 1))])
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            lo, hi = draw(
                st.sampled_from([(0, min(hot, len(out))), (max(0, len(out) - 1024), len(out))])
                | st.just((0, len(out)))
            )
            i = draw(st.integers(lo, hi - 1))
            out[i] ^= draw(st.integers(1, 255))
        return bytes(out)
    a = draw(st.integers(0, len(out)))
    b = draw(st.integers(a, min(len(out), a + 64)))
    at = draw(st.integers(0, len(out)))
    piece = bytes(out[a:b])
    if draw(st.booleans()):
        del out[a:b]
        at = min(at, len(out))
    out[at:at] = piece
    return bytes(out)


def _split_safetensors(data: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    header: dict[str, Any] = json.loads(data[8 : 8 + n])
    return header, data[8 + n :]


@st.composite
def header_damage(draw: st.DrawFn, data: bytes) -> bytes:
    """A safetensors file whose JSON header has a value replaced, a field deleted or its offsets
    nudged; the length prefix is rewritten to fit."""
    header, body = _split_safetensors(data)
    names = sorted(k for k in header if k != "__metadata__")
    name = draw(st.sampled_from(names))
    kind = draw(st.sampled_from(["value", "delete", "nudge", "entry", "metadata"]))
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
    if kind == "value":
        header[name][field] = draw(json_values)
    elif kind == "delete":
        del header[name][field]
    elif kind == "nudge":
        i = draw(st.integers(0, 1))
        header[name]["data_offsets"][i] += draw(st.sampled_from([-8, -2, -1, 1, 2, 8]))
    elif kind == "entry":
        header[name] = draw(json_values)
    else:
        header["__metadata__"] = draw(json_values)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


@st.composite
def index_damage(draw: st.DrawFn, data: bytes) -> bytes:
    index = json.loads(data)
    kind = draw(st.sampled_from(["root", "weight_map", "value", "key", "delete", "bytes"]))
    if kind == "bytes":
        return draw(byte_damage(data, len(data)))
    if kind == "root":
        index = draw(json_values)
    elif kind == "weight_map":
        index["weight_map"] = draw(json_values)
    elif kind == "value":
        index["weight_map"][draw(st.sampled_from(sorted(index["weight_map"])))] = draw(json_values)
    elif kind == "key":
        index["weight_map"][draw(st.text(max_size=8))] = draw(
            st.sampled_from(sorted(set(index["weight_map"].values())))
        )
    else:
        del index["weight_map"]
    return json.dumps(index).encode()


# --------------------------------------------------------------------------------------------------
# The property
# --------------------------------------------------------------------------------------------------


def _digest(path: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _check(
    src: Path, work: Path, verbs: tuple[str, ...] = ("inspect", "verify", "consolidate")
) -> Path | None:
    """Run the verbs on ``src``; return OUT when consolidate succeeded."""
    before = _digest(src)
    listing = {p.name for p in work.iterdir()}
    out = work / "out"
    done = None
    for verb in verbs:
        try:
            if verb == "inspect":
                ckptools.inspect(str(src))
            elif verb == "verify":
                ckptools.verify(str(src), quiet=True)
            elif verb == "reshard":
                ckptools.reshard(str(src), str(work / "resharded"), world_size=3, quiet=True)
            else:
                ckptools.consolidate(str(src), str(out))
                done = out
        except CkptError as e:
            assert "\n" not in str(e), f"{verb}: {e}"
    assert _digest(src) == before, "the source was modified"
    written = {p.name for p in work.iterdir()} - listing
    assert written <= {"out", "resharded"}, f"written outside OUT: {written}"
    return done


def _damaged_copy(
    src: Path, rel: str, damaged: bytes
) -> tuple[tempfile.TemporaryDirectory[str], Path]:
    tmp = tempfile.TemporaryDirectory(prefix="ckpt-fuzz-")
    work = Path(tmp.name)
    if src.is_file():
        copy = work / "src" / src.name
        copy.parent.mkdir()
        copy.write_bytes(damaged)
        return tmp, copy
    copy = work / "src"
    shutil.copytree(src, copy)
    (copy / rel).write_bytes(damaged)
    return tmp, copy


def _run(src: Path, rel: str, damaged: bytes) -> None:
    tmp, copy = _damaged_copy(src, rel, damaged)
    with tmp:
        out = _check(copy, copy.parent)
        if out is not None and src.suffix == ".safetensors":
            # the library is the referee: what ckptools accepts, safetensors loads, byte for byte
            want = load_file(str(copy))
            got = load_file(str(out / "model.safetensors"))
            assert set(want) == set(got)
            for k, t in want.items():
                assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
                assert torch.equal(
                    got[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
                )


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_header(sources: dict[str, Path], data: st.DataObject) -> None:
    src = sources["st"]
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    damaged = data.draw(header_damage(raw) | byte_damage(raw, 8 + n))
    _run(src, "", damaged)


@FUZZ
@given(data=st.data())
def test_fuzz_index_json(sources: dict[str, Path], data: st.DataObject) -> None:
    src = sources["hf"]
    rel = "model.safetensors.index.json"
    _run(src, rel, data.draw(index_damage((src / rel).read_bytes())))


@FUZZ
@given(data=st.data())
def test_fuzz_sharded_safetensors_header(sources: dict[str, Path], data: st.DataObject) -> None:
    src = sources["hf"]
    rel = data.draw(st.sampled_from(sorted(p.name for p in src.glob("*.safetensors"))))
    raw = (src / rel).read_bytes()
    damaged = data.draw(header_damage(raw) | byte_damage(raw, 1024))
    _run(src, rel, damaged)


@FUZZ
@given(data=st.data())
def test_fuzz_torch_save_zip(sources: dict[str, Path], data: st.DataObject) -> None:
    src = sources["pt"]
    raw = src.read_bytes()
    _run(src, "", data.draw(byte_damage(raw, 1024)))


@FUZZ
@given(data=st.data())
def test_fuzz_distcp_items(sources: dict[str, Path], data: st.DataObject) -> None:
    src = sources["dcp"]
    rel = data.draw(st.sampled_from(sorted(p.name for p in src.iterdir() if p.is_file())))
    raw = (src / rel).read_bytes()
    _run(src, rel, data.draw(byte_damage(raw, 1024)))


# --------------------------------------------------------------------------------------------------
# DCP .metadata: a pickle, damaged at its opcodes
# --------------------------------------------------------------------------------------------------


def _shared_tuple(levels: int) -> bytes:
    """t = (t, t) nested ``levels`` deep, each level two memo GETs (memo entries 200..)."""
    out = b")q\xc8"
    for k in range(200, 200 + levels):
        out += b"0h" + bytes([k]) + b"h" + bytes([k]) + b"\x86q" + bytes([k + 1])
    return out


def _le(n: int, width: int) -> bytes:
    return (n % (1 << (8 * width))).to_bytes(width, "little")


@st.composite
def opcode_piece(draw: st.DrawFn) -> bytes:
    """Opcodes a stranger could splice in: memo stores and reads at any index, lengths and
    counts far beyond the file, shared tuples hashed, runs of one opcode, or random bytes."""
    index = draw(st.integers(0, 2**32 - 1) | st.sampled_from([0, 1, 255, 256, 2**16, 10**8]))
    kind = draw(st.sampled_from(["put", "get", "length", "hash", "run", "bytes"]))
    if kind == "put":
        put = draw(st.sampled_from([b"r" + _le(index, 4), b"p%d\n" % index, b"q" + _le(index, 1)]))
        return b"N" + put + draw(st.sampled_from([b"0", b""]))
    if kind == "get":
        return draw(st.sampled_from([b"j" + _le(index, 4), b"h" + _le(index, 1), b"g%d\n" % index]))
    if kind == "length":
        op, width = draw(
            st.sampled_from([(b"X", 4), (b"\x8d", 8), (b"\x95", 8), (b"\x8b", 4), (b"B", 4)])
        )
        return op + _le(index * draw(st.sampled_from([1, 2**20])), width)
    if kind == "hash":
        container = draw(st.sampled_from([b"}", b"("]))
        close = b"K\x01s0" if container == b"}" else b"\x91" + b"0"
        return container + _shared_tuple(draw(st.integers(1, 40))) + close
    if kind == "run":
        op = draw(st.sampled_from([b"\x85", b"(", b"N", b"h\x00", b"\x94", b"2", b"0", b"t"]))
        return op * draw(st.integers(1, 100_000))
    return draw(st.binary(min_size=1, max_size=16))


@st.composite
def metadata_damage(draw: st.DrawFn, data: bytes, boundaries: list[int]) -> bytes:
    """``data`` with an opcode piece inserted at an opcode boundary, or one opcode replaced."""
    at = draw(st.sampled_from(boundaries))
    piece = draw(opcode_piece())
    if draw(st.booleans()):
        return data[:at] + piece + data[at:]
    after = next((b for b in boundaries if b > at), len(data))
    return data[:at] + piece + data[after:]


@settings(FUZZ, max_examples=100)  # ~4 s: each example fails or passes fast
@given(data=st.data())
def test_fuzz_dcp_metadata(sources: dict[str, Path], data: st.DataObject) -> None:
    import pickletools

    src = sources["dcp"]
    raw = (src / ".metadata").read_bytes()
    boundaries = [pos for _, _, pos in pickletools.genops(raw)]
    damaged = data.draw(metadata_damage(raw, boundaries) | byte_damage(raw, len(raw)))
    assert len(damaged) < 1 << 20
    _run(src, ".metadata", damaged)


VERL_FSDP1 = Path(__file__).resolve().parents[2] / "fixtures" / "verl" / "fsdp1_ws3_tied"


@FUZZ
@given(data=st.data())
def test_fuzz_verl_fsdp1_rank_files(data: st.DataObject) -> None:
    """verl's per-rank pickles (DTensor / ShardedTensor stand-ins, FSDP1's FlatParameter
    optimizer placed by a search): damaged, every verb reshard included ends in a result or
    one line."""
    rel = data.draw(
        st.sampled_from(sorted(p.name for p in VERL_FSDP1.glob("*_world_size_3_rank_*.pt")))
    )
    damaged = data.draw(byte_damage((VERL_FSDP1 / rel).read_bytes(), 4096))
    tmp, copy = _damaged_copy(VERL_FSDP1, rel, damaged)
    with tmp:
        _check(copy, copy.parent, ("inspect", "verify", "consolidate", "reshard"))
