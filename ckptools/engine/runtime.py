"""What both writers (the consolidation executor and the DCP writer) run on: threads, a syncing
thread, and the two ways bytes move.

* :func:`run_all`: ``workers`` threads take tasks in order from one FIFO queue; the first error
  (or Ctrl-C) stops the rest, and is the one raised.
* :class:`FileSyncer`: one thread fsyncs finished output files while the copy threads go on.
* :func:`kernel_copy`: ``os.copy_file_range`` between files, no user-space buffer at all.
* :func:`pwrite_all`: a positional write that finishes a short write, so threads never contend
  on a file position.
* :class:`Scratch`: one reusable block buffer per writing thread.

A write that finds the disk full (``ENOSPC``, ``EDQUOT``, ``EFBIG``) raises
:class:`~ckptools.errors.DiskFullError` naming the file (found from its descriptor), the bytes the
run still needed and those free (:mod:`ckptools.io.space`), instead of a bare ``OSError``.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, NoReturn, TypeVar

from ckptools.errors import PieceAbortedError
from ckptools.io import space

T = TypeVar("T")
K = TypeVar("K")

log = logging.getLogger(__name__)

#: Largest single buffer, and the DCP writer's block per file being written: beyond ~16 MiB per
#: read/write call, syscall overhead is already <0.1%, and smaller blocks let several threads
#: keep the disk busy (writing a few files at once stays far below the 512 MiB budget).
BLOCK_BYTES = 16 * 2**20
#: Finished output files that may wait for their fsync at once (each keeps a descriptor open).
SYNCS_PENDING = 4
#: Bytes per copy_file_range call: no memory is involved, so only the latency of a stop (error,
#: Ctrl-C) bounds it; at ~2 GB/s a step takes ~0.1 s.
KERNEL_COPY_STEP_BYTES = 256 * 2**20
# errnos with which copy_file_range says "not here" (other filesystem, old kernel, special file)
_NO_COPY_RANGE = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF}


def run_all(
    task: Callable[[T], None],
    items: Sequence[T],
    workers: int,
    on_error: Callable[[], None],
) -> None:
    """Run ``task`` on every item, ``workers`` threads taking them in order from one FIFO queue.

    On the first error (or Ctrl-C) ``on_error`` tells the running tasks to stop, no further item
    is taken, and once the running ones have returned the first real error is raised: of the
    failures in the order their pieces ended, the first that is not a
    :class:`~ckptools.errors.PieceAbortedError` (a piece that gave up because another failed,
    which may end before the piece that failed has finished cleaning up). A disk-full
    ``OSError`` that names its file is raised as :class:`~ckptools.errors.DiskFullError`.

    The queue is a shared position in ``items``, not a future per item: a 405B reshard hands a
    rank a million items, and a queued ``concurrent.futures.Future`` each held ~2 KB (2 GiB).
    """
    if workers <= 1:
        for item in items:
            _run_one(task, item)
        return
    failures: list[BaseException] = []
    lock = threading.Lock()
    stop = threading.Event()
    positions = iter(range(len(items)))

    def take() -> None:
        while not stop.is_set():
            with lock:
                i = next(positions, None)
            if i is None:
                return
            try:
                _run_one(task, items[i])
            except BaseException as e:
                with lock:  # in the order they happened
                    failures.append(e)
                stop.set()
                on_error()
                return

    threads = [
        threading.Thread(target=take, name=f"ckpt-copy_{n}")
        for n in range(min(workers, len(items)))
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except BaseException:  # Ctrl-C: the running tasks are told to stop, the interrupt raised
        stop.set()
        on_error()
        for t in threads:
            if t.ident is not None:  # started
                t.join()
        raise
    if failures:
        first = next((e for e in failures if not isinstance(e, PieceAbortedError)), None)
        raise first if first is not None else failures[0]


def _run_one(task: Callable[[T], None], item: T) -> None:
    try:
        task(item)
    except OSError as e:
        if space.is_disk_full(e) and e.filename is not None:
            raise space.disk_full(e, None) from e
        raise


def _disk_full(e: OSError, fd: int) -> NoReturn:
    """Re-raise ``e``, written to ``fd``, as the disk-full error naming its file, if it is one."""
    if space.is_disk_full(e):
        raise space.disk_full(e, space.path_of_fd(fd)) from e
    raise e


class FileSyncer(Generic[K]):
    """fsyncs finished output files on one thread while the copy threads go on, then reports
    each (``on_done(key)``, e.g. to journal it): a copy thread never waits for the disk to
    flush a file it just finished. At most ``max_pending`` files wait (each keeps a descriptor
    open; :meth:`submit` blocks beyond that). :meth:`drain` waits for all and raises the first
    error; call it before anything (a marker) relies on the files being durable.

    ``stop``: the writers' stop flag. A file whose sync runs once it is set is fsynced and
    closed but not reported: a writer told to stop returns early from the piece it was copying,
    so the file counted complete may lack that piece's bytes, and a journal must never record
    it (a resumed run would keep it). A complete file not reported is only written again.
    """

    def __init__(
        self,
        on_done: Callable[[K], None] | None = None,
        *,
        close: bool = True,
        max_pending: int = SYNCS_PENDING,
        stop: threading.Event | None = None,
    ) -> None:
        self._on_done = on_done
        self._stop = stop
        self._close = close
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-fsync")
        self._slots = threading.Semaphore(max_pending)
        self._futures: list[Future[None]] = []
        self._lock = threading.Lock()

    def submit(self, key: K, fd: int) -> None:
        """fsync ``fd`` (and close it, if the syncer owns it), then report ``key``."""
        self._slots.acquire()
        future = self._pool.submit(self._sync, key, fd)
        with self._lock:
            self._futures.append(future)

    def _sync(self, key: K, fd: int) -> None:
        try:
            try:
                os.fsync(fd)  # where a network filesystem may first say the disk is full
            except OSError as e:
                _disk_full(e, fd)
            finally:
                if self._close:
                    os.close(fd)
            if self._on_done is not None and not (self._stop is not None and self._stop.is_set()):
                self._on_done(key)
        finally:
            self._slots.release()

    def drain(self) -> None:
        with self._lock:
            futures, self._futures = self._futures, []
        for future in futures:
            future.result()

    def shutdown(self) -> None:
        """Let the syncs in flight finish (after an error, too: they are whole files)."""
        self._pool.shutdown(wait=True)


def kernel_copy(
    src_fd: int | None,
    dst_fd: int,
    src_off: int,
    dst_off: int,
    nbytes: int,
    on_progress: Callable[[int], None],
    stop: threading.Event | None = None,
) -> bool:
    """Copy ``nbytes`` between files inside the kernel (``os.copy_file_range``).

    Returns False, having copied nothing, where the kernel or filesystem does not support it, or
    the source has no descriptor (``src_fd`` None: an object store); the caller falls back to
    reads and writes. Raises ``EOFError(offset)`` at a short source.
    """
    if src_fd is None or not hasattr(os, "copy_file_range"):
        return False
    done = 0
    while done < nbytes:
        if stop is not None and stop.is_set():
            return True
        step = min(nbytes - done, KERNEL_COPY_STEP_BYTES)
        try:
            n = os.copy_file_range(src_fd, dst_fd, step, src_off + done, dst_off + done)
        except OSError as e:
            if e.errno in _NO_COPY_RANGE and done == 0:
                log.debug("copy_file_range unavailable (%s); using pread/pwrite", e)
                return False
            _disk_full(e, dst_fd)
        if n == 0:
            raise EOFError(src_off + done)
        done += n
        on_progress(n)
    return True


#: Bytes one ``os.pwrite`` hands the kernel at most. On this project's VM (Linux 6.18, ext4) a
#: large buffered write was often 5-12x as slow, all of it in the kernel's copy into the page
#: cache (``copy_folio_from_iter_atomic``; likely the large folios such a write allocates, from
#: memory the host had to fault back in): the 250 MB of a TP-2 run's row blocks took 0.27-0.86 s
#: of CPU in 7 of 8 runs as 8 MiB writes, 0.06-0.11 s in 8 of 8 as 1 MiB writes (0.09-0.24 s
#: as 64 KiB). ``copy_file_range`` (which splices page by page) was never slow. Smaller writes
#: only add system calls (~1,000 per GB).
WRITE_BYTES = 2**20


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset``, at most :data:`WRITE_BYTES` per ``os.pwrite``
    (which may also write less than asked).

    Raises:
        DiskFullError: the disk, a quota or the file-size limit is full (names the file).
    """
    view = memoryview(data)
    try:
        while view:
            n = os.pwrite(fd, view[:WRITE_BYTES], offset)
            view = view[n:]
            offset += n
    except OSError as e:
        _disk_full(e, fd)


class Scratch:
    """One reusable block buffer per writing thread (a fresh 16 MiB bytearray per block would
    cost a zero-fill and an allocation each time)."""

    def __init__(self) -> None:
        self._buf = bytearray(0)

    def view(self, nbytes: int) -> memoryview:
        if len(self._buf) < nbytes:
            self._buf = bytearray(max(nbytes, BLOCK_BYTES))
        return memoryview(self._buf)[:nbytes]
