"""Box geometry and the DCP writer's plan: properties that make resharding correct."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptools.core.geometry import copy_runs, fsdp2_rows, intersect
from ckptools.core.manifest import Chunk, Manifest, TensorEntry
from ckptools.plan.dcp import ChunkIndex, plan_dcp


def _global_index(
    offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...], i: int
) -> int:
    """Global row-major index of element ``i`` of a box."""
    idx = []
    for s in reversed(sizes):
        idx.append(i % s)
        i //= s
    idx.reverse()
    g = 0
    for d, n in enumerate(shape):
        g = g * n + offsets[d] + idx[d]
    return g


Boxes = list[tuple[tuple[int, ...], tuple[int, ...]]]


@st.composite
def _shapes(draw: st.DrawFn) -> tuple[int, ...]:
    return tuple(draw(st.integers(1, 6)) for _ in range(draw(st.integers(1, 3))))


@st.composite
def _grid_tiling(draw: st.DrawFn, shape: tuple[int, ...]) -> Boxes:
    """A tiling of ``shape`` by a grid of boxes (random cuts along each dim)."""
    cuts = []
    for n in shape:
        inner = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
        cuts.append([0, *inner, n])
    boxes: Boxes = []

    def rec(d: int, offs: tuple[int, ...], sizes: tuple[int, ...]) -> None:
        if d == len(shape):
            boxes.append((offs, sizes))
            return
        for a, b in itertools.pairwise(cuts[d]):
            rec(d + 1, (*offs, a), (*sizes, b - a))

    rec(0, (), ())
    return boxes


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_copy_runs_move_every_element_exactly_once(data: st.DataObject) -> None:
    shape = data.draw(_shapes())
    src_boxes = data.draw(_grid_tiling(shape))
    dst_boxes = data.draw(_grid_tiling(shape))
    written: dict[int, int] = {}
    for d_off, d_size in dst_boxes:
        for s_off, s_size in src_boxes:
            for s, d, n in copy_runs(s_off, s_size, d_off, d_size):
                for k in range(n):
                    g_src = _global_index(s_off, s_size, shape, s + k)
                    g_dst = _global_index(d_off, d_size, shape, d + k)
                    assert g_src == g_dst
                    written[g_dst] = written.get(g_dst, 0) + 1
    assert sorted(written) == list(range(math.prod(shape)))
    assert set(written.values()) == {1}


def test_copy_runs_merge_full_trailing_dims() -> None:
    # dim-0 reslicing is a single run; a dim-1 split is one run per row.
    assert list(copy_runs((0, 0), (4, 6), (2, 0), (4, 6))) == [(12, 0, 12)]
    assert list(copy_runs((0, 0), (4, 3), (0, 0), (4, 6))) == [
        (0, 0, 3),
        (3, 6, 3),
        (6, 12, 3),
        (9, 18, 3),
    ]


@given(st.integers(0, 200), st.integers(1, 64))
def test_fsdp2_rows_match_torch_chunk(dim0: int, world_size: int) -> None:
    import torch

    expected = [c.shape[0] for c in torch.arange(dim0).chunk(world_size)] if dim0 else []
    rows = fsdp2_rows(dim0, world_size)
    assert [n for _, n in rows if n] == [n for n in expected if n]
    assert sum(n for _, n in rows) == dim0
    for (start, n), (nxt, _) in itertools.pairwise(rows):
        assert start + n == nxt or n == 0


def _manifest(
    shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...], int]], ws: int
) -> Manifest:
    cs = tuple(Chunk(o, s, f"__{r}_0.distcp", 0, 100, "torch_save", r) for o, s, r in chunks)
    t = TensorEntry("w", "float32", shape, cs)
    return Manifest("r", "dcp", "dcp", {"w": t}, {}, {}, world_size=ws)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.integers(1, 9), st.integers(1, 9), st.integers(1, 5))
def test_plan_places_each_rank_rows_in_its_file(
    d0: int, cols: int, src_ws: int, dst_ws: int
) -> None:
    src_rows = [(o, n, r) for r, (o, n) in enumerate(fsdp2_rows(d0, src_ws)) if n]
    m = _manifest((d0, cols), [((o, 0), (n, cols), r) for o, n, r in src_rows], src_ws)
    plan = plan_dcp(m, dst_ws)
    rows = fsdp2_rows(d0, dst_ws)
    covered = 0
    for item in plan.tensors:
        if item.sizes[0]:
            assert (item.offsets[0], item.sizes[0]) == rows[item.rank]
            covered += item.sizes[0]
            # every source that intersects is listed, and only those
            hits = {c.offsets[0] for c in item.sources}
            want = {
                o
                for o, n, _ in src_rows
                if o < item.offsets[0] + item.sizes[0] and o + n > item.offsets[0]
            }
            assert hits == want
        else:
            assert item.offsets == (d0, 0)
    assert covered == d0
    assert sum(1 for i in plan.tensors if not i.sizes[0]) <= 1  # empty boxes stored once
    # items in a file do not overlap and the file sizes add up
    for r in range(dst_ws):
        spans = sorted((i.offset, i.offset + i.length) for i in plan.tensors if i.rank == r)
        for (_, b), (c, _) in itertools.pairwise(spans):
            assert b <= c
        assert plan.file_sizes[r] == sum(b - a for a, b in spans)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 30), st.integers(1, 6), st.integers(1, 7), st.integers(1, 3),
    st.booleans(), st.integers(1, 9),
)  # fmt: skip
def test_chunk_index_finds_exactly_the_chunks_a_box_meets(
    d0: int, cols: int, src_ws: int, col_split: int, box_rows: bool, dst_ws: int
) -> None:
    """The bisection over whole-row chunks (FSDP2's) and the box arithmetic for any other
    tiling (dim-1 splits) list the same chunks as a brute-force intersection."""
    col_split = min(col_split, cols)
    col_rows = fsdp2_rows(cols, col_split)
    boxes = [
        ((o, co), (n, cn), r)
        for r, (o, n) in enumerate(fsdp2_rows(d0, src_ws))
        for co, cn in col_rows
        if n and cn
    ]
    index = ChunkIndex(_manifest((d0, cols), boxes, src_ws).tensors["w"])
    wanted_cols = (0, cols) if box_rows else (cols // 2, cols - cols // 2)
    for start, n in fsdp2_rows(d0, dst_ws):
        offsets, sizes = (start, wanted_cols[0]), (n, wanted_cols[1])
        brute = {
            (c.offsets, c.sizes)
            for c in index.chunks
            if intersect(c.offsets, c.sizes, offsets, sizes) is not None
        }
        assert {(c.offsets, c.sizes) for c in index.meeting(offsets, sizes)} == brute
