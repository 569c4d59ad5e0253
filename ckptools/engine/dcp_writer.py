"""Writing DCP checkpoints laid out for a world size, from any manifest (reshard and shard).

Planning (:func:`plan_dcp`) is pure: each tensor is split on dim 0 the way FSDP2 ``fully_shard``
splits it on N ranks (:func:`ckptools.core.geometry.fsdp2_rows`), rank r's pieces go to
``__r_0.distcp``;
tensors that cannot be split (0-dim, or stored whole by a multi-rank source, i.e. replicated)
and the single empty box that FSDP2 records for ranks without rows are stored once, on the
least-loaded rank, as DCP's own deduplication does. Each piece is a ``torch.save`` archive whose
bytes around the tensor data are computed by
:func:`ckptools.formats.torch_archive.tensor_archive_layout`,
so every item's size, and hence every byte offset, is known before anything is written.

Execution (:func:`write_dcp`) fills each piece block by block from the source chunks that
intersect it (:func:`ckptools.core.geometry.copy_runs`), computing the archive's CRC-32 in order,
with memory bounded by the block size times the number of files written at once. Objects (non-tensor
entries) are copied byte for byte, never unpickled. ``.metadata`` is written last, with torch's
own metadata classes, so torch's ``dcp.load`` reads the result at N ranks with each rank
reading only its own file.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import os
import threading
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ckptools.core import dtypes
from ckptools.core.crc32 import crc32, crc32_combine
from ckptools.core.geometry import copy_runs, fsdp2_rows, intersect
from ckptools.core.manifest import Chunk, Manifest, TensorEntry
from ckptools.engine.executor import FileSyncer, kernel_copy, run_all
from ckptools.engine.reader import resolve_chunk
from ckptools.errors import CkptError, CorruptCheckpointError, UsageError
from ckptools.formats import torch_archive
from ckptools.formats.dcp_metadata import ChunkMeta, ObjectMeta, TensorMeta, metadata_pickle
from ckptools.io.progress import ByteProgress
from ckptools.io.storage import Reader, is_url, open_reader
from ckptools.plan.safetensors import unique_chunks

#: Bytes of one copy block per file being written: big enough that syscalls are a rounding
#: error, small enough that writing a few files at once stays far below the 512 MiB budget.
BLOCK_BYTES = 16 * 2**20
METADATA_FILE = ".metadata"
_EARLY_WRITEBACK = hasattr(os, "posix_fadvise")
#: Output bytes between two writeback starts: large enough that the calls are few, small enough
#: that the disk starts early (a 2 GB reshard makes ~30 of them).
WRITEBACK_STEP_BYTES = 64 * 2**20


@dataclass(frozen=True, slots=True)
class TensorItem:
    """One output chunk: a box of ``fqn`` stored as a torch.save archive at ``offset``."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int
    offset: int
    length: int
    sources: tuple[Chunk, ...]  # source chunks that intersect the box
    source_fqn: str  # FQN of the source tensor (names may differ: shard adds a prefix)


@dataclass(frozen=True, slots=True)
class ObjectItem:
    """A non-tensor entry copied byte for byte from ``source`` into rank ``rank``'s file."""

    fqn: str
    rank: int
    offset: int
    length: int
    source_file: str
    source_offset: int


@dataclass(frozen=True)
class DcpPlan:
    world_size: int
    tensors: tuple[TensorItem, ...]
    objects: tuple[ObjectItem, ...]
    file_sizes: tuple[int, ...]  # per rank
    shapes: Mapping[str, tuple[str, tuple[int, ...]]]  # fqn -> (dtype, global shape)
    paths: Mapping[str, tuple[str, ...]]  # fqn -> key path (DCP planner_data)

    @property
    def total_bytes(self) -> int:
        return sum(self.file_sizes)

    def to_dict(self) -> dict[str, Any]:
        per_rank: list[dict[str, Any]] = [
            {"file": file_name(r), "bytes": self.file_sizes[r], "tensors": 0, "objects": 0}
            for r in range(self.world_size)
        ]
        for t in self.tensors:
            per_rank[t.rank]["tensors"] += 1
        for o in self.objects:
            per_rank[o.rank]["objects"] += 1
        return {
            "world_size": self.world_size,
            "files": per_rank,
            "tensors": len(self.shapes),
            "chunks": len(self.tensors),
            "objects": len(self.objects),
            "bytes": self.total_bytes,
        }


def file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def _replicated_in_source(tensor: TensorEntry, source_world_size: int | None) -> bool:
    """A tensor a multi-rank job stored whole (a buffer, or a param FSDP did not shard)."""
    if not tensor.shape or source_world_size is None or source_world_size <= 1:
        return not tensor.shape
    boxes = {(c.offsets, c.sizes) for c in tensor.chunks if c.numel}
    return len(boxes) == 1 and next(iter(boxes))[1] == tensor.shape and tensor.shape[0] > 1


def plan_dcp(
    manifest: Manifest,
    world_size: int,
    names: Mapping[str, str] | None = None,
    paths: Mapping[str, tuple[str, ...]] | None = None,
    *,
    objects: Sequence[str] | None = None,
) -> DcpPlan:
    """Plan a DCP checkpoint for ``world_size`` ranks holding ``manifest``'s entries.

    Args:
        manifest: the source.
        world_size: ranks of the target layout.
        names: output FQN → source FQN for the tensors to write (default: all, same names).
        paths: output FQN → key path for ``planner_data`` (default: the source's paths).
        objects: source object FQNs to carry over (default: all).

    Example:
        >>> plan = plan_dcp(manifest, 8)                        # doctest: +SKIP
        >>> plan.to_dict()["files"][0]["file"]                   # doctest: +SKIP
        '__0_0.distcp'
    """
    if world_size < 1:
        raise UsageError(f"world size must be at least 1, got {world_size}")
    names = dict(names) if names is not None else {f: f for f in manifest.tensors}
    packer = _Packer(world_size)
    object_items: list[ObjectItem] = []
    out_paths: dict[str, tuple[str, ...]] = {}
    for fqn in objects if objects is not None else list(manifest.objects):
        entry = manifest.objects[fqn]
        if entry.file is None:
            raise UsageError(
                f"{fqn!r}: non-tensor values of {manifest.format} checkpoints cannot be carried "
                "into DCP byte for byte"
            )
        rank = packer.least_loaded()
        object_items.append(
            ObjectItem(fqn, rank, packer.take(rank, entry.length), entry.length, entry.file,
                       entry.offset)
        )  # fmt: skip
        out_paths[fqn] = manifest.paths.get(fqn, (fqn,))

    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    for out_fqn, src_fqn in names.items():
        tensor = manifest.tensors[src_fqn]
        shapes[out_fqn] = (tensor.dtype, tensor.shape)
        out_paths[out_fqn] = (paths or {}).get(out_fqn) or manifest.paths.get(src_fqn, (out_fqn,))
        _plan_tensor(packer, out_fqn, tensor, manifest.world_size)
    return DcpPlan(
        world_size, tuple(packer.items), tuple(object_items), tuple(packer.sizes), shapes, out_paths
    )


class _Packer:
    """Appends items to the rank files, tracking each file's size (the next item's offset)."""

    def __init__(self, world_size: int) -> None:
        self.sizes = [0] * world_size
        self.items: list[TensorItem] = []

    def least_loaded(self) -> int:
        return min(range(len(self.sizes)), key=lambda r: self.sizes[r])

    def take(self, rank: int, length: int) -> int:
        offset = self.sizes[rank]
        self.sizes[rank] += length
        return offset


class _Sources:
    """A tensor's stored chunks, sorted on dim 0 so a box finds the ones it meets by bisection."""

    def __init__(self, tensor: TensorEntry) -> None:
        self.chunks = sorted(unique_chunks(tensor), key=lambda c: c.offsets)
        self.starts = [c.offsets[0] if c.offsets else 0 for c in self.chunks]
        self.max_rows = max((c.sizes[0] for c in self.chunks if c.sizes), default=0)

    def meeting(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[Chunk, ...]:
        if math.prod(sizes) == 0:
            return ()
        if not offsets:
            return tuple(self.chunks)
        # Only chunks starting before the box ends, and no earlier than (box start - the tallest
        # chunk), can meet it.
        lo = bisect.bisect_left(self.starts, offsets[0] - self.max_rows)
        hi = bisect.bisect_left(self.starts, offsets[0] + sizes[0])
        return tuple(c for c in self.chunks[lo:hi] if intersect(c.offsets, c.sizes, offsets, sizes))


def _plan_tensor(
    packer: _Packer, out_fqn: str, tensor: TensorEntry, source_world_size: int | None
) -> None:
    sources = _Sources(tensor)

    def place(offsets: tuple[int, ...], sizes: tuple[int, ...], rank: int) -> None:
        length = torch_archive.tensor_archive_layout(tensor.dtype, sizes).length
        packer.items.append(
            TensorItem(
                out_fqn, tensor.dtype, tensor.shape, offsets, sizes, rank,
                packer.take(rank, length), length, sources.meeting(offsets, sizes), tensor.fqn,
            )
        )  # fmt: skip

    shape = tensor.shape
    if _replicated_in_source(tensor, source_world_size):
        place((0,) * len(shape), shape, packer.least_loaded())
        return
    zeros = (0,) * (len(shape) - 1)
    empty_placed = False
    for rank, (start, n) in enumerate(fsdp2_rows(shape[0], len(packer.sizes))):
        if n:
            place((start, *zeros), (n, *shape[1:]), rank)
        elif not empty_placed:
            # Ranks without rows all record the same empty box at offset dim0; DCP's dedup
            # keeps one copy, on the least-loaded rank.
            place((shape[0], *zeros), (0, *shape[1:]), packer.least_loaded())
            empty_placed = True


class _SourceCache:
    """Raw locations of source chunks, resolved once (a DCP item's archive directory is read
    once even when the chunk feeds several output pieces)."""

    def __init__(self, reader: Reader, manifest: Manifest) -> None:
        self._reader = reader
        self._manifest = manifest
        self._raw: dict[tuple[str, int], Chunk] = {}
        self._lock = threading.Lock()

    def raw(self, fqn: str, chunk: Chunk) -> Chunk:
        key = (chunk.file, chunk.offset)
        found = self._raw.get(key)
        if found is None:
            found = resolve_chunk(self._reader, self._manifest.tensors[fqn], chunk)
            with self._lock:
                self._raw[key] = found
        return found


def _strided_to_contiguous(reader: Reader, raw: Chunk, dtype: str) -> bytes:
    import torch

    data = bytearray(reader.read(raw.file, raw.offset, raw.length))
    flat = torch.frombuffer(data, dtype=torch.uint8).view(getattr(torch, dtype))
    assert raw.strides is not None
    out = flat.as_strided(raw.sizes, raw.strides).contiguous()
    return bytes(out.reshape(-1).view(torch.uint8).numpy().tobytes())


def _fill_block(
    buf: memoryview,
    item: TensorItem,
    block_offsets: tuple[int, ...],
    block_sizes: tuple[int, ...],
    cache: _SourceCache,
    reader: Reader,
    itemsize: int,
) -> None:
    for src in item.sources:
        raw = cache.raw(item.source_fqn, src)
        runs = list(copy_runs(src.offsets, src.sizes, block_offsets, block_sizes))
        if not runs:
            continue
        if raw.strides is not None:
            data = _strided_to_contiguous(reader, raw, item.dtype)
            view = memoryview(data)
            for s, d, n in runs:
                buf[d * itemsize : (d + n) * itemsize] = view[s * itemsize : (s + n) * itemsize]
            continue
        if len(runs) == 1:
            # The common case (dim-0 resharding): straight from the page cache into the block.
            s, d, n = runs[0]
            reader.readinto(
                raw.file, raw.offset + s * itemsize, buf[d * itemsize : (d + n) * itemsize]
            )
            continue
        first = runs[0][0]
        last = runs[-1][0] + runs[-1][2]
        needed = sum(n for _, _, n in runs)
        if (last - first) <= 2 * needed:
            # One read of the span, then slices: dim-1 splits give one short run per row.
            span = reader.read(raw.file, raw.offset + first * itemsize, (last - first) * itemsize)
            view = memoryview(span)
            for s, d, n in runs:
                rel = (s - first) * itemsize
                buf[d * itemsize : (d + n) * itemsize] = view[rel : rel + n * itemsize]
        else:
            for s, d, n in runs:
                reader.readinto(
                    raw.file, raw.offset + s * itemsize, buf[d * itemsize : (d + n) * itemsize]
                )


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


class _Writeback:
    """Starts writeback of each output file in large steps as items complete, so the fsync
    before the commit finds little left to do and the disk works while later items are read.

    One ``POSIX_FADV_DONTNEED`` per item would be thousands of small calls for a checkpoint of
    many small chunks (measured slower than none); one per :data:`WRITEBACK_STEP_BYTES` is not.
    """

    def __init__(self) -> None:
        self._marks: dict[int, int] = {}
        self._lock = threading.Lock()

    def written(self, fd: int, end: int) -> None:
        if not _EARLY_WRITEBACK:
            return
        with self._lock:
            start = self._marks.get(fd, 0)
            if end - start < WRITEBACK_STEP_BYTES:
                return
            self._marks[fd] = end
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)


class _Scratch:
    """One reusable block buffer per writing thread (a fresh 16 MiB bytearray per block would
    cost a zero-fill and an allocation each time)."""

    def __init__(self) -> None:
        self._buf = bytearray(0)

    def view(self, nbytes: int) -> memoryview:
        if len(self._buf) < nbytes:
            self._buf = bytearray(max(nbytes, BLOCK_BYTES))
        return memoryview(self._buf)[:nbytes]


def _write_tensor(
    fd: int,
    item: TensorItem,
    cache: _SourceCache,
    reader: Reader,
    progress: ByteProgress,
    scratch: _Scratch,
    writeback: _Writeback,
    segments: list[_Segment] | None = None,
    crcs: _SplitCrcs | None = None,
) -> None:
    layout = torch_archive.tensor_archive_layout(item.dtype, item.sizes)
    _pwrite_all(fd, layout.head, item.offset)
    itemsize = dtypes.dtype(item.dtype).itemsize
    pos = item.offset + layout.data_offset
    if segments is not None:
        assert crcs is not None
        crc = _copy_segments(fd, pos, segments, reader, progress, scratch, crcs)
        _pwrite_all(fd, layout.tail(crc), pos + layout.nbytes)
        writeback.written(fd, item.offset + item.length)
        return
    crc = 0
    if item.sizes == ():
        blocks: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), ())]
    else:
        row_bytes = math.prod(item.sizes[1:]) * itemsize
        rows_per_block = max(1, BLOCK_BYTES // max(1, row_bytes))
        blocks = [
            ((item.offsets[0] + i, *item.offsets[1:]),
             (min(rows_per_block, item.sizes[0] - i), *item.sizes[1:]))
            for i in range(0, item.sizes[0], rows_per_block)
        ]  # fmt: skip
    for offs, box in blocks:
        nbytes = math.prod(box) * itemsize
        if nbytes == 0:
            continue
        view = scratch.view(nbytes)
        _fill_block(view, item, offs, box, cache, reader, itemsize)
        crc = crc32(view, crc)
        _pwrite_all(fd, view, pos)
        pos += nbytes
        progress.update(nbytes)
    _pwrite_all(fd, layout.tail(crc), pos)
    writeback.written(fd, item.offset + item.length)


_SegmentMode = Literal["whole", "derive", "read"]


@dataclass(frozen=True, slots=True)
class _Segment:
    """A byte range of one source record that lands, unchanged, in an output piece.

    ``mode`` says where its CRC comes from: ``whole`` (the entire record: its stored CRC),
    ``derive`` (the record's last range: the stored CRC minus the ranges before it, which other
    pieces compute, so its bytes are never read), ``read`` (computed while copying).
    """

    raw: Chunk
    start: int
    length: int
    mode: _SegmentMode


def _row_ranges(item: TensorItem, cache: _SourceCache) -> list[tuple[Chunk, int, int]] | None:
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


class _SplitCrcs:
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
                raise CkptError("another piece of the reshard failed (see its error)")
            parts = [self._done[k] for k in keys]
        crc = 0
        for part_crc, length in parts:
            crc = crc32_combine(crc, part_crc, length)
        return crc


def _plan_segments(
    tasks: Sequence[TensorItem | ObjectItem], cache: _SourceCache
) -> tuple[dict[int, list[_Segment]], _SplitCrcs]:
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
    segments: dict[int, list[_Segment]] = {}
    for index, found in ranges.items():
        segments[index] = [
            _Segment(
                raw, start, length,
                "whole" if length == raw.length and raw.crc32 is not None
                else "derive" if (raw.file, raw.offset, start) in derived
                else "read",
            )
            for raw, start, length in found
        ]  # fmt: skip
    return segments, _SplitCrcs(leading)


def _copy_segments(
    fd: int,
    pos: int,
    segments: list[_Segment],
    reader: Reader,
    progress: ByteProgress,
    scratch: _Scratch,
    crcs: _SplitCrcs,
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
    seg: _Segment,
    reader: Reader,
    progress: ByteProgress,
    scratch: _Scratch,
) -> int:
    """Copy a segment through the block buffer, computing its CRC on the way."""
    part = 0
    done = 0
    while done < seg.length:
        n = min(BLOCK_BYTES, seg.length - done)
        view = scratch.view(n)
        reader.readinto(raw.file, raw.offset + seg.start + done, view)
        part = crc32(view, part)
        _pwrite_all(fd, view, pos + done)
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
        _pwrite_all(fd, reader.read(raw.file, src + done, n), pos + done)
        done += n
    progress.update(length)
    return True


def _copy_object(fd: int, item: ObjectItem, reader: Reader) -> None:
    done = 0
    while done < item.length:
        n = min(BLOCK_BYTES, item.length - done)
        data = reader.read(item.source_file, item.source_offset + done, n)
        _pwrite_all(fd, data, item.offset + done)
        done += n


def write_metadata(out_dir: str, plan: DcpPlan) -> None:
    """Write ``.metadata`` (what ``dcp.load`` unpickles), atomically and durably, last."""
    by_fqn: dict[str, list[TensorItem]] = {}
    for t in plan.tensors:
        by_fqn.setdefault(t.fqn, []).append(t)
    tensors = {
        fqn: TensorMeta(
            dtype,
            shape,
            [
                ChunkMeta(t.offsets, t.sizes, file_name(t.rank), t.offset, t.length)
                for t in sorted(by_fqn[fqn], key=lambda t: t.offsets)
            ],
        )
        for fqn, (dtype, shape) in plan.shapes.items()
    }
    objects = {o.fqn: ObjectMeta(file_name(o.rank), o.offset, o.length) for o in plan.objects}
    data = metadata_pickle(tensors, objects, plan.paths, str(uuid.uuid4()))
    if is_url(out_dir):
        # One PUT: the object appears whole or not at all, so no temporary name is needed.
        from ckptools.io.staging import write_file_synced

        write_file_synced(f"{out_dir.rstrip('/')}/{METADATA_FILE}", data)
        return
    tmp = os.path.join(out_dir, METADATA_FILE + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out_dir, METADATA_FILE))


class _OutputFiles:
    """The ``__r_0.distcp`` files, each open only while it has items left to write.

    Items run in (rank, offset) order, so only about ``workers`` files are open at once: a
    reshard to 1,024 ranks never holds 1,024 descriptors (a common ``ulimit -n``). A file is
    created (empty, even when it gets no item, as DCP writes one per rank), and after its last
    item handed to a :class:`ckptools.engine.executor.FileSyncer` that fsyncs, closes and reports
    it, so the copying threads go on while the disk catches up.
    """

    def __init__(
        self,
        out_dir: str,
        tasks: Sequence[TensorItem | ObjectItem],
        on_done: Callable[[int], None] | None = None,
    ) -> None:
        self._dir = out_dir
        self._left: dict[int, int] = {}
        for item in tasks:
            self._left[item.rank] = self._left.get(item.rank, 0) + 1
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._syncer: FileSyncer[int] = FileSyncer(on_done)

    def __enter__(self) -> _OutputFiles:
        return self

    def acquire(self, rank: int) -> int:
        with self._lock:
            fd = self._fds.get(rank)
            if fd is None:
                path = os.path.join(self._dir, file_name(rank))
                fd = self._fds[rank] = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            return fd

    def release(self, rank: int) -> None:
        with self._lock:
            self._left[rank] -= 1
            if self._left[rank]:
                return
            fd = self._fds.pop(rank)
        self._syncer.submit(rank, fd)

    def drain(self) -> None:
        """Wait until every finished file is durable (and reported); raise the first error."""
        self._syncer.drain()

    def __exit__(self, *exc: object) -> None:
        self._syncer.shutdown()
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():  # only left after an error: the temp dir is discarded
            os.close(fd)


def write_dcp(
    manifest: Manifest,
    plan: DcpPlan,
    out_dir: str,
    *,
    source_root: str,
    workers: int = 2,
    quiet: bool = True,
    only_files: Collection[int] | None = None,
    on_file_done: Callable[[int], None] | None = None,
) -> int:
    """Write the planned ``.distcp`` files into ``out_dir`` (existing, empty), then ``.metadata``.

    Returns the bytes written. Items are independent byte ranges, so ``workers`` threads take
    them in file order from one queue (each thread with its own block buffer) whatever the
    number of files; every file is fsynced before ``.metadata`` commits the checkpoint.

    With ``only_files`` (indices r of the ``__r_0.distcp`` files: this process's share under
    torchrun, see :mod:`ckptools.collective`) only those files are written, and no
    ``.metadata``: rank 0 writes it (:func:`write_metadata`) once every process is done.
    ``on_file_done(r)`` is called once file r is complete and durable (fsynced, or uploaded),
    to journal it (:mod:`ckptools.io.resume`).
    """
    if is_url(out_dir):
        return _write_dcp_to_store(
            manifest, plan, out_dir, source_root=source_root, workers=workers, quiet=quiet,
            only_files=only_files, on_file_done=on_file_done,
        )  # fmt: skip
    mine = range(plan.world_size) if only_files is None else sorted(set(only_files))
    wanted = set(mine)
    total = sum(plan.file_sizes[r] for r in mine)
    items: list[TensorItem | ObjectItem] = [*plan.objects, *plan.tensors]
    tasks = sorted(
        [i for i in items if i.rank in wanted], key=lambda item: (item.rank, item.offset)
    )
    for rank in mine:
        # Every rank's file exists, as DCP writes one per rank even when it holds nothing.
        open(os.path.join(out_dir, file_name(rank)), "wb").close()
    if on_file_done is not None:
        for rank in wanted - {item.rank for item in tasks}:
            on_file_done(rank)  # empty: nothing to wait for
    local = threading.local()
    with (
        _OutputFiles(out_dir, tasks, on_file_done) as files,
        open_reader(source_root) as reader,
        ByteProgress(total, "reshard", quiet=quiet) as bar,
    ):
        cache = _SourceCache(reader, manifest)
        writeback = _Writeback()
        segments, crcs = _plan_segments(tasks, cache)

        def run(index: int, item: TensorItem | ObjectItem) -> None:
            fd = files.acquire(item.rank)
            try:
                if isinstance(item, ObjectItem):
                    _copy_object(fd, item, reader)
                    bar.update(item.length)
                    return
                scratch = getattr(local, "scratch", None)
                if scratch is None:
                    scratch = local.scratch = _Scratch()
                _write_tensor(
                    fd, item, cache, reader, bar, scratch, writeback, segments.get(index), crcs
                )
            except BaseException:
                crcs.fail()  # a piece waiting for this one's CRC must not wait forever
                raise
            finally:
                files.release(item.rank)

        # One FIFO queue: a piece that derives its CRC waits only for pieces queued before it;
        # on the first error or Ctrl-C the waiting pieces are released and the rest cancelled.
        run_all(lambda task: run(*task), list(enumerate(tasks)), workers, crcs.fail)
        files.drain()
    if only_files is None:
        write_metadata(out_dir, plan)
    return total


def _write_dcp_to_store(
    manifest: Manifest,
    plan: DcpPlan,
    out_url: str,
    *,
    source_root: str,
    workers: int,
    quiet: bool,
    only_files: Collection[int] | None,
    on_file_done: Callable[[int], None] | None,
) -> int:
    """:func:`write_dcp` into an object-store prefix: rank files are written, ``workers`` at a
    time, into a local spool with the positional writes a local file allows, uploaded (a
    multipart upload appears only once complete) and deleted while the next ones are written;
    ``.metadata`` is one PUT after every upload has finished. Local disk use stays within a few
    rank files (:data:`ckptools.io.staging.MAX_PENDING_UPLOADS` plus those being written).
    """
    from ckptools.io.staging import Uploader, spool_dir

    mine = list(range(plan.world_size)) if only_files is None else sorted(set(only_files))
    step = max(1, workers)
    written = 0
    with spool_dir() as spool, Uploader() as uploader:
        for i in range(0, len(mine), step):
            group = mine[i : i + step]
            written += write_dcp(
                manifest, plan, spool, source_root=source_root, workers=workers, quiet=quiet,
                only_files=group,
            )  # fmt: skip
            for rank in group:
                done = None if on_file_done is None else functools.partial(on_file_done, rank)
                uploader.put(
                    os.path.join(spool, file_name(rank)), f"{out_url}/{file_name(rank)}", done
                )
        uploader.wait()
    if only_files is None:
        write_metadata(out_url, plan)
    return written
