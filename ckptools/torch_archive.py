"""The ``torch.save`` zip archive, read without torch.

``torch.save`` writes an uncompressed zip: ``<prefix>/data.pkl`` (the pickled object, whose
tensors refer to storages by key), ``<prefix>/data/<key>`` (each storage's raw bytes, 64-byte
aligned), ``<prefix>/byteorder`` and a few version records. DCP stores every tensor chunk and
every object of a ``.distcp`` file as one such archive at a byte range of the file.

This module finds the records in an archive (from its zip central directory, which also gives
each record's CRC-32) and unpickles ``data.pkl`` through :mod:`ckptools.safe_pickle`, so callers
learn where each tensor's raw bytes are without reading or materialising them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from . import safe_pickle
from .errors import CorruptCheckpointError, UnsupportedCheckpointError
from .storage import LocalReader

_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_CDIR = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
_TAIL_BYTES = 64 * 1024  # central directory of a torch.save archive: ~100 bytes a record
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
    """Records of one archive at ``[start, start + length)`` of ``file``."""

    file: str
    start: int
    length: int
    prefix: str
    records: dict[str, Record]

    def record(self, name: str) -> Record:
        rec = self.records.get(name)
        if rec is None:
            raise CorruptCheckpointError(
                f"{self.file}@{self.start}: torch.save archive has no record {name!r}",
                path=self.file,
            )
        return rec


def _parse_zip64_extra(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + size]
        if tag == 0x0001:
            vals = list(struct.unpack_from(f"<{len(body) // 8}Q", body))
            if usize == 0xFFFFFFFF and vals:
                usize = vals.pop(0)
            if csize == 0xFFFFFFFF and vals:
                csize = vals.pop(0)
            if offset == 0xFFFFFFFF and vals:
                offset = vals.pop(0)
        pos += 4 + size
    return usize, csize, offset


def read_archive(reader: LocalReader, file: str, start: int, length: int) -> Archive:
    """Parse the zip central directory of the archive at ``[start, start+length)`` of ``file``."""
    where = f"{file}@{start}"
    if length < 22:
        raise CorruptCheckpointError(f"{where}: record of {length} bytes is no torch.save archive")
    tail_len = min(length, _TAIL_BYTES)
    tail = reader.read(file, start + length - tail_len, tail_len)
    eocd = tail.rfind(_EOCD)
    if eocd < 0:
        raise CorruptCheckpointError(
            f"{where}: no zip end record: the item is not a torch.save archive or is cut short",
            path=file,
        )
    (_, _, _, _, count, cdir_size, cdir_off, _) = struct.unpack_from("<4sHHHHIIH", tail, eocd)
    if count == 0xFFFF or cdir_off == 0xFFFFFFFF or cdir_size == 0xFFFFFFFF:
        loc = tail.rfind(_EOCD64_LOCATOR, 0, eocd)
        if loc < 0:
            raise CorruptCheckpointError(f"{where}: zip64 archive without its locator")
        (eocd64_off,) = struct.unpack_from("<Q", tail, loc + 8)
        rec = reader.read(file, start + eocd64_off, 56)
        count, cdir_size, cdir_off = struct.unpack_from("<QQQ", rec, 32)
    if cdir_off + cdir_size > length:
        raise CorruptCheckpointError(f"{where}: zip directory points past the item's end")
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
            raise CorruptCheckpointError(f"{where}: damaged zip directory")
        h = _CDIR_HEADER.unpack_from(cdir, pos)
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
    return Archive(file, start, length, prefix, records)


def record_data_offset(reader: LocalReader, archive: Archive, rec: Record) -> int:
    """Absolute file offset of a record's bytes (reads its 30-byte local header)."""
    if rec.method != 0:
        raise UnsupportedCheckpointError(
            f"{archive.file}@{archive.start}: record {rec.name} is compressed; "
            "ckptools reads only torch.save's uncompressed archives",
            path=archive.file,
        )
    head = reader.read(archive.file, archive.start + rec.header_offset, 30)
    sig, *_, nlen, xlen = _LOCAL_HEADER.unpack(head)
    if sig != _LOCAL:
        raise CorruptCheckpointError(
            f"{archive.file}@{archive.start}: damaged zip record {rec.name}", path=archive.file
        )
    data: int = archive.start + rec.header_offset + 30 + int(nlen) + int(xlen)
    if data - archive.start + rec.size > archive.length:
        raise CorruptCheckpointError(
            f"{archive.file}@{archive.start}: record {rec.name} extends past the item",
            path=archive.file,
        )
    return data


def read_record(reader: LocalReader, archive: Archive, name: str) -> bytes:
    rec = archive.record(name)
    return reader.read(archive.file, record_data_offset(reader, archive, rec), rec.size)


def load_pickle(reader: LocalReader, archive: Archive) -> Any:
    """Unpickle the archive's ``data.pkl`` through the allowlist (tensors as TensorRef)."""
    byteorder = archive.records.get("byteorder")
    if byteorder is not None and read_record(reader, archive, "byteorder") != b"little":
        raise UnsupportedCheckpointError(
            f"{archive.file}: big-endian torch.save archives are not supported", path=archive.file
        )
    return safe_pickle.restricted_loads(
        read_record(reader, archive, "data.pkl"),
        safe_pickle.ARCHIVE_GLOBALS,
        source=f"{archive.file}@{archive.start}" if archive.start else archive.file,
        persistent_load=safe_pickle.storage_persistent_load,
    )


def is_zip(head: bytes) -> bool:
    return head[:4] == _LOCAL
