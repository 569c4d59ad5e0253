"""Copying one task of an execution: a chunk's bytes, or a block of whole rows, to their runs.

:class:`ChunkCopier` holds what the threads of one :func:`~ckptools.engine.executor.execute`
share (descriptors, a block buffer per thread, the stop flag) and copies one task: a chunk that
lands as one run in the kernel (``os.copy_file_range``), rows assembled from all of a tensor's
chunks (:class:`RowBlock`), anything else in blocks through the thread's buffer, cast, made
row-major or transformed on the way; each record's CRC-32 is checked from the bytes copied.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptools.core import dtypes
from ckptools.core.crc32 import crc32, crc32_combine
from ckptools.core.geometry import MAX_STRIDED_STEPS, gather_strided, strided_steps
from ckptools.core.manifest import Chunk, Manifest
from ckptools.engine import checked_copy
from ckptools.engine.reader import resolve_chunk
from ckptools.engine.runtime import pwrite_all
from ckptools.io.progress import ByteProgress
from ckptools.io.storage import Reader
from ckptools.plan.safetensors import FilePlan, TensorPlan, chunk_span, runs

if TYPE_CHECKING:
    from ckptools.producers.decoding import RowDecoder


def pieces(
    chunk_runs: Iterator[tuple[int, int, int]], max_elems: int
) -> Iterator[list[tuple[int, int, int]]]:
    """Group runs into blocks of at most ``max_elems`` elements, splitting long runs.

    Each block is a list of ``(src, dst, n)`` that are adjacent in the source, so one read of
    ``[block[0].src, block[-1].src + n)`` serves the whole block.
    """
    block: list[tuple[int, int, int]] = []
    used = 0
    for src, dst, n in chunk_runs:
        while n:
            take = min(n, max_elems - used)
            block.append((src, dst, take))
            used += take
            src, dst, n = src + take, dst + take, n - take
            if used == max_elems:
                yield block
                block, used = [], 0
    if block:
        yield block


@dataclass(frozen=True, slots=True)
class RowBlock:
    """A task writing rows ``[first, stop)`` (dim 0) of a tensor assembled from all its chunks;
    ``rows`` is the block height every such task of the tensor uses, ``numel`` its elements."""

    first: int
    stop: int
    rows: int
    numel: int


Task = tuple[FilePlan, TensorPlan, Chunk | RowBlock]
#: Changes rows ``[first, stop)`` of a tensor in place, given their bytes as they will be
#: written (the output dtype, row-major), before they are: a computed tensor (a merged LoRA
#: weight) written once, from its source's bytes.
RowTransform = Callable[[int, int, memoryview], None]


class _PartCrcs:
    """CRC-32s of a record read in parts by several tasks: the whole once all are in."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
        self._lock = threading.Lock()

    def add(self, key: tuple[str, int], expected: int, at: int, crc: int, n: int) -> int | None:
        with self._lock:
            parts = self._parts.setdefault(key, [])
            parts.append((at, crc, n))
            if len(parts) < expected:
                return None
            del self._parts[key]
        whole = 0
        for _, part, length in sorted(parts):
            whole = crc32_combine(whole, part, length)
        return whole


class ChunkCopier:
    """Shared state of one execution: descriptors, buffers per thread, the stop flag."""

    def __init__(
        self,
        manifest: Manifest,
        reader: Reader,
        out_fds: dict[str, int],
        block: int,
        progress: ByteProgress,
        transforms: Mapping[str, RowTransform] | None = None,
        decoders: Mapping[str, RowDecoder] | None = None,
    ) -> None:
        self.transforms = transforms or {}
        self.decoders = decoders or {}
        self.manifest = manifest
        self.reader = reader
        self.out_fds = out_fds
        self.block = block
        self.progress = progress
        self.stop = threading.Event()
        self._local = threading.local()
        self._lock = threading.Lock()
        self.kernel_copied = 0
        self.copy_range_ok = hasattr(os, "copy_file_range")
        self.early_writeback = hasattr(os, "posix_fadvise")
        self._resolved: dict[tuple[str, int], Chunk] = {}
        self._part_crcs = _PartCrcs()

    def buffer(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = memoryview(bytearray(self.block))
            self._local.buf = buf
        return buf

    def copy_chunk(self, file: FilePlan, tensor: TensorPlan, chunk: Chunk | RowBlock) -> None:
        if self.stop.is_set():
            return
        fd = self.out_fds[file.name]
        isz = dtypes.dtype(tensor.dtype).itemsize
        if isinstance(chunk, RowBlock):
            self._gather_rows(fd, tensor, chunk)
            row = math.prod(tensor.shape[1:])
            start, end = chunk.first * row, chunk.stop * row
        else:
            raw = resolve_chunk(
                self.reader, self.manifest.tensors[tensor.fqn], chunk, reading_data=True
            )
            checked_copy.check_record_of(self.reader, raw, tensor.fqn)
            if raw.strides is not None and not tensor.is_cast and _gathered(raw, isz):
                self._copy_strided(fd, tensor, raw)
            elif raw.strides is not None or tensor.is_cast:
                self._copy_with_torch(fd, tensor, raw)
            else:
                self._copy_bytes(fd, tensor, raw)
            start, end = chunk_span(tensor.shape, raw.offsets, raw.sizes) if raw.numel else (0, 0)
        if self.early_writeback and end > start:
            # Start writing this chunk's pages to disk now (DONTNEED begins writeback of dirty
            # pages without waiting), so the fsync the atomic commit needs overlaps the copy
            # instead of following it; clean output pages also leave the page cache.
            os.posix_fadvise(
                fd, tensor.begin + start * isz, (end - start) * isz, os.POSIX_FADV_DONTNEED
            )

    def _raw(self, tensor: TensorPlan, index: int) -> Chunk:
        """Chunk ``index`` of ``tensor`` resolved to its raw bytes, once per execution."""
        key = (tensor.fqn, index)
        raw = self._resolved.get(key)
        if raw is None:
            entry = self.manifest.tensors[tensor.fqn]
            raw = resolve_chunk(self.reader, entry, tensor.chunks[index], reading_data=True)
            checked_copy.check_record_of(self.reader, raw, tensor.fqn)
            with self._lock:
                self._resolved[key] = raw
        return raw

    def _gather_rows(self, fd: int, tensor: TensorPlan, task: RowBlock) -> None:
        """Rows ``[first, stop)`` of ``tensor``: each chunk's part read into the first half of
        the thread's buffer, placed run by run into the second (read straight into place when
        the chunk holds whole rows), transformed if asked, or decoded into the output dtype
        right after them, written once."""
        isz = dtypes.dtype(tensor.src_dtype).itemsize
        row = math.prod(tensor.shape[1:])
        buf = self.buffer()
        half = len(buf) // 2
        out = buf[half : half + task.numel * isz]
        base = task.first * row
        for index, chunk in enumerate(tensor.chunks):
            c0, cn = chunk.offsets[0], chunk.sizes[0]
            a, b = max(task.first, c0), min(task.stop, c0 + cn)
            if a >= b or not chunk.numel:
                continue
            raw = self._raw(tensor, index)
            per_row = chunk.numel // cn
            whole_rows = tuple(chunk.sizes[1:]) == tuple(tensor.shape[1:])
            if whole_rows:  # its rows are the output's rows: read straight into place
                o = (a - task.first) * row * isz
                part = out[o : o + (b - a) * row * isz]
            else:
                part = buf[: (b - a) * per_row * isz]
            at = (a - c0) * per_row * isz
            self.reader.readinto(raw.file, raw.offset + at, part)
            if raw.crc32 is not None:
                blocks = (c0 + cn - 1) // task.rows - c0 // task.rows + 1
                key = (tensor.fqn, index)
                whole = self._part_crcs.add(key, blocks, at, crc32(part, 0), len(part))
                if whole is not None:
                    checked_copy.check(self.reader, raw, tensor.fqn, whole)
            if whole_rows:
                continue
            box = (a, *chunk.offsets[1:]), (b - a, *chunk.sizes[1:])
            for src, dst, n in runs(tensor.shape, *box):
                o = (dst - base) * isz
                out[o : o + n * isz] = part[src * isz : (src + n) * isz]
        transform = self.transforms.get(tensor.name)
        if transform is not None:
            transform(task.first, task.stop, out)
        decoder = self.decoders.get(tensor.name)
        if decoder is not None:
            osz = dtypes.dtype(tensor.dtype).itemsize
            end = half + len(out)
            stored, out = out, buf[end : end + task.numel * osz]
            decoder(task.first, task.stop, stored, out)
            isz = osz
        pwrite_all(fd, out, tensor.begin + base * isz)
        self.progress.update(len(out))

    def _copy_bytes(self, fd: int, tensor: TensorPlan, raw: Chunk) -> None:
        isz = dtypes.dtype(tensor.dtype).itemsize
        chunk_runs = runs(tensor.shape, raw.offsets, raw.sizes)
        first_run = next(chunk_runs, None)
        if first_run is None:
            return
        second_run = next(chunk_runs, None)
        if second_run is None:
            # One run (dim-0 sharding, whole tensors): copied in the kernel, no buffer at all,
            # each window checksummed in place just before.
            src, dst, n = first_run
            crc, in_kernel = checked_copy.copy_range(
                self.reader, raw, src * isz, n * isz, fd, tensor.begin + dst * isz,
                self.progress.update, self.buffer, kernel=self.copy_range_ok, stop=self.stop,
                checksum=raw.crc32 is not None,
            )  # fmt: skip
            if in_kernel < n * isz and not self.reader.decoded.in_memory(raw.file):
                self.copy_range_ok = False  # (an item decoded in memory is never the kernel's)
            with self._lock:
                self.kernel_copied += in_kernel
            self._check(raw, tensor.fqn, crc if src == 0 and n * isz == raw.length else None)
            return
        head = [first_run, second_run]
        running = _RunningCrc()
        for block in pieces(itertools.chain(head, chunk_runs), self.block // isz):
            if self.stop.is_set():
                return
            first = block[0][0]
            nbytes = (block[-1][0] + block[-1][2] - first) * isz
            buf = self.buffer()[:nbytes]
            self.reader.readinto(raw.file, raw.offset + first * isz, buf)
            running.add(first * isz, buf)
            for src, dst, n in block:
                at = (src - first) * isz
                pwrite_all(fd, buf[at : at + n * isz], tensor.begin + dst * isz)
            self.progress.update(nbytes)
        self._check(raw, tensor.fqn, running.whole(raw.length))

    def _check(self, raw: Chunk, fqn: str, crc: int | None) -> None:
        """Check the chunk's record against its stored CRC: from the CRC of the bytes just
        copied when they were the whole record (always, for a plain chunk), else in place."""
        if raw.crc32 is None or self.stop.is_set():
            return
        if crc is None:
            crc = checked_copy.record_crc(self.reader, raw, self.buffer)
        checked_copy.check(self.reader, raw, fqn, crc)

    def _copy_strided(self, fd: int, tensor: TensorPlan, raw: Chunk) -> None:
        """A strided chunk without a cast: read whole, its elements gathered row-major without
        torch (:func:`~ckptools.core.geometry.gather_strided`), its runs written."""
        assert raw.strides is not None
        isz = dtypes.dtype(tensor.dtype).itemsize
        data = self.reader.read(raw.file, raw.offset, raw.length)
        mem = memoryview(gather_strided(data, isz, raw.sizes, raw.strides))
        for src, dst, n in runs(tensor.shape, raw.offsets, raw.sizes):
            pwrite_all(fd, mem[src * isz : (src + n) * isz], tensor.begin + dst * isz)
        self.progress.update(len(mem))
        self._check(raw, tensor.fqn, crc32(data, 0) if len(data) == raw.length else None)

    def _copy_with_torch(self, fd: int, tensor: TensorPlan, raw: Chunk) -> None:
        import torch

        src_t = getattr(torch, tensor.src_dtype)
        dst_t = getattr(torch, tensor.dtype)
        src_isz = dtypes.dtype(tensor.src_dtype).itemsize
        dst_isz = dtypes.dtype(tensor.dtype).itemsize
        chunk_runs = runs(tensor.shape, raw.offsets, raw.sizes)
        if raw.strides is not None:
            # A strided chunk must be read whole: its elements are spread over its span.
            data = bytearray(self.reader.read(raw.file, raw.offset, raw.length))
            flat = torch.frombuffer(data, dtype=torch.uint8).view(src_t)
            whole = flat.as_strided(raw.sizes, raw.strides).contiguous().to(dst_t).reshape(-1)
            mem = whole.view(torch.uint8).numpy().data
            for src, dst, n in chunk_runs:
                pwrite_all(
                    fd, mem[src * dst_isz : (src + n) * dst_isz], tensor.begin + dst * dst_isz
                )
            self.progress.update(len(mem))
            return
        crc = _RunningCrc()
        for block in pieces(chunk_runs, self.block // max(src_isz, dst_isz)):
            if self.stop.is_set():
                return
            first = block[0][0]
            count = block[-1][0] + block[-1][2] - first
            buf = self.buffer()[: count * src_isz]
            self.reader.readinto(raw.file, raw.offset + first * src_isz, buf)
            crc.add(first * src_isz, buf)
            cast = torch.frombuffer(buf, dtype=torch.uint8).view(src_t).to(dst_t)
            mem = cast.view(torch.uint8).numpy().data
            for src, dst, n in block:
                at = (src - first) * dst_isz
                pwrite_all(fd, mem[at : at + n * dst_isz], tensor.begin + dst * dst_isz)
            self.progress.update(count * dst_isz)
        self._check(raw, tensor.fqn, crc.whole(raw.length))


def _gathered(raw: Chunk, itemsize: int) -> bool:
    """Whether the strided chunk ``raw`` is made row-major without torch: all but a view of
    very many short rows (importing torch costs ~1.5 s of CPU and ~200 MiB)."""
    assert raw.strides is not None
    return strided_steps(itemsize, raw.sizes, raw.strides) <= MAX_STRIDED_STEPS


class _RunningCrc:
    """CRC-32 of a chunk's bytes as its blocks are read in order; :meth:`whole` is None when
    they did not run from its first byte to its last without a gap."""

    def __init__(self) -> None:
        self._crc = 0
        self._next: int | None = 0

    def add(self, at: int, data: memoryview) -> None:
        if self._next == at:
            self._crc = crc32(data, self._crc)
            self._next = at + len(data)
        else:
            self._next = None

    def whole(self, length: int) -> int | None:
        return self._crc if self._next == length else None
