"""The ``torch.save`` zip archive, read without torch.

``torch.save`` writes an uncompressed zip: ``<prefix>/data.pkl`` (the pickled object, whose
tensors refer to storages by key), ``<prefix>/data/<key>`` (each storage's raw bytes, 64-byte
aligned), ``<prefix>/byteorder`` and a few version records. DCP stores every tensor chunk and
every object of a ``.distcp`` file as one such archive at a byte range of the file.

This module finds the records in an archive (from its zip central directory, which also gives
each record's CRC-32) and unpickles ``data.pkl`` through :mod:`ckptools.formats.safe_pickle`, so
callers learn where each tensor's raw bytes are without reading or materialising them.
"""

from __future__ import annotations

import functools
import math
import pickle
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptools.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptools.formats import safe_pickle
from ckptools.formats.tensor_refs import TensorRef
from ckptools.io import storage
from ckptools.io.storage import Reader

_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_CDIR = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_CDIR_HEADER = struct.Struct("<4sHHHHHHIIIHHHHHII")


@dataclass(frozen=True, slots=True)
class Record:
    name: str  # without the archive prefix, e.g. "data.pkl", "data/0"
    header_offset: int  # of the local header, relative to the archive start
    size: int
    crc32: int
    method: int


@dataclass(frozen=True, slots=True)
class Archive:
    """Records of one archive at ``[start, start + length)`` of ``file`` (relative to the
    reader's root; ``shown``: the path errors name, the root's included)."""

    file: str
    start: int
    length: int
    prefix: str
    records: dict[str, Record]
    shown: str

    def record(self, name: str) -> Record:
        rec = self.records.get(name)
        if rec is None:
            raise CorruptCheckpointError(
                f"{self.shown}@{self.start}: torch.save archive has no record {name!r}",
                path=self.file,
            )
        return rec


def _unpack(fmt: struct.Struct | str, buf: bytes, pos: int, file: str, at: int) -> tuple[Any, ...]:
    """``struct.unpack_from`` on untrusted bytes: a short buffer is a one-line error naming the
    file and the absolute offset (``at`` is where ``buf`` starts in ``file``), not struct.error."""
    try:
        return (
            fmt.unpack_from(buf, pos)
            if isinstance(fmt, struct.Struct)
            else struct.unpack_from(fmt, buf, pos)
        )
    except struct.error as e:
        raise CorruptCheckpointError(
            f"{file}@{at + pos}: zip structure cut short or damaged ({e}): the item is "
            "truncated or not a torch.save archive",
            path=file,
        ) from e


def _parse_zip64_extra(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + size]
        if tag == 0x0001:
            vals = list(struct.unpack_from(f"<{len(body) // 8}Q", body, 0))
            if usize == 0xFFFFFFFF and vals:
                usize = vals.pop(0)
            if csize == 0xFFFFFFFF and vals:
                csize = vals.pop(0)
            if offset == 0xFFFFFFFF and vals:
                offset = vals.pop(0)
        pos += 4 + size
    return usize, csize, offset


def read_archive(reader: Reader, file: str, start: int, length: int) -> Archive:
    """Parse the zip central directory of the archive at ``[start, start+length)`` of ``file``."""
    shown = storage.join(reader.root, file)
    where = f"{shown}@{start}"
    if length < 22:
        raise CorruptCheckpointError(
            f"{where}: record of {length} bytes is no torch.save archive", path=file
        )
    # the reader's window: generous on a disk, small on an object store where bytes are fetched
    tail_len = min(length, reader.archive_tail_bytes)
    tail = reader.read(file, start + length - tail_len, tail_len)
    eocd = tail.rfind(_EOCD)
    if eocd < 0:
        raise CorruptCheckpointError(
            f"{where}: no zip end record: the item is not a torch.save archive or is cut short",
            path=file,
        )
    tail_at = start + length - tail_len
    (_, _, _, _, count, cdir_size, cdir_off, _) = _unpack("<4sHHHHIIH", tail, eocd, shown, tail_at)
    if count == 0xFFFF or cdir_off == 0xFFFFFFFF or cdir_size == 0xFFFFFFFF:
        loc = tail.rfind(_EOCD64_LOCATOR, 0, eocd)
        if loc < 0:
            raise CorruptCheckpointError(f"{where}: zip64 archive without its locator", path=file)
        (eocd64_off,) = _unpack("<Q", tail, loc + 8, shown, tail_at)
        if eocd64_off + 56 > length:
            raise CorruptCheckpointError(
                f"{where}: zip64 end record points past the item's end", path=file
            )
        rec = reader.read(file, start + eocd64_off, 56)
        count, cdir_size, cdir_off = _unpack("<QQQ", rec, 32, shown, start + eocd64_off)
    if cdir_off + cdir_size > length:
        raise CorruptCheckpointError(
            f"{where}: zip directory points past the item's end", path=file
        )
    tail_start = length - tail_len
    if cdir_off >= tail_start:
        cdir = tail[cdir_off - tail_start : cdir_off - tail_start + cdir_size]
    else:
        cdir = reader.read(file, start + cdir_off, cdir_size)
    records: dict[str, Record] = {}
    prefix = ""
    pos = 0
    for _ in range(count):
        if cdir[pos : pos + 4] != _CDIR:
            raise CorruptCheckpointError(
                f"{shown}@{start + cdir_off + pos}: damaged zip directory", path=file
            )
        h = _unpack(_CDIR_HEADER, cdir, pos, shown, start + cdir_off)
        method, crc, csize, usize, nlen, xlen, clen, hoff = (
            h[4],
            h[7],
            h[8],
            h[9],
            h[10],
            h[11],
            h[12],
            h[16],
        )
        name = cdir[pos + 46 : pos + 46 + nlen].decode("utf-8", "replace")
        extra = cdir[pos + 46 + nlen : pos + 46 + nlen + xlen]
        usize, csize, hoff = _parse_zip64_extra(extra, usize, csize, hoff)
        pos += 46 + nlen + xlen + clen
        head, _, rest = name.partition("/")
        if not prefix:
            prefix = head
        records[rest] = Record(rest, hoff, usize, crc, method)
    return Archive(file, start, length, prefix, records, shown)


def record_data_offset(reader: Reader, archive: Archive, rec: Record) -> int:
    """Absolute file offset of a record's bytes (reads its 30-byte local header)."""
    if rec.method != 0:
        raise UnsupportedCheckpointError(
            f"{archive.shown}@{archive.start}: record {rec.name} is compressed; "
            "ckptools reads only torch.save's uncompressed archives",
            path=archive.file,
        )
    if rec.header_offset + 30 > archive.length:
        raise CorruptCheckpointError(
            f"{archive.shown}@{archive.start}: record {rec.name} starts past the item's end",
            path=archive.file,
        )
    at = archive.start + rec.header_offset
    head = reader.read(archive.file, at, 30)
    sig, *_, nlen, xlen = _unpack(_LOCAL_HEADER, head, 0, archive.shown, at)
    if sig != _LOCAL:
        raise CorruptCheckpointError(
            f"{archive.shown}@{at}: damaged zip record {rec.name}", path=archive.file
        )
    data: int = archive.start + rec.header_offset + 30 + int(nlen) + int(xlen)
    if data - archive.start + rec.size > archive.length:
        raise CorruptCheckpointError(
            f"{archive.shown}@{archive.start}: record {rec.name} extends past the item",
            path=archive.file,
        )
    return data


def read_record(reader: Reader, archive: Archive, name: str) -> bytes:
    rec = archive.record(name)
    return reader.read(archive.file, record_data_offset(reader, archive, rec), rec.size)


def load_pickle(reader: Reader, archive: Archive, allowed: Mapping[str, Any] | None = None) -> Any:
    """Unpickle the archive's ``data.pkl`` through the allowlist (tensors as TensorRef).

    ``allowed``: the globals it may name; default ``safe_pickle.ARCHIVE_GLOBALS`` (a DCP object
    item, which torch loads with ``weights_only=False``); a ``torch.save`` file passes
    ``safe_pickle.WEIGHTS_ONLY_GLOBALS``, what ``torch.load(weights_only=True)`` admits.
    """
    return _decode(reader, archive, _pickle_bytes(reader, archive), allowed)


#: Tensor pickles already decoded, by their exact bytes (see :func:`load_tensor_pickle`)
_TENSOR_REFS: dict[bytes, TensorRef] = {}
#: at most this many kept (~400 bytes each): a checkpoint holds few distinct chunk shapes
_TENSOR_REFS_MAX = 4096


def load_tensor_pickle(reader: Reader, archive: Archive) -> Any:
    """:func:`load_pickle` of a DCP tensor item, where a ``data.pkl`` whose exact bytes were
    already decoded to a ``TensorRef`` is not decoded again.

    Every chunk of a sharded tensor pickles the same few bytes (its shape, strides and dtype:
    ranks of one tensor mostly hold chunks of one shape), and the restricted unpickler cost a
    third of the ~100 us it takes to resolve a chunk, for each of a 405B checkpoint's million
    chunks. The decoded value is a function of the bytes alone (the allowlist is fixed here), a
    ``TensorRef`` is immutable, and a remembered one costs no decoding work for the budgets to
    bound; anything else (another object, an error) is never remembered.
    """
    data = _pickle_bytes(reader, archive)
    ref = _TENSOR_REFS.get(data)
    if ref is None:
        ref = _decode(reader, archive, data, None)
        if isinstance(ref, TensorRef) and len(_TENSOR_REFS) < _TENSOR_REFS_MAX:
            _TENSOR_REFS[data] = ref
    return ref


def _pickle_bytes(reader: Reader, archive: Archive) -> bytes:
    byteorder = archive.records.get("byteorder")
    if byteorder is not None and read_record(reader, archive, "byteorder") != b"little":
        raise UnsupportedCheckpointError(
            f"{archive.shown}: big-endian torch.save archives are not supported", path=archive.file
        )
    return read_record(reader, archive, "data.pkl")


def _decode(
    reader: Reader, archive: Archive, data: bytes, allowed: Mapping[str, Any] | None
) -> Any:
    return safe_pickle.restricted_loads(
        data,
        safe_pickle.ARCHIVE_GLOBALS if allowed is None else allowed,
        source=f"{archive.shown}@{archive.start}" if archive.start else archive.shown,
        persistent_load=safe_pickle.storage_persistent_load,
    )


def is_zip(head: bytes) -> bool:
    return head[:4] == _LOCAL


# --- Writing ---------------------------------------------------------------------------------
#
# Converters that write DCP checkpoints (reshard, shard) emit each tensor chunk as a torch.save
# archive without torch: the archive around the tensor's bytes is computed here, so the bytes
# themselves can be copied straight from the source with positional writes. The records and
# their order follow torch.save's (data.pkl, .format_version, .storage_alignment, byteorder,
# data/0, version), the tensor data is 64-byte aligned as torch aligns it (``mmap=True`` loads
# need it), and like torch the data record is followed by a data descriptor holding its CRC-32,
# so the CRC can be computed while the bytes are copied.

_STORAGE_ALIGNMENT = 64
_ZIP64_LIMIT = 0xFFFFFFFF
_FLAG_UTF8 = 0x0800
_FLAG_DESCRIPTOR = 0x0008
_ARCHIVE_PREFIX = "archive"


def _pickle_str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _pickle_int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if 0 <= n < 65536:
        return b"M" + struct.pack("<H", n)
    if -(2**31) <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _pickle_int_tuple(values: tuple[int, ...]) -> bytes:
    return b"(" + b"".join(_pickle_int(v) for v in values) + b"t"


def tensor_pickle(dtype_name: str, shape: tuple[int, ...]) -> bytes:
    """``data.pkl`` of ``torch.save(t)`` for a contiguous CPU tensor ``t`` stored as key "0"."""
    from ckptools.core import dtypes

    dt = dtypes.dtype(dtype_name)
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    strides.reverse()
    numel = step
    # torch pickles legacy typed storages where one exists, else UntypedStorage + dtype (v3).
    if dt.storage is not None and dt.name not in _V3_DTYPES:
        storage_global, count, rebuild = f"torch\n{dt.storage}\n", numel, "_rebuild_tensor_v2"
    else:
        storage_global, count, rebuild = (
            "torch.storage\nUntypedStorage\n",
            numel * dt.itemsize,
            ("_rebuild_tensor_v3"),
        )
    out = bytearray(b"\x80\x02")
    out += f"ctorch._utils\n{rebuild}\n".encode()
    out += b"(("  # MARK (args), MARK (persistent id)
    out += _pickle_str("storage") + f"c{storage_global}".encode()
    out += _pickle_str("0") + _pickle_str("cpu") + _pickle_int(count) + b"tQ"
    out += _pickle_int(0) + _pickle_int_tuple(tuple(shape)) + _pickle_int_tuple(tuple(strides))
    out += b"\x89" + b"ccollections\nOrderedDict\n)R"
    if rebuild == "_rebuild_tensor_v3":
        out += f"ctorch\n{dt.name}\n".encode()
    out += b"tR."
    return bytes(out)


# dtypes torch.save writes with UntypedStorage and _rebuild_tensor_v3 (no legacy storage class).
_V3_DTYPES = frozenset(
    {
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "uint16",
        "uint32",
        "uint64",
    }
)


def _local_header(name: bytes, crc: int, size: int, flags: int, extra: bytes) -> bytes:
    return (
        struct.pack(
            "<4sHHHHHIIIHH",
            _LOCAL,
            45 if size >= _ZIP64_LIMIT else 20,
            flags,
            0,
            0,
            0,
            crc,
            _ZIP64_LIMIT if size >= _ZIP64_LIMIT else size,
            _ZIP64_LIMIT if size >= _ZIP64_LIMIT else size,
            len(name),
            len(extra),
        )
        + name
        + extra
    )


def _padding_extra(offset_after_name: int, other_extra_len: int = 0) -> bytes:
    """torch's "FB" extra field that pads a record's data to the storage alignment."""
    pos = offset_after_name + other_extra_len + 4
    pad = (-pos) % _STORAGE_ALIGNMENT
    return b"FB" + struct.pack("<H", pad) + b"Z" * pad


@dataclass(frozen=True, slots=True)
class TensorArchiveLayout:
    """The bytes of a ``torch.save`` archive around one tensor's data, computed without torch.

    The archive is ``head`` + the tensor's raw bytes (``nbytes``) + ``tail(crc32 of the bytes)``.
    ``data_offset`` is where the raw bytes start, relative to the archive start.
    """

    head: bytes
    nbytes: int
    tail_length: int
    _entries: tuple[tuple[bytes, int, int, int, int], ...]  # name, crc, size, header offset, flags

    @property
    def data_offset(self) -> int:
        return len(self.head)

    @property
    def length(self) -> int:
        return len(self.head) + self.nbytes + self.tail_length

    def tail(self, crc: int) -> bytes:
        """Everything after the tensor bytes: descriptor, last record, central directory.

        Only the CRC differs between calls: the bytes are built once per layout, and the CRC is
        written into its two places (a reshard writes thousands of pieces of a few shapes).
        """
        template, places = _tail_template(self)
        out = bytearray(template)
        packed = struct.pack("<I", crc)
        for at in places:
            out[at : at + 4] = packed
        return bytes(out)

    def _build_tail(self, crc: int) -> bytes:
        zip64_data = self.nbytes >= _ZIP64_LIMIT
        out = bytearray()
        if zip64_data:
            out += struct.pack("<4sIQQ", b"PK\x07\x08", crc, self.nbytes, self.nbytes)
        else:
            out += struct.pack("<4sIII", b"PK\x07\x08", crc, self.nbytes, self.nbytes)
        pos = len(self.head) + self.nbytes + len(out)
        version_name = f"{_ARCHIVE_PREFIX}/version".encode()
        version_data = b"3\n"
        version_crc = zlib.crc32(version_data)
        version_extra = _padding_extra(pos + 30 + len(version_name))
        version_offset = pos
        out += _local_header(version_name, version_crc, 2, _FLAG_UTF8, version_extra)
        out += version_data
        entries = list(self._entries)
        for i, entry in enumerate(entries):
            if entry[0].endswith(b"/data/0"):
                entries[i] = (entry[0], crc, entry[2], entry[3], entry[4])
        entries.append((version_name, version_crc, 2, version_offset, _FLAG_UTF8))
        out += _directory(entries, len(self.head) + self.nbytes + len(out))
        return bytes(out)


def _directory(entries: list[tuple[bytes, int, int, int, int]], cdir_start: int) -> bytes:
    """The central directory of ``entries`` (name, crc, size, header offset, flags) starting at
    ``cdir_start``, and the zip64 and plain end records after it."""
    cdir = bytearray()
    for name, ecrc, size, offset, flags in entries:
        big = size >= _ZIP64_LIMIT or offset >= _ZIP64_LIMIT
        extra = b""
        if big:
            extra = struct.pack("<HHQQQ", 0x0001, 24, size, size, offset)
        cdir += struct.pack(
            "<4sHHHHHHIIIHHHHHII",
            _CDIR,
            45 if big else 20,
            45 if big else 20,
            flags,
            0,
            0,
            0,
            ecrc,
            _ZIP64_LIMIT if big else size,
            _ZIP64_LIMIT if big else size,
            len(name),
            len(extra),
            0,
            0,
            0,
            0,
            _ZIP64_LIMIT if big else offset,
        )
        cdir += name + extra
    out = bytearray(cdir)
    eocd64_offset = cdir_start + len(cdir)
    n = len(entries)
    out += struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, len(cdir), cdir_start)
    out += struct.pack("<4sIQI", _EOCD64_LOCATOR, 0, eocd64_offset, 1)
    out += struct.pack(
        "<4sHHHHIIH",
        _EOCD,
        0,
        0,
        min(n, 0xFFFF),
        min(n, 0xFFFF),
        min(len(cdir), _ZIP64_LIMIT),
        min(cdir_start, _ZIP64_LIMIT),
        0,
    )
    return bytes(out)


_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes)


def _is_plain(value: Any, depth: int = 0) -> bool:
    if type(value) in _PLAIN_LEAVES:
        return True
    if depth > 32:
        return False
    if type(value) in (list, tuple):
        return all(_is_plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(_is_plain(k, depth + 1) and _is_plain(v, depth + 1) for k, v in value.items())
    return False


def object_archive(value: Any) -> bytes:
    """``torch.save(value)`` of a plain value, made without torch: how DCP stores a non-tensor
    entry (an optimizer's ``lr``, ``betas``, a group's ``params`` FQNs...).

    ``value`` is None, a bool, number, string or bytes, or a list, tuple or dict of them (exactly
    these types: what the pickle names is what ``torch.load(weights_only=True)`` accepts).

    Raises:
        TypeError: ``value`` is not plain.

    Example:
        >>> object_archive(0.001)[:4]
        b'PK\x03\x04'
    """
    if not _is_plain(value):
        raise TypeError(f"not a plain value: {type(value).__name__}")
    return pickled_archive(pickle.dumps(value, protocol=2))


def pickled_archive(data_pkl: bytes) -> bytes:
    """The ``torch.save`` archive around the pickle ``data_pkl`` of a value without tensors
    (:func:`object_archive`'s, or a producer's value pickled by its writer, e.g. a run's
    ``common_state`` with its ``argparse.Namespace``)."""
    records = [
        ("data.pkl", data_pkl),
        (".format_version", b"1"),
        (".storage_alignment", str(_STORAGE_ALIGNMENT).encode()),
        ("byteorder", b"little"),
        ("version", b"3\n"),
    ]
    out, entries = _small_records(records)
    out += _directory(entries, len(out))
    return bytes(out)


def _small_records(
    records: list[tuple[str, bytes]],
) -> tuple[bytearray, list[tuple[bytes, int, int, int, int]]]:
    """The archive's leading records (``data.pkl``, versions...), each padded as torch pads
    them, and their directory entries (name, crc, size, header offset, flags)."""
    out = bytearray()
    entries: list[tuple[bytes, int, int, int, int]] = []
    for rel, data in records:
        name = f"{_ARCHIVE_PREFIX}/{rel}".encode()
        crc = zlib.crc32(data)
        offset = len(out)
        extra = _padding_extra(offset + 30 + len(name))
        out += _local_header(name, crc, len(data), _FLAG_UTF8, extra) + data
        entries.append((name, crc, len(data), offset, _FLAG_UTF8))
    return out, entries


@functools.lru_cache(maxsize=4096)
def _tail_template(layout: TensorArchiveLayout) -> tuple[bytes, tuple[int, ...]]:
    """The tail with CRC 0, and where the CRC goes (found by building it with two CRCs)."""
    zero = layout._build_tail(0)
    ones = layout._build_tail(0xFFFFFFFF)
    places = tuple(i for i in range(0, len(zero) - 3) if ones[i : i + 4] == b"\xff" * 4
                   and zero[i : i + 4] == b"\0" * 4)  # fmt: skip
    # the data descriptor and the record's central-directory entry; nothing else differs
    assert len(places) == 2, places
    return zero, places


@functools.lru_cache(maxsize=4096)
def tensor_archive_layout(dtype_name: str, shape: tuple[int, ...]) -> TensorArchiveLayout:
    """Layout of ``torch.save(t)`` for a contiguous tensor of ``dtype_name`` and ``shape``.

    Example:
        >>> layout = tensor_archive_layout("float32", (2, 3))
        >>> layout.data_offset % 64, layout.nbytes
        (0, 24)
    """
    from ckptools.core import dtypes

    nbytes = dtypes.dtype(dtype_name).itemsize * math.prod(shape)
    head, entries = _small_records(
        [
            ("data.pkl", tensor_pickle(dtype_name, shape)),
            (".format_version", b"1"),
            (".storage_alignment", str(_STORAGE_ALIGNMENT).encode()),
            ("byteorder", b"little"),
        ]
    )
    name = f"{_ARCHIVE_PREFIX}/data/0".encode()
    offset = len(head)
    zip64_extra_len = 20 if nbytes >= _ZIP64_LIMIT else 0
    pad = _padding_extra(offset + 30 + len(name), zip64_extra_len)
    zip64_extra = struct.pack("<HHQQ", 0x0001, 16, 0, 0) if zip64_extra_len else b""
    flags = _FLAG_UTF8 | _FLAG_DESCRIPTOR
    head += _local_header(name, 0, 0, flags, zip64_extra + pad)
    entries.append((name, 0, nbytes, offset, flags))
    layout = TensorArchiveLayout(bytes(head), nbytes, 0, tuple(entries))
    tail_length = len(layout.tail(0))
    return TensorArchiveLayout(bytes(head), nbytes, tail_length, tuple(entries))
