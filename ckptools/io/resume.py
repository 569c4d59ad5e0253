"""Resumable conversions: a journal of the output files already written, in the staging location.

A conversion of a large checkpoint that is killed (kill -9, a lost node, Ctrl-C) leaves its
staging location behind: locally the ``<out>.tmp-<id>/`` directory beside OUT, on an object
store OUT itself without its marker (:mod:`ckptools.io.staging`). Re-running the same command finds
it and writes only what is missing. What "the same" means is the *fingerprint*: a hash of the
command, its options that shape the output, the ckptools version and the source's identity (its
marker files' bytes and every data file's size), so a changed source or option never reuses
stale output.

The journal (``.ckptools-resume-<writer>.json`` files inside the staging location, one per writing
process, so ranks under torchrun never write the same object) records each output file only once
it is complete and durable (fsynced locally; its upload finished on an object store, where an
object appears only whole): its size and, locally, its modification time. On resume a file is
skipped only if it is still there with that size (and mtime): a file cut short or touched since
is written again, as is every file the journal does not name. Hashing every output file to
record a digest would mean reading it back -- from disk, since the writers drop written pages
from the cache -- and add a second full pass to every conversion that never needs resuming.
The journal is removed before the marker is written, so it never appears in a committed
checkpoint.

Example:
    >>> fp = fingerprint("consolidate", manifest, {"max_shard_size": 5e9})  # doctest: +SKIP
    >>> journal = Journal.open(staging, fp)                                  # doctest: +SKIP
    >>> todo = [f for f in files if not journal.is_done(f)]                  # doctest: +SKIP
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from ckptools.core.manifest import Manifest
from ckptools.io import storage

log = logging.getLogger(__name__)

JOURNAL_PREFIX = ".ckptools-resume-"
#: a writer's journal part (its temporary file while it is replaced, ``<part>.tmp-<id>``, is not)
_JOURNAL_PART = re.compile(re.escape(JOURNAL_PREFIX) + r"\d+\.json")
_FORMAT = "ckptools-resume"


def _version() -> str:
    from ckptools._version import __version__

    return __version__


def fingerprint(kind: str, source: Manifest, options: Mapping[str, Any]) -> str:
    """Identity of a conversion: equal only for the same command on the same source bytes.

    ``options`` holds the arguments that shape the output (JSON-serialisable); progress,
    worker counts and the like must be left out, so a re-run with other ones still resumes.
    """
    h = xxhash.xxh3_128()
    head = {"kind": kind, "version": _version(), "options": options, "format": source.format}
    h.update(json.dumps(head, sort_keys=True, default=str).encode())
    root = source.data_dir()
    for marker in sorted(source.markers):
        h.update(marker.encode() + b"\0")
        digest = source.marker_digests.get(marker)  # the layout's digest spares a second read
        h.update(digest.encode() if digest else storage.read_bytes(storage.join(root, marker)))
    for rel, info in sorted(source.files.items()):
        h.update(f"{rel}\0{info.size}\0".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Done:
    size: int
    mtime_ns: int | None  # local files; None on object stores


def _stat(path: str) -> Done | None:
    if storage.is_url(path):
        try:
            return Done(storage.size(path), None)
        except FileNotFoundError:
            return None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return Done(st.st_size, st.st_mtime_ns)


class Journal:
    """The output files of one staging location that are complete (thread-safe)."""

    def __init__(
        self, staging: str, fingerprint: str, done: dict[str, Done], writer: int = 0
    ) -> None:
        self.staging = staging
        self.fingerprint = fingerprint
        self.writer = writer
        self._done = done
        self._mine: dict[str, Done] = {}
        self._lock = threading.Lock()
        self.resumed = bool(done)

    @classmethod
    def open(cls, staging: str, fingerprint: str, *, writer: int = 0) -> Journal:
        """The journal of ``staging`` (all writers' parts); empty when there is none or it is
        another conversion's. ``writer`` names the part this process appends to."""
        done: dict[str, Done] = {}
        mine: dict[str, Done] = {}
        try:
            names = storage.listdir(staging)
        except FileNotFoundError:
            names = []
        for name in sorted(n for n in names if _JOURNAL_PART.fullmatch(n)):
            path = storage.join(staging, name)
            try:
                data = json.loads(storage.read_bytes(path))
                if data.get("format") == _FORMAT and data.get("fingerprint") == fingerprint:
                    part = {
                        k: Done(int(v["size"]), v.get("mtime_ns")) for k, v in data["done"].items()
                    }
                    done.update(part)
                    if name == f"{JOURNAL_PREFIX}{writer}.json":
                        mine = part  # rewritten with new entries added: keep the old ones
            except (OSError, ValueError, KeyError, TypeError) as e:  # torn: redo its files
                log.warning("%s: unreadable resume journal (%s); its files are written again",
                            path, e)  # fmt: skip
        journal = cls(staging, fingerprint, done, writer)
        journal._mine = dict(mine)
        return journal

    @property
    def done_count(self) -> int:
        return len(self._done)

    def is_done(self, rel: str) -> bool:
        """``rel`` was recorded complete and is still there, unchanged since."""
        entry = self._done.get(rel)
        return entry is not None and _stat(storage.join(self.staging, rel)) == entry

    def record(self, rel: str, *, size: int | None = None) -> None:
        """Record ``rel`` complete; call after it is durable (fsynced, or its upload done).

        On an object store pass ``size`` (the writer knows it) to spare a request.
        """
        path = storage.join(self.staging, rel)
        entry = Done(size, None) if size is not None and storage.is_url(path) else _stat(path)
        if entry is None:
            raise FileNotFoundError(path)
        with self._lock:
            self._done[rel] = self._mine[rel] = entry
            self._write()

    def _write(self) -> None:
        data = json.dumps(
            {
                "format": _FORMAT,
                "fingerprint": self.fingerprint,
                "done": {
                    k: {"size": v.size, "mtime_ns": v.mtime_ns} for k, v in self._mine.items()
                },
            }
        ).encode()
        # Atomic: a journal torn by a crash would send all of this writer's files to be redone.
        # No directory fsync: one per output file (1,024 rank files in a reshard) buys nothing,
        # since a crash that loses the rename only costs redoing the last file.
        path = storage.join(self.staging, f"{JOURNAL_PREFIX}{self.writer}.json")
        storage.write_atomic(path, data, sync_dir=False)

    def discard(self) -> None:
        """Remove every writer's journal part (before the marker commits the output)."""
        for name in storage.listdir(self.staging):
            if name.startswith(JOURNAL_PREFIX):
                storage.remove(storage.join(self.staging, name))


def local_stagings(out: str) -> list[str]:
    """Every ``<out>.tmp-*`` directory beside the local ``out`` (staging locations of its
    runs, live or left by interrupted ones)."""
    found = glob.glob(glob.escape(os.path.abspath(out)) + ".tmp-*")
    return sorted(c for c in found if os.path.isdir(c) and not os.path.islink(c))


def superseded(staging: str, fingerprint: str) -> bool:
    """True when the (dead) staging location ``staging`` holds nothing to resume but for the
    conversion ``fingerprint``: no readable journal of another conversion (killed before its
    first file was done, or while writing its first journal part: the part's temporary file,
    named like it, never became a journal), or this conversion's own."""
    try:
        names = storage.listdir(staging)
    except (FileNotFoundError, NotADirectoryError):
        return False
    for name in names:
        if not _JOURNAL_PART.fullmatch(name):
            continue
        try:
            data = json.loads(storage.read_bytes(storage.join(staging, name)))
        except (OSError, ValueError):
            continue  # torn: nothing in it to resume
        if isinstance(data, dict) and data.get("fingerprint") != fingerprint:
            return False  # another conversion's: kept for it
    return True


def find_local_staging(out: str, fingerprint: str) -> str | None:
    """An earlier run's ``<out>.tmp-*`` directory with a journal of the same conversion.

    Where several exist, the one with the most files done.
    """
    best: tuple[int, str] | None = None
    for candidate in local_stagings(out):
        journal = Journal.open(candidate, fingerprint)
        if journal.resumed and (best is None or journal.done_count > best[0]):
            best = (journal.done_count, candidate)
    return None if best is None else best[1]
