"""FSDP1 FlatParameter placement (:mod:`ckptools.producers.fsdp1.flat`), pure.

The real producer's files are tested in tests/integration/test_verl.py (verl's FSDP1 fixtures,
bit-exact against torch's gather); here the search itself: FSDP's flattening rule simulated
on model trees of many shapes must be recovered exactly, and what it cannot tell apart refused.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptools.errors import UnsupportedCheckpointError
from ckptools.producers.fsdp1.flat import Param, partition


def _llama(layers: int, hidden: int = 32, vocab: int = 127) -> list[Param]:
    out = [Param("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        at = f"model.layers.{i}"
        out += [
            Param(f"{at}.self_attn.q_proj.weight", (hidden, hidden)),
            Param(f"{at}.self_attn.k_proj.weight", (hidden // 2, hidden)),
            Param(f"{at}.mlp.down_proj.weight", (hidden, 48)),
            Param(f"{at}.input_layernorm.weight", (hidden,)),
        ]
    return [*out, Param("model.norm.weight", (hidden,)), Param("lm_head.weight", (vocab, hidden))]


def _fsdp_local(params: list[Param], units: list[list[str]], world: int) -> list[int]:
    """What FSDP1 saves: ``ceil(numel / world)`` per FlatParameter (root first if it holds any)."""
    owned = {f for unit in units for f in unit}
    root = [p for p in params if p.fqn not in owned]
    flat = ([root] if root else []) + [[p for p in params if p.fqn in u] for u in units]
    return [-(-sum(p.numel for p in unit) // world) for unit in flat]


def _names(placement: object) -> list[list[str]]:
    return [[p.fqn for p, _ in unit] for unit in placement.units]  # type: ignore[attr-defined]


@pytest.mark.parametrize("world", [1, 2, 3, 7, 64])
def test_each_decoder_layer_wrapped_is_recovered(world: int) -> None:
    params = _llama(4)
    layers = [[p.fqn for p in params if p.fqn.startswith(f"model.layers.{i}.")] for i in range(4)]
    placement = partition(params, world, _fsdp_local(params, layers, world), "f")
    root = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert _names(placement) == [root, *layers]
    starts = [at for _, at in placement.units[0]]
    assert starts == [0, 127 * 32, 127 * 32 + 32]


def test_a_root_without_parameters_of_its_own_has_no_flat_parameter() -> None:
    params = [Param("a.w", (8, 4)), Param("b.w", (5,)), Param("b.v", (3, 3))]
    placement = partition(params, 2, _fsdp_local(params, [["a.w"], ["b.w", "b.v"]], 2), "f")
    assert _names(placement) == [["a.w"], ["b.w", "b.v"]]


def test_sizes_no_wrapping_gives_are_refused_with_the_numbers() -> None:
    params = _llama(2)
    with pytest.raises(
        UnsupportedCheckpointError, match=r"rank0.pt: .*\[1000, 2000\].* no wrapping"
    ):
        partition(params, 2, [1000, 2000], "rank0.pt")


def test_two_wrappings_that_fit_are_refused() -> None:
    """Three equal layers, two wrapped: which one stayed in the root is not in the files."""
    params = [Param(f"layers.{i}.w", (4, 4)) for i in range(3)]
    with pytest.raises(UnsupportedCheckpointError, match="several wrappings"):
        partition(params, 2, [8, 8, 8], "f")


def test_a_tied_copy_is_tried_both_ways() -> None:
    params = _llama(2)
    tied = [p for p in params if p.fqn != "lm_head.weight"]
    layers = [[p.fqn for p in params if p.fqn.startswith(f"model.layers.{i}.")] for i in range(2)]
    local = _fsdp_local(tied, layers, 3)
    with pytest.raises(UnsupportedCheckpointError, match="no wrapping"):
        partition(params, 3, local, "f")
    placement = partition(params, 3, local, "f", shared=["lm_head.weight"])
    assert _names(placement)[0] == ["model.embed_tokens.weight", "model.norm.weight"]


def test_a_hostile_model_cannot_make_the_search_walk_without_end() -> None:
    """3000 one-element modules, 1500 one-element FlatParameters: astronomically many ways;
    the search stops at its step budget and says so."""
    params = [Param(f"m{i}.w", (1,)) for i in range(3000)]
    with pytest.raises(UnsupportedCheckpointError, match="too many wrappings"):
        partition(params, 1, [1] * 1500, "f")


@st.composite
def _wrapped_models(draw: st.DrawFn) -> tuple[list[Param], list[list[str]], int]:
    """A random module tree (parameters at any depth), some disjoint modules wrapped."""
    params: list[Param] = []
    blocks = draw(st.integers(1, 6))
    wrapped = []
    for b in range(blocks):
        inner = [
            Param(
                f"blocks.{b}.{name}.weight",
                tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))),
            )
            for name in draw(
                st.lists(st.sampled_from("abcdef"), min_size=1, max_size=4, unique=True)
            )
        ]
        params += inner
        if draw(st.booleans()):
            wrapped.append([p.fqn for p in inner])
    if draw(st.booleans()):
        params.append(
            Param("head.weight", tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=2))))
        )
    return params, wrapped, draw(st.integers(1, 8))


@settings(max_examples=300, deadline=None)
@given(_wrapped_models())
def test_a_found_placement_is_always_one_that_gives_the_saved_sizes(
    case: tuple[list[Param], list[list[str]], int],
) -> None:
    """The true wrapping always fits, so an answer (given only when one placement fits) is the
    true one, with every parameter at its flat offset; otherwise it says several fit."""
    params, wrapped, world = case
    local = _fsdp_local(params, wrapped, world)
    try:
        placement = partition(params, world, local, "f")
    except UnsupportedCheckpointError as e:
        assert "several wrappings" in str(e)
        return
    got = [math.ceil(sum(p.numel for p, _ in unit) / world) for unit in placement.units]
    assert got == local
    owned = {f for unit in wrapped for f in unit}
    root = [p.fqn for p in params if p.fqn not in owned]
    assert _names(placement) == ([root] if root else []) + wrapped
    for unit in placement.units:
        at = 0
        for p, start in unit:
            assert start == at
            at += p.numel
