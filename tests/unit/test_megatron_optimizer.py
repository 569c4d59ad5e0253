"""Megatron's distributed-optimizer placement: each parameter's range in the flat buckets.

The property tests describe a buffer the other way round from the placement: they choose where
each bucket closes (after a parameter, or before a pipeline-shared embedding), lay the
parameters out with Megatron's 64-element alignment, record what Megatron saves
(``per_bucket_numel_unpadded``, ``per_bucket_numel`` padded for DP, one stored chunk per
parameter piece of each DP rank's slice, padding chunks in the gaps) and check that
:func:`place_params` recovers every range from the saved sizes alone, and that the chunks
:func:`param_chunks` makes read back each parameter's own elements.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptools.core import geometry
from ckptools.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptools.producers.megatron import buckets
from ckptools.producers.megatron import optimizer as mo

ITEM = 4  # the test's bucket elements are int32 indices


def _pad(n: int, d: int) -> int:
    return -(-n // d) * d


@st.composite
def _buffers(draw: st.DrawFn) -> dict:
    n = draw(st.integers(1, 12))
    shapes = [
        tuple(
            draw(
                st.lists(st.integers(1, 40), min_size=1, max_size=2)
                if draw(st.booleans())
                else st.lists(st.integers(1, 9), min_size=3, max_size=3)
            )
        )
        for _ in range(n)
    ]
    params = []
    for i, s in enumerate(shapes):
        if len(s) == 2 and s[0] > 1 and draw(st.booleans()):
            # a SwiGLU fc1 on one TP rank: its gate rows, then its up rows, of a taller tensor
            gate = draw(st.integers(1, s[0] - 1))
            boxes = (((3, 0), (gate, s[1])), ((50, 0), (s[0] - gate, s[1])))
            params.append(mo.LocalParam(f"p{i}", boxes))
        else:
            params.append(mo.LocalParam(f"p{i}", (((0,) * len(s), s),)))
    dp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    busbw = draw(st.booleans())
    # buffer order is reversed named_parameters order; a bucket may close after any parameter
    # and, before the last one (the first stage's shared embedding), at its aligned start
    order = list(reversed(params))
    close_after = [draw(st.booleans()) for _ in order]
    split_before_last = draw(st.booleans())
    ranges, unpadded = [], []
    bucket, cursor, held = 0, 0, 0
    for i, p in enumerate(order):
        start = _pad(cursor, mo.ALIGN_ELEMENTS)
        if i == len(order) - 1 and split_before_last and held:
            unpadded.append(start)
            bucket, cursor, held, start = bucket + 1, 0, 0, 0
        ranges.append(mo.ParamRange(p, bucket, start, start + p.numel))
        held += 1
        cursor = start + p.numel
        if close_after[i] or i == len(order) - 1:
            unpadded.append(cursor)
            bucket, cursor, held = bucket + 1, 0, 0
    divisor = mo.bucket_end_choices(dp)[busbw]
    padded = [_pad(u, divisor) for u in unpadded]
    return {"params": params, "ranges": ranges, "unpadded": unpadded, "padded": padded, "dp": dp}


def _stored_pieces(b: dict, seed: int) -> dict[int, list[mo.StoredPiece]]:
    """What each DP rank saves: its slice of each bucket cut at parameter bounds, as chunks at
    distinct byte offsets of its own file."""
    out: dict[int, list[mo.StoredPiece]] = {}
    for k, (n, full) in enumerate(zip(b["unpadded"], b["padded"], strict=True)):
        local = full // b["dp"]
        cuts = {0, n} | {r * local for r in range(b["dp"]) if r * local < n}
        for r in b["ranges"]:
            if r.bucket == k:
                cuts |= {r.start, r.stop}
        bounds = sorted(cuts)
        pieces = []
        for lo, hi in itertools.pairwise(bounds):
            rank = lo // local
            at = (seed * 7 + k * 100_003 + lo * 3) * ITEM  # distinct, not in element order
            pieces.append(mo.StoredPiece(lo, hi - lo, f"__{rank}_0.distcp", at, rank))
        out[k] = pieces
    return out


def _files(pieces: dict[int, list[mo.StoredPiece]]) -> dict[str, dict[int, int]]:
    """file -> byte offset -> the bucket element (bucket * 10**6 + index) stored there."""
    files: dict[str, dict[int, int]] = {}
    for k, found in pieces.items():
        for s in found:
            for j in range(s.count):
                files.setdefault(s.file, {})[s.offset + j * ITEM] = k * 10**6 + s.start + j
    return files


@settings(max_examples=100, deadline=None)
@given(_buffers())
def test_place_params_recovers_every_range_from_the_saved_sizes(b: dict) -> None:
    got = mo.place_params(b["params"], b["unpadded"], b["padded"], b["dp"])
    assert got == b["ranges"]
    for r in got:
        assert r.start % mo.ALIGN_ELEMENTS == 0


@settings(max_examples=60, deadline=None)
@given(_buffers(), st.integers(0, 1000))
def test_param_chunks_read_back_each_parameters_own_elements(b: dict, seed: int) -> None:
    pieces = _stored_pieces(b, seed)
    files = _files(pieces)
    ranges = mo.place_params(b["params"], b["unpadded"], b["padded"], b["dp"])
    assert mo.check_boundaries(ranges, pieces) is None
    for r in ranges:
        chunks = mo.param_chunks(r, pieces[r.bucket], ITEM)
        # the parameter's flat index of every element of its boxes, boxes back to back
        flat_of: dict[tuple[int, ...], int] = {}
        for offsets, sizes in r.param.boxes:
            for local in itertools.product(*(range(n) for n in sizes)):
                flat_of[tuple(o + x for o, x in zip(offsets, local, strict=True))] = len(flat_of)
        seen = []
        for c in chunks:
            assert c.length == c.numel * ITEM
            # the chunk's elements, row-major, are consecutive bytes of its file
            for j, local in enumerate(itertools.product(*(range(n) for n in c.sizes))):
                coords = tuple(o + x for o, x in zip(c.offsets, local, strict=True))
                stored = files[c.file][c.offset + j * ITEM]
                assert stored == r.bucket * 10**6 + r.start + flat_of[coords]
                seen.append(coords)
        assert sorted(seen) == sorted(flat_of)  # every element once


@settings(max_examples=300, deadline=None)
@given(_buffers(), st.data())
def test_sizes_that_do_not_add_up_are_refused(b: dict, data: st.DataObject) -> None:
    k = data.draw(st.integers(0, len(b["unpadded"]) - 1))
    delta = data.draw(st.sampled_from([-1, 1, mo.ALIGN_ELEMENTS]))
    wrong = list(b["unpadded"])
    wrong[k] += delta
    try:
        got = mo.place_params(b["params"], wrong, None, None)
    except CorruptCheckpointError as e:
        assert "do not add up" in str(e) and "\n" not in str(e)
        return
    if got == b["ranges"]:
        # the one other reading of the same buffer: a bucket closed at the next parameter's
        # aligned start (before a pipeline-shared embedding) instead of at its last end; a
        # size that aligns to the same start reads as that same buffer (the placement, not the
        # number, is what the stored chunks are checked against)
        aligned = _pad(b["unpadded"][k], mo.ALIGN_ELEMENTS)
        assert (
            _pad(wrong[k], mo.ALIGN_ELEMENTS) == aligned and wrong[k] > aligned - mo.ALIGN_ELEMENTS
        )
    else:
        # another buffer the sizes allow: the stored chunks' bounds tell it apart
        assert mo.check_boundaries(got, _stored_pieces(b, 0)) is not None


def test_padding_for_another_dp_size_is_refused() -> None:
    p = [mo.LocalParam("w", (((0,), (100,)),))]
    mo.place_params(p, [100], [128], 2)
    with pytest.raises(CorruptCheckpointError, match="padded to 128"):
        mo.place_params(p, [100], [128], 3)


def test_a_parameter_starting_inside_a_stored_chunk_is_found() -> None:
    ranges = mo.place_params(
        [mo.LocalParam("a", (((0,), (10,)),)), mo.LocalParam("b", (((0,), (3,)),))], [74]
    )
    whole = {0: [mo.StoredPiece(0, 74, "__0_0.distcp", 0)]}
    assert "inside a chunk" in (mo.check_boundaries(ranges, whole) or "")


def _model(tp: int, layers: int, hidden: int = 8, tied: bool = False) -> list[mo.ModelTensor]:
    """Stacked tensors as Megatron saves a GPT model: per layer and TP rank one box."""

    def stacked(name: str, rows: int, cols: int | None, split: int | None) -> mo.ModelTensor:
        shape = (layers, rows) if cols is None else (layers, rows, cols)
        boxes = []
        for layer in range(layers):
            for t in range(tp if split is not None else 1):
                offs, sizes = [layer, 0, 0][: len(shape)], [1, *shape[1:]]
                if split is not None:
                    sizes[split] = shape[split] // tp
                    offs[split] = t * sizes[split]
                boxes.append((tuple(offs), tuple(sizes)))
        return mo.ModelTensor(f"decoder.layers.{name}", shape, tuple(boxes))

    def flat(name: str, shape: tuple[int, ...], split: bool) -> mo.ModelTensor:
        n = tp if split else 1
        rows = shape[0] // n
        boxes = tuple(((t * rows, *[0] * (len(shape) - 1)), (rows, *shape[1:])) for t in range(n))
        return mo.ModelTensor(name, shape, boxes)

    out = [
        flat("embedding.word_embeddings.weight", (32, hidden), True),
        stacked("self_attention.linear_qkv.layer_norm_weight", hidden, None, None),
        stacked("self_attention.linear_qkv.weight", 3 * hidden, hidden, 1),
        stacked("self_attention.linear_proj.weight", hidden, hidden, 2),
        stacked("mlp.linear_fc1.layer_norm_weight", hidden, None, None),
        stacked("mlp.linear_fc1.weight", 4 * hidden, hidden, 1),
        stacked("mlp.linear_fc2.weight", hidden, 2 * hidden, 2),
        flat("decoder.final_layernorm.weight", (hidden,), False),
    ]
    if not tied:
        out.append(flat("output_layer.weight", (32, hidden), True))
    return out


def test_stage_params_orders_each_ranks_parameters_as_named_parameters_does() -> None:
    staged = mo.stage_params(_model(2, 4), tp=2, pp=2, num_layers=4)
    assert sorted(staged) == [0, 1, 2, 3]
    first = [(p.fqn.removeprefix("decoder.layers."), p.boxes[0][0][0]) for p in staged[1]]
    assert first[:4] == [
        ("embedding.word_embeddings.weight", 16),
        ("self_attention.linear_qkv.layer_norm_weight", 0),
        ("self_attention.linear_proj.weight", 0),
        ("self_attention.linear_qkv.weight", 0),
    ]
    assert [p.fqn for p in staged[3][-2:]] == [
        "decoder.final_layernorm.weight",
        "output_layer.weight",
    ]
    # the norms every TP rank keeps are taken once, from TP rank 0
    assert [p.replica for p in staged[1][:2]] == [False, True]
    assert staged[2][0].boxes[0][0] == (2, 0)  # stage 1 starts at layer 2


def test_stage_params_gives_the_last_stage_a_replica_of_a_tied_embedding() -> None:
    staged = mo.stage_params(_model(1, 2, tied=True), tp=1, pp=2, num_layers=2, tied=True)
    last = staged[1][-1]
    assert last.fqn == "embedding.word_embeddings.weight" and last.replica


def test_an_unknown_tensor_is_refused_by_name() -> None:
    model = [*_model(1, 2), mo.ModelTensor("decoder.layers.mlp.experts.weight1", (2, 4), ())]
    with pytest.raises(UnsupportedCheckpointError, match=r"experts\.weight1"):
        mo.stage_params(model, tp=1, pp=1, num_layers=2)


def _saved(model: list[mo.ModelTensor], tp: int, pp: int, dp: int, order: tuple[str, ...]) -> dict:
    """Buckets as Megatron would save them for ``order`` (one bucket per buffer)."""
    staged = mo.stage_params(model, tp=tp, pp=pp, num_layers=4, layer_order=order)
    buffers = {}
    for group, params in staged.items():
        cursor = 0
        ranges = []
        for p in reversed(params):
            start = _pad(cursor, mo.ALIGN_ELEMENTS)
            ranges.append(mo.ParamRange(p, 0, start, start + p.numel))
            cursor = start + p.numel
        b = {"ranges": ranges, "unpadded": [cursor], "dp": dp}
        b["padded"] = [_pad(cursor, mo.bucket_end_choices(dp)[0])]
        pieces = _stored_pieces(b, group)
        buffers[group] = buckets.Buckets(
            (cursor,), tuple(b["padded"]), {(0, k): pieces[0] for k in mo.KINDS}
        )
    return buffers


@pytest.mark.parametrize("order", mo.LAYER_ORDERS)
def test_bucket_state_tiles_every_model_tensor_for_either_layer_spec(
    order: tuple[str, ...],
) -> None:
    model = _model(2, 4)
    buffers = _saved(model, 2, 2, 2, order)
    state = buckets.bucket_state(
        model, buffers, buckets.Parallelism(2, 2, 2, 4, False), dtype="float32", itemsize=4
    )
    assert set(state) == set(mo.KINDS)
    for t in model:
        entry = state["exp_avg"][t.fqn]
        assert entry.shape == t.shape
        assert not geometry.tiling_problems(t.shape, [(c.offsets, c.sizes) for c in entry.chunks])


def test_bucket_state_refuses_buckets_of_another_model_in_one_line() -> None:
    buffers = _saved(_model(2, 4), 2, 2, 2, mo.LAYER_ORDERS[0])
    with pytest.raises(CorruptCheckpointError, match="do not add up") as e:
        buckets.bucket_state(
            _model(2, 4, hidden=16),
            buffers,
            buckets.Parallelism(tp=2, pp=2, dp=2, num_layers=4, tied=False),
            dtype="float32",
            itemsize=4,
        )
    assert "\n" not in str(e.value) and "--drop-optimizer" in str(e.value)


def test_bucket_numels_reads_the_saved_object() -> None:
    assert buckets.bucket_numels([{("f32", "f32"): [5, 7]}], "per_bucket_numel", "x") == (5, 7)
    with pytest.raises(UnsupportedCheckpointError, match="virtual pipeline"):
        buckets.bucket_numels([{1: [1]}, {1: [2]}], "per_bucket_numel", "x")


def test_bucket_fqns_and_model_space_names_are_parsed() -> None:
    name = mo.parse_bucket_fqn(
        "optimizer.distributed.dp_group_idx_3.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32)"
        ".bucket_idx_1.exp_avg_sq"
    )
    assert name == mo.BucketName(3, 0, ("torch.bfloat16", "torch.float32"), 1, "exp_avg_sq")
    assert mo.parse_bucket_fqn("optimizer.distributed.dp_group_idx_0.per_bucket_numel") is None


def test_megatron_groups_keep_decay_on_matrices_and_none_on_norms_and_biases() -> None:
    from ckptools.core.manifest import TensorEntry
    from ckptools.producers.megatron.masters import MegatronOptimizer
    from ckptools.producers.megatron.training import param_groups

    model = {
        n: TensorEntry(n, "float32", shape, ())
        for n, shape in [
            ("model.embed_tokens.weight", (8, 4)),
            ("model.layers.0.input_layernorm.weight", (4,)),
            ("model.layers.0.self_attn.q_proj.weight", (4, 4)),
            ("model.layers.0.self_attn.q_proj.bias", (4,)),
        ]
    }
    # saved in Megatron's order (the default group first), told apart by wd_mult either way
    for first, second in [(1.0, 0.0), (0.0, 1.0)]:
        saved = tuple({"wd_mult": m, "weight_decay": 0.1 * m, "lr": 1e-3} for m in (first, second))
        groups = param_groups("run", MegatronOptimizer("dp_reshardable", {}, saved, 10), model)
        by_decay = {g["weight_decay"]: g["params"] for g in groups}
        assert by_decay == {
            0.1: ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"],
            0.0: ["model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.bias"],
        }
        assert all("step" not in g for g in groups)  # AdamW keeps it per parameter
    three = MegatronOptimizer("dp_reshardable", {}, ({}, {}, {}), 10)
    with pytest.raises(UnsupportedCheckpointError, match="--drop-optimizer"):
        param_groups("run", three, model)
