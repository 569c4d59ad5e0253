"""Where checkpoint bytes live: local paths through ``os``, everything else through fsspec.

This is the one module that knows the difference. Paths are ``str`` throughout (a ``Path`` would
mangle ``s3://``); a path with a scheme (``s3://``, ``gs://``, ``memory://``, ...) is a URL and goes
through ``fsspec.core.url_to_fs``, anything else (and ``file://``) stays a local path with its fast
path intact: positional reads, ``copy_file_range``, file descriptors held open.

* Path primitives (:func:`join`, :func:`exists`, :func:`isdir`, :func:`listdir`,
  :func:`file_sizes`, :func:`walk_files`, :func:`read_bytes`, :func:`remove_tree`, ...) are what
  layouts, verify, list and prune use instead of ``os.path``.
* Readers (:func:`open_reader`): :class:`LocalReader` (``pread`` on open descriptors) and
  :class:`RemoteReader` (ranged GETs: only the bytes asked for, large requests split into parts
  fetched concurrently, small reads of an archive's head and tail fetched together by
  :meth:`~RemoteReader.prefetch`). Both raise errors that name the file; a short read is a
  truncated file, not the bare ``EOFError`` torch gives.
* Credentials and endpoints come from the environment the backends read themselves
  (``AWS_*`` including ``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS``, fsspec's
  ``FSSPEC_<PROTOCOL>_<OPTION>``), and from :func:`storage_options`, a scoped setting that every
  public function taking ``storage_options=`` (and the CLI's ``--storage-options JSON``) enters.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import mmap
import os
import posixpath
import shutil
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

from ckptools.errors import CheckpointNotFoundError, CkptError, CorruptCheckpointError, UsageError
from ckptools.tunables import env_int

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

#: Largest single ranged GET. A bigger read is split into parts of this size fetched concurrently
#: (object stores serve one connection at ~50-100 MB/s, many in parallel at line rate); 8 MiB is
#: S3's own recommended part size and keeps each part's latency share small.
DEFAULT_REMOTE_PART_BYTES = 8 * 2**20
REMOTE_PART_BYTES_ENV = "CKPTOOLS_REMOTE_PART_BYTES"
#: Tail of a DCP item read to find its zip directory on object stores. A DCP item's directory
#: is well under 1 KiB; the local reader reads 64 KiB (free on a disk), but on a store every
#: byte is fetched, and these bytes count against reading ~1.0x the output.
REMOTE_ARCHIVE_TAIL_BYTES = 4096
LOCAL_ARCHIVE_TAIL_BYTES = 64 * 1024
#: Prefetched ranges kept per remote reader (archive heads and tails, small items whole): enough
#: for every worker thread's chunk in flight; the oldest go first past either bound.
_PREFETCH_SEGMENTS = 512
_PREFETCH_BYTES = 128 * 2**20


# --------------------------------------------------------------------------------------------------
# Storage options (credentials, endpoints)
# --------------------------------------------------------------------------------------------------

_scopes: list[dict[str, Any]] = []
_scopes_lock = threading.Lock()


def parse_storage_options(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """Options given as JSON text or a mapping; ``{}`` for None or empty.

    Raises:
        UsageError: not a JSON object.
    """
    if value is None or value == "":
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise UsageError(f"--storage-options: not JSON ({e})") from e
    if not isinstance(parsed, dict):
        raise UsageError("--storage-options: expected a JSON object, e.g. '{\"anon\": true}'")
    return parsed


def _per_protocol(options: Mapping[str, Any]) -> bool:
    """``{"s3": {...}, "gs": {...}}`` (options per protocol) rather than one flat set."""
    from fsspec.registry import known_implementations

    return bool(options) and all(
        k in known_implementations and isinstance(v, Mapping) for k, v in options.items()
    )


@contextlib.contextmanager
def storage_options(options: str | Mapping[str, Any] | None) -> Iterator[None]:
    """Use ``options`` for every URL opened inside the block (process-wide, so worker threads
    see them too). Either one flat set, passed to every URL's filesystem (``{"anon": true}``,
    ``{"endpoint_url": "http://127.0.0.1:9000"}``), or one set per protocol (``{"s3": {...},
    "gs": {...}}``) when source and destination are on different stores. Nested blocks merge.

    Example:
        >>> with storage_options({"anon": True}):          # doctest: +SKIP
        ...     ckptools.inspect("s3://public-bucket/ckpt")
    """
    token = push_storage_options(options)
    try:
        yield
    finally:
        pop_storage_options(token)


def push_storage_options(options: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Enter a :func:`storage_options` scope that outlives a ``with`` block (an object's
    lifetime); returns the token for :func:`pop_storage_options`."""
    parsed = parse_storage_options(options)
    if not parsed:
        return None
    with _scopes_lock:
        _scopes.append(parsed)
    return parsed


def pop_storage_options(token: dict[str, Any] | None) -> None:
    """Leave the scope :func:`push_storage_options` entered."""
    if token is None:
        return
    with _scopes_lock:
        for i in range(len(_scopes) - 1, -1, -1):
            if _scopes[i] is token:
                del _scopes[i]
                break


#: What ``storage_options=`` accepts: a mapping, or its JSON text (the CLI's ``--storage-options``).
StorageOptions = Mapping[str, Any] | str

_P = ParamSpec("_P")
_R = TypeVar("_R")


def accepts_storage_options(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``fn`` inside :func:`storage_options` of its ``storage_options=`` keyword argument: how
    the public functions' (and the CLI's) ``storage_options`` reach every URL they open, worker
    threads included, without threading them through each layer."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with storage_options(kwargs.get("storage_options")):  # type: ignore[arg-type]
            return fn(*args, **kwargs)

    return wrapper


def options_for(protocol: str) -> dict[str, Any]:
    """The options in force for URLs of ``protocol``."""
    merged: dict[str, Any] = {}
    with _scopes_lock:
        scopes = list(_scopes)
    for scope in scopes:
        if _per_protocol(scope):
            merged.update(scope.get(protocol, {}))
        else:
            merged.update(scope)
    return merged


# --------------------------------------------------------------------------------------------------
# Path primitives
# --------------------------------------------------------------------------------------------------


def is_url(path: str) -> bool:
    """True for ``s3://``, ``gs://``, ``memory://``, chained (``simplecache::s3://``) URLs;
    False for local paths and ``file://`` URLs."""
    return "://" in path and not path.startswith(("file://", "local://"))


def _local(path: str) -> str:
    for prefix in ("file://", "local://"):
        if path.startswith(prefix):
            return path[len(prefix) :]
    return path


def protocol_of(path: str) -> str:
    return path.split("::")[-1].split("://", 1)[0] if is_url(path) else "file"


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
    return os.path.dirname(_local(path))


def basename(path: str) -> str:
    if is_url(path):
        return posixpath.basename(path.rstrip("/"))
    return os.path.basename(os.path.normpath(_local(path)))


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(_local(path))
    fs, inner = _fresh(path)
    return bool(fs.exists(inner))


def lexists(path: str) -> bool:
    return os.path.lexists(_local(path)) if not is_url(path) else exists(path)


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(_local(path))
    fs, inner = _fresh(path)
    return bool(fs.isdir(inner))


def isfile(path: str) -> bool:
    if not is_url(path):
        return os.path.isfile(_local(path))
    fs, inner = _fresh(path)
    return bool(fs.isfile(inner))


def listdir(path: str) -> list[str]:
    """Names directly inside ``path`` (files and directories), like ``os.listdir``.

    Raises:
        FileNotFoundError: ``path`` is no directory.
    """
    if not is_url(path):
        return os.listdir(_local(path))
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
    that do not exist are left out). One listing on object stores, one ``stat`` each locally."""
    if not is_url(directory):
        local = _local(directory)
        out: dict[str, int] = {}
        for name in names if names is not None else os.listdir(local):
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
        return os.path.getsize(_local(path))
    fs, inner = _fresh(path)
    return int(fs.size(inner))


def walk_files(directory: str) -> dict[str, int]:
    """Relative path (``/``-separated) -> size of every file below ``directory``."""
    if not is_url(directory):
        local = _local(directory)
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
        with open(_local(path), "rb") as f:
            return f.read()
    fs, inner = filesystem(path)
    return bytes(fs.cat_file(inner))


def read_range(path: str, start: int, length: int) -> bytes:
    """Up to ``length`` bytes at ``start`` (fewer at the end of the file)."""
    if not is_url(path):
        with open(_local(path), "rb") as f:
            return os.pread(f.fileno(), length, start)
    fs, inner = filesystem(path)
    return bytes(fs.cat_file(inner, start=start, end=start + length))


def write_bytes(path: str, data: bytes) -> None:
    """Write a whole small file (marker, index, config). Locally: fsynced before it returns;
    on object stores one PUT, which makes the object appear whole or not at all."""
    if not is_url(path):
        with open(_local(path), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return
    fs, inner = filesystem(path)
    fs.pipe_file(inner, data)


def makedirs(path: str) -> None:
    """Create a local directory (and parents); object stores have no directories to create."""
    if not is_url(path):
        os.makedirs(_local(path), exist_ok=True)
        return
    fs, inner = filesystem(path)
    with contextlib.suppress(OSError, NotImplementedError):
        fs.makedirs(inner, exist_ok=True)


def remove(path: str) -> None:
    """Delete one file (missing is fine)."""
    if not is_url(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(_local(path))
        return
    fs, inner = _fresh(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(inner)


def remove_tree(path: str) -> None:
    """Delete a directory or prefix and everything below it (missing is fine)."""
    if not is_url(path):
        local = _local(path)
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
        shutil.copyfile(_local(src), local_dst)
        return
    fs, inner = filesystem(src)
    fs.get_file(inner, local_dst)


def put_file(local_src: str, dst: str) -> None:
    """Copy the local file ``local_src`` to ``dst`` (local or URL). On object stores a big file
    goes up as a multipart upload (concurrent parts), which appears only once complete."""
    if not is_url(dst):
        shutil.copyfile(local_src, _local(dst))
        return
    fs, inner = filesystem(dst)
    fs.put_file(local_src, inner)


# --------------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------------


class Reader(Protocol):
    """Positional reads of the files under ``root``; thread-safe. What executors and layouts use.

    ``fileno`` returns None where no descriptor exists (object stores): callers then take their
    buffered path instead of ``copy_file_range``.
    """

    root: str
    #: bytes :func:`ckptools.formats.torch_archive.read_archive` reads from an archive's end
    archive_tail_bytes: int

    def fileno(self, rel: str) -> int | None: ...

    def crc32(self, rel: str, offset: int, length: int) -> int | None: ...

    def size(self, rel: str) -> int: ...

    def read(self, rel: str, offset: int, length: int) -> bytes: ...

    def readinto(self, rel: str, offset: int, buf: memoryview) -> None: ...

    def prefetch(self, rel: str, ranges: Sequence[tuple[int, int]]) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> Reader: ...

    def __exit__(self, *exc: object) -> None: ...


def open_reader(root: str) -> Reader:
    """A :class:`LocalReader` for a local directory, a :class:`RemoteReader` for a URL."""
    if is_url(root):
        return RemoteReader(root)
    return LocalReader(_local(root))


def _open_read(path: str) -> int:
    """``os.open`` for reading; a checkpoint of many ranks keeps one descriptor per rank file
    open, so on EMFILE the soft ``RLIMIT_NOFILE`` is raised to the hard limit once and the open
    retried, and past that the error says what to do."""
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as e:
        if e.errno != errno.EMFILE:
            raise
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            try:
                return os.open(path, os.O_RDONLY)
            except OSError as again:
                if again.errno != errno.EMFILE:
                    raise
        raise CkptError(
            f"{path}: too many open files (limit {soft}/{hard}); raise it with `ulimit -n`",
            path=path,
        ) from e


#: Bytes of one read-only mapping when checksumming in place: large enough that the mmap calls
#: are few, small enough that the resident set stays far below the memory budget.
CRC_WINDOW_BYTES = 64 * 2**20


class LocalReader:
    """Positional reads from files under ``root``, keeping file descriptors open.

    Thread-safe: ``os.pread`` does not move a shared file position.
    """

    archive_tail_bytes = LOCAL_ARCHIVE_TAIL_BYTES

    def __init__(self, root: str) -> None:
        self.root = root
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _fd(self, rel: str) -> int:
        fd = self._fds.get(rel)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._fds.get(rel)
            if fd is None:
                path = join(self.root, rel)
                try:
                    fd = _open_read(path)
                except FileNotFoundError as e:
                    raise CheckpointNotFoundError(
                        f"{path}: file is missing (the checkpoint metadata refers to it)",
                        path=path,
                    ) from e
                self._fds[rel] = fd
            return fd

    def fileno(self, rel: str) -> int:
        """The open descriptor of ``rel`` (for ``os.copy_file_range``); owned by the reader."""
        return self._fd(rel)

    def size(self, rel: str) -> int:
        return os.fstat(self._fd(rel)).st_size

    def prefetch(self, rel: str, ranges: Sequence[tuple[int, int]]) -> None:
        """Nothing to do: the page cache and read-ahead serve local files."""

    def read(self, rel: str, offset: int, length: int) -> bytes:
        """Read exactly ``length`` bytes at ``offset`` of ``rel`` or raise."""
        fd = self._fd(rel)
        data = os.pread(fd, length, offset)
        if len(data) < length:
            # pread may return short for large requests; loop before declaring truncation.
            parts = [data]
            got = len(data)
            while got < length:
                more = os.pread(fd, length - got, offset + got)
                if not more:
                    path = join(self.root, rel)
                    raise CorruptCheckpointError(
                        f"{path}: file is truncated: needed bytes {offset}..{offset + length} but "
                        f"it ends at {os.fstat(fd).st_size}",
                        path=path,
                    )
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        return data

    def readinto(self, rel: str, offset: int, buf: memoryview) -> None:
        fd = self._fd(rel)
        got = 0
        while got < len(buf):
            n = os.preadv(fd, [buf[got:]], offset + got)
            if n == 0:
                path = join(self.root, rel)
                raise CorruptCheckpointError(
                    f"{path}: file is truncated at byte {offset + got}", path=path
                )
            got += n

    def crc32(self, rel: str, offset: int, length: int) -> int | None:
        """CRC-32 of bytes ``offset..offset+length`` of ``rel``, computed over the page cache in
        place (read-only ``mmap`` windows of :data:`CRC_WINDOW_BYTES`, unmapped as it goes, so
        neither a copy nor the resident set grows with the range); raises as :meth:`read` at a
        short file (checked first: touching a mapping past the end would be SIGBUS)."""
        from ckptools.core.crc32 import crc32

        fd = self._fd(rel)
        end = offset + length
        size = os.fstat(fd).st_size
        if end > size:
            path = join(self.root, rel)
            raise CorruptCheckpointError(
                f"{path}: file is truncated: needed bytes {offset}..{end} but it ends at {size}",
                path=path,
            )
        crc = 0
        pos = offset
        while pos < end:
            base = pos - pos % mmap.ALLOCATIONGRANULARITY
            span = min(end, base + CRC_WINDOW_BYTES) - base
            with mmap.mmap(fd, span, prot=mmap.PROT_READ, offset=base) as window:
                view = memoryview(window)
                try:
                    crc = crc32(view[pos - base : span], crc)
                finally:
                    view.release()
            pos = base + span
        return crc

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> LocalReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteReader:
    """Ranged reads of the objects under a URL ``root``, through fsspec.

    * Only the bytes asked for are fetched: no read-ahead past a request, so reading a
      checkpoint's tensors costs about the tensors' bytes (``bytes_fetched`` counts them).
    * A request larger than ``part_bytes`` is split into parts fetched concurrently in one
      ``cat_ranges`` call (s3fs and gcsfs run them in parallel), so one executor thread keeps
      several connections busy; executors add their own threads on top.
    * :meth:`prefetch` fetches several small ranges in one concurrent batch (a DCP item's
      archive head and tail) and keeps them, so the ~6 small reads that find a chunk's bytes
      cost one round trip instead of six.
    * ``fileno`` is None: executors take their buffered path.

    Thread-safe; holds no connection of its own (fsspec's filesystem instance does).
    """

    archive_tail_bytes = REMOTE_ARCHIVE_TAIL_BYTES

    def __init__(self, root: str, *, part_bytes: int | None = None) -> None:
        self.root = root.rstrip("/")
        self.fs, self._base = filesystem(self.root)
        self._base = self._base.rstrip("/")
        self.part_bytes = part_bytes or env_int(REMOTE_PART_BYTES_ENV, DEFAULT_REMOTE_PART_BYTES)
        self._sizes: dict[str, int] = {}
        # (rel, start) -> bytes, oldest first; per file, start -> bytes for lookups
        self._segments: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._by_file: dict[str, dict[int, bytes]] = {}
        self._cached_bytes = 0
        self._lock = threading.Lock()
        #: bytes received from the store so far (ranged GET payloads)
        self.bytes_fetched = 0
        #: ranged requests made so far
        self.requests = 0

    def _path(self, rel: str) -> str:
        return f"{self._base}/{rel}" if self._base else rel

    def _url(self, rel: str) -> str:
        return join(self.root, rel)

    def fileno(self, rel: str) -> None:
        return None

    def crc32(self, rel: str, offset: int, length: int) -> None:
        return None  # no page cache to checksum in place: callers read

    def size(self, rel: str) -> int:
        found = self._sizes.get(rel)
        if found is None:
            try:
                found = int(self.fs.size(self._path(rel)))
            except FileNotFoundError as e:
                raise self._missing(rel) from e
            self._sizes[rel] = found
        return found

    def _missing(self, rel: str) -> CheckpointNotFoundError:
        url = self._url(rel)
        return CheckpointNotFoundError(
            f"{url}: file is missing (the checkpoint metadata refers to it)", path=url
        )

    def _fetch(self, rel: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Fetch ``(start, end)`` ranges of ``rel`` concurrently; exactly those bytes or raise."""
        if not ranges:
            return []
        path = self._path(rel)
        if len(ranges) == 1:
            start, end = ranges[0]
            try:
                got: list[Any] = [self.fs.cat_file(path, start=start, end=end)]
            except FileNotFoundError as e:
                raise self._missing(rel) from e
        else:
            got = self.fs.cat_ranges(
                [path] * len(ranges), [s for s, _ in ranges], [e for _, e in ranges]
            )
        out: list[bytes] = []
        for (start, end), data in zip(ranges, got, strict=True):
            if isinstance(data, FileNotFoundError):
                raise self._missing(rel) from data
            if isinstance(data, BaseException):
                raise data
            if len(data) < end - start:
                url = self._url(rel)
                raise CorruptCheckpointError(
                    f"{url}: file is truncated: needed bytes {start}..{end} but it ends at "
                    f"{start + len(data)}",
                    path=url,
                )
            out.append(bytes(data))
        with self._lock:
            self.bytes_fetched += sum(len(d) for d in out)
            self.requests += len(out)
        return out

    def _cached(self, rel: str, offset: int, length: int) -> bytes | None:
        with self._lock:
            for start, data in (self._by_file.get(rel) or {}).items():
                if start <= offset and offset + length <= start + len(data):
                    return data[offset - start : offset - start + length]
        return None

    def prefetch(self, rel: str, ranges: Sequence[tuple[int, int]]) -> None:
        """Fetch the ``(offset, length)`` ranges of ``rel`` in one concurrent batch and keep them
        for the reads that follow (the most recent few hundred, up to 128 MiB, are kept)."""
        wanted = sorted((o, o + n) for o, n in ranges if n > 0)
        merged: list[tuple[int, int]] = []
        for start, end in wanted:  # neighbours and overlaps become one request
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        merged = [(s, e) for s, e in merged if self._cached(rel, s, e - s) is None]
        for (start, _), data in zip(merged, self._fetch(rel, merged), strict=True):
            with self._lock:
                self._segments[(rel, start)] = data
                self._by_file.setdefault(rel, {})[start] = data
                self._cached_bytes += len(data)
                while len(self._segments) > _PREFETCH_SEGMENTS or (
                    self._cached_bytes > _PREFETCH_BYTES and len(self._segments) > 1
                ):
                    (old_rel, old_start), old = self._segments.popitem(last=False)
                    del self._by_file[old_rel][old_start]
                    self._cached_bytes -= len(old)

    def _split(self, offset: int, length: int) -> list[tuple[int, int]]:
        part = self.part_bytes
        return [(o, min(o + part, offset + length)) for o in range(offset, offset + length, part)]

    def read(self, rel: str, offset: int, length: int) -> bytes:
        """Read exactly ``length`` bytes at ``offset`` of ``rel`` or raise."""
        if length <= 0:
            return b""
        hit = self._cached(rel, offset, length)
        if hit is not None:
            return hit
        parts = self._fetch(rel, self._split(offset, length))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def readinto(self, rel: str, offset: int, buf: memoryview) -> None:
        n = len(buf)
        if n == 0:
            return
        hit = self._cached(rel, offset, n)
        if hit is not None:
            buf[:] = hit
            return
        pos = 0
        for data in self._fetch(rel, self._split(offset, n)):
            buf[pos : pos + len(data)] = data
            pos += len(data)

    def close(self) -> None:
        with self._lock:
            self._segments.clear()
            self._by_file.clear()
            self._cached_bytes = 0

    def __enter__(self) -> RemoteReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
