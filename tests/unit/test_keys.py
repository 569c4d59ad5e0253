"""Finding the model part of a key tree, and the model's own FQNs."""

from __future__ import annotations

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
    assert keys.strip_wrappers("module._fsdp_wrapped_module.embed.weight") == "embed.weight"
