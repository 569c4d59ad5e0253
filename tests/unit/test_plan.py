"""The consolidation planner: byte coverage, shard splitting, headers (pure, no I/O, no torch)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptools.core import dtypes
from ckptools.core.manifest import Chunk, Manifest, TensorEntry
from ckptools.core.sizes import parse_size
from ckptools.engine.chunk_copier import pieces
from ckptools.engine.executor import block_bytes, share_of
from ckptools.errors import CorruptCheckpointError, UnsupportedCheckpointError, UsageError
from ckptools.plan.safetensors import (
    INDEX_NAME,
    SINGLE_FILE_NAME,
    ConsolidationPlan,
    chunk_span,
    header_bytes,
    plan_consolidation,
    runs,
    shard_groups,
    unique_chunks,
)

DTYPES = ["float32", "bfloat16", "float16", "int64", "bool", "float8_e4m3fn", "float64", "uint8"]


@st.composite
def tiled(draw: st.DrawFn) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """A shape and a grid of boxes tiling it (cuts on any dims: dim-0, dim-1 and 2-D sharding)."""
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    per_dim = []
    for d in shape:
        cuts = sorted(draw(st.sets(st.integers(0, d), max_size=3)) | {0, d})
        spans = [(a, b - a) for a, b in itertools.pairwise(cuts)] or [(0, 0)]
        per_dim.append(spans)
    boxes = [
        (tuple(o for o, _ in combo), tuple(s for _, s in combo))
        for combo in itertools.product(*per_dim)
    ]
    return shape, boxes


def _linear(index: tuple[int, ...], shape: tuple[int, ...]) -> int:
    return sum(i * math.prod(shape[j + 1 :]) for j, i in enumerate(index))


@settings(max_examples=300, deadline=None)
@given(tiled())
def test_runs_cover_every_element_once_at_its_row_major_place(case: tuple) -> None:
    shape, boxes = case
    hits = [0] * math.prod(shape)
    for offsets, sizes in boxes:
        src_seen = 0
        local = list(itertools.product(*(range(s) for s in sizes)))
        for src, dst, n in runs(shape, offsets, sizes):
            assert src == src_seen, "runs must be adjacent in the chunk, in order"
            src_seen += n
            for k in range(n):
                idx = tuple(o + i for o, i in zip(offsets, local[src + k], strict=True))
                assert _linear(idx, shape) == dst + k
                hits[dst + k] += 1
        assert src_seen == math.prod(sizes)
        spans = [(dst, dst + n) for _, dst, n in runs(shape, offsets, sizes)]
        if spans:
            assert chunk_span(shape, offsets, sizes) == (spans[0][0], spans[-1][1])
    assert all(h == 1 for h in hits)


def test_runs_dim1_sharding_is_one_run_per_row() -> None:
    assert list(runs((3, 4), (0, 2), (3, 2))) == [(0, 2, 2), (2, 6, 2), (4, 10, 2)]
    assert list(runs((4, 3), (2, 0), (2, 3))) == [(0, 6, 6)]
    assert list(runs((), (), ())) == [(0, 0, 1)]
    assert list(runs((0, 3), (0, 0), (0, 3))) == []


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    n = draw(st.integers(1, 8))
    tensors = {}
    for i in range(n):
        shape, boxes = draw(tiled())
        dtype = draw(st.sampled_from(DTYPES))
        isz = dtypes.dtype(dtype).itemsize
        chunks = tuple(
            Chunk(o, s, f"__{r % 3}_0.distcp", 1000 * r, math.prod(s) * isz, "raw", r % 3)
            for r, (o, s) in enumerate(boxes)
        )
        # a replica of the first chunk (HSDP writes each shard once per replica group)
        if draw(st.booleans()):
            chunks = (*chunks, chunks[0])
        name = f"layers.{i}.{draw(st.sampled_from(['w', 'b', 'weight']))}"
        tensors[name] = TensorEntry(name, dtype, shape, chunks)
    return Manifest("ck", "dcp", "dcp", tensors, {}, {})


def _check_plan(plan: ConsolidationPlan, m: Manifest, limit: int) -> None:
    names_seen = []
    for f in plan.files:
        # the header is what it claims and pads data to 8 bytes
        n = int.from_bytes(f.header[:8], "little")
        assert len(f.header) == 8 + n and len(f.header) % 8 == 0
        header = json.loads(f.header[8:])
        assert header.pop("__metadata__") == {"format": "pt"}
        # every byte of the file is covered exactly once: header, then each tensor's chunk runs
        cover = [0] * f.size
        for b in range(len(f.header)):
            cover[b] += 1
        for t in f.tensors:
            h = header[t.name]
            assert h["data_offsets"] == [
                t.begin - len(f.header),
                t.begin - len(f.header) + t.nbytes,
            ]
            assert h["shape"] == list(t.shape)
            assert h["dtype"] == dtypes.dtype(t.dtype).safetensors
            isz = dtypes.dtype(t.dtype).itemsize
            for c in t.chunks:
                for _src, dst, k in runs(t.shape, c.offsets, c.sizes):
                    for b in range(t.begin + dst * isz, t.begin + (dst + k) * isz):
                        cover[b] += 1
            names_seen.append(t.name)
        assert all(c == 1 for c in cover), "some output byte is not written exactly once"
        # within a file: dtype alignment descending, then name (safetensors' own order)
        order = [(-dtypes.dtype(t.dtype).itemsize, t.name) for t in f.tensors]
        assert order == sorted(order)
        # shards respect the limit unless a single tensor alone exceeds it
        assert f.data_bytes <= limit or len(f.tensors) == 1
    assert sorted(names_seen) == sorted(m.tensors)
    assert plan.total_size == sum(t.nbytes for t in m.tensors.values())
    if len(plan.files) == 1:
        assert plan.files[0].name == SINGLE_FILE_NAME and plan.index is None
    else:
        assert plan.index is not None
        assert plan.index["metadata"]["total_size"] == plan.total_size
        where = {t.name: f.name for f in plan.files for t in f.tensors}
        assert plan.index["weight_map"] == dict(sorted(where.items()))
        k = len(plan.files)
        assert [f.name for f in plan.files] == [
            f"model-{i:05d}-of-{k:05d}.safetensors" for i in range(1, k + 1)
        ]


@settings(max_examples=200, deadline=None)
@given(manifests(), st.integers(1, 3000))
def test_plan_covers_every_output_byte_once_and_splits_by_size(m: Manifest, limit: int) -> None:
    plan = plan_consolidation(m, {n: n for n in m.tensors}, max_shard_size=limit)
    _check_plan(plan, m, limit)


@settings(max_examples=50, deadline=None)
@given(manifests())
def test_cast_changes_floating_only_and_resizes(m: Manifest) -> None:
    plan = plan_consolidation(m, {n: n for n in m.tensors}, max_shard_size=10**9, dtype="bfloat16")
    for t in plan.tensors:
        src = m.tensors[t.fqn]
        floating = dtypes.dtype(src.dtype).is_floating
        assert t.dtype == ("bfloat16" if floating else src.dtype)
        assert t.nbytes == src.numel * dtypes.dtype(t.dtype).itemsize


def test_shard_groups_like_transformers() -> None:
    assert shard_groups([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
    assert shard_groups([], 8) == [[]]
    assert shard_groups([3, 3, 3], 100) == [[0, 1, 2]]


def test_names_in_plan_follow_the_mapping() -> None:
    t = TensorEntry("model.model.w", "float32", (2,), (Chunk((0,), (2,), "f", 0, 8),))
    m = Manifest("ck", "dcp", "dcp", {t.fqn: t}, {}, {})
    plan = plan_consolidation(m, {"model.w": "model.model.w"}, max_shard_size=100)
    [tp] = plan.tensors
    assert (tp.name, tp.fqn) == ("model.w", "model.model.w")


def _entry(chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> TensorEntry:
    return TensorEntry(
        "w", "float32", (4, 4), tuple(Chunk(o, s, "f", 0, 0, "raw") for o, s in chunks)
    )


def test_unique_chunks_drops_replicas_and_rejects_gaps_and_overlaps() -> None:
    ok = _entry([((0, 0), (2, 4)), ((2, 0), (2, 4)), ((0, 0), (2, 4))])
    assert len(unique_chunks(ok)) == 2
    with pytest.raises(CorruptCheckpointError, match="do not tile"):
        unique_chunks(_entry([((0, 0), (2, 4))]))
    with pytest.raises(CorruptCheckpointError, match="do not tile"):
        unique_chunks(_entry([((0, 0), (3, 4)), ((2, 0), (1, 4)), ((3, 0), (0, 4))]))
    with pytest.raises(CorruptCheckpointError, match="do not tile"):
        # same element count as the tensor, but two boxes overlap and leave a gap (2-D split)
        unique_chunks(
            _entry([((0, 0), (2, 2)), ((0, 1), (2, 2)), ((2, 0), (2, 2)), ((2, 2), (2, 2))])
        )
    with pytest.raises(CorruptCheckpointError, match="outside"):
        unique_chunks(_entry([((0, 0), (5, 4))]))


def test_an_overlap_among_300_chunks_is_refused_naming_the_tensor() -> None:
    # A 2-D sharding (15 x 20 boxes): one box grows into its neighbour, which shrinks, so the
    # element count adds up. The planner once checked pairwise only up to 256 chunks and let
    # this through; the one exact check in core.geometry refuses it at any count.
    boxes = [((2 * i, 2 * j), (2, 2)) for i in range(15) for j in range(20)]
    boxes[0], boxes[1] = ((0, 0), (2, 3)), ((0, 2), (2, 1))
    chunks = tuple(Chunk(o, s, f"f{k}", 0, 16, "raw", k) for k, (o, s) in enumerate(boxes))
    t = TensorEntry("model.layers.0.w", "float32", (30, 40), chunks)
    with pytest.raises(CorruptCheckpointError, match="do not tile") as caught:
        unique_chunks(t)
    assert caught.value.fqn == "model.layers.0.w"
    assert "'model.layers.0.w'" in str(caught.value) and "overlap" in str(caught.value)
    m = Manifest("ck", "dcp", "dcp", {t.fqn: t}, {}, {})
    with pytest.raises(CorruptCheckpointError, match=r"model\.layers\.0\.w"):
        plan_consolidation(m, {"w": t.fqn}, max_shard_size=10**9)
    # replicas of every box (each rank saving the same chunks) are still a tiling
    good = [((2 * i, 2 * j), (2, 2)) for i in range(15) for j in range(20)]
    replicated = tuple(Chunk(o, s, f"f{r}", 0, 16, "raw", r) for r in range(2) for o, s in good)
    kept = unique_chunks(TensorEntry("w", "float32", (30, 40), replicated))
    assert [c.rank for c in kept] == [0] * 300  # the first replica of each box is the one read


def test_dtype_without_safetensors_code_is_refused() -> None:
    t = TensorEntry("q", "qint8", (1,), (Chunk((0,), (1,), "f", 0, 1),))
    m = Manifest("ck", "dcp", "dcp", {"q": t}, {}, {})
    with pytest.raises(UnsupportedCheckpointError, match="safetensors cannot store"):
        plan_consolidation(m, {"q": "q"}, max_shard_size=100)


def test_header_is_padded_to_8_bytes() -> None:
    for name in ("a", "ab", "abc", "abcd", "abcdefgh"):
        h = header_bytes([(name, "float32", (1,), 0, 4)])
        assert len(h) % 8 == 0
        assert json.loads(h[8:])[name]["data_offsets"] == [0, 4]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(1, 40)), max_size=20),
    st.integers(1, 64),
)
def test_pieces_split_runs_into_bounded_adjacent_blocks(spans: list, max_elems: int) -> None:
    chunk_runs = []
    src = 0
    for gap, n in spans:
        chunk_runs.append((src, src * 3 + gap, n))
        src += n
    flat_in = [(s + k, d + k) for s, d, n in chunk_runs for k in range(n)]
    flat_out = []
    for block in pieces(iter(chunk_runs), max_elems):
        assert sum(n for _, _, n in block) <= max_elems
        for (s1, _, n1), (s2, _, _) in itertools.pairwise(block):
            assert s1 + n1 == s2
        flat_out.extend((s + k, d + k) for s, d, n in block for k in range(n))
    assert flat_out == flat_in


def test_block_bytes_bounded_and_aligned() -> None:
    assert block_bytes(256 * 2**20, 4) == 16 * 2**20
    assert block_bytes(1000, 3) % 64 == 0
    assert block_bytes(10, 8) == 64


@pytest.mark.parametrize(
    ("text", "expected"),
    [("5GB", 5 * 10**9), ("300KB", 300_000), ("2GiB", 2 * 2**30), ("1.5MB", 1_500_000), (7, 7)],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["5XB", "GB", "-1", "0", ""])
def test_parse_size_rejects(bad: str) -> None:
    with pytest.raises(UsageError):
        parse_size(bad)


def test_index_name() -> None:
    assert INDEX_NAME == "model.safetensors.index.json"


@settings(max_examples=100, deadline=None)
@given(manifests(), st.integers(1, 6))
def test_rank_shares_partition_the_chunks(m: Manifest, world: int) -> None:
    plan = plan_consolidation(m, {n: n for n in m.tensors}, max_shard_size=500)
    tasks = [(f, t, c) for f in plan.files for t in f.tensors for c in t.chunks]
    shares = [share_of(tasks, r, world) for r in range(world)]
    flat = [task for share in shares for task in share]
    assert len(flat) == len(tasks)
    assert {id(task[2]) for task in flat} == {id(task[2]) for task in tasks}
