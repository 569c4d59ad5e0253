"""Writing DCP checkpoints laid out for a world size, from any manifest (reshard and shard).

The plan (:func:`ckptools.plan.dcp.plan_dcp`) fixes every item's rank file, offset and length
before anything is written. Execution (:func:`write_dcp`) fills each piece block by block from
the source chunks that intersect it (:func:`ckptools.core.geometry.copy_runs`), computing the
archive's CRC-32 in order, with memory bounded by the block size times the number of files
written at once; a piece made of whole dim-0 rows of plain source records moves its bytes in the
kernel instead (:mod:`ckptools.engine.crc_segments`). Every source record's stored CRC-32 is
checked on the way: from the CRCs of the bytes copied, or, for a record that a piece reads only
part of (a dim-1 split), over the whole record in place before its first read
(:class:`_SourceChecks`).
A tensor the source held as a value (:class:`ckptools.core.tensor_value.TensorValue`, an
optimizer's ``step`` saved as a number) is written from the bytes its plan item carries.
Objects (non-tensor entries) are copied byte for byte, never unpickled. ``.metadata`` is written
last, with torch's own metadata classes, so torch's ``dcp.load`` reads the result at N ranks
with each rank reading only its own file.
"""

from __future__ import annotations

import math
import os
import threading
import uuid
from collections.abc import Callable, Collection, Sequence

from ckptools.core import dtypes
from ckptools.core.crc32 import crc32
from ckptools.core.geometry import copy_runs
from ckptools.core.manifest import Chunk, Manifest, TensorEntry
from ckptools.engine import checked_copy
from ckptools.engine.checked_copy import RecordChecks
from ckptools.engine.crc_segments import Segment, copy_segments, resolve_segments
from ckptools.engine.reader import SourceCache
from ckptools.engine.runtime import BLOCK_BYTES, FileSyncer, Scratch, pwrite_all, run_all
from ckptools.formats import torch_archive
from ckptools.formats.dcp_metadata import ChunkMeta, ObjectMeta, TensorMeta, metadata_pickle
from ckptools.io import storage
from ckptools.io.progress import ByteProgress
from ckptools.io.storage import Reader, is_url, open_reader
from ckptools.plan.dcp import DcpPlan, ObjectItem, TensorItem, file_name

METADATA_FILE = ".metadata"
_EARLY_WRITEBACK = hasattr(os, "posix_fadvise")
#: Output bytes between two writeback starts: large enough that the calls are few, small enough
#: that the disk starts early (a 2 GB reshard makes ~30 of them).
WRITEBACK_STEP_BYTES = 64 * 2**20


def _strided_to_contiguous(reader: Reader, raw: Chunk, dtype: str) -> bytes:
    import torch

    data = bytearray(reader.read(raw.file, raw.offset, raw.length))
    flat = torch.frombuffer(data, dtype=torch.uint8).view(getattr(torch, dtype))
    assert raw.strides is not None
    out = flat.as_strided(raw.sizes, raw.strides).contiguous()
    return bytes(out.reshape(-1).view(torch.uint8).numpy().tobytes())


class _SourceChecks:
    """Source records read piecemeal by :func:`_fill_block`, each checked once against its
    stored CRC-32, whole and in place over the page cache, before its first read (two threads
    meeting a record at once may both check it: harmless)."""

    def __init__(self, reader: Reader) -> None:
        self._reader = reader
        self._done: set[tuple[str, int]] = set()
        self._local = threading.local()  # a buffer per thread, apart from the block's

    def check(self, raw: Chunk, fqn: str) -> None:
        checked_copy.check_record_of(self._reader, raw, fqn)
        key = (raw.file, raw.offset)
        if raw.crc32 is None or key in self._done:
            return
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = Scratch()
        crc = checked_copy.record_crc(self._reader, raw, scratch.view(BLOCK_BYTES))
        checked_copy.check(self._reader, raw, fqn, crc)
        self._done.add(key)


def _fill_block(
    buf: memoryview,
    item: TensorItem,
    block_offsets: tuple[int, ...],
    block_sizes: tuple[int, ...],
    cache: SourceCache,
    reader: Reader,
    itemsize: int,
    sources: _SourceChecks,
) -> None:
    for src in item.sources:
        raw = cache.raw(item.source_fqn, src)
        runs = list(copy_runs(src.offsets, src.sizes, block_offsets, block_sizes))
        if not runs:
            continue
        sources.check(raw, item.source_fqn)
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


def _write_tensor(
    fd: int,
    item: TensorItem,
    cache: SourceCache,
    reader: Reader,
    progress: ByteProgress,
    scratch: Scratch,
    writeback: _Writeback,
    checks: RecordChecks,
    sources: _SourceChecks,
    segments: list[Segment] | None = None,
) -> None:
    layout = torch_archive.tensor_archive_layout(item.dtype, item.sizes)
    pwrite_all(fd, layout.head, item.offset)
    itemsize = dtypes.dtype(item.dtype).itemsize
    pos = item.offset + layout.data_offset
    if item.data is not None:
        # a value the source held decoded (small: the plan holds its bytes)
        pwrite_all(fd, item.data, pos)
        pwrite_all(fd, layout.tail(crc32(item.data, 0)), pos + layout.nbytes)
        progress.update(len(item.data))
        return
    if segments is not None:
        crc = copy_segments(fd, pos, segments, item.source_fqn, reader, progress, scratch, checks)
        pwrite_all(fd, layout.tail(crc), pos + layout.nbytes)
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
        _fill_block(view, item, offs, box, cache, reader, itemsize, sources)
        crc = crc32(view, crc)
        pwrite_all(fd, view, pos)
        pos += nbytes
        progress.update(nbytes)
    pwrite_all(fd, layout.tail(crc), pos)
    writeback.written(fd, item.offset + item.length)


def _copy_object(fd: int, item: ObjectItem, reader: Reader) -> None:
    if item.data is not None:
        pwrite_all(fd, item.data, item.offset)
        return
    checked_copy.check_object_item(
        reader, item.source_file, item.source_offset, item.length, item.fqn, BLOCK_BYTES
    )
    done = 0
    while done < item.length:
        n = min(BLOCK_BYTES, item.length - done)
        data = reader.read(item.source_file, item.source_offset + done, n)
        pwrite_all(fd, data, item.offset + done)
        done += n


def share_of(manifest: Manifest, plan: DcpPlan, files: Collection[int]) -> tuple[Manifest, DcpPlan]:
    """What :func:`write_dcp` needs to write the rank files ``files`` of ``plan``
    (``only_files``) from ``manifest``: the plan's items of those files
    (:meth:`ckptools.plan.dcp.DcpPlan.of_files`), and of the manifest only the entries those
    items read, without their chunks. The writer finds each source entry by an item's
    ``source_fqn``, for its name and dtype (:class:`ckptools.engine.reader.SourceCache`); the
    chunks it reads are the item's own ``sources``, and an object item names its own bytes.

    Under torchrun rank 0 reads the source and hands each other rank this, so that no other
    rank reads the source's metadata (:mod:`ckptools.engine.collective`).
    """
    share = plan.of_files(files)
    entries = {}
    for item in share.tensors:
        if item.source_fqn not in entries and item.data is None:
            entry = manifest.tensors[item.source_fqn]
            entries[item.source_fqn] = TensorEntry(entry.fqn, entry.dtype, entry.shape, ())
    source = Manifest(
        root=manifest.root, format=manifest.format, layout=manifest.layout, tensors=entries,
        objects={}, files={}, world_size=manifest.world_size, data_root=manifest.data_root,
    )  # fmt: skip
    return source, share


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
    # The commit syncs the directory once, after everything else is in it.
    storage.write_atomic(storage.join(out_dir, METADATA_FILE), data, sync_dir=False)


class _OutputFiles:
    """The ``__r_0.distcp`` files, each open only while it has items left to write.

    Items run in (rank, offset) order, so only about ``workers`` files are open at once: a
    reshard to 1,024 ranks never holds 1,024 descriptors (a common ``ulimit -n``). A file is
    created (empty, even when it gets no item, as DCP writes one per rank), and after its last
    item handed to a :class:`ckptools.engine.runtime.FileSyncer` that fsyncs, closes and reports
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
    torchrun, see :mod:`ckptools.engine.collective`) only those files are written, and no
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
    filled = dict.fromkeys(mine, 0)
    for item in tasks:
        filled[item.rank] += item.length
    if any(filled[r] != plan.file_sizes[r] for r in mine):
        # a share that lacks items (:func:`share_of` given other files than a rank writes)
        # would write, and journal as complete, files with holes: a bug, never a result
        raise ValueError(f"the plan's items do not fill rank files {sorted(mine)}")
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
        cache = SourceCache(reader, manifest)
        writeback = _Writeback()
        segments, checks = resolve_segments(tasks, cache)
        sources = _SourceChecks(reader)

        def run(index: int, item: TensorItem | ObjectItem) -> None:
            fd = files.acquire(item.rank)
            if isinstance(item, ObjectItem):
                _copy_object(fd, item, reader)
                bar.update(item.length)
            else:
                scratch = getattr(local, "scratch", None)
                if scratch is None:
                    scratch = local.scratch = Scratch()
                _write_tensor(
                    fd, item, cache, reader, bar, scratch, writeback, checks, sources,
                    segments.get(index),
                )  # fmt: skip
            # Only an item written whole counts toward its file's completion: a file whose
            # item failed or was interrupted is never synced and journaled as done (a resumed
            # run would keep it); its descriptor is closed when the files are.
            files.release(item.rank)

        # One queue in file order; on the first error or Ctrl-C the rest are cancelled.
        run_all(lambda task: run(*task), list(enumerate(tasks)), workers, lambda: None)
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
    rank files (:data:`ckptools.io.spool.MAX_PENDING_UPLOADS` plus those being written).
    """
    from ckptools.io.spool import spool_uploads

    mine = list(range(plan.world_size)) if only_files is None else sorted(set(only_files))
    step = max(1, workers)
    rank_of = {file_name(rank): rank for rank in mine}
    written = 0

    def write(spool: str, names: Sequence[str]) -> None:
        nonlocal written
        written += write_dcp(
            manifest, plan, spool, source_root=source_root, workers=workers, quiet=quiet,
            only_files=[rank_of[n] for n in names],
        )  # fmt: skip

    groups = [[file_name(r) for r in mine[i : i + step]] for i in range(0, len(mine), step)]
    report = on_file_done
    done = None if report is None else (lambda name: report(rank_of[name]))
    spool_uploads(out_url, groups, write, done)
    if only_files is None:
        write_metadata(out_url, plan)
    return written
