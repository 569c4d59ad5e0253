"""Where checkpoint bytes come from: positional reads of local files.

Paths are ``str`` throughout (a ``Path`` would mangle ``s3://``). Every read names the file in
its error, and a read that comes back short is reported as a truncated file rather than as the
bare ``EOFError`` torch gives.
"""

from __future__ import annotations

import errno
import os
import threading

from .errors import CheckpointNotFoundError, CkptError, CorruptCheckpointError


def join(root: str, rel: str) -> str:
    return rel if not root else os.path.join(root, rel)


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


class LocalReader:
    """Positional reads from files under ``root``, keeping file descriptors open.

    Thread-safe: ``os.pread`` does not move a shared file position.
    """

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

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> LocalReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
