"""ZeRO's placement of parameters and flat ranges as boxes (pure; no files, no DeepSpeed).

The truth for each property is computed element by element, independently of the code under
test: a flat index is mapped to its position with ``divmod`` and back.
"""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptools.core.flat_ranges import (
    RankFlat,
    Segment,
    chunks_of,
    flat_boxes,
    zero3_segments,
    zero12_segments,
)
from ckptools.core.geometry import tiling_problems


def _flat_index(shape: tuple[int, ...], pos: tuple[int, ...]) -> int:
    i = 0
    for p, d in zip(pos, shape, strict=True):
        i = i * d + p
    return i


@st.composite
def _shape_and_range(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int]:
    shape = tuple(draw(st.lists(st.integers(1, 5), max_size=4)))
    n = math.prod(shape)
    a = draw(st.integers(0, n))
    b = draw(st.integers(a, n))
    return shape, a, b


@settings(max_examples=200, deadline=None)
@given(_shape_and_range())
def test_flat_boxes_cover_the_range_in_order_each_contiguous(
    case: tuple[tuple[int, ...], int, int],
) -> None:
    shape, a, b = case
    seen: list[int] = []
    boxes = list(flat_boxes(shape, a, b))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    for (offsets, sizes), first in boxes:
        cells = itertools.product(*(range(o, o + s) for o, s in zip(offsets, sizes, strict=True)))
        flat = [_flat_index(shape, c) for c in cells]
        # contiguous in the tensor's flat view, starting where the box says
        assert flat == list(range(first, first + len(flat)))
        seen += flat
    assert seen == list(range(a, b))


def test_mid_row_split_is_three_boxes() -> None:
    assert [b for b, _ in flat_boxes((37, 12), 5, 30)] == [
        ((0, 5), (1, 7)),
        ((1, 0), (1, 12)),
        ((2, 0), (1, 6)),
    ]


def _flats(saved: list[list[int]]) -> dict[int, RankFlat]:
    """Rank r's groups in file f"r{r}" back to back at byte 0, fp32."""
    out = {}
    for r, groups in enumerate(saved):
        pieces, at = [], 0
        for n in groups:
            pieces.append((f"r{r}", at, n))
            at += n * 4
        out[r] = RankFlat(tuple(pieces), "float32", 4)
    return out


def _element_sources(
    shape: tuple[int, ...], segs: list[Segment], flats: dict[int, RankFlat]
) -> dict[int, tuple[str, int]]:
    """Parameter flat index -> (file, byte) through the chunks; each element exactly once."""
    chunks = chunks_of(shape, segs, flats)
    assert tiling_problems(shape, [(c.offsets, c.sizes) for c in chunks]) == []
    out: dict[int, tuple[str, int]] = {}
    for c in chunks:
        cells = itertools.product(
            *(range(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))
        )
        for k, cell in enumerate(cells):
            i = _flat_index(shape, cell)
            assert i not in out
            out[i] = (c.file, c.offset + 4 * k)
    return out


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=3), min_size=1, max_size=5),
    st.integers(1, 4),
    st.integers(0, 3),
)
def test_zero12_places_every_element_where_zero_to_fp32_reads_it(
    shapes: list[list[int]], world: int, align: int
) -> None:
    params = {f"p{i}": tuple(s) for i, s in enumerate(shapes)}
    aligns = [[align if i < len(params) - 1 else 0 for i in range(len(params))]]
    used = sum(math.prod(s) + a for s, a in zip(params.values(), aligns[0], strict=True))
    size = -(-used // world)
    # each rank saves its partition without the padding, which only ends the group
    saved = [[max(0, min(size, used - r * size))] for r in range(world)]
    segs, got_used = zero12_segments([params], aligns, saved)
    assert got_used == [used]
    flats = _flats(saved)
    at = 0
    for (name, shape), pad in zip(params.items(), aligns[0], strict=True):
        src = _element_sources(shape, segs[name], flats)
        for i in range(math.prod(shape)):
            # zero_to_fp32: the saved partitions back to back, parameters in order
            g = at + i
            r = next(r for r in range(world) if sum(x[0] for x in saved[: r + 1]) > g)
            assert src[i] == (f"r{r}", 4 * (g - sum(x[0] for x in saved[:r])))
        at += math.prod(shape) + pad


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3), min_size=1, max_size=5),
    st.integers(1, 4),
    st.integers(1, 3),
)
def test_zero3_places_every_element_where_zero_to_fp32_reads_it(
    shapes: list[list[int]], world: int, groups: int
) -> None:
    params = {f"p{i}": tuple(s) for i, s in enumerate(shapes)}
    segs, per_rank = zero3_segments(params, world)
    assert per_rank == sum(-(-math.prod(s) // world) for s in params.values())
    # the rank's flat space cut into ``groups`` sub-groups (a parameter may straddle two)
    cuts = sorted({0, per_rank, *(per_rank * k // groups for k in range(groups))})
    sizes = [b - a for a, b in itertools.pairwise(cuts)]
    flats = _flats([sizes] * world)
    local = 0
    for name, shape in params.items():
        n = math.prod(shape)
        per = -(-n // world)
        src = _element_sources(shape, segs[name], flats)
        for i in range(n):
            r, k = divmod(i, per)
            assert src[i] == (f"r{r}", 4 * (local + k))
        local += per
