"""The pure plan of a DCP checkpoint laid out for a world size the way FSDP2 lays it out.

Each tensor is split on dim 0 the way FSDP2 ``fully_shard`` splits it on N ranks
(:func:`ckptools.core.geometry.fsdp2_rows`), rank r's pieces go to ``__r_0.distcp``; tensors
that cannot be split (0-dim, or stored whole by a multi-rank source, i.e. replicated) and the
single empty box that FSDP2 records for ranks without rows are stored once, on the least-loaded
rank, as DCP's own deduplication does. Each piece is a ``torch.save`` archive whose bytes around
the tensor data are computed by :func:`ckptools.formats.torch_archive.tensor_archive_layout`, so
every item's size, and hence every byte offset, is known before anything is written. Each piece
also lists the source chunks it meets (found by bisection on dim-0 offsets), so the writer
(:func:`ckptools.engine.dcp_writer.write_dcp`) never searches.

No disk, no threads, no torch.
"""

from __future__ import annotations

import bisect
import math
import operator
import pickle
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice, repeat
from typing import Any, NamedTuple

from ckptools.core.bulk import gc_paused, without_gc
from ckptools.core.geometry import fsdp2_rows, intersect
from ckptools.core.manifest import Chunk, Manifest, TensorEntry
from ckptools.core.tensor_value import TensorValue
from ckptools.errors import UnsupportedCheckpointError, UsageError
from ckptools.formats import torch_archive
from ckptools.plan.safetensors import unique_chunks


class TensorItem(NamedTuple):
    """One output chunk: a box of ``fqn`` stored as a torch.save archive at ``offset``; its
    bytes come from ``sources``, or are ``data`` (a :class:`TensorValue`, stored whole).

    A named tuple, not a frozen dataclass: a plan holds one per output chunk (2.3M for a 405B
    model at 2,048 ranks), and a tuple is built 4x faster than a frozen dataclass's
    ``__init__`` sets eleven fields."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int
    offset: int
    length: int
    sources: tuple[Chunk, ...]  # source chunks that intersect the box
    source_fqn: str  # FQN of the source tensor (names may differ: shard adds a prefix)
    data: bytes | None = None  # the box's bytes, for a value the source holds decoded


_new = tuple.__new__  # a named tuple from all its fields, in order


@dataclass(frozen=True, slots=True)
class ObjectItem:
    """A non-tensor entry of rank ``rank``'s file: copied byte for byte from ``source_file``
    (a DCP source's item), or, when ``data`` is set, those bytes (a value the source held
    decoded, e.g. a ``torch.save`` optimizer's ``lr``, stored as ``torch.save`` of it)."""

    fqn: str
    rank: int
    offset: int
    length: int
    source_file: str
    source_offset: int
    data: bytes | None = None


@dataclass(frozen=True, slots=True)
class Archived:
    """A non-tensor value already in the bytes DCP stores (a ``torch.save`` archive), for
    :func:`plan_dcp`'s ``values``: stored as they are."""

    data: bytes


@dataclass(frozen=True)
class DcpPlan:
    """Every item of every rank file, and what ``.metadata`` records about each tensor."""

    world_size: int
    tensors: tuple[TensorItem, ...]
    objects: tuple[ObjectItem, ...]
    file_sizes: tuple[int, ...]  # per rank
    shapes: Mapping[str, tuple[str, tuple[int, ...]]]  # fqn -> (dtype, global shape)
    paths: Mapping[str, tuple[str, ...]]  # fqn -> key path (DCP planner_data)

    @property
    def total_bytes(self) -> int:
        return sum(self.file_sizes)

    def of_files(self, files: Collection[int]) -> DcpPlan:
        """This plan with only the items of the rank files ``files``: what the process that
        writes those files (under torchrun, :mod:`ckptools.engine.collective`) needs. The file sizes
        stay whole, so every process still finds the same split of the files, and so do the
        shapes and key paths; such a plan writes no ``.metadata`` (its items are not all)."""
        wanted = set(files)
        return DcpPlan(
            self.world_size,
            tuple(t for t in self.tensors if t.rank in wanted),
            tuple(o for o in self.objects if o.rank in wanted),
            self.file_sizes,
            self.shapes,
            self.paths,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled to go to another process (a rank's share under torchrun: 1.04M items of a
        # 405B reshard to 2,048 ranks): as columns of plain values, which pickle at C speed,
        # where each named tuple would cost two Python calls; rebuilt with the collector paused.
        return (_unpacked, (_packed(self),))

    def to_dict(self) -> dict[str, Any]:
        per_rank: list[dict[str, Any]] = [
            {"file": file_name(r), "bytes": self.file_sizes[r], "tensors": 0, "objects": 0}
            for r in range(self.world_size)
        ]
        for rank, n in Counter(map(_RANK, self.tensors)).items():
            per_rank[rank]["tensors"] = n
        for rank, n in Counter(map(_RANK, self.objects)).items():
            per_rank[rank]["objects"] = n
        return {
            "world_size": self.world_size,
            "files": per_rank,
            "tensors": len(self.shapes),
            "chunks": len(self.tensors),
            "objects": len(self.objects),
            "bytes": self.total_bytes,
        }


_RANK = operator.attrgetter("rank")


@without_gc
def _packed(plan: DcpPlan) -> bytes:
    """``plan`` as the bytes :func:`_unpacked` rebuilds it from: its items as columns (one per
    field), and their source chunks, in order, as columns too, each item's ``sources`` a count.
    (A rank's share holds one of each pair of neighbouring pieces that share their sources: no
    sharing is kept.)"""
    columns: list[Any] = list(zip(*plan.tensors, strict=True))
    chunks: list[Any] = []
    if columns:
        sources = columns[_SOURCES]
        chunks = list(zip(*[c for s in sources for c in s], strict=True))
        columns[_SOURCES] = list(map(len, sources))
    fields = (plan.world_size, columns, chunks, plan.objects, plan.file_sizes, plan.shapes,
              plan.paths)  # fmt: skip
    return pickle.dumps(fields, protocol=pickle.HIGHEST_PROTOCOL)


def _unpacked(data: bytes) -> DcpPlan:
    """The plan :func:`_packed` made ``data`` of."""
    with gc_paused():  # millions of tuples, none in a cycle
        world_size, columns, chunks, objects, file_sizes, shapes, paths = pickle.loads(data)
        if columns:
            each = iter(map(_new, repeat(Chunk), zip(*chunks, strict=True)))
            columns[_SOURCES] = [tuple(islice(each, n)) for n in columns[_SOURCES]]
        tensors = tuple(map(_new, repeat(TensorItem), zip(*columns, strict=True)))
    return DcpPlan(world_size, tensors, objects, file_sizes, shapes, paths)


_SOURCES = TensorItem._fields.index("sources")


def file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def _replicated_in_source(tensor: TensorEntry, source_world_size: int | None) -> bool:
    """A tensor a multi-rank job stored whole (a buffer, or a param FSDP did not shard)."""
    if not tensor.shape or source_world_size is None or source_world_size <= 1:
        return not tensor.shape
    boxes = {(c.offsets, c.sizes) for c in tensor.chunks if 0 not in c.sizes}
    return len(boxes) == 1 and next(iter(boxes))[1] == tensor.shape and tensor.shape[0] > 1


@without_gc  # millions of items at scale: the collector would walk them again and again
def plan_dcp(
    manifest: Manifest,
    world_size: int,
    names: Mapping[str, str] | None = None,
    paths: Mapping[str, tuple[str, ...]] | None = None,
    *,
    objects: Sequence[str] | None = None,
    values: Mapping[str, Any] | None = None,
) -> DcpPlan:
    """Plan a DCP checkpoint for ``world_size`` ranks holding ``manifest``'s entries.

    Args:
        manifest: the source.
        world_size: ranks of the target layout.
        names: output FQN → source FQN for the tensors to write (default: all, same names).
        paths: output FQN → key path for ``planner_data`` (default: the source's paths).
        objects: source object FQNs to carry over (default: all).
        values: output FQN → plain value to store as a non-tensor entry (its key path from
            ``paths``), for values a source held decoded rather than as DCP items; a
            :class:`ckptools.core.tensor_value.TensorValue` is stored as a tensor (one chunk,
            on the least-loaded rank, as DCP stores a replicated tensor).

    Example:
        >>> plan = plan_dcp(manifest, 8)                        # doctest: +SKIP
        >>> plan.to_dict()["files"][0]["file"]                   # doctest: +SKIP
        '__0_0.distcp'
    """
    if world_size < 1:
        raise UsageError(f"world size must be at least 1, got {world_size}")
    names = dict(names) if names is not None else {f: f for f in manifest.tensors}
    packer = _Packer(world_size)
    object_items: list[ObjectItem] = []
    out_paths: dict[str, tuple[str, ...]] = {}
    for fqn in objects if objects is not None else list(manifest.objects):
        entry = manifest.objects[fqn]
        if entry.file is None:
            raise UsageError(
                f"{fqn!r}: non-tensor values of {manifest.format} checkpoints cannot be carried "
                "into DCP byte for byte"
            )
        rank = packer.least_loaded()
        object_items.append(
            ObjectItem(fqn, rank, packer.take(rank, entry.length), entry.length, entry.file,
                       entry.offset)
        )  # fmt: skip
        out_paths[fqn] = manifest.paths.get(fqn, (fqn,))
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    for fqn, value in (values or {}).items():
        out_paths[fqn] = (paths or {}).get(fqn) or (fqn,)
        if isinstance(value, TensorValue):
            shapes[fqn] = (value.dtype, value.shape)
            _plan_value_tensor(packer, fqn, value)
            continue
        try:
            data = (
                value.data if isinstance(value, Archived) else torch_archive.object_archive(value)
            )
        except TypeError as e:
            raise UnsupportedCheckpointError(
                f"{manifest.root}: {fqn!r} cannot be stored in DCP ({e})", fqn=fqn
            ) from e
        rank = packer.least_loaded()
        object_items.append(
            ObjectItem(fqn, rank, packer.take(rank, len(data)), len(data), "", 0, data)
        )
    for out_fqn, src_fqn in names.items():
        tensor = manifest.tensors[src_fqn]
        shapes[out_fqn] = (tensor.dtype, tensor.shape)
        out_paths[out_fqn] = (paths or {}).get(out_fqn) or manifest.paths.get(src_fqn, (out_fqn,))
        _plan_tensor(packer, out_fqn, tensor, manifest.world_size)
    return DcpPlan(
        world_size, tuple(packer.items), tuple(object_items), tuple(packer.sizes), shapes, out_paths
    )


class _Packer:
    """Appends items to the rank files, tracking each file's size (the next item's offset)."""

    def __init__(self, world_size: int) -> None:
        self.sizes = [0] * world_size
        self.items: list[TensorItem] = []

    def least_loaded(self) -> int:
        return self.sizes.index(min(self.sizes))  # the first of the smallest, at C speed

    def take(self, rank: int, length: int) -> int:
        offset = self.sizes[rank]
        self.sizes[rank] += length
        return offset


_OFFSETS = operator.itemgetter(0)  # Chunk.offsets, at C speed


class ChunkIndex:
    """A tensor's stored chunks, sorted on dim 0 so a box finds the ones it meets by bisection."""

    def __init__(self, tensor: TensorEntry) -> None:
        self.chunks = sorted(unique_chunks(tensor), key=_OFFSETS)
        self.starts = [c.offsets[0] if c.offsets else 0 for c in self.chunks]
        self.max_rows = max((c.sizes[0] for c in self.chunks if c.sizes), default=0)
        # Chunks that are whole rows (dim-0 shards, as FSDP2 stores every tensor) and tile the
        # shape are disjoint dim-0 intervals, sorted by start and so by end too: a box of whole
        # rows meets exactly those between two bisections, with no box arithmetic per chunk
        # (a reshard of 1.16M chunks to 2,048 ranks asks 2.3M boxes).
        self.rows = tensor.shape[1:] if tensor.shape else None
        zeros = (0,) * (len(tensor.shape) - 1)
        self.ends: list[int] | None = None
        if self.rows is not None and all(
            c.sizes[1:] == self.rows and c.offsets[1:] == zeros for c in self.chunks
        ):
            self.ends = [c.offsets[0] + c.sizes[0] for c in self.chunks]
        self.zeros = zeros

    def meeting(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[Chunk, ...]:
        if math.prod(sizes) == 0:
            return ()
        if not offsets:
            return tuple(self.chunks)
        if self.ends is not None and sizes[1:] == self.rows and offsets[1:] == self.zeros:
            lo = bisect.bisect_right(self.ends, offsets[0])
            return tuple(self.chunks[lo : bisect.bisect_left(self.starts, offsets[0] + sizes[0])])
        # Only chunks starting before the box ends, and no earlier than (box start - the tallest
        # chunk), can meet it.
        lo = bisect.bisect_left(self.starts, offsets[0] - self.max_rows)
        hi = bisect.bisect_left(self.starts, offsets[0] + sizes[0])
        return tuple(c for c in self.chunks[lo:hi] if intersect(c.offsets, c.sizes, offsets, sizes))


def _plan_value_tensor(packer: _Packer, fqn: str, value: TensorValue) -> None:
    rank = packer.least_loaded()
    length = torch_archive.tensor_archive_layout(value.dtype, value.shape).length
    zeros = (0,) * len(value.shape)
    packer.items.append(
        TensorItem(
            fqn, value.dtype, value.shape, zeros, value.shape, rank, packer.take(rank, length),
            length, (), fqn, value.data,
        )
    )  # fmt: skip


def _plan_tensor(
    packer: _Packer, out_fqn: str, tensor: TensorEntry, source_world_size: int | None
) -> None:
    sources = ChunkIndex(tensor)
    lengths: dict[tuple[int, ...], int] = {}  # a tensor's pieces have one or two sizes
    append, file_sizes = packer.items.append, packer.sizes

    def place(offsets: tuple[int, ...], sizes: tuple[int, ...], rank: int) -> None:
        length = lengths.get(sizes)
        if length is None:
            length = torch_archive.tensor_archive_layout(tensor.dtype, sizes).length
            lengths[sizes] = length
        offset = file_sizes[rank]
        file_sizes[rank] = offset + length
        append(
            TensorItem(
                out_fqn, tensor.dtype, tensor.shape, offsets, sizes, rank, offset, length,
                sources.meeting(offsets, sizes), tensor.fqn,
            )
        )  # fmt: skip

    shape = tensor.shape
    if _replicated_in_source(tensor, source_world_size):
        place((0,) * len(shape), shape, packer.least_loaded())
        return
    zeros = (0,) * (len(shape) - 1)
    empty_placed = False
    rows = fsdp2_rows(shape[0], len(packer.sizes))
    if sources.ends is not None:
        _place_rows(packer, out_fqn, tensor, sources, rows)
    for rank, (start, n) in enumerate(rows):
        if n:
            if sources.ends is None:
                place((start, *zeros), (n, *shape[1:]), rank)
        elif not empty_placed:
            # Ranks without rows all record the same empty box at offset dim0; DCP's dedup
            # keeps one copy, on the least-loaded rank.
            place((shape[0], *zeros), (0, *shape[1:]), packer.least_loaded())
            empty_placed = True


def _place_rows(
    packer: _Packer,
    out_fqn: str,
    tensor: TensorEntry,
    sources: ChunkIndex,
    rows: Sequence[tuple[int, int]],
) -> None:
    """Place each rank's rows of ``tensor`` (stored as whole-row chunks) in its file: the loop
    :func:`_plan_tensor` would run per rank, with the box arithmetic reduced to two bisections
    and the tuples that neighbouring ranks share (sizes, sources, lengths) built once."""
    assert sources.ends is not None
    append, file_sizes, chunks = packer.items.append, packer.sizes, sources.chunks
    starts, ends = sources.starts, sources.ends
    fqn, dtype, shape, src_fqn = out_fqn, tensor.dtype, tensor.shape, tensor.fqn
    zeros, tail = sources.zeros, shape[1:]
    boxes: dict[int, tuple[tuple[int, ...], int]] = {}  # rows -> (sizes, archive length)
    last_lo, last_hi = -1, -1
    met: tuple[Chunk, ...] = ()  # the sources of the previous rank
    empty = not math.prod(tail)
    right, left = bisect.bisect_right, bisect.bisect_left
    for rank, (start, n) in enumerate(rows):
        if not n:
            continue
        box = boxes.get(n)
        if box is None:
            sizes = (n, *tail)
            box = boxes[n] = (sizes, torch_archive.tensor_archive_layout(dtype, sizes).length)
        sizes, length = box
        lo = right(ends, start)
        hi = left(starts, start + n)
        if lo != last_lo or hi != last_hi:
            last_lo, last_hi, met = lo, hi, () if empty else tuple(chunks[lo:hi])
        offset = file_sizes[rank]
        file_sizes[rank] = offset + length
        # built as the tuple it is, every field given (2M of them at 2,048 ranks)
        append(
            _new(TensorItem, (fqn, dtype, shape, (start, *zeros), sizes, rank, offset, length,
                              met, src_fqn, None))
        )  # fmt: skip
