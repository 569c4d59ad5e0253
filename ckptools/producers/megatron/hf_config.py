"""What every Hugging Face ``config.json`` made from a Megatron run's args says alike (pure):
its sizes, vocabulary, activation, positions, norm epsilon, rope base, ties and dtype. Each
family's maker (:func:`ckptools.producers.megatron.plan.hf_config`, ``moe.moe_config``,
``mla``'s) adds what is its own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: the rule of an embedding (or output layer) whose padding rows are kept: a run with a Hugging
#: Face tokenizer keeps only the padded size in its args (as Megatron's own export does then)
PADDING_KEPT = (
    "vocab padding kept (the run's args lack the tokenizer's true size; --config with the "
    "model's config.json drops it)"
)


def common_config(
    architecture: str,
    model_type: str,
    *,
    hidden: int,
    layers: int,
    heads: int,
    groups: int,
    head_dim: int,
    vocab: int,
    tied: bool,
    args: Mapping[str, Any],
    norm_eps: float = 1e-5,
) -> dict[str, Any]:
    """The fields every family's config takes from the run alike (``norm_eps``: the default
    when the args do not set ``norm_epsilon``)."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "hidden_act": "silu",
        "max_position_embeddings": args.get("max_position_embeddings") or 4096,
        "rms_norm_eps": args.get("norm_epsilon") or norm_eps,
        "rope_theta": args.get("rotary_base") or 10000.0,
        "tie_word_embeddings": tied,
        "torch_dtype": args.get("params_dtype") or "float32",
    }
