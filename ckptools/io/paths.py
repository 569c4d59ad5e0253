"""Path primitives: local paths through ``os``, everything else through fsspec.

This is the one module that knows the difference. Paths are ``str`` throughout (a ``Path`` would
mangle ``s3://``); a path with a scheme (``s3://``, ``gs://``, ``memory://``, ...) is a URL and goes
through ``fsspec.core.url_to_fs`` with the options in force (:mod:`ckptools.io.options`), anything
else (and ``file://``) stays a local path with its fast path intact.

:func:`join`, :func:`exists`, :func:`isdir`, :func:`listdir`, :func:`file_sizes`,
:func:`walk_files`, :func:`read_bytes`, :func:`write_bytes`, :func:`remove_tree`, ... are what
layouts, verify, list and prune use instead of ``os.path``; they are reached through the facade
:mod:`ckptools.io.storage`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import shutil
import stat
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckptools.errors import UsageError
from ckptools.io import durable
from ckptools.io.options import options_for

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem


def is_url(path: str) -> bool:
    """True for ``s3://``, ``gs://``, ``memory://``, chained (``simplecache::s3://``) URLs;
    False for local paths and ``file://`` URLs."""
    return "://" in path and not path.startswith(("file://", "local://"))


def local_path(path: str) -> str:
    """``path`` without a ``file://`` or ``local://`` prefix: what ``os`` functions take."""
    for prefix in ("file://", "local://"):
        if path.startswith(prefix):
            return path[len(prefix) :]
    return path


def protocol_of(path: str) -> str:
    return path.split("::")[-1].split("://", 1)[0] if is_url(path) else "file"


#: the top-level packages of the network and cloud clients fsspec's backends raise from
_REMOTE_CLIENTS = frozenset(
    {"botocore", "aiobotocore", "aiohttp", "google", "gcsfs", "adlfs", "azure", "requests"}
)


def remote_failure(e: BaseException) -> str | None:
    """One line for an error an fsspec backend raised reaching its store (no connection, no
    credentials, a refused request) that it did not turn into an ``OSError``; None for any
    other error."""
    if not any(c.__module__.split(".")[0] in _REMOTE_CLIENTS for c in type(e).__mro__):
        return None
    said = " ".join(str(e).split()) or type(e).__name__
    return (
        f"the object store could not be reached or refused the request ({said}); check its "
        "endpoint and credentials (the AWS_* / provider environment, or --storage-options)"
    )


def filesystem(path: str) -> tuple[AbstractFileSystem, str]:
    """``(fsspec filesystem, path inside it)`` for a URL, with the options in force."""
    from fsspec.core import url_to_fs

    try:
        return url_to_fs(path, **options_for(protocol_of(path)))  # type: ignore[no-any-return]
    except (ImportError, ValueError) as e:
        raise UsageError(
            f"{path}: cannot open this URL ({e}); install the fsspec backend for "
            f"{protocol_of(path)}:// (e.g. `pip install ckptools[s3]` for s3://)"
        ) from e


def _fresh(path: str) -> tuple[AbstractFileSystem, str]:
    """The filesystem, with its listing cache for ``path`` dropped: other processes (ranks, a
    second ``ckpt`` run) write to the same prefix, and a stale listing would hide their files."""
    fs, inner = filesystem(path)
    fs.invalidate_cache(inner)
    return fs, inner


def join(root: str, *rels: str) -> str:
    """``root/rel...``; ``rel`` alone when ``root`` is empty. URLs join with ``/`` always."""
    parts = [r for r in rels if r]
    if not root:
        root, parts = (parts[0], parts[1:]) if parts else ("", [])
    if not parts:
        return root
    if is_url(root):
        return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts)])
    return os.path.join(root, *parts)


def dirname(path: str) -> str:
    if is_url(path):
        scheme, _, rest = path.partition("://")
        rest = rest.rstrip("/")
        if "/" not in rest:
            return f"{scheme}://{rest}"  # a bucket is its own parent, as "/" is locally
        return f"{scheme}://{posixpath.dirname(rest)}"
    return os.path.dirname(local_path(path))


def basename(path: str) -> str:
    if is_url(path):
        return posixpath.basename(path.rstrip("/"))
    return os.path.basename(os.path.normpath(local_path(path)))


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(local_path(path))
    fs, inner = _fresh(path)
    return bool(fs.exists(inner))


def lexists(path: str) -> bool:
    return os.path.lexists(local_path(path)) if not is_url(path) else exists(path)


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(local_path(path))
    fs, inner = _fresh(path)
    return bool(fs.isdir(inner))


def isfile(path: str) -> bool:
    if not is_url(path):
        return os.path.isfile(local_path(path))
    fs, inner = _fresh(path)
    return bool(fs.isfile(inner))


def listdir(path: str) -> list[str]:
    """Names directly inside ``path`` (files and directories), like ``os.listdir``.

    Raises:
        FileNotFoundError: ``path`` is no directory.
    """
    if not is_url(path):
        return os.listdir(local_path(path))
    fs, inner = _fresh(path)
    try:
        entries = fs.ls(inner, detail=False)
    except FileNotFoundError:
        raise
    base = inner.rstrip("/")
    names = []
    for name in entries:
        name = str(name).rstrip("/")
        if name == base:
            continue  # some backends list a file "directory" as itself
        names.append(posixpath.basename(name))
    if not names and not fs.isdir(inner):
        raise FileNotFoundError(errno.ENOENT, "no such directory", path)
    return names


def file_sizes(directory: str, names: Sequence[str] | None = None) -> dict[str, int]:
    """Name -> size of the files directly in ``directory`` (only ``names`` when given; those
    that do not exist are left out, and a missing ``directory`` holds none, as on an object store
    where a prefix without objects is not there). One listing on object stores, one ``stat``
    each locally."""
    if not is_url(directory):
        local = local_path(directory)
        out: dict[str, int] = {}
        if names is None:
            try:
                names = os.listdir(local)
            except (FileNotFoundError, NotADirectoryError):
                return out
        for name in names:
            try:
                st = os.stat(os.path.join(local, name))
            except (FileNotFoundError, NotADirectoryError):
                continue
            if not stat.S_ISDIR(st.st_mode):
                out[name] = st.st_size
        return out
    if names is not None and any("/" in n for n in names):
        # files in subdirectories (accelerate's parts): one recursive listing
        found = walk_files(directory)
        return {n: found[n] for n in names if n in found}
    fs, inner = _fresh(directory)
    try:
        entries = fs.ls(inner, detail=True)
    except FileNotFoundError:
        return {}
    sizes = {
        posixpath.basename(str(e["name"]).rstrip("/")): int(e.get("size") or 0)
        for e in entries
        if e.get("type") != "directory"
    }
    if names is None:
        return sizes
    return {n: sizes[n] for n in names if n in sizes}


def size(path: str) -> int:
    if not is_url(path):
        return os.path.getsize(local_path(path))
    fs, inner = _fresh(path)
    return int(fs.size(inner))


def walk_files(directory: str) -> dict[str, int]:
    """Relative path (``/``-separated) -> size of every file below ``directory``."""
    if not is_url(directory):
        local = local_path(directory)
        sizes: dict[str, int] = {}
        for dirpath, _, filenames in os.walk(local):
            for name in filenames:
                full = os.path.join(dirpath, name)
                sizes[os.path.relpath(full, local)] = os.path.getsize(full)
        return sizes
    fs, inner = _fresh(directory)
    base = inner.rstrip("/") + "/"
    found = fs.find(inner, detail=True)
    return {
        str(name)[len(base) :]: int(info.get("size") or 0)
        for name, info in found.items()
        if str(name).startswith(base) and info.get("type") != "directory"
    }


def read_bytes(path: str) -> bytes:
    """The whole file. Raises ``FileNotFoundError`` when it does not exist."""
    if not is_url(path):
        with open(local_path(path), "rb") as f:
            return f.read()
    fs, inner = filesystem(path)
    return bytes(fs.cat_file(inner))


def read_range(path: str, start: int, length: int) -> bytes:
    """Up to ``length`` bytes at ``start`` (fewer at the end of the file)."""
    if not is_url(path):
        with open(local_path(path), "rb") as f:
            return os.pread(f.fileno(), length, start)
    fs, inner = filesystem(path)
    return bytes(fs.cat_file(inner, start=start, end=start + length))


def write_bytes(path: str, data: bytes, *, exclusive: bool = False) -> None:
    """Write a whole small file (marker, index, config). Locally: fsynced before it returns
    (``exclusive``: the file must not exist yet); on object stores one PUT, which makes the
    object appear whole or not at all."""
    if not is_url(path):
        durable.write_synced(local_path(path), data, exclusive=exclusive)
        return
    fs, inner = filesystem(path)
    fs.pipe_file(inner, data)


def write_atomic(path: str, data: bytes, *, sync_dir: bool = True) -> None:
    """Replace the small file ``path`` with ``data`` so that readers see the old or the new
    content, never a torn one: locally a synced temporary file renamed over it, the directory
    fsynced unless ``sync_dir`` is off (:func:`ckptools.io.durable.replace_synced`); on object
    stores one PUT, atomic already."""
    if not is_url(path):
        durable.replace_synced(local_path(path), data, sync_dir=sync_dir)
        return
    write_bytes(path, data)


def makedirs(path: str) -> None:
    """Create a local directory (and parents); object stores have no directories to create."""
    if not is_url(path):
        os.makedirs(local_path(path), exist_ok=True)
        return
    fs, inner = filesystem(path)
    with contextlib.suppress(OSError, NotImplementedError):
        fs.makedirs(inner, exist_ok=True)


def remove(path: str) -> None:
    """Delete one file (missing is fine)."""
    if not is_url(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(local_path(path))
        return
    fs, inner = _fresh(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(inner)


def remove_tree(path: str) -> None:
    """Delete a directory or prefix and everything below it (missing is fine)."""
    if not is_url(path):
        local = local_path(path)
        if os.path.isdir(local) and not os.path.islink(local):
            shutil.rmtree(local, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(local)
        return
    fs, inner = _fresh(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(inner, recursive=True)
    fs.invalidate_cache(inner)


def get_file(src: str, local_dst: str) -> None:
    """Copy ``src`` (local or URL) to the local path ``local_dst``."""
    if not is_url(src):
        shutil.copyfile(local_path(src), local_dst)
        return
    fs, inner = filesystem(src)
    fs.get_file(inner, local_dst)


def put_file(local_src: str, dst: str) -> None:
    """Copy the local file ``local_src`` to ``dst`` (local or URL). On object stores a big file
    goes up as a multipart upload (concurrent parts), which appears only once complete."""
    if not is_url(dst):
        shutil.copyfile(local_src, local_path(dst))
        return
    fs, inner = filesystem(dst)
    fs.put_file(local_src, inner)
