"""Disk space of local outputs: the check before a run writes, and the error when a write finds
the disk full.

A full disk surfaces as a bare ``OSError`` from a positional write or a kernel copy, which names
no file, and only after minutes of work. Two things make it a one-line error the user can act
on, written once here for every writer (consolidate, reshard, shard, ``save_pretrained``):

* :func:`reserve`: once the staging location exists, the writer states the bytes of the whole
  output; what is not already there (a resumed run's files) is compared with the free space of
  the output's filesystem before a byte is written, and refused with both numbers
  (``CKPTOOLS_SPACE_CHECK=0`` skips the comparison, for filesystems whose ``statvfs`` reports
  less than they take). The figure is remembered, so that an error later can say how much more
  the run needed.
* :func:`disk_full` turns ``ENOSPC``, ``EDQUOT`` and ``EFBIG`` (a quota, a file-size limit:
  ``ulimit -f``) into a :class:`~ckptools.errors.DiskFullError` naming the file being written,
  the bytes the run still needed and the bytes free on the filesystem's mount point, e.g.
  ``OUT.tmp-1a2b/model-00002-of-00004.safetensors: no space left on device: this run needs
  2.1 GB more, 0.4 GB free on /mnt/x``. Both are measured when the error happens, before the
  staging location is removed (which frees the space again).

Local paths only: an object store has no free space to ask for, and its spool directory holds
only a few files at a time.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Iterator

from ckptools.core.sizes import human_size
from ckptools.errors import DiskFullError
from ckptools.io import tunables

#: What a write answers when the space (or the quota, or the file-size limit) is exhausted.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_WHAT = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large for this filesystem or this process's file size limit (ulimit -f)",
}
_expected: dict[str, int] = {}  # staging location (absolute) -> bytes of the whole output
_lock = threading.Lock()


def is_disk_full(e: BaseException) -> bool:
    """``e`` is a system error saying the space, a quota or a file-size limit ran out (and not
    already a :class:`DiskFullError`)."""
    return (
        isinstance(e, OSError) and not isinstance(e, DiskFullError) and e.errno in DISK_FULL_ERRNOS
    )


def _existing(path: str) -> str:
    """``path`` or its nearest existing ancestor (what ``statvfs`` can be asked about)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def mount_point(path: str) -> str:
    """The mount point of the filesystem that holds ``path`` (or would hold it)."""
    path = os.path.realpath(_existing(path))
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def free_bytes(path: str) -> int:
    """Bytes this (unprivileged) user may still write on the filesystem of ``path``."""
    st = os.statvfs(_existing(path))
    return st.f_bavail * st.f_frsize


def allocated_bytes(directory: str) -> int:
    """Bytes of the files under ``directory`` already on disk: each file's allocated blocks, so
    that one created at its final size counts for what was written into it, and at most its
    size, so that a file's last partial block does not count as more than it holds."""
    total = 0
    for dirpath, _, filenames in os.walk(directory):
        for name in filenames:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                total += min(st.st_size, st.st_blocks * 512)
    return total


def reserve(location: str, nbytes: int) -> None:
    """The run writing into the local staging location ``location`` will write ``nbytes`` in
    all: refuse it now if the filesystem lacks the part not yet written, and remember the figure
    for :func:`disk_full`. Call once the location exists, before writing into it.

    Raises:
        DiskFullError: less is free than the run still has to write (unless
            ``CKPTOOLS_SPACE_CHECK=0``).
        UsageError: ``CKPTOOLS_SPACE_CHECK`` holds something other than 0 or 1.
    """
    with _lock:
        _expected[os.path.abspath(location)] = nbytes
    if not tunables.space_check():
        return
    need = nbytes - allocated_bytes(location)
    free = free_bytes(location)
    if need > free:
        mount = mount_point(location)
        raise DiskFullError(
            f"{location}: not enough space: this run writes {human_size(need)}, "
            f"{human_size(free)} free on {mount}; free some space or write elsewhere "
            f"({tunables.SPACE_CHECK_ENV}=0 skips this check, for a filesystem that reports "
            "less than it holds)",
            errno=errno.ENOSPC, path=location, needed_bytes=need, free_bytes=free, mount=mount,
        )  # fmt: skip


def release(location: str) -> None:
    """Forget what :func:`reserve` remembered for ``location`` (committed or discarded)."""
    with _lock:
        _expected.pop(os.path.abspath(location), None)


def _reserved_for(path: str) -> tuple[str, int] | None:
    path = os.path.abspath(path)
    with _lock:
        for location, nbytes in _expected.items():
            if path == location or path.startswith(location + os.sep):
                return location, nbytes
    return None


def disk_full(e: OSError, path: str | None) -> DiskFullError:
    """The one-line error for the disk-full ``e`` raised while writing ``path`` (the file being
    written; None when unknown, then ``e.filename`` is used): what the system said, the bytes
    the run still needed (when :func:`reserve` was told) and the bytes free on the mount point.
    """
    where = path or (os.fsdecode(e.filename) if e.filename is not None else None)
    what = _WHAT.get(e.errno or 0, e.strerror or str(e))
    if where is None:
        return DiskFullError(f"{what} while writing the output", errno=e.errno or errno.ENOSPC)
    free: int | None = None
    mount: str | None = None
    with contextlib.suppress(OSError):
        free, mount = free_bytes(where), mount_point(where)
    needed: int | None = None
    reserved = _reserved_for(where)
    if reserved is not None:
        needed = max(0, reserved[1] - allocated_bytes(reserved[0]))
    facts = []
    if needed is not None:
        facts.append(f"this run needs {human_size(needed)} more")
    if free is not None:
        facts.append(f"{human_size(free)} free on {mount}")
    tail = f": {', '.join(facts)}" if facts else ""
    return DiskFullError(
        f"{where}: {what}{tail}",
        errno=e.errno or errno.ENOSPC, path=where, needed_bytes=needed, free_bytes=free,
        mount=mount,
    )  # fmt: skip


def disk_full_cause(e: BaseException) -> OSError | None:
    """The disk-full ``OSError`` behind ``e``, where a library wrapped it: ``e`` itself, its
    ``__cause__``/``__context__`` chain, or the per-rank failures a torch
    ``CheckpointException`` carries (``failures``: rank -> exception, or (exception,
    traceback)); None when there is none."""
    seen: set[int] = set()
    todo: list[object] = [e]
    while todo:
        item = todo.pop()
        if isinstance(item, tuple) and item:
            item = item[0]
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and item.errno in DISK_FULL_ERRNOS:
            return item
        todo += [item.__cause__, item.__context__]
        failures = getattr(item, "failures", None)
        if isinstance(failures, dict):
            todo += list(failures.values())
    return None


@contextlib.contextmanager
def translated(path: str | None) -> Iterator[None]:
    """Inside, a disk-full ``OSError`` becomes :func:`disk_full`'s error about ``path``, also
    where a library wrapped it (:func:`disk_full_cause`: torch's ``CheckpointException``, which
    derives from ``BaseException``). An interrupt passes unchanged."""
    try:
        yield
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit, DiskFullError)):
            raise
        cause = disk_full_cause(e)
        if cause is None:
            raise
        raise disk_full(cause, path) from e


def path_of_fd(fd: int) -> str | None:
    """The path the open descriptor ``fd`` was opened with, where the system can tell (Linux's
    ``/proc/self/fd``, macOS's ``F_GETPATH``); None elsewhere. For errors only: a positional
    write knows its descriptor, not its file."""
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/self/fd/{fd}")
    import fcntl

    getpath = getattr(fcntl, "F_GETPATH", None)
    if getpath is not None:
        with contextlib.suppress(OSError):
            raw = fcntl.fcntl(fd, getpath, bytes(1024))
            return os.fsdecode(raw.split(b"\0", 1)[0])
    return None
