"""Writing DCP's ``.metadata`` pickle without importing torch.

``dcp.load`` reads ``.metadata`` with plain ``pickle.load`` into torch's own classes
(``Metadata``, ``TensorStorageMetadata``, ``ChunkStorageMetadata``, ``TensorProperties``,
``MetadataIndex``, ``_StorageInfo``, ``StorageMeta``). This module emits the pickle opcodes that
rebuild exactly those objects, the way ``pickle.dumps`` of them would (protocol 2: ``NEWOBJ`` +
``BUILD`` of each dataclass's state, ``torch.Size`` by ``REDUCE``), so converters need not pay
torch's import (~2 s here, half of a 2 GB reshard) just to write a few megabytes of metadata.
The test suite checks the result against the pickle torch itself produces.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
# TensorProperties pickles memory_format as this enum; 0 is torch.contiguous_format.
_CONTIGUOUS_FORMAT = 0


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class TensorMeta:
    dtype: str  # torch name
    shape: tuple[int, ...]
    chunks: Sequence[ChunkMeta]  # in metadata order; MetadataIndex.index is the position


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    file: str
    offset: int
    length: int


class _Pickler:
    """Emits protocol-2 opcodes; globals are memoised so each class name is written once."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self._memo: dict[tuple[str, str], int] = {}

    def _put(self) -> int:
        n = len(self._memo)
        self.out += b"q" + bytes([n]) if n < 256 else b"r" + struct.pack("<I", n)
        return n

    def global_(self, module: str, name: str) -> None:
        key = (module, name)
        n = self._memo.get(key)
        if n is None:
            self.out += f"c{module}\n{name}\n".encode()
            self._memo[key] = self._put()
        else:
            self.out += b"h" + bytes([n]) if n < 256 else b"j" + struct.pack("<I", n)

    def value(self, v: Any) -> None:
        if v is None:
            self.out += b"N"
        elif v is True:
            self.out += b"\x88"
        elif v is False:
            self.out += b"\x89"
        elif isinstance(v, int):
            if 0 <= v < 256:
                self.out += b"K" + bytes([v])
            elif 0 <= v < 65536:
                self.out += b"M" + struct.pack("<H", v)
            elif -(2**31) <= v < 2**31:
                self.out += b"J" + struct.pack("<i", v)
            else:
                raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
                self.out += b"\x8a" + bytes([len(raw)]) + raw
        elif isinstance(v, str):
            raw = v.encode()
            self.out += b"X" + struct.pack("<I", len(raw)) + raw
        elif isinstance(v, tuple):
            self.out += b"("
            for x in v:
                self.value(x)
            self.out += b"t"
        else:
            raise TypeError(f"cannot emit {type(v).__name__}")

    def size(self, dims: tuple[int, ...]) -> None:
        self.global_("torch", "Size")
        self.value(tuple(dims))
        self.out += b"\x85R"  # TUPLE1, REDUCE: torch.Size((d0, d1, ...))

    def new(self, module: str, name: str) -> None:
        """Start ``cls.__new__(cls)``; follow with the state and :meth:`build`."""
        self.global_(module, name)
        self.out += b")\x81"  # EMPTY_TUPLE, NEWOBJ

    def build(self) -> None:
        self.out += b"b"

    def dict_begin(self) -> None:
        self.out += b"}("  # EMPTY_DICT, MARK

    def dict_end(self) -> None:
        self.out += b"u"  # SETITEMS

    def list_begin(self) -> None:
        self.out += b"]("  # EMPTY_LIST, MARK

    def list_end(self) -> None:
        self.out += b"e"  # APPENDS


def _properties(p: _Pickler, dtype: str) -> None:
    # TensorProperties.__getstate__: (dtype, layout, requires_grad, memory_format, pin_memory)
    p.new(_MD, "TensorProperties")
    p.out += b"("
    p.global_("torch", dtype)
    p.global_("torch.serialization", "_get_layout")
    p.value("torch.strided")
    p.out += b"\x85R"
    p.value(False)
    p.global_(_MD, "_MEM_FORMAT_ENCODING")
    p.value(_CONTIGUOUS_FORMAT)
    p.out += b"\x85R"
    p.value(False)
    p.out += b"t"
    p.build()


def _index(p: _Pickler, fqn: str, offsets: tuple[int, ...] | None, index: int | None) -> None:
    p.new(_MD, "MetadataIndex")
    p.dict_begin()
    p.value("fqn")
    p.value(fqn)
    p.value("offset")
    if offsets is None:
        p.value(None)
    else:
        p.size(offsets)
    p.value("index")
    p.value(index)
    p.dict_end()
    p.build()


def _storage_info(p: _Pickler, file: str, offset: int, length: int) -> None:
    # _StorageInfo.__getstate__ leaves out None fields (transform_descriptors).
    p.new(_FS, "_StorageInfo")
    p.dict_begin()
    for key, v in (("relative_path", file), ("offset", offset), ("length", length)):
        p.value(key)
        p.value(v)
    p.dict_end()
    p.build()


def metadata_pickle(
    tensors: Mapping[str, TensorMeta],
    objects: Mapping[str, ObjectMeta],
    planner_data: Mapping[str, tuple[str, ...]],
    save_id: str,
) -> bytes:
    """The ``.metadata`` bytes for these entries (tensors first, as ``dcp.save`` orders them).

    Example:
        >>> data = metadata_pickle({}, {}, {}, "id")
        >>> data[:2]
        b'\\x80\\x02'
    """
    p = _Pickler()
    p.new(_MD, "Metadata")
    p.dict_begin()
    p.value("state_dict_metadata")
    p.dict_begin()
    for fqn in objects:
        p.value(fqn)
        p.new(_MD, "BytesStorageMetadata")
        p.dict_begin()
        p.dict_end()
        p.build()
    for fqn, t in tensors.items():
        p.value(fqn)
        p.new(_MD, "TensorStorageMetadata")
        p.dict_begin()
        p.value("properties")
        _properties(p, t.dtype)
        p.value("size")
        p.size(t.shape)
        p.value("chunks")
        p.list_begin()
        for c in t.chunks:
            p.new(_MD, "ChunkStorageMetadata")
            p.dict_begin()
            p.value("offsets")
            p.size(c.offsets)
            p.value("sizes")
            p.size(c.sizes)
            p.dict_end()
            p.build()
        p.list_end()
        p.dict_end()
        p.build()
    p.dict_end()
    p.value("planner_data")
    p.dict_begin()
    for fqn, path in planner_data.items():
        p.value(fqn)
        p.value(tuple(path))
    p.dict_end()
    p.value("storage_data")
    p.dict_begin()
    for fqn, o in objects.items():
        _index(p, fqn, None, None)
        _storage_info(p, o.file, o.offset, o.length)
    for fqn, t in tensors.items():
        for i, c in enumerate(t.chunks):
            _index(p, fqn, c.offsets, i)
            _storage_info(p, c.file, c.offset, c.length)
    p.dict_end()
    p.value("storage_meta")
    p.new(_MD, "StorageMeta")
    p.dict_begin()
    for key, v in (("checkpoint_id", None), ("save_id", save_id), ("load_id", None)):
        p.value(key)
        p.value(v)
    p.value("modules")
    p.list_begin()
    p.list_end()
    p.dict_end()
    p.build()
    p.value("version")
    p.value("1.0.0")
    p.dict_end()
    p.build()
    p.out += b"."
    return bytes(p.out)
