r"""Pieces of a reshard that are whole rows of source records, and how their CRCs are checked.

Every FSDP/FSDP2 dim-0 reshard makes pieces that are whole dim-0 rows of plain source records
stacked in order. Such a piece is a list of :class:`Segment`\ s, byte ranges of source records
that land unchanged; their bytes move in the kernel (``copy_file_range``), each window
checksummed in place over the source's page cache just before
(:func:`ckptools.engine.checked_copy.copy_range`). The piece's own CRC combines its segments',
and each source record is checked against its stored CRC from those same computations:

* a record copied whole (a merge, 4 -> 2) is checked by the segment that copies it;
* a record split over several pieces (4 -> 8, non-divisors) is checked once all its ranges are
  copied, their CRCs combined (:class:`~ckptools.engine.checked_copy.RecordChecks`);
* a record only part of which this process copies (torchrun shares the output files among
  processes) is checked whole, in place, by the segment holding its first local range.

:func:`resolve_segments` finds the segments: it resolves every source chunk (reads DCP archive
directories), so it is the writer's I/O step, run before any byte is copied, not part of the pure
plan (:mod:`ckptools.plan.dcp`). :func:`copy_segments` then copies one piece's segments.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ckptools.core import dtypes
from ckptools.core.crc32 import crc32_combine
from ckptools.core.manifest import Chunk
from ckptools.engine import checked_copy
from ckptools.engine.checked_copy import RecordChecks
from ckptools.engine.reader import SourceCache
from ckptools.engine.runtime import BLOCK_BYTES, Scratch
from ckptools.io.progress import ByteProgress
from ckptools.io.storage import Reader
from ckptools.plan.dcp import ObjectItem, TensorItem

SegmentCheck = Literal["whole", "part", "record", "none"]


@dataclass(frozen=True, slots=True)
class Segment:
    """A byte range of one source record that lands, unchanged, in an output piece.

    ``check`` says how the record's stored CRC is checked: ``whole`` (the range is the entire
    record: against the range's CRC), ``part`` (one of several ranges copied here:
    :class:`~ckptools.engine.checked_copy.RecordChecks`), ``record`` (the first local range of a
    record not all copied here: the whole record, in place), ``none`` (no stored CRC, or another
    segment checks it).
    """

    raw: Chunk
    start: int
    length: int
    check: SegmentCheck


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


def resolve_segments(
    tasks: Sequence[TensorItem | ObjectItem], cache: SourceCache
) -> tuple[dict[int, list[Segment]], RecordChecks]:
    """Per task index, the segments of pieces made of whole rows; and the split records to check."""
    ranges: dict[int, list[tuple[Chunk, int, int]]] = {}
    parts: dict[tuple[str, int], list[tuple[int, int]]] = {}  # record -> its ranges copied here
    lengths: dict[tuple[str, int], int] = {}
    for index, item in enumerate(tasks):
        if isinstance(item, ObjectItem):
            continue
        found = _row_ranges(item, cache)
        if found is None:
            continue
        ranges[index] = found
        for raw, start, length in found:
            if length != raw.length and raw.crc32 is not None:
                parts.setdefault((raw.file, raw.offset), []).append((start, length))
                lengths[(raw.file, raw.offset)] = raw.length
    split: dict[tuple[str, int], int] = {}  # record -> number of ranges, when they tile it
    first: dict[tuple[str, int], int] = {}  # record -> its first local range, when they do not
    for key, found_parts in parts.items():
        found_parts.sort()
        ends = list(itertools.accumulate((n for _, n in found_parts), initial=0))
        if [start for start, _ in found_parts] == ends[:-1] and ends[-1] == lengths[key]:
            split[key] = len(found_parts)
        else:
            first[key] = found_parts[0][0]

    def check(raw: Chunk, start: int, length: int) -> SegmentCheck:
        key = (raw.file, raw.offset)
        if raw.crc32 is None:
            return "none"
        if length == raw.length:
            return "whole"
        if key in split:
            return "part"
        return "record" if first.get(key) == start else "none"

    segments = {
        index: [Segment(raw, at, n, check(raw, at, n)) for raw, at, n in found]
        for index, found in ranges.items()
    }
    return segments, RecordChecks(split)


def copy_segments(
    fd: int,
    pos: int,
    segments: list[Segment],
    fqn: str,
    reader: Reader,
    progress: ByteProgress,
    scratch: Scratch,
    checks: RecordChecks,
) -> int:
    """Copy the segments to ``fd`` at ``pos`` on, checking the source records' stored CRCs
    (see :class:`Segment`); return the CRC-32 of the bytes written.

    Raises:
        CorruptCheckpointError: a source record's bytes do not match its stored CRC-32.
    """
    crc: int | None = None

    def buffer() -> memoryview:  # only where the kernel cannot copy or the page cache is not ours
        return scratch.view(BLOCK_BYTES)

    for seg in segments:
        raw = seg.raw
        checked_copy.check_record_of(reader, raw, fqn)
        part, _ = checked_copy.copy_range(
            reader, raw, seg.start, seg.length, fd, pos, progress.update, buffer
        )
        if seg.check == "whole":
            checked_copy.check(reader, raw, fqn, part)
        elif seg.check == "part":
            checks.add(reader, raw, fqn, seg.start, seg.length, part)
        elif seg.check == "record":
            checked_copy.check(reader, raw, fqn, checked_copy.record_crc(reader, raw, buffer))
        crc = part if crc is None else crc32_combine(crc, part, seg.length)
        pos += seg.length
    return crc or 0
