"""plan.megatron: the Megatron <-> HF pieces tile both sides exactly (pure, no files).

Sizes are drawn by hypothesis; the pieces are checked with the one tiling check every verb
uses (``core.geometry.tiling_problems``): in the consolidate direction every HF tensor is
covered exactly once by its boxes, in the shard direction every Megatron tensor (vocabulary
padding rows included) is.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptools.core.geometry import tiling_problems
from ckptools.errors import UnsupportedCheckpointError, UsageError
from ckptools.plan.conversions import KeyMap
from ckptools.producers.megatron import plan as megatron


def _hf_tiles(km: KeyMap) -> None:
    boxes = defaultdict(list)
    shapes = {}
    for p in km.pieces:
        offsets, sizes = p.disk_box
        boxes[p.disk].append((offsets, sizes))
        shapes[p.disk] = p.disk_shape
    for name, shape in shapes.items():
        assert tiling_problems(shape, boxes[name]) == [], name


def _megatron_tiles(km: KeyMap) -> None:
    boxes = defaultdict(list)
    for p in km.pieces:
        boxes[p.memory].append((p.offsets, p.sizes))
    for name, shape in km.memory_shapes.items():
        assert tiling_problems(shape, boxes[name]) == [], name


@st.composite
def _dims(draw: st.DrawFn) -> megatron.Dims:
    groups = draw(st.integers(1, 4))
    heads = groups * draw(st.integers(1, 4))
    vocab = draw(st.integers(1, 300))
    return megatron.Dims(
        layers=draw(st.integers(1, 3)), hidden=draw(st.integers(1, 24)), heads=heads,
        groups=groups, head_dim=draw(st.integers(1, 8)), ffn=draw(st.integers(1, 40)),
        vocab=vocab, padded_vocab=megatron.padded_vocab(vocab, draw(st.sampled_from([1, 8, 128]))),
        tied=draw(st.booleans()), qkv_bias=draw(st.booleans()), qk_norm=draw(st.booleans()),
        stacked=draw(st.booleans()),
    )  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(_dims())
def test_pieces_tile_both_sides(d: megatron.Dims) -> None:
    _megatron_tiles(megatron.keymap(d, megatron.FUSED_NORMS, "llama", padding=True))
    km = megatron.keymap(d, megatron.FUSED_NORMS, "llama", padding=False)
    _hf_tiles(km)
    # consolidate reads Megatron's rows once each, leaving out only the vocabulary padding
    covered = sum(p.disk_box[1][0] * _rest(p.disk_box[1]) for p in km.pieces)
    hf_elements = sum(_size(p.disk_shape) for p in {p.disk: p for p in km.pieces}.values())
    assert covered == hf_elements


def _rest(sizes: tuple[int, ...]) -> int:
    return _size(sizes[1:])


def _size(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def test_qkv_rows_per_query_group() -> None:
    """4 heads in 2 groups of head_dim 2: rows [q0 q1 k0 v0 | q2 q3 k1 v1], two each."""
    d = megatron.Dims(layers=1, hidden=3, heads=4, groups=2, head_dim=2, ffn=5, vocab=7,
                      padded_vocab=8, tied=True)  # fmt: skip
    km = megatron.keymap(d, megatron.FUSED_NORMS, "llama", padding=False)
    rows = {
        (p.disk.rsplit(".", 2)[-2], p.offsets[1], p.disk_box[0][0])
        for p in km.pieces
        if "linear_qkv.weight" in p.memory
    }
    assert rows == {
        ("q_proj", 0, 0), ("k_proj", 4, 0), ("v_proj", 6, 0),
        ("q_proj", 8, 4), ("k_proj", 12, 2), ("v_proj", 14, 2),
    }  # fmt: skip


def test_refusals_name_the_family() -> None:
    with pytest.raises(UnsupportedCheckpointError, match="MoE experts"):
        megatron.refuse_family(["decoder.layers.mlp.experts.linear_fc1.weight0"], "run")
    with pytest.raises(UnsupportedCheckpointError, match="multi-latent attention"):
        megatron.refuse_family(["decoder.layers.self_attention.linear_kv_down_proj.weight"], "r")
    with pytest.raises(UnsupportedCheckpointError, match="'gemma'"):
        megatron.family_of({"model_type": "gemma"}, "cfg")
    shapes = {
        "embedding.word_embeddings.weight": (112, 16),
        "decoder.layers.self_attention.linear_qkv.weight": (2, 32, 16),
        "decoder.layers.mlp.linear_fc1.weight": (2, 64, 16),
    }
    with pytest.raises(UsageError, match="--config"):
        megatron.dims_from_run(shapes, {"num_attention_heads": 4, "num_query_groups": 2}, None, "r")
    with pytest.raises(UnsupportedCheckpointError, match="MoE"):
        megatron.dims_from_run(shapes, {"num_experts": 8}, None, "r")
