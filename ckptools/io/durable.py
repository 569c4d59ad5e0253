"""Making local files durable: the fsyncs an atomic commit relies on, written once.

A commit is only as good as the order in which bytes reach the disk: every data file must be
durable before the marker that declares it complete, and a rename only survives a crash once its
directory entry is fsynced. These are the local-disk primitives for that; they know nothing of
URLs (an uploaded object is durable when its PUT returns, so object stores need none of this:
:mod:`ckptools.io.paths` and :mod:`ckptools.io.staging` choose when to call them).
"""

from __future__ import annotations

import contextlib
import errno
import os

from ckptools.io import space

#: errnos of filesystems that cannot fsync a directory (some network and FUSE filesystems):
#: their directory entries are as durable as they will get, so refusing to commit would not help.
_DIR_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF})


def fsync_file(path: str) -> None:
    """fsync the existing file ``path`` (one another writer or a copy produced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """fsync the directory ``path``, making the entries created or renamed in it durable.

    A missing directory raises; a filesystem that cannot fsync directories is tolerated.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def fsync_tree(directory: str) -> None:
    """fsync every file and directory below ``directory``: what a writer that did not sync its
    own files (torch's DCP writer, with ``sync_files`` off) needs before its marker."""
    for dirpath, _, filenames in os.walk(directory):
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def write_synced(path: str, data: bytes, *, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` and fsync it before returning. ``exclusive``: the file must
    not exist yet (a writer's own index or marker: an existing one is a bug, not a replace).
    A full disk raises :class:`~ckptools.errors.DiskFullError` naming ``path``."""
    with space.translated(path), open(path, "xb" if exclusive else "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_synced(path: str, data: bytes, *, sync_dir: bool = True) -> None:
    """Atomically replace ``path`` with ``data``: written to a temporary name beside it, fsynced,
    renamed over ``path``, and (``sync_dir``) the directory fsynced. A crash leaves the old
    content or the new, never a torn file under ``path`` (at worst a ``<name>.tmp-<id>`` file
    beside it). Without ``sync_dir`` a crash may bring the old content back: fine for a record
    that only saves work (a resume journal), not for a commit marker."""
    tmp = f"{path}.tmp-{os.urandom(4).hex()}"
    try:
        write_synced(tmp, data, exclusive=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if sync_dir:
        fsync_dir(os.path.dirname(os.path.abspath(path)))
