"""torch.save archives: read without torch, and written without torch so that torch loads them."""

from __future__ import annotations

import io
import zlib

import pytest
import torch

from ckptools.formats import safe_pickle
from ckptools.formats.torch_archive import (
    load_pickle,
    read_archive,
    record_data_offset,
    tensor_archive_layout,
)
from ckptools.io.storage import LocalReader

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
]
SHAPES = [(2, 3), (), (0, 4), (257,), (3, 1, 5)]


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    bits = torch.randint(0, 256, (*shape, torch.empty(0, dtype=dtype).element_size()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape).bool()
    return bits.to(torch.uint8).view(dtype).reshape(shape)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_written_archive_loads_in_torch_bit_exactly(
    dtype: torch.dtype, shape: tuple[int, ...], tmp_path: object
) -> None:
    t = _sample(dtype, shape)
    layout = tensor_archive_layout(str(dtype).removeprefix("torch."), shape)
    data = _raw(t)
    blob = layout.head + data + layout.tail(zlib.crc32(data))
    assert len(blob) == layout.length
    assert layout.data_offset % 64 == 0  # torch's alignment, needed by mmap loads
    back = torch.load(io.BytesIO(blob), weights_only=True)
    assert back.dtype == t.dtype and back.shape == t.shape
    assert _raw(back) == data

    # ...and ckptools' own reader finds the same bytes, CRC and tensor description.
    from pathlib import Path

    path = Path(str(tmp_path)) / "item.pt"
    path.write_bytes(b"\xaa" * 7 + blob)  # at an offset, as inside a .distcp file
    with LocalReader(str(path.parent)) as reader:
        archive = read_archive(reader, path.name, 7, len(blob))
        ref = load_pickle(reader, archive)
        assert isinstance(ref, safe_pickle.TensorRef)
        assert ref.shape == shape and ref.dtype == str(dtype).removeprefix("torch.")
        rec = archive.record("data/0")
        assert rec.crc32 == zlib.crc32(data)
        start = record_data_offset(reader, archive, rec)
        assert path.read_bytes()[start : start + len(data)] == data


def test_torch_save_archive_is_read_without_torch(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "t.pt"
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    torch.save(t, path)
    with LocalReader(str(path.parent)) as reader:
        archive = read_archive(reader, "t.pt", 0, path.stat().st_size)
        ref = load_pickle(reader, archive)
        assert isinstance(ref, safe_pickle.TensorRef)
        assert (ref.shape, ref.strides, ref.dtype) == ((3, 4), (4, 1), "float32")
        assert archive.record("data/0").crc32 == zlib.crc32(_raw(t))


def test_crc32_combine_matches_zlib() -> None:
    import os
    import random

    from ckptools.core.crc32 import crc32_combine

    rng = random.Random(0)
    for _ in range(200):
        a = os.urandom(rng.randint(0, 3000))
        b = os.urandom(rng.randint(0, 3000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    # lengths far beyond what the test can allocate: the operator for 2**k zero bytes
    big = 2**40 + 12345
    assert crc32_combine(0x1234, 0, big) == crc32_combine(crc32_combine(0x1234, 0, 2**40), 0, 12345)


@pytest.mark.parametrize("shape", [(), (0, 5), (7,), (3, 4), (1000, 1000)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "bool"])
def test_cached_tail_equals_a_fresh_build(dtype: str, shape: tuple[int, ...]) -> None:
    import random

    from ckptools.formats.torch_archive import tensor_archive_layout

    layout = tensor_archive_layout(dtype, shape)
    assert tensor_archive_layout(dtype, shape) is layout  # planned and written alike: cached
    for crc in (0, 0xFFFFFFFF, 0x12345678, random.getrandbits(32)):
        assert layout.tail(crc) == layout._build_tail(crc)


def test_a_tensor_pickle_seen_before_is_not_decoded_again(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of one shape pickle the same bytes: the second is answered from the first's
    TensorRef; other values and refusals are decoded every time."""
    from pathlib import Path

    from ckptools.formats import torch_archive

    monkeypatch.setattr(torch_archive, "_TENSOR_REFS", {})
    decoded: list[bytes] = []
    real = safe_pickle.restricted_loads

    def counting(data: bytes, *args: object, **kwargs: object) -> object:
        decoded.append(data)
        return real(data, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(safe_pickle, "restricted_loads", counting)
    root = Path(str(tmp_path))
    torch.save(torch.ones(3, 4), root / "a.pt")
    torch.save(torch.zeros(3, 4), root / "b.pt")  # same shape, other bytes: the same pickle
    torch.save(torch.ones(4, 3), root / "c.pt")  # another shape
    torch.save({"step": 3}, root / "d.pt")  # not a tensor
    with LocalReader(str(root)) as reader:

        def ref(name: str) -> object:
            archive = read_archive(reader, name, 0, (root / name).stat().st_size)
            return torch_archive.load_tensor_pickle(reader, archive)

        a, b, c = ref("a.pt"), ref("b.pt"), ref("c.pt")
        assert a is b and isinstance(a, safe_pickle.TensorRef)
        assert isinstance(c, safe_pickle.TensorRef) and c.shape == (4, 3)
        assert len(decoded) == 2
        assert ref("d.pt") == {"step": 3} and ref("d.pt") == {"step": 3}
        assert len(decoded) == 4  # a dict is decoded (and a fresh one returned) every time
