"""``geometry.tiling_problems``: exact tiling, checked against a brute-force cover count."""

from __future__ import annotations

import itertools
import math
import random
import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptools.core.manifest import Chunk, TensorEntry
from ckptools.core.geometry import Box, tiling_problems
from ckptools.verify.structure import tiling_findings


def _cover_counts(shape: tuple[int, ...], boxes: list[Box]) -> np.ndarray:
    counts = np.zeros(shape, dtype=np.int64)
    for offsets, sizes in dict.fromkeys(boxes):  # replicas count once, as in the checker
        if len(offsets) != len(shape) or any(
            o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)
        ):
            continue
        counts[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] += 1
    return counts


def _grid(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Box]:
    """A random grid partition of ``shape`` (cuts per dim), possibly with empty boxes."""
    cuts = []
    for d in shape:
        inner = draw(st.lists(st.integers(0, d), max_size=3))
        cuts.append(sorted({0, d, *inner}))
    boxes: list[Box] = [((), ())]
    for edges in cuts:
        boxes = [((*o, a), (*s, b - a)) for o, s in boxes for a, b in itertools.pairwise(edges)]
    return boxes


@st.composite
def _cases(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
    boxes = _grid(draw, shape)
    mutation = draw(st.sampled_from(["none", "drop", "grow", "shift", "dup", "random"]))
    rnd = random.Random(draw(st.integers(0, 2**16)))
    if mutation == "drop" and boxes:
        boxes.pop(rnd.randrange(len(boxes)))
    elif mutation in ("grow", "shift") and boxes and shape:
        i, d = rnd.randrange(len(boxes)), rnd.randrange(len(shape))
        o, s = list(boxes[i][0]), list(boxes[i][1])
        if mutation == "grow":
            s[d] += 1
        else:
            o[d] += rnd.choice([-1, 1])
        boxes[i] = (tuple(o), tuple(s))
    elif mutation == "dup" and boxes:
        boxes.append(boxes[rnd.randrange(len(boxes))])  # a replica: still a tiling
    elif mutation == "random":
        boxes = [
            (
                tuple(rnd.randrange(0, d + 1) for d in shape),
                tuple(rnd.randrange(0, d + 1) for d in shape),
            )
            for _ in range(rnd.randrange(0, 5))
        ]
    rnd.shuffle(boxes)
    return shape, boxes


@settings(max_examples=400, deadline=None)
@given(_cases())
def test_matches_brute_force(case: tuple[tuple[int, ...], list[Box]]) -> None:
    shape, boxes = case
    problems = tiling_problems(shape, boxes)
    counts = _cover_counts(shape, boxes)
    outside = any(
        len(o) != len(shape)
        or any(a < 0 or b < 0 or a + b > d for a, b, d in zip(o, s, shape, strict=False))
        for o, s in boxes
    )
    exact = not outside and bool((counts == 1).all())
    assert (problems == []) == exact, (shape, boxes, problems)
    kinds = {p.kind for p in problems}
    if not outside:
        assert ("overlap" in kinds) == bool((counts > 1).any()), (shape, boxes, problems)
        if "overlap" not in kinds:
            assert ("gap" in kinds) == bool((counts == 0).any())
    for p in problems:
        if p.kind == "overlap":
            assert p.box is not None and p.other is not None
            assert p.box != p.other


def test_examples() -> None:
    assert tiling_problems((4, 2), [((0, 0), (2, 2)), ((2, 0), (2, 2))]) == []
    assert tiling_problems((), [((), ())]) == []
    assert tiling_problems((0, 3), []) == []
    gap = tiling_problems((4, 2), [((0, 0), (2, 2))])
    assert [(p.kind, p.covered, p.numel) for p in gap] == [("gap", 4, 8)]
    assert tiling_problems((4,), [((3,), (2,)), ((0,), (3,))])[0].kind == "outside"
    assert tiling_problems((4,), [((0, 0), (4, 1))])[0].kind == "ndim"
    # a dim-1 split whose boxes overlap only along dim 1 (sweep picks dim 1)
    over = tiling_problems((2, 4), [((0, 0), (2, 3)), ((0, 2), (2, 2))])
    assert over[0].kind == "overlap"


def test_near_linear_for_many_chunks() -> None:
    # 200k chunks of one tensor, and a 1000 x 100 grid: near-linear, so about a second each.
    n = 200_000
    boxes = [((i, 0), (1, 16)) for i in range(n)]
    t = time.perf_counter()
    assert tiling_problems((n, 16), boxes) == []
    assert time.perf_counter() - t < 20
    # a 2-D grid of 1000 x 100 boxes
    grid = [((i, j), (1, 1)) for i in range(1000) for j in range(100)]
    t = time.perf_counter()
    assert tiling_problems((1000, 100), grid) == []
    assert time.perf_counter() - t < 20
    assert math.prod((1000, 100)) == len(grid)


def test_findings_name_tensor_chunk_rank_and_file() -> None:
    chunks = (
        Chunk((0, 0), (3, 4), "__0_0.distcp", 0, 100, "torch_save", 0),
        Chunk((2, 0), (2, 4), "__1_0.distcp", 0, 100, "torch_save", 1),
    )
    findings = tiling_findings(TensorEntry("model.w", "float32", (4, 4), chunks))
    assert len(findings) == 1
    f = findings[0]
    assert (f.kind, f.fqn, f.rank, f.file, f.chunk) == (
        "tiling",
        "model.w",
        1,
        "__1_0.distcp",
        (2, 0),
    )
    assert "overlap" in f.message and "'model.w'" in f.message
    gap = tiling_findings(TensorEntry("model.v", "float32", (4, 4), chunks[:1]))
    assert "cover 12 of 16" in gap[0].message
