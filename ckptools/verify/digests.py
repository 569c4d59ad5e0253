"""The digests a content scan computes: one hash per stored item and per file.

The scanner (:mod:`ckptools.verify.scan`) returns them as data; a checksum manifest
(:mod:`ckptools.verify.checksums`) records them and is later compared with them. Kept apart from
both so that neither imports the other for the hash they share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import xxhash

#: XXH3-128 (the ``xxhash`` package): ~20 GB/s per core, against ~0.9 GB/s for BLAKE2b, so a
#: manifest costs a save or a verify almost nothing beyond reading the bytes. It detects
#: corruption and swapped data; it is not a defence against a deliberate forger.
ALGORITHM = "xxh3-128"
#: 16 bytes: collisions among a checkpoint's millions of chunks stay out of reach (2^-64 by the
#: birthday bound at 2^32 chunks), and the digest stays small in the JSON.
DIGEST_BYTES = 16

#: An item key: (FQN, chunk offsets) for a tensor chunk, (FQN, None) for a DCP object.
ItemKey = tuple[str, tuple[int, ...] | None]


def new_hasher() -> Any:
    """The hash every digest uses (:data:`ALGORITHM`)."""
    return xxhash.xxh3_128()


@dataclass(frozen=True)
class ItemSum:
    """The digest of one item's stored bytes, and where they are."""

    file: str
    offset: int
    length: int
    digest: str


@dataclass(frozen=True)
class FileSum:
    """The digest of a file: its bytes, each recorded item replaced by the item's digest."""

    size: int
    digest: str


@dataclass(frozen=True)
class Digests:
    """Digests computed during a content scan (what a checksum manifest records)."""

    items: dict[ItemKey, ItemSum]
    files: dict[str, FileSum]
