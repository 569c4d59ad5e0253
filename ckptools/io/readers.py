"""Readers: positional, thread-safe reads of the files under a checkpoint root.

:func:`open_reader` gives a :class:`LocalReader` (``pread`` on open descriptors, CRC-32 over the
page cache in place) for a local directory and a :class:`RemoteReader` (ranged GETs: only the
bytes asked for, large requests split into parts fetched concurrently, small reads of an
archive's head and tail fetched together by :meth:`~RemoteReader.prefetch`) for a URL. Both raise
errors that name the file; a short read is a truncated file, not the bare ``EOFError`` torch gives.

Each reader also holds the items ckptools decoded for it (:class:`DecodedFiles`: a DCP item
stored through a stream transform, decoded once, in memory or into a private local spool):
reads of such an item's name go there, the one place outside the checkpoint a reader reads.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

from ckptools.errors import CheckpointNotFoundError, CkptError, CorruptCheckpointError
from ckptools.io.containment import contained
from ckptools.io.decoded import DecodedFiles
from ckptools.io.paths import filesystem, is_url, join, local_path
from ckptools.io.tunables import env_int

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


class Reader(Protocol):
    """Positional reads of the files under ``root``; thread-safe. What executors and layouts use.

    ``fileno`` returns None where no descriptor exists (object stores): callers then take their
    buffered path instead of ``copy_file_range``.
    """

    root: str
    #: bytes :func:`ckptools.formats.torch_archive.read_archive` reads from an archive's end
    archive_tail_bytes: int
    #: items decoded for this reader: their names read from memory or the spool ckptools made
    decoded: DecodedFiles

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
    return LocalReader(local_path(root))


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
#: are few (~120 per GB), small enough that the
#: resident set, which counts mapped pages, stays small: 8 MiB per copying thread.
CRC_WINDOW_BYTES = 8 * 2**20
#: Ranges at most this long are checksummed from a read into memory, not through a mapping.
CRC_READ_BYTES = 2**20


class LocalReader:
    """Positional reads from files under ``root``, keeping file descriptors open.

    Thread-safe: ``os.pread`` does not move a shared file position.
    """

    archive_tail_bytes = LOCAL_ARCHIVE_TAIL_BYTES

    def __init__(self, root: str) -> None:
        self.root = root
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.decoded = DecodedFiles()

    def _fd(self, rel: str) -> int:
        fd = self._fds.get(rel)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._fds.get(rel)
            if fd is None and rel in self.decoded:  # a spool file ckptools wrote itself
                fd = self._fds[rel] = os.open(self.decoded.path(rel), os.O_RDONLY)
            if fd is None:
                path = contained(self.root, rel, named_by=self.root, entry="asked for", links=False)
                try:
                    fd = _open_read(path)
                except FileNotFoundError as e:
                    raise CheckpointNotFoundError(
                        f"{path}: file is missing (the checkpoint metadata refers to it)",
                        path=path,
                    ) from e
                self._fds[rel] = fd
            return fd

    def fileno(self, rel: str) -> int | None:
        """The open descriptor of ``rel`` (for ``os.copy_file_range``); owned by the reader.
        None for an item decoded in memory (no file holds it)."""
        if self.decoded.in_memory(rel):
            return None
        return self._fd(rel)

    def size(self, rel: str) -> int:
        held = self.decoded.view(rel)
        if held is not None:
            return len(held)
        return os.fstat(self._fd(rel)).st_size

    def _held(self, rel: str, offset: int, length: int) -> memoryview | None:
        """Bytes ``offset..offset+length`` of ``rel`` when it is an item decoded in memory
        (None otherwise); raises as :meth:`read` past its end."""
        held = self.decoded.view(rel)
        if held is None:
            return None
        if offset + length > len(held):
            path = join(self.root, rel)
            raise CorruptCheckpointError(
                f"{path}: file is truncated: needed bytes {offset}..{offset + length} but it "
                f"ends at {len(held)}",
                path=path,
            )
        return held[offset : offset + length]

    def prefetch(self, rel: str, ranges: Sequence[tuple[int, int]]) -> None:
        """Nothing to do: the page cache and read-ahead serve local files."""

    def read(self, rel: str, offset: int, length: int) -> bytes:
        """Read exactly ``length`` bytes at ``offset`` of ``rel`` or raise."""
        held = self._held(rel, offset, length)
        if held is not None:
            return bytes(held)
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
        held = self._held(rel, offset, len(buf))
        if held is not None:
            buf[:] = held
            return
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
        short file (checked first: touching a mapping past the end would be SIGBUS).

        A range of at most :data:`CRC_READ_BYTES` is read instead (a mapping's set-up costs more
        than copying that little), and so is any range when no descriptor is left for the
        mapping (Python's ``mmap`` duplicates the file's: EMFILE under a low ``ulimit -n``).
        """
        from ckptools.core.crc32 import crc32

        held = self._held(rel, offset, length)
        if held is not None:  # an item decoded in memory: checksummed there
            return crc32(held, 0)
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
            if end - pos <= CRC_READ_BYTES:
                return crc32(self.read(rel, pos, end - pos), crc)
            base = pos - pos % mmap.ALLOCATIONGRANULARITY
            span = min(end, base + CRC_WINDOW_BYTES) - base
            try:
                window = mmap.mmap(fd, span, prot=mmap.PROT_READ, offset=base)
            except OSError as e:
                if e.errno != errno.EMFILE:
                    raise
                for at in range(pos, end, CRC_READ_BYTES):
                    crc = crc32(self.read(rel, at, min(CRC_READ_BYTES, end - at)), crc)
                return crc
            with window:
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
        self.decoded.close()

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
        self._checked: set[str] = set()
        # (rel, start) -> bytes, oldest first; per file, start -> bytes for lookups
        self._segments: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._by_file: dict[str, dict[int, bytes]] = {}
        self._cached_bytes = 0
        self._lock = threading.Lock()
        #: bytes received from the store so far (ranged GET payloads)
        self.bytes_fetched = 0
        #: ranged requests made so far
        self.requests = 0
        self.decoded = DecodedFiles()
        # reads of decoded items: their local spool files (fileno and crc32 stay None, as for
        # every file of this reader)
        self._spooled = LocalReader(self.root)
        self._spooled.decoded = self.decoded

    def _path(self, rel: str) -> str:
        if rel not in self._checked:  # layouts checked it; a name alone is judged again here
            contained(self.root, rel, named_by=self.root, entry="asked for", links=False)
            self._checked.add(rel)
        return f"{self._base}/{rel}" if self._base else rel

    def _url(self, rel: str) -> str:
        return join(self.root, rel)

    def fileno(self, rel: str) -> None:
        return None

    def crc32(self, rel: str, offset: int, length: int) -> None:
        return None  # no page cache to checksum in place: callers read

    def size(self, rel: str) -> int:
        if rel in self.decoded:
            return self._spooled.size(rel)
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
        if rel in self.decoded:
            return
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
        if rel in self.decoded:
            return self._spooled.read(rel, offset, length)
        hit = self._cached(rel, offset, length)
        if hit is not None:
            return hit
        parts = self._fetch(rel, self._split(offset, length))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def readinto(self, rel: str, offset: int, buf: memoryview) -> None:
        n = len(buf)
        if n == 0:
            return
        if rel in self.decoded:
            self._spooled.readinto(rel, offset, buf)
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
        self._spooled.close()  # and the decoded items' spool

    def __enter__(self) -> RemoteReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
