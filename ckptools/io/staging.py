"""Output locations and their commit: local directories by rename, object stores by marker last.

Every writer (consolidate, reshard, shard, ``save_pretrained``, the training manager) goes
through the same steps, whatever OUT is; what differs between a local directory and an object
store is one :class:`Staging` strategy, chosen once by :func:`staging_for` (modelled on orbax's
pair of temporary-path classes, atomic rename and commit file):

* ``check_writable`` (before any work): refuse an OUT that exists (locally) or that holds a
  checkpoint or foreign objects (object store), unless ``overwrite``; the writers call it
  through :func:`ckptools.io.out_rules.check_out`, which holds every rule about OUT (apart
  from the source, what ``overwrite`` may replace);
* ``location`` + ``begin`` give the *staging location* to write into: locally a fresh
  ``<out>.tmp-<id>/`` beside OUT (same filesystem, so rename works); on an object store, which
  has no rename, OUT itself, after an in-progress note (:data:`IN_PROGRESS`) is written and
  whatever an earlier run or ``overwrite`` left there is removed, commit markers first;
  ``resume`` reuses the location an interrupted run of the same conversion left instead;
* the writer writes its files there, its marker (DCP ``.metadata``, the safetensors index,
  ``.ckptools-complete``) last. Writers accept a URL as their output directory: they write each
  file into a local spool and upload it once complete (:mod:`ckptools.io.spool`);
* ``commit`` publishes: locally fsync and rename (an existing OUT is moved aside first); on an
  object store the marker is already the commit, and the in-progress note is removed.
  ``discard`` removes the staging location on failure; ``delete`` removes a committed output so
  that no half-deleted one ever looks complete.

The module functions (:func:`make_tmp_dir`, :func:`resumable_staging`,
:func:`commit`, :func:`discard`, :func:`output_dir`, ...) are these steps for the strategy of
their OUT.

An exception, Ctrl-C or full disk removes the staging location, so nothing that looks complete is
ever left behind: locally a kill -9 leaves only a ``*.tmp-*`` directory, never OUT; on an object
store it leaves OUT without its marker (every uploaded object is whole: a PUT or multipart
upload appears only when complete), which readers treat as incomplete and a later run clears.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

from ckptools.errors import UsageError
from ckptools.io import durable, resume, space, storage
from ckptools.io.spool import hostname, spool_dir, spool_uploads

log = logging.getLogger(__name__)

#: Written first into an object-store OUT and removed after the commit: marks a prefix as an
#: unfinished ckptools write, which a later run may clear without ``overwrite``.
IN_PROGRESS = ".ckptools-writing"
#: Files whose presence commits a checkpoint directory: written last, deleted first.
MARKER_NAMES = frozenset(
    {".metadata", "model.safetensors.index.json", "pytorch_model.bin.index.json",
     ".ckptools-complete"}
)  # fmt: skip
#: A single-file Hugging Face model: the object is whole or absent, so it is its own marker.
_WHOLE_MODEL_FILES = frozenset({"model.safetensors", "pytorch_model.bin"})
#: Why a staging directory cannot be created where OUT asks (a usage error, not a failure).
_CANNOT_CREATE = frozenset(
    {errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EEXIST, errno.EROFS,
     errno.EBUSY}
)  # fmt: skip


def _is_marker(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name in MARKER_NAMES or name in _WHOLE_MODEL_FILES


def _markers_first(rels: Iterable[str]) -> list[str]:
    """``rels`` ordered for removal: commit markers first (deepest first), then the rest, so a
    checkpoint being removed stops looking complete before any of its data goes."""
    rels = list(rels)
    markers = sorted((r for r in rels if _is_marker(r)), key=lambda r: -r.count("/"))
    return markers + [r for r in rels if not _is_marker(r)]


class Staging(Protocol):
    """How outputs of one kind of location are staged, committed and removed.

    ``name`` arguments are the local sibling's name for a staging location or an output moved
    aside (the training store names its own, ``.tmp-step-<n>-<id>``); object stores ignore them.
    """

    def check_writable(self, out: str, overwrite: bool) -> None:
        """Refuse an existing ``out`` unless ``overwrite`` (before any work starts)."""
        ...

    def location(self, out: str, name: str | None = None) -> str:
        """Where the files that become ``out`` are written (not created yet)."""
        ...

    def begin(self, tmp: str) -> str:
        """Create the staging location ``tmp``; returns it. Call ``check_writable`` first."""
        ...

    def resume(self, out: str, fingerprint: str) -> str:
        """The staging location an interrupted run of the same conversion left, else a new
        one; held for this process until ``commit`` or ``discard``."""
        ...

    def sync(self, tmp: str, *, files: bool = False) -> None:
        """Make what was written under ``tmp`` durable (``files``: each file too, not only
        the directory entries), before the marker that declares it complete."""
        ...

    def commit(self, tmp: str, out: str, *, overwrite: bool, name: str | None = None) -> bool:
        """Publish ``tmp`` (marker written) as ``out``; True when an existing ``out`` was
        replaced."""
        ...

    def discard(self, tmp: str, *, keep: bool = False) -> None:
        """Give up the staging location ``tmp``: removed, unless ``keep`` (to resume)."""
        ...

    def delete(self, out: str, *, name: str | None = None) -> None:
        """Remove the committed output ``out`` so that no half-deleted one looks complete."""
        ...


class LocalStaging:
    """A local directory: staged in ``<out>.tmp-<id>/`` beside OUT, committed by an atomic rename
    after fsyncs; a staging location being written is held under an exclusive ``flock``, so that
    a second run of the same conversion neither resumes into it nor removes it meanwhile."""

    def __init__(self) -> None:
        self._locks: dict[str, int] = {}

    def check_writable(self, out: str, overwrite: bool) -> None:
        if os.path.lexists(out) and not overwrite:
            raise UsageError(f"{out}: already exists; pass --overwrite to replace it", path=out)

    def location(self, out: str, name: str | None = None) -> str:
        if name is None:
            return f"{os.path.abspath(out)}.tmp-{os.urandom(4).hex()}"
        return os.path.join(os.path.dirname(out), name)

    def begin(self, tmp: str) -> str:
        parent = os.path.dirname(os.path.abspath(tmp))
        try:
            os.makedirs(parent, exist_ok=True)
            os.mkdir(tmp)
        except OSError as e:
            # a place where nothing can be made (/proc, a read-only or vanished directory):
            # what out_rules.check_place could not foresee, said in one line
            if e.errno == errno.ENAMETOOLONG:
                raise UsageError(
                    f"{tmp}: the staging directory's name is too long ({e.strerror}); choose "
                    "a shorter OUT",
                    path=tmp,
                ) from e
            if e.errno not in _CANNOT_CREATE:
                raise
            raise UsageError(
                f"{parent}: cannot create the output there ({e.strerror}); choose another OUT",
                path=parent,
            ) from e
        return tmp

    def resume(self, out: str, fingerprint: str) -> str:
        staging = resume.find_local_staging(out, fingerprint) or self.begin(self.location(out))
        self.hold(staging, out)
        self._clear_stale(out, fingerprint)
        return staging

    def hold(self, staging: str, out: str) -> None:
        """Lock the staging location ``staging`` of ``out`` for this process (until ``commit``
        or ``discard``): no other run resumes into it or clears it meanwhile.

        Raises:
            UsageError: another live run holds it.
        """
        fd = os.open(staging, os.O_RDONLY)
        if not _try_lock(fd):
            os.close(fd)
            raise UsageError(
                f"{out}: another ckptools run is writing it (in {staging}); wait for it to finish",
                path=out,
            )
        self._locks[staging] = fd

    def _clear_stale(self, out: str, fingerprint: str) -> None:
        """Remove every ``<out>.tmp-*`` that no live process holds (not this one's) and that
        holds nothing another conversion could resume: what runs killed with kill -9 left
        before their first file was done, and this conversion's older ones (the best was
        resumed). A live run holds its staging location under an exclusive ``flock``, which the
        kernel drops when the process dies, so a lock that can be taken is a dead run's; a
        directory with another conversion's journal is kept for that conversion to resume."""
        for candidate in resume.local_stagings(out):
            if candidate in self._locks:
                continue
            try:
                fd = os.open(candidate, os.O_RDONLY)
            except OSError:
                continue
            try:
                if _try_lock(fd) and resume.superseded(candidate, fingerprint):
                    log.info("removing %s, left by an interrupted run", candidate)
                    _remove_local(candidate)
            finally:
                os.close(fd)

    def _unlock(self, staging: str) -> None:
        fd = self._locks.pop(staging, None)
        if fd is not None:
            os.close(fd)

    def sync(self, tmp: str, *, files: bool = False) -> None:
        if files:
            durable.fsync_tree(tmp)
        else:
            durable.fsync_dir(tmp)

    def _aside(self, out: str, name: str | None) -> str:
        """Where ``out`` is renamed before it is replaced or deleted: the same filesystem, so
        the rename is atomic, and a name that cleanup recognises as not a checkpoint."""
        if name is None:
            return f"{os.path.abspath(out)}.old-{os.urandom(4).hex()}"
        return os.path.join(os.path.dirname(out), name)

    def commit(self, tmp: str, out: str, *, overwrite: bool, name: str | None = None) -> bool:
        self._unlock(tmp)
        space.release(tmp)
        old = None
        if os.path.lexists(out):
            if not overwrite:
                raise UsageError(f"{out}: appeared while writing; pass --overwrite to replace it")
            old = self._aside(out, name)
            os.rename(out, old)
        os.rename(tmp, out)
        durable.fsync_dir(os.path.dirname(os.path.abspath(out)))
        if old is not None:
            _remove_local(old)
        return old is not None

    def discard(self, tmp: str, *, keep: bool = False) -> None:
        self._unlock(tmp)
        space.release(tmp)
        if not keep:
            _remove_local(tmp)

    def delete(self, out: str, *, name: str | None = None) -> None:
        trash = self._aside(out, name)
        os.rename(out, trash)
        durable.fsync_dir(os.path.dirname(os.path.abspath(out)))
        _remove_local(trash)


def _try_lock(fd: int) -> bool:
    """Take an exclusive ``flock`` on ``fd`` without waiting; False when another holds it."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _remove_local(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)


class ObjectStoreStaging:
    """An object-store prefix, which has no rename: written in place after an in-progress note,
    committed by its marker written last, the note removed after it. Every object is whole or
    absent, so a prefix without its marker is incomplete, whatever else it holds."""

    def check_writable(self, out: str, overwrite: bool) -> None:
        """OUT is a prefix: one that holds nothing, or only what an interrupted ckptools write
        left (the in-progress note and no marker), is writable; one that holds a committed
        checkpoint or anything else needs ``overwrite``. A prefix that cannot be listed (a
        bucket that does not exist) is refused either way, before any work."""
        try:
            held = storage.walk_files(out)
        except FileNotFoundError as e:  # fsspec's word for a missing bucket or container
            raise UsageError(
                f"{out}: cannot be written ({e}); create the bucket first or choose another OUT",
                path=out,
            ) from e
        if overwrite or not held:
            return
        markers = sorted(rel for rel in held if _is_marker(rel))
        if markers:
            raise UsageError(
                f"{out}: already holds a checkpoint ({markers[0]}); pass --overwrite to replace it",
                path=out,
            )
        if IN_PROGRESS not in held:
            raise UsageError(
                f"{out}: not empty ({len(held)} objects, e.g. {sorted(held)[0]}); pass "
                "--overwrite to replace them",
                path=out,
            )

    def location(self, out: str, name: str | None = None) -> str:
        return out.rstrip("/")

    def begin(self, tmp: str) -> str:
        note = {"host": hostname(), "pid": os.getpid(), "time": time.time()}
        storage.write_bytes(storage.join(tmp, IN_PROGRESS), json.dumps(note).encode())
        for rel in _markers_first(storage.walk_files(tmp)):
            if rel != IN_PROGRESS:
                storage.remove(storage.join(tmp, rel))
        return tmp.rstrip("/")

    def resume(self, out: str, fingerprint: str) -> str:
        """An interrupted run's prefix is reused as it is (an upload is whole or absent, so
        there is nothing half-written to clear); anything else is cleared as ``begin`` does."""
        interrupted = storage.exists(storage.join(out, IN_PROGRESS))
        if interrupted and resume.Journal.open(out, fingerprint).resumed:
            return out.rstrip("/")
        return self.begin(self.location(out))

    def sync(self, tmp: str, *, files: bool = False) -> None:
        """Nothing to do: an uploaded object is durable, and there are no directory entries."""

    def commit(self, tmp: str, out: str, *, overwrite: bool, name: str | None = None) -> bool:
        storage.remove(storage.join(out, IN_PROGRESS))
        return False

    def discard(self, tmp: str, *, keep: bool = False) -> None:
        if not keep:
            with contextlib.suppress(Exception):  # best effort: the missing marker already tells
                storage.remove_tree(tmp)

    def delete(self, out: str, *, name: str | None = None) -> None:
        for rel in _markers_first(storage.walk_files(out)):
            if not _is_marker(rel):
                break
            storage.remove(storage.join(out, rel))
        storage.remove_tree(out)


_LOCAL = LocalStaging()
_OBJECT_STORE = ObjectStoreStaging()


def staging_for(out: str) -> Staging:
    """The strategy for outputs at ``out``: the one place that asks whether it is a URL."""
    return _OBJECT_STORE if storage.is_url(out) else _LOCAL


def fsync_dir(path: str) -> None:
    """Make the entries of the directory ``path`` durable (nothing to do on an object store)."""
    staging_for(path).sync(path)


def commit(tmp: str, out: str, overwrite: bool) -> None:
    """Publish the staging location ``tmp`` as ``out``.

    Locally ``tmp`` is renamed onto ``out`` (an existing ``out``, with ``overwrite``, is moved
    aside first). On an object store ``tmp`` is ``out``, whose marker the writer has written
    last; only the in-progress note is left to remove.
    """
    staging_for(out).commit(tmp, out, overwrite=overwrite)


def make_tmp_dir(out: str) -> str:
    """Create and return the staging location for ``out`` (see the module docstring).

    Locally ``<out>.tmp-<random>/`` beside ``out`` (same filesystem: rename works). On an object
    store ``out`` itself, holding only the in-progress note; call
    :func:`ckptools.io.out_rules.check_out` first,
    since whatever else is there is removed.
    """
    strategy = staging_for(out)
    tmp = strategy.begin(strategy.location(out))
    if strategy is _LOCAL:
        _LOCAL.hold(tmp, out)  # a live run's: never cleared as stale by another run
    return tmp


def reserve(tmp: str, nbytes: int) -> None:
    """The run writing into the staging location ``tmp`` writes ``nbytes`` in all: refused now,
    before a byte is written, when the output's filesystem has less free than the part not yet
    there, and remembered for the error should the disk fill up anyway
    (:func:`ckptools.io.space.reserve`). Nothing to check on an object store.

    Raises:
        DiskFullError: not enough free space (``CKPTOOLS_SPACE_CHECK=0`` skips the check).
    """
    if not storage.is_url(tmp):
        space.reserve(tmp, nbytes)


def _has_journal(staging: str) -> bool:
    try:
        return any(n.startswith(resume.JOURNAL_PREFIX) for n in storage.listdir(staging))
    except (OSError, ValueError):
        return False


def resumable_staging(out: str, fingerprint: str) -> str:
    """The staging location for ``out`` (as :func:`make_tmp_dir`), or the one an interrupted run
    of the same conversion (``fingerprint``, :func:`ckptools.io.resume.fingerprint`) left, whose
    journaled files the writer then skips. Call :func:`ckptools.io.out_rules.check_out` first.

    Locally the directory is locked for this process until :func:`commit` or :func:`discard`.
    On an object store an interrupted run's prefix is reused as it is (an upload is whole or
    absent, so there is nothing half-written to clear); anything else is cleared as usual.
    """
    return staging_for(out).resume(out, fingerprint)


def discard(tmp: str, error: BaseException | None = None) -> None:
    """Remove a staging location after a failure (everything under it is this run's).

    Except after an interrupt (Ctrl-C) of a resumable conversion (one whose staging location
    holds a resume journal): then the files already written are kept, and running the same
    command again finishes the job (:mod:`ckptools.io.resume`).
    """
    keep = isinstance(error, KeyboardInterrupt) and _has_journal(tmp)
    if keep:
        assert error is not None
        # a note on the interrupt, not a log line: it shows in the traceback a library caller
        # sees, and the CLI prints it as its one line
        error.add_note(
            f"the files written so far are kept in {tmp}: run the same command again to resume "
            "(or delete it)"
        )
        log.info("interrupted: kept %s to resume from", tmp)
    staging_for(tmp).discard(tmp, keep=keep)


def write_file_synced(path: str, data: bytes) -> None:
    """Write a new small file (an index, a marker) and make it durable before anyone relies on
    it: fsynced locally, one whole PUT on an object store."""
    storage.write_bytes(path, data, exclusive=True)


def copy_into(src: str, dst: str) -> None:
    """Copy the file ``src`` (local or URL) to ``dst`` (local or URL), durably."""
    if not storage.is_url(dst):
        os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
        with space.translated(dst):
            if storage.is_url(src):
                storage.get_file(src, dst)
            else:
                shutil.copy2(src, dst)
            durable.fsync_file(dst)
        return
    if not storage.is_url(src):
        storage.put_file(src, dst)
        return
    with spool_dir() as spool:
        local = os.path.join(spool, "copy")
        storage.get_file(src, local)
        storage.put_file(local, dst)


def upload_dir(local_dir: str, out: str, overwrite: bool) -> None:
    """Publish the finished local directory ``local_dir`` at the object-store prefix ``out``:
    staged as :func:`make_tmp_dir` does, data files uploaded (:func:`spool_uploads`), then the
    commit markers, then :func:`commit`. For writers whose ranks share local files
    (``save_pretrained``); call :func:`ckptools.io.out_rules.check_out` before the work starts.
    """
    staging = make_tmp_dir(out)
    try:
        files = sorted(storage.walk_files(local_dir))
        data = [[rel] for rel in files if not _is_marker(rel)]
        spool_uploads(out, data, lambda spool, names: None, spool=local_dir)
        for rel in sorted((r for r in files if _is_marker(r)), key=lambda r: -r.count("/")):
            storage.put_file(os.path.join(local_dir, rel), storage.join(out, rel))
        commit(staging, out, overwrite)
    except BaseException:
        discard(staging)
        raise


@contextmanager
def output_dir(out: str, *, overwrite: bool = False) -> Iterator[str]:
    """Yield the staging location for ``out``; commit it on success, discard it on failure.

    Example:
        >>> with output_dir("/tmp/model-out", overwrite=True) as tmp:   # doctest: +SKIP
        ...     write_everything_into(tmp)                                # marker last
    """
    staging_for(out).check_writable(out, overwrite)
    tmp = make_tmp_dir(out)
    try:
        yield tmp
        fsync_dir(tmp)
        commit(tmp, out, overwrite)
    except BaseException:
        discard(tmp)
        raise
