"""Atomic output directories: write into ``<out>.tmp-<id>/`` beside OUT, then rename.

Every writer commits this way. The caller writes its marker (DCP ``.metadata``, the safetensors
index) last inside the temporary directory; :func:`output_dir` then fsyncs and renames it onto
OUT. An exception, Ctrl-C or full disk removes the temporary directory, so nothing that looks
complete is ever left behind (a kill -9 leaves only a ``*.tmp-*`` directory, never OUT).
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import UsageError


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_writable(out: str, overwrite: bool) -> None:
    """Refuse an existing OUT unless ``overwrite`` (checked before any work starts)."""
    if os.path.lexists(out) and not overwrite:
        raise UsageError(f"{out}: already exists; pass --overwrite to replace it", path=out)


def commit(tmp: str, out: str, overwrite: bool) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` (with ``overwrite``) is moved aside first."""
    old = None
    if os.path.lexists(out):
        if not overwrite:
            raise UsageError(f"{out}: appeared while writing; pass --overwrite to replace it")
        old = f"{os.path.abspath(out)}.old-{secrets.token_hex(4)}"
        os.rename(out, old)
    os.rename(tmp, out)
    fsync_dir(os.path.dirname(os.path.abspath(out)))
    if old is not None:
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.remove(old)


def make_tmp_dir(out: str) -> str:
    """Create and return ``<out>.tmp-<random>/`` beside ``out`` (same filesystem: rename works)."""
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{os.path.abspath(out)}.tmp-{secrets.token_hex(4)}"
    os.mkdir(tmp)
    return tmp


def write_file_synced(path: str, data: bytes) -> None:
    """Write a new small file (an index, a marker) and fsync it before anyone relies on it."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def output_dir(out: str, *, overwrite: bool = False) -> Iterator[str]:
    """Yield a fresh temporary directory beside ``out``; commit it to ``out`` on success.

    Example:
        >>> with output_dir("/tmp/model-out", overwrite=True) as tmp:   # doctest: +SKIP
        ...     write_everything_into(tmp)                                # marker last
    """
    check_writable(out, overwrite)
    tmp = make_tmp_dir(out)
    try:
        yield tmp
        fsync_dir(tmp)
        commit(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
