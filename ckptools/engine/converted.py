"""Sources seen through a conversion: the I/O half of :mod:`ckptools.plan.conversions`.

The conversion's pieces are boxes of stored chunks; a box of a DCP item is a byte range of its
raw data, which only reading the item's archive directory tells (:class:`SourceCache`). These
functions resolve the stored chunks the pieces meet, hand them to the pure planners, and check the
CRC-32 of every stored record that no output chunk copies whole (the executor checks the others
while copying), so a converted consolidation checks every record as a plain one does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptools.core.manifest import Manifest
from ckptools.engine import checked_copy
from ckptools.engine.reader import SourceCache
from ckptools.engine.runtime import BLOCK_BYTES
from ckptools.errors import UnsupportedCheckpointError
from ckptools.io import storage
from ckptools.plan.conversion_cache import keymap_for
from ckptools.plan.conversion_entries import merge_entries, split_entries
from ckptools.plan.conversions import KeyMap


def split_source(
    manifest: Manifest, names: Mapping[str, str], keymap: KeyMap, *, check: bool = True
) -> tuple[Manifest, dict[str, str]]:
    """:func:`~ckptools.plan.conversion_entries.split_entries` over ``manifest``'s files; ``check``:
    CRC-check the split records now (not for a dry run, or a diff, which promises no CRCs).

    Raises:
        CorruptCheckpointError: a split record's bytes do not match its stored CRC-32.
    """
    with storage.open_reader(manifest.data_dir()) as reader:
        cache = SourceCache(reader, manifest)
        derived, out, split = split_entries(
            manifest, names, keymap, lambda e, c: cache.raw(e.fqn, c)
        )
        buffer = memoryview(bytearray(BLOCK_BYTES))
        for fqn, raw in split if check else ():
            checked_copy.check(reader, raw, fqn, checked_copy.record_crc(reader, raw, buffer))
    return derived, out


def merge_source(
    manifest: Manifest, names: Mapping[str, str], keymap: KeyMap
) -> tuple[Manifest, dict[str, str]]:
    """:func:`~ckptools.plan.conversion_entries.merge_entries` over ``manifest``'s files,
    CRC-checking the records it cuts (a fused file tensor split by a ``Chunk`` rule).

    Raises:
        CorruptCheckpointError: a cut record's bytes do not match its stored CRC-32.
    """
    with storage.open_reader(manifest.data_dir()) as reader:
        cache = SourceCache(reader, manifest)
        derived, out, cut = merge_entries(manifest, names, keymap, lambda e, c: cache.raw(e.fqn, c))
        buffer = memoryview(bytearray(BLOCK_BYTES))
        for fqn, raw in cut:
            checked_copy.check(reader, raw, fqn, checked_copy.record_crc(reader, raw, buffer))
    return derived, out


def to_disk_names(
    manifest: Manifest,
    names: dict[str, str],
    config: Mapping[str, Any] | None,
    *,
    boxes_only: bool = False,
    check: bool = True,
    quiet: bool = False,
) -> tuple[Manifest, dict[str, str], KeyMap | None]:
    """``names`` (in-memory name → stored FQN) in the on-disk format ``save_pretrained`` writes.

    The installed transformers' conversion mapping for ``config``
    (:func:`~ckptools.plan.conversions.rules_for`) becomes byte boxes of the stored chunks
    (:func:`split_source`). Without a conversion the inputs come back unchanged.
    ``boxes_only``: the manifest holds boxes, not bytes (``save_pretrained``'s, whose chunks are
    local shards); nothing is read. ``check``: see :func:`split_source`. The conversion is
    read from the user's cache when an earlier run derived it
    (:func:`~ckptools.plan.conversion_cache.keymap_for`; ``quiet``: no status line meanwhile).
    """
    shapes = {n: manifest.tensors[f].shape for n, f in names.items()}
    keymap = keymap_for(config, shapes, "disk", quiet=quiet)
    if keymap is None:
        return manifest, names, None
    if boxes_only:
        _refuse_joins(keymap)
        derived, out, _ = split_entries(manifest, names, keymap, lambda e, c: c)
    else:
        derived, out = split_source(manifest, names, keymap, check=check)
    return derived, out, keymap


def _refuse_joins(keymap: KeyMap) -> None:
    """``save_pretrained`` from training writes each rank's shards as boxes of one stored tensor;
    a file tensor joined from several in-memory tensors (a ``Chunk`` rule's reverse) is not that.

    Raises:
        UnsupportedCheckpointError: naming the file tensor, its parts and the rule.
    """
    for p in keymap.pieces:
        if p.fused_on_disk:
            parts = sorted(q.memory for q in keymap.pieces if q.disk == p.disk)
            raise UnsupportedCheckpointError(
                f"{p.disk!r}: transformers writes it joined from {parts} (rule {p.rule!r}); "
                "ckptools.save_pretrained cannot join tensors yet: pass "
                "keep_in_memory_names=True, or save a DCP and consolidate it"
            )


def to_memory_names(
    manifest: Manifest,
    names: dict[str, str],
    config: Mapping[str, Any] | None,
    *,
    quiet: bool = False,
) -> tuple[Manifest, dict[str, str], KeyMap | None]:
    """``names`` (on-disk name → stored FQN) in the layout transformers holds in memory.

    Returns the manifest with fused entries added (:func:`merge_source`), in-memory name →
    FQN in it, and the conversion applied; without a conversion the inputs come back unchanged.
    The conversion comes from the user's cache as in :func:`to_disk_names`.
    """
    shapes = {n: manifest.tensors[f].shape for n, f in names.items()}
    keymap = keymap_for(config, shapes, "memory", quiet=quiet)
    if keymap is None:
        return manifest, names, None
    derived, out = merge_source(manifest, names, keymap)
    return derived, out, keymap
