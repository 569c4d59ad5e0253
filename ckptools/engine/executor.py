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
  contiguous read per chunk), the rows are assembled in the thread's buffer and written as one
  range (:func:`~ckptools.engine.runtime.pwrite_all`: 1 MiB writes; one write per run instead
  would be a syscall per row per rank, and output pages written partly, twice);
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

import math
import os
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptools.core import dtypes
from ckptools.core.manifest import Chunk, Manifest
from ckptools.engine.chunk_copier import ChunkCopier, RowBlock, RowTransform, Task
from ckptools.engine.runtime import BLOCK_BYTES, FileSyncer, pwrite_all, run_all
from ckptools.errors import UsageError
from ckptools.io import space, storage
from ckptools.io.progress import ByteProgress
from ckptools.io.storage import open_reader
from ckptools.io.tunables import DEFAULT_MEMORY_BUDGET_BYTES
from ckptools.plan.safetensors import ConsolidationPlan, FilePlan, TensorPlan

if TYPE_CHECKING:
    from ckptools.producers.decoding import RowDecoder

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


def in_row_blocks(t: TensorPlan, block: int, decoded: bool = False) -> bool:
    """Whether ``t`` can be written in blocks of whole rows from buffers of ``block`` bytes (not
    cast, no strided chunk, a row within half a buffer): what a :data:`RowTransform` needs.
    ``decoded``: computed by a :data:`~ckptools.producers.decoding.RowDecoder` into its own
    dtype, so a row's stored and written bytes both fit half a buffer."""
    row = math.prod(t.shape[1:]) if len(t.shape) >= 2 else 0
    return bool(
        row
        and (decoded or not t.is_cast)
        and row * _row_itemsize(t, decoded) <= block // 2
        and all(c.strides is None for c in t.chunks)
    )


def _row_itemsize(t: TensorPlan, decoded: bool) -> int:
    """Bytes per element a row block holds: stored, and written too when ``decoded``."""
    stored = dtypes.dtype(t.src_dtype).itemsize
    return stored + dtypes.dtype(t.dtype).itemsize if decoded else stored


def _tasks(
    f: FilePlan, t: TensorPlan, block: int, rows_ok: bool, transformed: bool, decoded: bool
) -> Iterator[Task]:
    """The tasks writing ``t``: blocks of whole rows when its chunks all land as many runs
    (sharded on a trailing dim), or it is ``transformed`` or ``decoded``, and a row fits half a
    buffer; else one task per chunk. ``rows_ok`` False (ranks sharing the tasks: a chunk's CRC
    is checked only where one process reads every block of it): one task per chunk always."""
    isz = _row_itemsize(t, decoded)
    row = math.prod(t.shape[1:]) if len(t.shape) >= 2 else 0
    gather = (
        rows_ok
        and in_row_blocks(t, block, decoded)
        and (
            transformed
            or decoded
            or (len(t.chunks) > 1 and all(c.sizes[1:] != t.shape[1:] for c in t.chunks))
        )
    )
    half_block = block // 2
    if not gather:
        yield from ((f, t, c) for c in t.chunks)
        return
    rows = max(1, half_block // (row * isz))
    for first in range(0, t.shape[0], rows):
        stop = min(first + rows, t.shape[0])
        yield f, t, RowBlock(first, stop, rows, (stop - first) * row)


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


def _checked_decoders(
    plan: ConsolidationPlan,
    decoders: Mapping[str, RowDecoder] | None,
    block: int,
    share: tuple[int, int] | None,
) -> Mapping[str, RowDecoder]:
    """``decoders``, each of whose tensors this execution computes in row blocks.

    Raises:
        UsageError: one it cannot: ranks share the copy, or a row of the tensor (stored and
            written) is larger than half a copy buffer (the message names the budget to give).
    """
    decoders = decoders or {}
    for f in plan.files:
        for t in f.tensors:
            if t.name not in decoders:
                continue
            if share is not None:
                raise UsageError(
                    f"{t.name}: a computed tensor is written by one process; run consolidate "
                    "without torchrun"
                )
            if not in_row_blocks(t, block, decoded=True):
                raise UsageError(
                    f"{t.fqn}: a row of {t.shape} does not fit the copy buffers; raise "
                    "--memory-budget (CKPTOOLS_MEMORY_BUDGET) or lower --workers"
                )
    return decoders


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
    decoders: Mapping[str, RowDecoder] | None = None,
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
        decoders: output tensor name -> :data:`~ckptools.producers.decoding.RowDecoder`
            computing its rows (in the plan's dtype) from its stored rows, in row blocks;
            ``share`` None.

    ``out_dir`` may be a URL (an object-store prefix): each file is then written into a local
    spool, one at a time, and uploaded while the next is written (:func:`_execute_to_store`).

    Example:
        >>> stats = execute(plan, manifest, "out.tmp-1", workers=4)  # doctest: +SKIP
    """
    if storage.is_url(out_dir):
        return _execute_to_store(
            plan, manifest, out_dir, workers=workers, memory_budget=memory_budget, quiet=quiet,
            share=share, skip=skip, on_file_done=on_file_done, decoders=decoders,
        )  # fmt: skip
    root = manifest.data_dir()
    todo = [f for f in plan.files if f.name not in skip]
    block = block_bytes(memory_budget, workers)
    transforms = _checked_transforms(plan, transforms, block, share)
    decoders = _checked_decoders(plan, decoders, block, share)
    tasks = [
        task
        for f in todo
        for t in f.tensors
        for task in _tasks(f, t, block, share is None, t.name in transforms, t.name in decoders)
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
            copier = ChunkCopier(manifest, reader, fds, block, bar, transforms, decoders)
            copy: Callable[[FilePlan, TensorPlan, Chunk | RowBlock], None] = copier.copy_chunk
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
    decoders: Mapping[str, RowDecoder] | None = None,
) -> ExecuteStats:
    """:func:`execute` into an object-store prefix: the positional writes need a local file, so
    each output file is written whole into a local spool, then uploaded (a multipart upload for
    big files, which appears only once complete) and deleted while the next file is written.
    Local disk use stays within a few output files
    (:data:`ckptools.io.spool.MAX_PENDING_UPLOADS`).
    """
    from dataclasses import replace

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
            memory_budget=memory_budget, quiet=quiet, decoders=decoders,
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
        self, copy: Callable[[FilePlan, TensorPlan, Chunk | RowBlock], None]
    ) -> Callable[[FilePlan, TensorPlan, Chunk | RowBlock], None]:
        def run(f: FilePlan, t: TensorPlan, c: Chunk | RowBlock) -> None:
            copy(f, t, c)
            with self._lock:
                self._left[f.name] -= 1
                last = not self._left[f.name]
            if last:
                self._syncer.submit(f.name, self._fds[f.name])

        return run
