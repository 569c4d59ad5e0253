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
from ckptools.producers.megatron import moe
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
    with pytest.raises(UsageError, match="--config"):  # the head count is nowhere
        megatron.dims_from_run(shapes, {"num_query_groups": 2}, None, "r")
    # the true vocabulary is nowhere: Megatron's padded rows are the model's, and said so
    dims, _ = megatron.dims_from_run(shapes, {"num_attention_heads": 4, "num_query_groups": 2},
                                     None, "r")  # fmt: skip
    assert (dims.vocab, dims.padded_vocab, dims.padding_kept) == (112, 112, True)
    km = megatron.keymap(dims, megatron.FUSED_NORMS, "llama", padding=False)
    assert megatron.PADDING_KEPT in km.rules
    with pytest.raises(UnsupportedCheckpointError, match="MoE"):
        megatron.dims_from_run(shapes, {"num_experts": 8}, None, "r")


@settings(max_examples=40, deadline=None)
@given(_dims(), st.integers(1, 5), st.integers(1, 12), st.sampled_from(moe.MOE_FAMILIES))
def test_moe_pieces_tile_both_sides(
    d: megatron.Dims, experts: int, moe_ffn: int, family: str
) -> None:
    """Every expert's gate / up / down is one box of its layer's expert in the folded
    ``[L*E, ...]`` (stacked) or ``[E, ...]`` (per layer) tensors, which they tile exactly."""
    import dataclasses

    md = dataclasses.replace(d, experts=experts, moe_ffn=moe_ffn)
    km = megatron.keymap(md, megatron.FUSED_NORMS, family, padding=False)
    _hf_tiles(km)
    _megatron_tiles(dataclasses.replace(km, memory_shapes={
        k: v for k, v in km.memory_shapes.items() if "vocab" not in k and "embedding" not in k
        and "output_layer" not in k
    }))  # fmt: skip
    names = {p.disk for p in km.pieces}
    router, gate, _, down = moe.MOE_NAMES[family]
    last = f"model.layers.{d.layers - 1}."
    assert {last + router, last + gate.format(e=experts - 1), last + down.format(e=0)} <= names
    dense = (".mlp.gate_proj.weight", ".mlp.up_proj.weight", ".mlp.down_proj.weight")
    assert not any(n.endswith(dense) for n in names)


#: a Mixtral-shaped run's tensors as the plan sees them (the experts folded): 2 layers, 4 experts
_MOE_SHAPES = {
    "embedding.word_embeddings.weight": (104, 16),
    "output_layer.weight": (104, 16),
    "decoder.final_layernorm.weight": (16,),
    "decoder.layers.self_attention.linear_qkv.weight": (2, 32, 16),
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (2, 16),
    "decoder.layers.self_attention.linear_proj.weight": (2, 16, 16),
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": (2, 16),
    "decoder.layers.mlp.router.weight": (2, 4, 16),
    "decoder.layers.mlp.experts.experts.linear_fc1.weight": (8, 64, 16),
    "decoder.layers.mlp.experts.experts.linear_fc2.weight": (8, 16, 32),
}
_MOE_ARGS = {"num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 100,
             "num_experts": 4, "moe_router_topk": 2}  # fmt: skip


def test_a_moe_config_is_made_from_the_args() -> None:
    _, made = megatron.to_hf(_MOE_SHAPES, _MOE_ARGS, None, "run")
    assert (made["model_type"], made["num_local_experts"], made["intermediate_size"]) == (
        "mixtral", 4, 32,
    )  # fmt: skip
    qk = {**_MOE_SHAPES, "decoder.layers.self_attention.q_layernorm.weight": (2, 4),
          "decoder.layers.self_attention.k_layernorm.weight": (2, 4)}  # fmt: skip
    _, made = megatron.to_hf(qk, {**_MOE_ARGS, "moe_router_pre_softmax": True}, None, "run")
    assert (made["model_type"], made["num_experts"], made["norm_topk_prob"]) == (
        "qwen3_moe", 4, False,
    )  # fmt: skip
    with pytest.raises(UnsupportedCheckpointError, match="softmax over all experts"):
        mixtral = {**made, "model_type": "mixtral", "num_local_experts": 4}
        megatron.to_hf(_MOE_SHAPES, {**_MOE_ARGS, "moe_router_pre_softmax": True}, mixtral, "r")


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"moe_router_score_function": "sigmoid"}, "sigmoid scores"),
        ({"moe_router_enable_expert_bias": True}, "expert bias"),
        ({"moe_router_num_groups": 8}, "group-limited top-k"),
        ({"moe_router_topk_scaling_factor": 2.5}, "top-k scaling factor 2.5"),
        ({"moe_shared_expert_intermediate_size": 64}, "shared experts"),
        ({"moe_layer_freq": [0, 1]}, "MoE in some layers only"),
        ({"num_experts": 8}, "args.num_experts is 8"),
    ],
)
def test_moe_routing_no_family_computes_is_refused_by_name(extra: dict, why: str) -> None:
    with pytest.raises(UnsupportedCheckpointError, match=why):
        megatron.to_hf(_MOE_SHAPES, {**_MOE_ARGS, **extra}, None, "run")


def test_moe_parts_no_family_has_are_refused_by_name() -> None:
    for name, why in [
        ("decoder.layers.mlp.shared_experts.linear_fc1.weight", "shared expert"),
        ("decoder.layers.mlp.router.expert_bias", "expert bias"),
        ("decoder.layers.self_attention.linear_q_down_proj.weight", "multi-latent attention"),
    ]:
        with pytest.raises(UnsupportedCheckpointError, match=why):
            megatron.to_hf({**_MOE_SHAPES, name: (2, 4)}, _MOE_ARGS, None, "run")
    mixed = {**_MOE_SHAPES, "decoder.layers.mlp.linear_fc1.weight": (2, 64, 16)}
    with pytest.raises(UnsupportedCheckpointError, match="both dense MLPs"):
        megatron.to_hf(mixed, _MOE_ARGS, None, "run")
