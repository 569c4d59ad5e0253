"""Local spools for files on their way to an object store, and the uploads that empty them.

Positional writes need a local file, so a writer to an object store writes each output file
into a private spool (:func:`spool_dir`, in ``CKPTOOLS_SPOOL_DIR`` or the system temporary
directory), and :class:`Uploader` puts it up in the background and deletes it once it is up.
:func:`spool_uploads` is the one such loop every writer runs. A spool left by a run killed with
kill -9 is removed by the next spool made in the same place.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

from ckptools.io import durable, paths

log = logging.getLogger(__name__)

SPOOL_DIR_ENV = "CKPTOOLS_SPOOL_DIR"
#: Uploads queued or running before a writer waits for one to finish: local spool space is
#: bounded by (this + the file being written) x the largest output file.
MAX_PENDING_UPLOADS = 2


def hostname() -> str:
    """This machine's name, for spool owner, lock and in-progress notes (``socket`` imported
    only here: it costs every command ~5 ms at start)."""
    import socket

    return socket.gethostname()


def make_spool_dir(prefix: str = "ckptools-spool-") -> str:
    """Create a private local directory for files on their way to an object store, in
    ``CKPTOOLS_SPOOL_DIR`` or the system temporary directory; the caller removes it.

    Beside it, ``<dir>.owner`` names this host and process, so that a later spool in the same
    place removes what a run killed with kill -9 left (up to a few output files): every spool
    whose owner was on this host and is no longer running (:func:`_clear_dead_spools`).
    """
    import tempfile  # here: only outputs on an object store spool (~2 ms of every start-up)

    base = os.environ.get(SPOOL_DIR_ENV) or None
    if base:
        os.makedirs(base, exist_ok=True)
    _clear_dead_spools(base or tempfile.gettempdir(), prefix)
    path = tempfile.mkdtemp(prefix=prefix, dir=base)
    owner = {"host": hostname(), "pid": os.getpid()}
    durable.write_synced(path + _SPOOL_OWNER, json.dumps(owner).encode())
    return path


def remove_spool_dir(path: str) -> None:
    """Remove a :func:`make_spool_dir` directory and its owner note."""
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.remove(path + _SPOOL_OWNER)


_SPOOL_OWNER = ".owner"


def _clear_dead_spools(base: str, prefix: str) -> None:
    """Remove the ``prefix*`` spools in ``base`` (and their owner notes) whose owner ran on this
    host and is gone: what runs killed with kill -9 left. A spool without a readable note, or of
    another host (a shared ``CKPTOOLS_SPOOL_DIR``), or of a live process, is kept."""
    try:
        notes = [e for e in os.scandir(base) if e.name.startswith(prefix)]
    except OSError:
        return
    host = hostname()
    for entry in notes:
        if not entry.name.endswith(_SPOOL_OWNER) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            with open(entry.path, "rb") as f:
                owner = json.loads(f.read(4096))
            pid = int(owner["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if owner.get("host") != host or pid <= 0 or _alive(pid):
            continue
        spool = entry.path[: -len(_SPOOL_OWNER)]
        log.info("removing %s, left by a run that was killed", spool)
        if os.path.isdir(spool) and not os.path.islink(spool):
            shutil.rmtree(spool, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(entry.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextmanager
def spool_dir() -> Iterator[str]:
    """A :func:`make_spool_dir` directory, removed afterwards."""
    path = make_spool_dir()
    try:
        yield path
    finally:
        remove_spool_dir(path)


class Uploader:
    """Uploads finished local files in the background, deleting each once it is up.

    ``put`` blocks while :data:`MAX_PENDING_UPLOADS` uploads are pending, so a writer never
    runs further ahead of the network than that many files; ``wait`` raises the first failure.
    """

    def __init__(self, max_pending: int = MAX_PENDING_UPLOADS) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max_pending, thread_name_prefix="ckpt-up")
        self._slots = threading.Semaphore(max_pending)
        self._futures: list[Future[None]] = []

    def put(self, local: str, url: str, on_done: Callable[[], None] | None = None) -> None:
        """Upload ``local`` to ``url`` in the background, then delete it and call ``on_done``."""
        self._slots.acquire()

        def run() -> None:
            try:
                paths.put_file(local, url)
                os.remove(local)
                if on_done is not None:
                    on_done()
            finally:
                self._slots.release()

        self._futures.append(self._pool.submit(run))
        for fut in self._futures:
            if fut.done() and fut.exception() is not None:
                self.wait()

    def wait(self) -> None:
        futures, self._futures = self._futures, []
        errors = [fut.exception() for fut in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Uploader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spool_uploads(
    out_url: str,
    groups: Iterable[Sequence[str]],
    write: Callable[[str, Sequence[str]], None],
    on_uploaded: Callable[[str], None] | None = None,
    *,
    spool: str | None = None,
) -> None:
    """The one spool-and-upload loop of every writer to an object store: positional writes
    need a local file, so each group of files (names relative to ``out_url``) is written by
    ``write(spool, names)`` into a local spool, then uploaded (a multipart upload appears only
    once complete), each deleted locally once up and ``on_uploaded(name)`` called, while the
    next group is written. Returns once every upload is done; local disk use stays within
    :data:`MAX_PENDING_UPLOADS` files plus one group. ``spool``: files already written there
    (``write`` then has nothing to do), else a private :func:`spool_dir`.
    """
    with contextlib.ExitStack() as stack:
        if spool is None:
            spool = stack.enter_context(spool_dir())
        uploader = stack.enter_context(Uploader())
        for names in groups:
            write(spool, names)
            for name in names:
                done = None if on_uploaded is None else functools.partial(on_uploaded, name)
                uploader.put(os.path.join(spool, name), paths.join(out_url, name), done)
        uploader.wait()
