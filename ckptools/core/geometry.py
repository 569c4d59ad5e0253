"""Geometry of chunks: boxes of a row-major tensor, their intersections, and FSDP2's split.

A *box* is ``(offsets, sizes)`` in global element coordinates. Moving bytes between two layouts
of the same tensor is copying, for each pair of boxes that intersect, the intersection's
elements: :func:`copy_runs` lists them as runs of consecutive elements in both boxes. Pure
functions, no I/O, no torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]


def intersect(
    a_offsets: Sequence[int],
    a_sizes: Sequence[int],
    b_offsets: Sequence[int],
    b_sizes: Sequence[int],
) -> Box | None:
    """The intersection of two boxes, or None when it holds no element."""
    offsets = []
    sizes = []
    for ao, asz, bo, bsz in zip(a_offsets, a_sizes, b_offsets, b_sizes, strict=True):
        lo = max(ao, bo)
        hi = min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


def _strides(sizes: Sequence[int]) -> list[int]:
    out = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        out[d] = out[d + 1] * sizes[d + 1]
    return out


def copy_runs(
    src_offsets: Sequence[int],
    src_sizes: Sequence[int],
    dst_offsets: Sequence[int],
    dst_sizes: Sequence[int],
) -> Iterator[tuple[int, int, int]]:
    """Runs ``(src, dst, n)`` copying the intersection of a source and a destination box.

    ``src``/``dst`` are element indices within each box's own row-major layout; runs come in
    increasing order in both. Trailing dims that both boxes span fully merge into one run, so a
    dim-0 reslicing is a single run and a dim-1 split is one run per row.

    Example:
        >>> list(copy_runs((0, 0), (4, 6), (1, 3), (2, 3)))
        [(9, 0, 3), (15, 3, 3)]
    """
    ndim = len(src_sizes)
    if ndim == 0:
        yield (0, 0, 1)
        return
    box = intersect(src_offsets, src_sizes, dst_offsets, dst_sizes)
    if box is None:
        return
    offsets, sizes = box
    # Merge trailing dims that the intersection spans fully in both boxes.
    k = ndim - 1
    while k > 0 and sizes[k] == src_sizes[k] == dst_sizes[k]:
        k -= 1
    run = math.prod(sizes[k:])
    s_strides = _strides(src_sizes)
    d_strides = _strides(dst_sizes)
    s_base = sum((o - so) * st for o, so, st in zip(offsets, src_offsets, s_strides, strict=True))
    d_base = sum((o - do) * st for o, do, st in zip(offsets, dst_offsets, d_strides, strict=True))
    if k == 0:
        yield (s_base, d_base, run)
        return
    for idx in itertools.product(*(range(sizes[j]) for j in range(k))):
        s = s_base + sum(i * s_strides[j] for j, i in enumerate(idx))
        d = d_base + sum(i * d_strides[j] for j, i in enumerate(idx))
        yield (s, d, run)


def fsdp2_rows(dim0: int, world_size: int) -> list[tuple[int, int]]:
    """Rank r's ``(offset, size)`` on dim 0 as FSDP2 ``fully_shard`` splits it.

    ``torch.chunk`` semantics: every rank gets ``ceil(dim0 / world_size)`` rows until they run
    out; later ranks get none, and their (empty) box sits at offset ``dim0``.

    Example:
        >>> fsdp2_rows(5, 4)
        [(0, 2), (2, 2), (4, 1), (5, 0)]
    """
    per = math.ceil(dim0 / world_size) if dim0 else 0
    out = []
    for r in range(world_size):
        start = min(r * per, dim0)
        out.append((start, min(per, dim0 - start)))
    return out
