"""A conversion's pieces as manifest entries: boxes of stored chunks, as raw byte runs (pure).

:func:`split_entries` gives the on-disk tensors of in-memory ones (``consolidate``: a box of a
stored fused chunk is a run of its bytes) and :func:`merge_entries` the in-memory tensors of
on-disk ones (``shard``: the fused tensor's chunks are its parts' chunks placed at their boxes),
both for the :class:`~ckptools.plan.conversions.KeyMap` that
:meth:`~ckptools.plan.conversions.Rules.to_disk` or ``to_memory`` made. No I/O: a stored chunk
is resolved to its raw byte range by the caller's ``raw``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace

from ckptools.core.manifest import Chunk, Manifest, TensorEntry
from ckptools.errors import CorruptCheckpointError
from ckptools.plan.conversions import KeyMap, Piece, drop_dim, insert_dim
from ckptools.plan.dcp import ChunkIndex
from ckptools.plan.safetensors import unique_chunks


def _strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    out = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        out[d] = out[d + 1] * sizes[d + 1]
    return tuple(out)


def _sub_chunk(raw: Chunk, chunk: Chunk, piece: Piece, itemsize: int) -> Chunk:
    """The part of ``chunk`` (resolved to ``raw``) in ``piece``'s box, in on-disk coordinates."""
    lo = tuple(max(a, b) for a, b in zip(chunk.offsets, piece.offsets, strict=True))
    hi = tuple(
        min(a + n, b + m)
        for a, n, b, m in zip(chunk.offsets, chunk.sizes, piece.offsets, piece.sizes, strict=True)
    )
    sizes = tuple(h - low for low, h in zip(lo, hi, strict=True))
    strides = raw.strides or _strides(chunk.sizes)
    start = sum((low - o) * s for low, o, s in zip(lo, chunk.offsets, strides, strict=True))
    span = 1 + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))
    out_offsets = drop_dim(tuple(low - o for low, o in zip(lo, piece.offsets, strict=True)),
                        piece.stack_dim)  # fmt: skip
    numel = math.prod(sizes)
    contiguous = raw.strides is None and span == numel
    return raw._replace(
        offsets=out_offsets,
        sizes=drop_dim(sizes, piece.stack_dim),
        offset=raw.offset + start * itemsize,
        length=(numel if contiguous else span) * itemsize,
        strides=None if contiguous else drop_dim(strides, piece.stack_dim),
        crc32=raw.crc32 if sizes == chunk.sizes else None,
    )


def split_fqn(fqn: str, disk: str) -> str:
    """The FQN :func:`split_entries` gives the on-disk tensor ``disk`` cut from stored ``fqn``."""
    return f"{fqn}/{disk}"


def _cut(
    entry: TensorEntry,
    sources: ChunkIndex,
    p: Piece,
    raw: Callable[[TensorEntry, Chunk], Chunk],
    unchecked: dict[tuple[str, int], tuple[str, Chunk]],
) -> tuple[Chunk, ...]:
    """The chunks of the box ``p`` of stored ``entry`` (the fused side), as raw byte ranges;
    stored records no new chunk copies whole go to ``unchecked``."""
    chunks = []
    for c in sources.meeting(p.offsets, p.sizes):
        r = raw(entry, c)
        sub = _sub_chunk(r, c, p, entry.itemsize)
        if not r.file:  # boxes only (save_pretrained's manifest): no bytes to point at
            sub = sub._replace(offset=0, length=0, strides=None)
        if r.crc32 is not None and sub.crc32 is None:
            unchecked[(r.file, r.offset)] = (entry.fqn, r)
        chunks.append(sub)
    return tuple(chunks)


def _shifted(chunks: tuple[Chunk, ...], at: tuple[int, ...]) -> tuple[Chunk, ...]:
    """``chunks`` (offsets in a box) moved to the box's place ``at`` (none: where they are)."""
    if not any(at):
        return chunks
    return tuple(
        c._replace(offsets=tuple(a + o for a, o in zip(at, c.offsets, strict=True))) for c in chunks
    )


def _within(
    entry: TensorEntry,
    p: Piece,
    raw: Callable[[TensorEntry, Chunk], Chunk],
    unchecked: dict[tuple[str, int], tuple[str, Chunk]],
) -> tuple[Chunk, ...]:
    """The stored chunks of on-disk ``entry`` that piece ``p`` takes, resolved by ``raw``: all
    of them, or for a piece that is part of it (``Piece.at``) their boxes inside that part
    (offsets relative to the part)."""
    if not p.at:
        return tuple(raw(entry, c) for c in unique_chunks(entry))
    offsets, sizes = p.disk_box
    part = Piece(p.disk, p.disk, offsets, sizes, None, p.rule)
    return _cut(entry, ChunkIndex(entry), part, raw, unchecked)


def _place(
    manifest: Manifest,
    members: list[tuple[str, Piece]],
    raw: Callable[[TensorEntry, Chunk], Chunk],
    key: str,
    shape: tuple[int, ...],
    unchecked: dict[tuple[str, int], tuple[str, Chunk]],
) -> TensorEntry:
    """Entry ``key`` of ``shape`` made of stored tensors ``members`` ((stored FQN, piece)),
    each placed at its piece's box: the chunks are theirs, moved.

    Raises:
        CorruptCheckpointError: the members differ in dtype.
    """
    first = manifest.tensors[members[0][0]]
    placed = []
    for fqn, p in members:
        entry = manifest.tensors[fqn]
        if entry.dtype != first.dtype:
            raise CorruptCheckpointError(
                f"{fqn!r} is {entry.dtype} but {first.fqn!r} is {first.dtype}; rule {p.rule!r} "
                f"joins both into {key!r}",
                fqn=fqn,
            )
        for r in _within(entry, p, raw, unchecked):
            offsets = insert_dim(r.offsets, p.stack_dim, 0)
            placed.append(
                r._replace(
                    offsets=tuple(a + b for a, b in zip(offsets, p.offsets, strict=True)),
                    sizes=insert_dim(r.sizes, p.stack_dim, 1),
                    strides=None if r.strides is None else insert_dim(r.strides, p.stack_dim, 0),
                )
            )
    return TensorEntry(key, first.dtype, shape, tuple(placed))


def _free_key(manifest: Manifest, name: str) -> str:
    # a stored tensor of the same name (never the case for a real model) is not replaced
    return name if name not in manifest.tensors else f"{name}/fused"


def split_entries(
    manifest: Manifest,
    names: Mapping[str, str],
    keymap: KeyMap,
    raw: Callable[[TensorEntry, Chunk], Chunk],
) -> tuple[Manifest, dict[str, str], list[tuple[str, Chunk]]]:
    """The on-disk tensors of ``names`` (in-memory name → stored FQN) as manifest entries.

    A piece that is a whole tensor keeps its stored entry under its on-disk name; a piece that
    is a box of a fused tensor gets an entry ``"<stored FQN>/<on-disk name>"`` whose chunks are
    the boxes of the stored chunks inside it, as raw byte ranges (``raw`` resolves a stored
    chunk: the one I/O step, the caller's); a file tensor joined from in-memory parts (a
    ``Chunk`` rule's reverse) gets an entry of their chunks placed at their boxes.

    Returns:
        The manifest with those entries added, on-disk name → FQN in it (in ``names``' order),
        and ``(stored FQN, resolved chunk)`` of the records no new chunk covers whole (their
        CRC-32 is for the caller to check).
    """
    by_memory: dict[str, list[Piece]] = {}
    for p in keymap.pieces:
        by_memory.setdefault(p.memory, []).append(p)
    added: dict[str, TensorEntry] = {}
    out: dict[str, str] = {}
    joins: dict[str, list[tuple[str, Piece]]] = {}
    unchecked: dict[tuple[str, int], tuple[str, Chunk]] = {}
    for memory, fqn in names.items():
        entry = manifest.tensors[fqn]
        sources: ChunkIndex | None = None  # built once per stored tensor: linear in its chunks
        for p in by_memory.get(memory, ()):
            if p.whole:
                out[p.disk] = fqn
            elif p.fused_on_disk:
                joins.setdefault(p.disk, []).append((fqn, p))
                out[p.disk] = _free_key(manifest, p.disk)
            else:
                new_fqn = split_fqn(fqn, p.disk)
                sources = sources or ChunkIndex(entry)
                chunks = _shifted(_cut(entry, sources, p, raw, unchecked), p.at)
                if new_fqn in added:  # another box of the same on-disk tensor (``Piece.at``)
                    chunks = added[new_fqn].chunks + chunks
                added[new_fqn] = TensorEntry(new_fqn, entry.dtype, p.disk_shape, chunks)
                out[p.disk] = new_fqn
    for disk, members in joins.items():
        added[out[disk]] = _place(
            manifest, members, raw, out[disk], members[0][1].disk_shape, unchecked
        )
    tensors = {**manifest.tensors, **added}
    return replace(manifest, tensors=tensors), out, list(unchecked.values())


def merge_entries(
    manifest: Manifest,
    names: Mapping[str, str],
    keymap: KeyMap,
    raw: Callable[[TensorEntry, Chunk], Chunk],
) -> tuple[Manifest, dict[str, str], list[tuple[str, Chunk]]]:
    """The in-memory tensors of ``names`` (on-disk name → stored FQN) as manifest entries.

    A fused tensor gets an entry under its in-memory name whose chunks are its parts' stored
    chunks (resolved to raw byte ranges by ``raw``) placed at their boxes; a part cut from a
    fused file tensor (a ``Chunk`` rule) gets an entry ``"<stored FQN>/<in-memory name>"`` of
    the boxes of its stored chunks; a whole piece keeps its stored entry.

    Returns:
        The manifest with those entries added, in-memory name → FQN in it, and the records
        no new chunk covers whole, as :func:`split_entries`.

    Raises:
        CorruptCheckpointError: the parts of one fused tensor differ in dtype.
    """
    added: dict[str, TensorEntry] = {}
    out: dict[str, str] = {}
    stacks: dict[str, list[tuple[str, Piece]]] = {}
    unchecked: dict[tuple[str, int], tuple[str, Chunk]] = {}
    indexes: dict[str, ChunkIndex] = {}
    for p in keymap.pieces:
        fqn = names[p.disk]
        entry = manifest.tensors[fqn]
        if p.whole:
            out[p.memory] = fqn
        elif p.fused_on_disk:
            key = split_fqn(fqn, p.memory)
            sources = indexes.setdefault(fqn, ChunkIndex(entry))
            added[key] = TensorEntry(key, entry.dtype, p.sizes,
                                     _cut(entry, sources, p, raw, unchecked))  # fmt: skip
            out[p.memory] = key
        else:
            stacks.setdefault(p.memory, []).append((fqn, p))
            out[p.memory] = _free_key(manifest, p.memory)
    for memory, members in stacks.items():
        key = out[memory]
        added[key] = _place(manifest, members, raw, key, keymap.memory_shapes[memory], unchecked)
    tensors = {**manifest.tensors, **added}
    return replace(manifest, tensors=tensors), out, list(unchecked.values())
