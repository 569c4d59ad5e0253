"""The executor: moves the bytes a :class:`~ckptools.plan.safetensors.ConsolidationPlan` describes.

One task per stored chunk. A task finds the chunk's raw bytes
(:func:`ckptools.engine.reader.resolve_chunk`
reads a DCP item's archive directory, never its tensor), maps them to output runs with
:func:`ckptools.plan.safetensors.runs`, and copies:

* a chunk that lands as one contiguous run is copied in the kernel with ``os.copy_file_range``
  (no user-space buffer at all), falling back to positional reads and writes where the kernel
  or filesystem refuses;
* a tensor whose chunks land as many runs each (sharded on dim 1: tensor parallelism) is
  written a block of whole rows at a time: each chunk's part of those rows is read (one
  contiguous read per chunk), the rows are assembled in the thread's buffer and written with one
  ``os.pwrite`` (one write per run instead: a syscall per row per rank, and output pages
  written partly, twice);
* any other chunk that lands as many runs is read in blocks into a per-thread buffer and each
  run is written with ``os.pwrite``;
* a cast (``dtype``) converts each block with torch, elementwise, so memory stays one block;
* a strided chunk (a transposed view saved as is) is read whole and made row-major, without
  torch (:func:`~ckptools.core.geometry.gather_strided`; with torch for a view of very many
  short rows, or with a cast): the only case whose memory is the chunk's size, not a block.

Each chunk whose record stores a CRC-32 (every DCP item) is checked against it from the bytes
copied: computed over the blocks as they are read, or, for a kernel copy, over the source's page
cache just before the kernel copies the same pages (:mod:`ckptools.engine.checked_copy`). A
damaged record stops the run with one line naming the file, the byte range and the tensor.

Memory is bounded by ``workers × block``: each thread owns one block buffer, sized from the
memory budget. Writes use positional I/O on a shared descriptor, so threads never contend on a
file position. The threads, the syncing thread and the kernel and positional copies are
:mod:`ckptools.engine.runtime`'s, shared with the DCP writer.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

from ckptools.core import dtypes
from ckptools.core.crc32 import crc32, crc32_combine
from ckptools.core.geometry import MAX_STRIDED_STEPS, gather_strided, strided_steps
from ckptools.core.manifest import Chunk, Manifest
from ckptools.engine import checked_copy
from ckptools.engine.reader import resolve_chunk
from ckptools.engine.runtime import BLOCK_BYTES, FileSyncer, pwrite_all, run_all
from ckptools.io import space, storage
from ckptools.io.progress import ByteProgress
from ckptools.io.storage import Reader, open_reader
from ckptools.io.tunables import DEFAULT_MEMORY_BUDGET_BYTES
from ckptools.plan.safetensors import ConsolidationPlan, FilePlan, TensorPlan, chunk_span, runs

#: Blocks are a multiple of the largest itemsize (complex128) so no element is ever split.
_BLOCK_ALIGN_BYTES = 64


@dataclass(frozen=True)
class ExecuteStats:
    bytes_written: int
    chunks: int
    kernel_copied_bytes: int  # of bytes_written, moved by copy_file_range


def block_bytes(memory_budget: int, workers: int) -> int:
    """Per-thread buffer size for ``workers`` threads sharing ``memory_budget`` bytes."""
    per = min(BLOCK_BYTES, memory_budget // max(1, workers))
    return max(_BLOCK_ALIGN_BYTES, per - per % _BLOCK_ALIGN_BYTES)


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
class _Rows:
    """A task writing rows ``[first, stop)`` (dim 0) of a tensor assembled from all its chunks;
    ``rows`` is the block height every such task of the tensor uses, ``numel`` its elements."""

    first: int
    stop: int
    rows: int
    numel: int


Task = tuple[FilePlan, TensorPlan, Chunk | _Rows]
#: Changes rows ``[first, stop)`` of a tensor in place, given their bytes as they will be
#: written (the output dtype, row-major), before they are: a computed tensor (a merged LoRA
#: weight) written once, from its source's bytes.
RowTransform = Callable[[int, int, memoryview], None]


def in_row_blocks(t: TensorPlan, block: int) -> bool:
    """Whether ``t`` can be written in blocks of whole rows from buffers of ``block`` bytes (not
    cast, no strided chunk, a row within half a buffer): what a :data:`RowTransform` needs."""
    row = math.prod(t.shape[1:]) if len(t.shape) >= 2 else 0
    return bool(
        row
        and not t.is_cast
        and row * dtypes.dtype(t.src_dtype).itemsize <= block // 2
        and all(c.strides is None for c in t.chunks)
    )


def _tasks(
    f: FilePlan, t: TensorPlan, block: int, rows_ok: bool, transformed: bool = False
) -> Iterator[Task]:
    """The tasks writing ``t``: blocks of whole rows when its chunks all land as many runs
    (sharded on a trailing dim), or it is ``transformed``, and a row fits half a buffer; else
    one task per chunk. ``rows_ok`` False (ranks sharing the tasks: a chunk's CRC is checked
    only where one process reads every block of it): one task per chunk always."""
    isz = dtypes.dtype(t.src_dtype).itemsize
    row = math.prod(t.shape[1:]) if len(t.shape) >= 2 else 0
    gather = (
        rows_ok
        and in_row_blocks(t, block)
        and (
            transformed or (len(t.chunks) > 1 and all(c.sizes[1:] != t.shape[1:] for c in t.chunks))
        )
    )
    half_block = block // 2
    if not gather:
        yield from ((f, t, c) for c in t.chunks)
        return
    rows = max(1, half_block // (row * isz))
    for first in range(0, t.shape[0], rows):
        stop = min(first + rows, t.shape[0])
        yield f, t, _Rows(first, stop, rows, (stop - first) * row)


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


class _Copier:
    """Shared state of one execution: descriptors, buffers per thread, the stop flag."""

    def __init__(
        self,
        manifest: Manifest,
        reader: Reader,
        out_fds: dict[str, int],
        block: int,
        progress: ByteProgress,
        transforms: Mapping[str, RowTransform] | None = None,
    ) -> None:
        self.transforms = transforms or {}
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

    def copy_chunk(self, file: FilePlan, tensor: TensorPlan, chunk: Chunk | _Rows) -> None:
        if self.stop.is_set():
            return
        fd = self.out_fds[file.name]
        isz = dtypes.dtype(tensor.dtype).itemsize
        if isinstance(chunk, _Rows):
            self._gather_rows(fd, tensor, chunk)
            row = math.prod(tensor.shape[1:])
            start, end = chunk.first * row, chunk.stop * row
        else:
            raw = resolve_chunk(
                self.reader, self.manifest.tensors[tensor.fqn], chunk, reading_data=True
            )
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
            with self._lock:
                self._resolved[key] = raw
        return raw

    def _gather_rows(self, fd: int, tensor: TensorPlan, task: _Rows) -> None:
        """Rows ``[first, stop)`` of ``tensor``: each chunk's part read into the first half of
        the thread's buffer, placed run by run into the second (read straight into place when
        the chunk holds whole rows), transformed if asked, written once."""
        isz = dtypes.dtype(tensor.dtype).itemsize
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
            if in_kernel < n * isz:
                self.copy_range_ok = False
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


def create_files(
    plan: ConsolidationPlan, out_dir: str, files: Sequence[FilePlan] | None = None
) -> None:
    """Create every file of ``plan`` (or ``files``) in ``out_dir`` at its final size, with its
    header written; a file left by an interrupted run is replaced.

    Under torchrun one rank calls this before any rank copies chunks.
    """
    for f in plan.files if files is None else files:
        fd = os.open(os.path.join(out_dir, f.name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with space.translated(os.path.join(out_dir, f.name)):  # EFBIG: a file-size limit
                os.ftruncate(fd, f.size)
            pwrite_all(fd, memoryview(f.header), 0)
        finally:
            os.close(fd)


def share_of(tasks: Sequence[Task], rank: int, world_size: int) -> list[Task]:
    """The tasks ``rank`` copies: consecutive tasks holding about 1/world_size of the bytes.

    Every rank computes the same split from the same plan, so no communication is needed;
    consecutive tasks keep each rank's writes within a few files.
    """
    sizes = [c.numel * dtypes.dtype(t.dtype).itemsize for _, t, c in tasks]
    total = sum(sizes) or 1
    out = []
    pos = 0
    for task, n in zip(tasks, sizes, strict=True):
        # a task belongs to the rank whose byte range holds the task's midpoint
        if min(world_size - 1, (2 * pos + n) * world_size // (2 * total)) == rank:
            out.append(task)
        pos += n
    return out


def _checked_transforms(
    plan: ConsolidationPlan,
    transforms: Mapping[str, RowTransform] | None,
    block: int,
    share: tuple[int, int] | None,
) -> Mapping[str, RowTransform]:
    """``transforms``, each of whose tensors this execution writes in row blocks.

    Raises:
        ValueError: one it cannot (the caller asked for what :func:`in_row_blocks` refuses,
            or ranks share the copy).
    """
    transforms = transforms or {}
    for f in plan.files:
        for t in f.tensors:
            if t.name in transforms and not (share is None and in_row_blocks(t, block)):
                raise ValueError(f"cannot transform {t.name!r} in row blocks here")
    return transforms


def execute(
    plan: ConsolidationPlan,
    manifest: Manifest,
    out_dir: str,
    *,
    workers: int = 1,
    memory_budget: int = DEFAULT_MEMORY_BUDGET_BYTES,
    quiet: bool = False,
    share: tuple[int, int] | None = None,
    skip: Collection[str] = (),
    on_file_done: Callable[[str], None] | None = None,
    transforms: Mapping[str, RowTransform] | None = None,
) -> ExecuteStats:
    """Write the files of ``plan`` into ``out_dir`` and fsync them.

    Files are created with their final size (:func:`create_files`), the header is written with a
    positional write, and every chunk is copied to its place, so the order of writes does not
    matter and threads (or ranks) need no coordination. Writes no index; the caller commits.

    Args:
        plan: from :func:`ckptools.plan.safetensors.plan_consolidation` on ``manifest``.
        manifest: the source checkpoint.
        out_dir: an existing, empty directory (or, with ``share``, one where
            :func:`create_files` already ran).
        workers: threads copying chunks concurrently.
        memory_budget: bytes of copy buffers over all threads.
        quiet: no progress bar.
        share: ``(rank, world_size)``: copy only this rank's share of the chunks into files
            another rank created.
        skip: names of files an interrupted run already wrote (:mod:`ckptools.io.resume`); not
            written again.
        on_file_done: called with a file's name once it is complete and durable (fsynced, or
            uploaded), to journal it; not with ``share``, where no rank sees a file complete.
        transforms: output tensor name -> :data:`RowTransform` applied to its rows before
            they are written; each such tensor must be :func:`in_row_blocks` for this
            ``memory_budget`` and ``workers``, and ``share`` None, local ``out_dir``.

    ``out_dir`` may be a URL (an object-store prefix): each file is then written into a local
    spool, one at a time, and uploaded while the next is written (:func:`_execute_to_store`).

    Example:
        >>> stats = execute(plan, manifest, "out.tmp-1", workers=4)  # doctest: +SKIP
    """
    if storage.is_url(out_dir):
        return _execute_to_store(
            plan, manifest, out_dir, workers=workers, memory_budget=memory_budget, quiet=quiet,
            share=share, skip=skip, on_file_done=on_file_done,
        )  # fmt: skip
    root = manifest.data_dir()
    todo = [f for f in plan.files if f.name not in skip]
    block = block_bytes(memory_budget, workers)
    transforms = _checked_transforms(plan, transforms, block, share)
    tasks = [
        task
        for f in todo
        for t in f.tensors
        for task in _tasks(f, t, block, share is None, t.name in transforms)
    ]
    if share is None:
        create_files(plan, out_dir, todo)
    else:
        tasks = share_of(tasks, *share)
        on_file_done = None
    total = sum(c.numel * dtypes.dtype(t.dtype).itemsize for _, t, c in tasks)
    reader = open_reader(root)
    fds: dict[str, int] = {}
    try:
        # Every file is fsynced, also those this rank writes nothing into: the header is in them.
        for f in todo:
            fds[f.name] = os.open(os.path.join(out_dir, f.name), os.O_WRONLY)
        with ByteProgress(total, "consolidate", quiet=quiet) as bar:
            copier = _Copier(manifest, reader, fds, block, bar, transforms)
            copy: Callable[[FilePlan, TensorPlan, Chunk | _Rows], None] = copier.copy_chunk
            if on_file_done is None:
                run_all(lambda task: copy(*task), tasks, workers, copier.stop.set)
            else:
                # journaled: each file fsynced (and reported) as soon as it is complete
                syncer = FileSyncer(on_file_done, close=False, stop=copier.stop)
                try:
                    copy = _FileCompletion(tasks, fds, syncer).wrap(copy)
                    run_all(lambda task: copy(*task), tasks, workers, copier.stop.set)
                    syncer.drain()
                finally:
                    syncer.shutdown()
        for fd in fds.values():
            os.fsync(fd)
        written = total + (sum(len(f.header) for f in todo) if share is None else 0)
        return ExecuteStats(written, len(tasks), copier.kernel_copied)
    finally:
        for fd in fds.values():
            os.close(fd)
        reader.close()


def _execute_to_store(
    plan: ConsolidationPlan,
    manifest: Manifest,
    out_url: str,
    *,
    workers: int,
    memory_budget: int,
    quiet: bool,
    share: tuple[int, int] | None,
    skip: Collection[str],
    on_file_done: Callable[[str], None] | None,
) -> ExecuteStats:
    """:func:`execute` into an object-store prefix: the positional writes need a local file, so
    each output file is written whole into a local spool, then uploaded (a multipart upload for
    big files, which appears only once complete) and deleted while the next file is written.
    Local disk use stays within a few output files
    (:data:`ckptools.io.spool.MAX_PENDING_UPLOADS`).
    """
    from dataclasses import replace

    from ckptools.errors import UsageError
    from ckptools.io.spool import spool_uploads

    if share is not None:
        raise UsageError(
            f"{out_url}: ranks cannot share output files on an object store; consolidate "
            "into a local or shared directory under torchrun, or run one process"
        )
    files = {f.name: f for f in plan.files}
    totals = [0, 0, 0]  # bytes written, chunks, bytes kernel-copied

    def write(spool: str, names: Sequence[str]) -> None:
        (name,) = names
        stats = execute(
            replace(plan, files=(files[name],)), manifest, spool, workers=workers,
            memory_budget=memory_budget, quiet=quiet,
        )  # fmt: skip
        totals[0] += stats.bytes_written
        totals[1] += stats.chunks
        totals[2] += stats.kernel_copied_bytes

    todo = [[f.name] for f in plan.files if f.name not in skip]
    spool_uploads(out_url, todo, write, on_file_done)
    written, chunks, kernel = totals
    return ExecuteStats(written, chunks, kernel)


class _FileCompletion:
    """Counts each file's chunks down as they are copied and hands a file to the syncer after
    its last one (files with no chunk, only a header, at once)."""

    def __init__(
        self,
        tasks: Sequence[Task],
        fds: dict[str, int],
        syncer: FileSyncer[str],
    ) -> None:
        self._left: dict[str, int] = dict.fromkeys(fds, 0)
        for f, _, _ in tasks:
            self._left[f.name] += 1
        self._fds = fds
        self._syncer = syncer
        self._lock = threading.Lock()
        for name, left in list(self._left.items()):
            if not left:
                syncer.submit(name, fds[name])

    def wrap(
        self, copy: Callable[[FilePlan, TensorPlan, Chunk | _Rows], None]
    ) -> Callable[[FilePlan, TensorPlan, Chunk | _Rows], None]:
        def run(f: FilePlan, t: TensorPlan, c: Chunk | _Rows) -> None:
            copy(f, t, c)
            with self._lock:
                self._left[f.name] -= 1
                last = not self._left[f.name]
            if last:
                self._syncer.submit(f.name, self._fds[f.name])

        return run
