"""Where ZeRO puts each parameter's elements, and a flat range of a tensor as boxes (pure).

**Where a parameter lies.** ZeRO flattens a parameter group into one vector and cuts it into
equal rank partitions; a partition boundary falls anywhere, mid-row included:

* stages 1 and 2: group ``g`` is the parameters of ``param_shapes[g]`` in that order, each
  followed by its ``param_alignment_paddings`` entry, then the group's padding; rank ``r``
  owns elements ``[r*P, (r+1)*P)`` of that vector (``P`` equal on every rank) and saves them
  in ``single_partition_of_fp32_groups[g]`` without the padding (its ``group_paddings[g]``),
  so the saved partitions back to back are the vector, as ``zero_to_fp32`` concatenates
  them. A parameter meets one rank or a few.
* stage 3: every parameter is cut on its own: ``pn = ceil(numel / W)`` elements per rank, the
  last ranks padded; rank ``r``'s flat groups (``fp32_flat_groups``, concatenated) hold its
  ``pn`` elements of every parameter of ``param_shapes`` (all groups, in order) back to back.
  A parameter meets every rank.

**A flat range as boxes.** A manifest chunk is a box of the global shape, and consolidate,
reshard and verify all work on boxes. A range ``[a, b)`` of a row-major tensor's flat view is
a union of at most ``2*ndim - 1`` boxes, each contiguous both in the tensor and in the range
(:func:`flat_boxes`: the rest of the first row, whole rows, the start of the last row, applied
recursively per dimension), so a piece of a partition becomes those boxes, each a ``raw`` chunk
at its own byte offset in the rank file. A 2-D weight split mid-row is three chunks: nothing
downstream needs a "flat" chunk kind, and tiling checks every element as for DCP.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from ckptools.core.manifest import Chunk, Record, stored_in
from ckptools.errors import CorruptCheckpointError

Box = tuple[tuple[int, ...], tuple[int, ...]]


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> Iterator[tuple[Box, int]]:
    """The boxes (offsets, sizes) covering flat elements ``[start, stop)`` of a row-major
    ``shape``, in order, each with the flat index of its first element.

    Example:
        >>> [b for b, _ in flat_boxes((3, 4), 2, 9)]
        [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 1))]
    """
    shape = tuple(shape)
    if start >= stop:
        return
    if not shape:
        yield ((), ()), 0
        return
    inner = math.prod(shape[1:])
    rest = shape[1:]
    first, last = start // inner, (stop - 1) // inner
    if first == last and (start % inner or stop - first * inner < inner):
        for (offs, sizes), at in flat_boxes(rest, start - first * inner, stop - first * inner):
            yield ((first, *offs), (1, *sizes)), first * inner + at
        return
    if start % inner:
        yield from flat_boxes(shape, start, (first + 1) * inner)
        first += 1
    whole_end = stop // inner
    if whole_end > first:
        yield ((first, *(0,) * len(rest)), (whole_end - first, *rest)), first * inner
    if stop % inner:
        yield from flat_boxes(shape, whole_end * inner, stop)


@dataclass(frozen=True, slots=True)
class Segment:
    """Elements ``[start, start + count)`` of a parameter's flat view, stored on ``rank`` at
    element ``local`` of that rank's flat space (its flat groups back to back)."""

    rank: int
    local: int
    start: int
    count: int


@dataclass(frozen=True, slots=True)
class RankFlat:
    """One rank's flat space in one kind of storage: ``(file, byte offset, numel)`` per flat
    group, in order; all float tensors of ``dtype``. ``records``: per piece, the stored record
    it lies in (its CRC-32 checks the chunks cut from it), or () where none is known."""

    pieces: tuple[tuple[str, int, int], ...]
    dtype: str
    itemsize: int
    records: tuple[Record | None, ...] = ()

    @property
    def numel(self) -> int:
        return sum(n for _, _, n in self.pieces)

    def runs(self, local: int, count: int) -> Iterator[tuple[str, int, int, int, Record | None]]:
        """(file, byte offset, count, offset into the request, the piece's record) of
        ``[local, local+count)``."""
        base, done = 0, 0
        for i, (file, at, n) in enumerate(self.pieces):
            lo, hi = max(local, base), min(local + count, base + n)
            if lo < hi:
                record = self.records[i] if self.records else None
                yield file, at + (lo - base) * self.itemsize, hi - lo, lo - local, record
                done += hi - lo
            base += n
        if done != count:
            raise CorruptCheckpointError(
                f"{self.pieces[0][0] if self.pieces else '?'}: elements {local}..{local + count}"
                f" lie past the rank's {base} stored elements"
            )


def chunks_of(
    shape: tuple[int, ...], segments: Sequence[Segment], flats: Mapping[int, RankFlat]
) -> tuple[Chunk, ...]:
    """Raw chunks of a parameter from its segments and the ranks' flat spaces."""
    out: list[Chunk] = []
    for seg in segments:
        flat = flats[seg.rank]
        for file, at, count, into, record in flat.runs(seg.local, seg.count):
            first = seg.start + into
            for (offsets, sizes), flat_at in flat_boxes(shape, first, first + count):
                offset = at + (flat_at - first) * flat.itemsize
                length = math.prod(sizes) * flat.itemsize
                checks = {} if record is None else stored_in(record, offset, length)
                out.append(Chunk(offsets, sizes, file, offset, length, rank=seg.rank, **checks))
    if not out and math.prod(shape) == 0 and flats:
        file = next(iter(flats.values())).pieces[0][0]
        out.append(Chunk((0,) * len(shape), shape, file, 0, 0, rank=None))
    return tuple(out)


def zero12_segments(
    groups: Sequence[Mapping[str, tuple[int, ...]]],
    aligns: Sequence[Sequence[int]],
    saved: Sequence[Sequence[int]],
) -> tuple[dict[str, list[Segment]], list[int]]:
    """Stages 1/2: each parameter's segments, and each group's used elements (parameters and
    their alignment paddings).

    ``saved[r][g]`` is how many elements of group ``g`` rank ``r``'s file holds: DeepSpeed
    saves each partition without its padding, so the group's vector is the ranks' saved
    partitions back to back (as ``zero_to_fp32`` concatenates them).
    """
    out: dict[str, list[Segment]] = {}
    used: list[int] = []
    world = len(saved)
    base = [0] * world  # where group g starts in each rank's flat space
    for g, shapes in enumerate(groups):
        starts = list(itertools.accumulate((saved[r][g] for r in range(world)), initial=0))
        at = 0
        for i, (name, shape) in enumerate(shapes.items()):
            n = math.prod(shape)
            segs = []
            r = max(0, bisect.bisect_right(starts, at) - 1)
            while r < world and starts[r] < at + n:
                lo, hi = max(at, starts[r]), min(at + n, starts[r + 1])
                if lo < hi:
                    segs.append(Segment(r, base[r] + lo - starts[r], lo - at, hi - lo))
                r += 1
            out[name] = segs
            at += n + aligns[g][i]
        used.append(at)
        for r in range(world):
            base[r] += saved[r][g]
    return out, used


def zero3_segments(
    shapes: Mapping[str, tuple[int, ...]], world: int
) -> tuple[dict[str, list[Segment]], int]:
    """Stage 3: each parameter's segments, and the elements each rank must hold."""
    out: dict[str, list[Segment]] = {}
    local = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        per = -(-n // world)
        out[name] = [
            Segment(r, local, r * per, min(n, (r + 1) * per) - r * per)
            for r in range(world)
            if r * per < n
        ]
        local += per
    return out, local
