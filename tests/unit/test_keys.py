"""Finding the model part of a key tree, and the model's own FQNs."""

from __future__ import annotations

import pytest

from ckptools.core import keys
from ckptools.core.manifest import Chunk, Manifest, TensorEntry


def _manifest(paths: list[tuple[str, ...]]) -> Manifest:
    tensors = {}
    fqn_paths = {}
    for p in paths:
        fqn = ".".join(p)
        chunk = Chunk((0,), (1,), "f", 0, 4)
        tensors[fqn] = TensorEntry(fqn, "float32", (1,), (chunk,))
        fqn_paths[fqn] = p
    return Manifest("r", "dcp", "dcp", tensors, {}, {}, paths=fqn_paths)


def test_model_and_optim_containers() -> None:
    m = _manifest(
        [
            ("model", "model.layers.0.w"),
            ("model", "lm_head.weight"),
            ("optim", "state", "model.layers.0.w", "exp_avg"),
        ]
    )
    part = keys.find_model_part(m)
    assert part.prefix == "model."
    assert dict(keys.model_keys(m, part)) == {
        "model.layers.0.w": "model.model.layers.0.w",
        "lm_head.weight": "model.lm_head.weight",
    }


def test_nested_app_container_is_entered() -> None:
    m = _manifest([("app", "model", "w"), ("app", "optim", "state", "w", "exp_avg")])
    assert keys.find_model_part(m).prefix == "app.model."


def test_flat_hf_keys_are_not_stripped() -> None:
    # safetensors keys are flat: their "model." is part of the model's own FQN.
    m = _manifest([("model.embed_tokens.weight",), ("lm_head.weight",)])
    part = keys.find_model_part(m)
    assert part.prefix == ""
    assert set(keys.model_keys(m, part)) == {"model.embed_tokens.weight", "lm_head.weight"}


def test_top_level_model_beside_optimizer_is_excluded() -> None:
    # torchtitan keeps the model's FQNs at the top level beside "optimizer".
    m = _manifest([("tok_embeddings", "weight"), ("optimizer", "state", "x", "exp_avg")])
    part = keys.find_model_part(m)
    assert part.path == () and part.excluded == ("optimizer",)
    assert set(keys.model_keys(m, part)) == {"tok_embeddings.weight"}


def test_wrapper_segments_are_removed() -> None:
    assert (
        keys.strip_wrappers("_orig_mod.layers.0._checkpoint_wrapped_module.mlp.w")
        == "layers.0.mlp.w"
    )
    assert keys.own_names(["module._fsdp_wrapped_module.embed.weight"]) == ["embed.weight"]


def test_a_submodule_named_module_keeps_its_name() -> None:
    # transformers' LeViT keeps each residual block's layer in ``.module``.
    assert keys.strip_wrappers("blocks.0.module.weight") == "blocks.0.module.weight"
    names = ["blocks.0.module.weight", "blocks.0.module.bias", "head.weight"]
    assert keys.own_names(names) == names


def test_ddp_module_is_removed_only_in_front_of_every_name() -> None:
    ddp = ["module.blocks.0.module.weight", "module.head.weight"]
    assert keys.own_names(ddp) == ["blocks.0.module.weight", "head.weight"]
    # one name without it: "module" is the model's own top-level submodule, not DDP
    assert keys.own_names(["module.weight", "head.weight"]) == ["module.weight", "head.weight"]
    assert keys.own_names([]) == []


@pytest.mark.parametrize(
    "stored",
    [
        # torch.compile(DDP(model)), DDP(torch.compile(model)), FSDP1 inside DDP
        ["_orig_mod.module.blocks.0.module.weight", "_orig_mod.module.head.weight"],
        ["module._orig_mod.blocks.0.module.weight", "module._orig_mod.head.weight"],
        ["module._fsdp_wrapped_module.blocks.0.module.weight", "module.head.weight"],
    ],
)
def test_nested_wrappers(stored: list[str]) -> None:
    assert keys.own_names(stored) == ["blocks.0.module.weight", "head.weight"]


def test_model_keys_of_a_ddp_model_in_a_container() -> None:
    # dcp.save({"model": ddp.state_dict(), "optim": ...}): DDP's module. follows the container.
    m = _manifest(
        [
            ("model", "module.blocks.0.module.weight"),
            ("model", "module.head.weight"),
            ("optim", "state", "module.head.weight", "exp_avg"),
        ]
    )
    assert dict(keys.model_keys(m)) == {
        "blocks.0.module.weight": "model.module.blocks.0.module.weight",
        "head.weight": "model.module.head.weight",
    }


def test_model_keys_keep_the_models_own_module() -> None:
    m = _manifest([("model", "blocks.0.module.weight"), ("model", "head.weight")])
    assert set(keys.model_keys(m)) == {"blocks.0.module.weight", "head.weight"}
    # flat torch.save / safetensors keys of a DDP model
    flat = _manifest([("module.blocks.0.module.weight",), ("module.head.weight",)])
    assert set(keys.model_keys(flat)) == {"blocks.0.module.weight", "head.weight"}
