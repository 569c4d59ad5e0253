r"""Where a reshard piece's CRC-32 comes from when the piece is whole rows of source records.

Every FSDP/FSDP2 dim-0 reshard makes pieces that are whole dim-0 rows of plain source records
stacked in order. Such a piece is a list of :class:`Segment`\ s, byte ranges of source records
that land unchanged, and all their bytes move in the kernel (``copy_file_range``):

* a whole record keeps its stored CRC;
* a record split over several pieces (4 -> 8, non-divisors) has its leading ranges checksummed
  in place over the source's pages (``LocalReader.crc32``: no copy into a buffer) and its last
  range's CRC *derived*, ``crc(last) = crc(record) ^ crc32_combine(crc(leading), 0, len(last))``
  (CRC-32 is linear), so those bytes are never read. :class:`SplitCrcs` hands the leading CRCs
  from the pieces that compute them to the piece that derives.

:func:`resolve_segments` finds the segments: it resolves every source chunk (reads DCP archive
directories), so it is the writer's I/O step, run before any byte is copied, not part of the pure
plan (:mod:`ckptools.plan.dcp`). :func:`copy_segments` then copies one piece's segments.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ckptools.core import dtypes
from ckptools.core.crc32 import crc32, crc32_combine
from ckptools.core.manifest import Chunk
from ckptools.engine.reader import SourceCache
from ckptools.engine.runtime import BLOCK_BYTES, Scratch, kernel_copy, pwrite_all
from ckptools.errors import CorruptCheckpointError, PieceAbortedError
from ckptools.io.progress import ByteProgress
from ckptools.io.storage import Reader
from ckptools.plan.dcp import ObjectItem, TensorItem

SegmentMode = Literal["whole", "derive", "read"]


@dataclass(frozen=True, slots=True)
class Segment:
    """A byte range of one source record that lands, unchanged, in an output piece.

    ``mode`` says where its CRC comes from: ``whole`` (the entire record: its stored CRC),
    ``derive`` (the record's last range: the stored CRC minus the ranges before it, which other
    pieces compute, so its bytes are never read), ``read`` (computed while copying).
    """

    raw: Chunk
    start: int
    length: int
    mode: SegmentMode


def _row_ranges(item: TensorItem, cache: SourceCache) -> list[tuple[Chunk, int, int]] | None:
    """``(raw record, start byte, length)`` per source when the piece is whole dim-0 rows of
    plain (non-strided) records stacked in order -- every FSDP/FSDP2 dim-0 reshard -- else None.
    """
    if not item.sources or math.prod(item.sizes) == 0:
        return None
    itemsize = dtypes.dtype(item.dtype).itemsize
    if item.sizes == ():
        raw = cache.raw(item.source_fqn, item.sources[0])
        ok = len(item.sources) == 1 and item.sources[0].sizes == () and raw.strides is None
        return [(raw, 0, raw.length)] if ok and raw.length == itemsize else None
    row_bytes = math.prod(item.sizes[1:]) * itemsize
    first, rows = item.offsets[0], item.sizes[0]
    ranges = []
    end = first
    for src in sorted(item.sources, key=lambda c: c.offsets):
        raw = cache.raw(item.source_fqn, src)
        if raw.strides is not None or src.sizes[1:] != item.sizes[1:]:
            return None
        if src.offsets[1:] != item.offsets[1:] or raw.length != src.sizes[0] * row_bytes:
            return None
        lo, hi = max(src.offsets[0], first), min(src.offsets[0] + src.sizes[0], first + rows)
        if lo != end or hi <= lo:
            return None
        ranges.append((raw, (lo - src.offsets[0]) * row_bytes, (hi - lo) * row_bytes))
        end = hi
    return ranges if end == first + rows else None


class SplitCrcs:
    """CRCs of the leading ranges of split records, handed from the pieces that read them to
    the piece that derives the last range's CRC (``crc32(last) = crc32(record) ^
    crc32_combine(crc32(leading), 0, len(last))``, from the linearity of CRC-32).

    A deriving piece always comes after the pieces it waits for in the one work queue, so the
    wait ends; a failure anywhere releases every waiter with an error.
    """

    def __init__(self, leading: dict[tuple[str, int], tuple[int, ...]]) -> None:
        self._leading = leading  # record -> start bytes of the ranges before its last one
        self._done: dict[tuple[str, int, int], tuple[int, int]] = {}
        self._cond = threading.Condition()
        self._failed = False

    def wanted(self, raw: Chunk, start: int) -> bool:
        return (raw.file, raw.offset) in self._leading and start in self._leading[
            (raw.file, raw.offset)
        ]

    def put(self, raw: Chunk, start: int, crc: int, length: int) -> None:
        with self._cond:
            self._done[(raw.file, raw.offset, start)] = (crc, length)
            self._cond.notify_all()

    def fail(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def leading(self, raw: Chunk) -> int:
        """CRC-32 of the record's bytes before its last range (waits for the pieces)."""
        keys = [(raw.file, raw.offset, s) for s in self._leading[(raw.file, raw.offset)]]
        with self._cond:
            self._cond.wait_for(lambda: self._failed or all(k in self._done for k in keys))
            if self._failed:
                raise PieceAbortedError("another piece of the reshard failed (see its error)")
            parts = [self._done[k] for k in keys]
        crc = 0
        for part_crc, length in parts:
            crc = crc32_combine(crc, part_crc, length)
        return crc


def resolve_segments(
    tasks: Sequence[TensorItem | ObjectItem], cache: SourceCache
) -> tuple[dict[int, list[Segment]], SplitCrcs]:
    """Per task index, the segments of pieces made of whole rows; and which CRCs to hand on.

    A record split over several pieces gets its last range's CRC derived only when the pieces
    holding the other ranges run earlier in ``tasks`` (and in this process): then its bytes
    move in the kernel and are never read. Otherwise every range is read for its CRC.
    """
    ranges: dict[int, list[tuple[Chunk, int, int]]] = {}
    parts: dict[tuple[str, int], list[tuple[int, int, int]]] = {}  # record -> (task, start, len)
    for index, item in enumerate(tasks):
        if isinstance(item, ObjectItem):
            continue
        found = _row_ranges(item, cache)
        if found is None:
            continue
        ranges[index] = found
        for raw, start, length in found:
            if length != raw.length:
                parts.setdefault((raw.file, raw.offset), []).append((index, start, length))
    records = {(raw.file, raw.offset): raw for found in ranges.values() for raw, _, _ in found}
    derived: set[tuple[str, int, int]] = set()
    leading: dict[tuple[str, int], tuple[int, ...]] = {}
    for key, split in parts.items():
        split.sort(key=lambda p: p[1])
        raw = records[key]
        tiles = [start for _, start, _ in split] == list(
            itertools.accumulate((length for _, _, length in split[:-1]), initial=0)
        ) and split[-1][1] + split[-1][2] == raw.length
        last = split[-1]
        if raw.crc32 is not None and tiles and all(p[0] < last[0] for p in split[:-1]):
            derived.add((*key, last[1]))
            leading[key] = tuple(start for _, start, _ in split[:-1])
    segments: dict[int, list[Segment]] = {}
    for index, found in ranges.items():
        segments[index] = [
            Segment(
                raw, start, length,
                "whole" if length == raw.length and raw.crc32 is not None
                else "derive" if (raw.file, raw.offset, start) in derived
                else "read",
            )
            for raw, start, length in found
        ]  # fmt: skip
    return segments, SplitCrcs(leading)


def copy_segments(
    fd: int,
    pos: int,
    segments: list[Segment],
    reader: Reader,
    progress: ByteProgress,
    scratch: Scratch,
    crcs: SplitCrcs,
) -> int:
    """Copy the segments to ``fd`` at ``pos`` on; return the CRC-32 of the bytes written.

    Bytes move inside the kernel (``copy_file_range``). ``whole`` and ``derive`` segments take
    their CRC from the record's stored one; a ``read`` segment's CRC is computed over the
    source's pages in place (``LocalReader.crc32``: no copy into a buffer), or, where the
    source has no page cache to view (an object store) or the kernel cannot copy, through the
    block buffer on the way. A source record whose bytes no longer match its stored CRC thus
    gives an output that fails ``ckpt verify`` (possibly on the sibling piece of the same
    record); ``ckpt verify SRC`` localises it.
    """
    crc: int | None = None
    for seg in segments:
        raw = seg.raw
        if seg.mode == "read":
            in_place = reader.crc32(raw.file, raw.offset + seg.start, seg.length)
            if in_place is not None and _kernel_copy_range(
                fd, pos, raw, seg.start, seg.length, reader, progress, fallback=False
            ):
                part = in_place
            else:
                part = _copy_reading(fd, pos, raw, seg, reader, progress, scratch)
            if crcs.wanted(raw, seg.start):
                crcs.put(raw, seg.start, part, seg.length)
        else:
            _kernel_copy_range(fd, pos, raw, seg.start, seg.length, reader, progress)
            assert raw.crc32 is not None
            if seg.mode == "whole":
                part = raw.crc32
            else:
                part = raw.crc32 ^ crc32_combine(crcs.leading(raw), 0, seg.length)
        crc = part if crc is None else crc32_combine(crc, part, seg.length)
        pos += seg.length
    return crc or 0


def _copy_reading(
    fd: int,
    pos: int,
    raw: Chunk,
    seg: Segment,
    reader: Reader,
    progress: ByteProgress,
    scratch: Scratch,
) -> int:
    """Copy a segment through the block buffer, computing its CRC on the way."""
    part = 0
    done = 0
    while done < seg.length:
        n = min(BLOCK_BYTES, seg.length - done)
        view = scratch.view(n)
        reader.readinto(raw.file, raw.offset + seg.start + done, view)
        part = crc32(view, part)
        pwrite_all(fd, view, pos + done)
        done += n
        progress.update(n)
    return part


def _kernel_copy_range(
    fd: int,
    pos: int,
    raw: Chunk,
    start: int,
    length: int,
    reader: Reader,
    progress: ByteProgress,
    *,
    fallback: bool = True,
) -> bool:
    """Copy ``length`` bytes of ``raw`` from ``start`` to ``fd`` at ``pos`` in the kernel.

    Where the kernel cannot (no descriptor, or unsupported), copies through memory if
    ``fallback`` and returns True, else returns False having copied nothing.
    """
    src = raw.offset + start
    try:
        copied = kernel_copy(reader.fileno(raw.file), fd, src, pos, length, progress.update)
    except EOFError as e:
        raise CorruptCheckpointError(
            f"{reader.root}/{raw.file}: file is truncated at byte {e.args[0]}", path=raw.file
        ) from e
    if copied or not fallback:
        return copied
    done = 0
    while done < length:
        n = min(BLOCK_BYTES, length - done)
        pwrite_all(fd, reader.read(raw.file, src + done, n), pos + done)
        done += n
    progress.update(length)
    return True
