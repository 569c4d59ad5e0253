"""The user's cache directory: small derived facts worth keeping between runs.

Where: ``CKPTOOLS_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/ckptools``, else
``~/.cache/ckptools``. What is kept there is derived, never a source of truth: an entry that
cannot be read, parsed or written is treated as absent (the caller derives again), and an
entry is written to a temporary file in its own directory then renamed over the old one, so a
reader never sees half of it and concurrent writers (the ranks of one job) leave one whole.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from ckptools.io import progress
from ckptools.io.durable import replace_synced

__all__ = ["CACHE_DIR_ENV", "Miss", "cache_dir", "entry", "kept", "read", "write"]

T = TypeVar("T")

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "CKPTOOLS_CACHE_DIR"
#: An entry larger than this is not read (a damaged or foreign file): derived again instead.
_MAX_ENTRY_BYTES = 256 * 2**20


def cache_dir() -> str:
    """The cache root (see module docstring); not created here."""
    override = os.environ.get(CACHE_DIR_ENV, "")
    if override:
        return os.path.expanduser(override)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ckptools")


def read(*parts: str) -> bytes | None:
    """The entry at ``cache_dir()/parts...``, or None when absent or unreadable."""
    path = os.path.join(cache_dir(), *parts)
    try:
        if os.path.getsize(path) > _MAX_ENTRY_BYTES:
            return None
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def write(data: bytes, *parts: str) -> str | None:
    """Write the entry ``cache_dir()/parts...`` atomically; its path, or None when the cache
    cannot be written (read-only home, full disk: the run goes on without it)."""
    path = os.path.join(cache_dir(), *parts)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # no directory fsync: a crash that loses the entry only means deriving it again
        replace_synced(path, data, sync_dir=False)
        return path
    except OSError as e:  # DiskFullError is an OSError too
        log.debug("cache entry %s not written: %s", path, e)
        return None


class Miss(Exception):
    """A cache entry that is absent, damaged or not this one's: derived again."""


def entry(raw: bytes, fmt: int, key: str) -> dict[str, Any]:
    """The JSON entry ``raw``, written as ``{"format": fmt, "key": key, ...}``; :class:`Miss`
    when it is no JSON object, or another format's or key's."""
    try:
        found = json.loads(raw)
    except ValueError as e:
        raise Miss from e
    if not isinstance(found, dict) or found.get("format") != fmt or found.get("key") != key:
        raise Miss
    return found


def kept(
    parts: tuple[str, ...],
    decode: Callable[[bytes], T],
    derive: Callable[[], T],
    encode: Callable[[T], bytes],
    status: str,
    quiet: bool,
) -> T:
    """The entry at ``parts`` decoded, or (absent, or ``decode`` raises :class:`Miss`)
    derived under the status line ``status`` (unless ``quiet``) and written there."""
    raw = read(*parts)
    if raw is not None:
        try:
            return decode(raw)
        except Miss:
            log.info("cache entry %s is damaged: derived again", "/".join(parts))
    with progress.status(status + f"(first run; kept in {cache_dir()})", quiet=quiet):
        value = derive()
    write(encode(value), *parts)
    return value
