"""``shard --to megatron`` of a Hugging Face ``DeepseekV3ForCausalLM`` (pure): the Megatron-core
model its config describes, and the byte boxes that place each HF tensor in it.

The boxes are :func:`ckptools.producers.megatron.mla.to_hf`'s, read the other way: the Megatron
tensors' shapes are made from the config (multi-latent attention as the local spec saves it:
``linear_q_down_proj``, ``q_layernorm``, ``linear_q_up_proj``, ``linear_kv_down_proj``,
``kv_layernorm``, ``linear_kv_up_proj``; SwiGLU ``linear_fc1`` of the dense first layers and the
shared experts; the router and its ``expert_bias``; each MoE layer's routed experts
``[E, 2F, H]`` / ``[E, H, F]``) and ``mla.to_hf`` cuts them into the HF model's, so the one
mapping serves both directions. A model with MoE layers keeps per-layer keys
(``decoder.layers.<i>.``: Megatron-core does so for any ``--moe-layer-freq`` list); a dense MLA
model (``first_k_dense_replace`` = every layer) is stacked as the local spec saves it. The
vocabulary is padded as for the other families (:func:`.plan.vocab_pieces`).

What Megatron's MLA and router would compute otherwise than DeepseekV3 is refused by name: no q
low-rank (the local spec has no kv latent norm then), rope not ``rope_interleave`` or scaled
(YaRN), a bias on attention, tied embeddings, top-k probabilities not normalised as Megatron's
sigmoid router does (exactly when top-k > 1), groups scored by other than their top-2, a tensor
held in another dtype than the model (but the float32 router of a bf16 model, below), and tensors
with no place in the model (MTP layers).

A bf16 DeepseekV3 keeps its router weight and ``e_score_correction_bias`` in float32
(:data:`.mla.KEPT_FP32`); they are written as stored. The expert bias is float32 in Megatron too
(``_maintain_float32_expert_bias``: its own bf16 saves store it so); the router weight is a bf16
parameter in Megatron's ``Float16Module``, and its ``dist_checkpointing`` load copies the stored
float32 into it (torch DCP's ``FileSystemReader.read_data``: ``target_tensor.copy_(tensor)``, no
dtype check in ``MCoreLoadPlanner``), rounding it as Megatron's own cast of that model does.
Written as stored, the run consolidates back to the HF model bit-exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptools.errors import UnsupportedCheckpointError, UsageError
from ckptools.plan.conversions import KeyMap, Piece, Shapes
from ckptools.producers.megatron import mla, moe, plan

_LAYERS = "decoder.layers."
_ATTENTION = (
    "self_attention.linear_proj",
    "self_attention.linear_q_down_proj",
    "self_attention.linear_q_up_proj",
    "self_attention.linear_kv_down_proj",
    "self_attention.linear_kv_up_proj",
)
_DENSE_MLP = ("mlp.linear_fc1", "mlp.linear_fc2")
_SHARED = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")


def _refuse(where: str, what: str) -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(
        f"{where}: the model's {what}, which Megatron-core's multi-latent attention and router "
        "do not compute as DeepseekV3 does: not written to Megatron"
    )


def _int(config: Mapping[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"{where}: config.json has no positive integer {key!r}")
    return value


def _refuse_config(config: Mapping[str, Any], moe_layers: bool, where: str) -> None:
    """Refuse, by name, what Megatron's MLA and sigmoid router cannot hold as DeepseekV3 has it.

    Raises:
        UnsupportedCheckpointError: naming the config key.
    """
    if not config.get("q_lora_rank"):
        raise _refuse(where, "q_lora_rank is null (a plain q_proj: Megatron's local MLA spec "
                      "then has no kv latent norm, which DeepseekV3 applies)")  # fmt: skip
    if config.get("rope_interleave") is False:
        raise _refuse(where, "rope_interleave is false (Megatron's MLA rope de-interleaves "
                      "the rope dims: HF's rope_interleave true)")  # fmt: skip
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        raise _refuse(where, f"rope is {kind}-scaled (rope_parameters.rope_type)")
    if config.get("hidden_act", "silu") != "silu":
        raise _refuse(where, f"hidden_act is {config.get('hidden_act')} (SwiGLU is silu)")
    if config.get("attention_bias"):
        raise _refuse(where, "attention has biases (attention_bias)")
    if config.get("tie_word_embeddings"):
        raise _refuse(where, "embeddings are tied (tie_word_embeddings; not written yet)")
    if not moe_layers:
        return
    topk = _int(config, "num_experts_per_tok", where)
    if bool(config.get("norm_topk_prob")) != (topk > 1):
        norm = config.get("norm_topk_prob")
        raise _refuse(where, f"norm_topk_prob is {norm} with top-{topk} (Megatron's sigmoid "
                      "router normalises the top-k exactly when k > 1)")  # fmt: skip
    groups, group_topk = config.get("n_group") or 1, config.get("topk_group") or 1
    if groups > 1 and topk // group_topk != 2:
        raise _refuse(where, f"expert groups are scored by their top-2 with top-{topk} of "
                      f"top-{group_topk} groups (num_experts_per_tok / topk_group: Megatron "
                      f"scores each group by its top-{topk // group_topk})")  # fmt: skip


def _layer_shapes(config: Mapping[str, Any], moe_layer: bool, where: str) -> dict[str, Any]:
    """One layer's Megatron tensors (suffix -> shape), as the local spec names them."""
    h, heads = _int(config, "hidden_size", where), _int(config, "num_attention_heads", where)
    q_rank, kv_rank = _int(config, "q_lora_rank", where), _int(config, "kv_lora_rank", where)
    nope, rope = _int(config, "qk_nope_head_dim", where), _int(config, "qk_rope_head_dim", where)
    v = _int(config, "v_head_dim", where)
    out: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "self_attention.linear_q_down_proj.weight": (q_rank, h),
        "self_attention.q_layernorm.weight": (q_rank,),
        "self_attention.linear_q_up_proj.weight": (heads * (nope + rope), q_rank),
        "self_attention.linear_kv_down_proj.weight": (kv_rank + rope, h),
        "self_attention.kv_layernorm.weight": (kv_rank,),
        "self_attention.linear_kv_up_proj.weight": (heads * (nope + v), kv_rank),
        "self_attention.linear_proj.weight": (h, heads * v),
        "pre_mlp_layernorm.weight": (h,),
    }
    if not moe_layer:
        ffn = _int(config, "intermediate_size", where)
        out["mlp.linear_fc1.weight"], out["mlp.linear_fc2.weight"] = (2 * ffn, h), (h, ffn)
        return out
    experts = _int(config, "n_routed_experts", where)
    f = _int(config, "moe_intermediate_size", where)
    out[moe.ROUTER] = (experts, h)
    out["mlp.router.expert_bias"] = (experts,)
    out[moe.EXPERT_FC1], out[moe.EXPERT_FC2] = (experts, 2 * f, h), (experts, h, f)
    shared = (config.get("n_shared_experts") or 0) * f
    if shared:
        out["mlp.shared_experts.linear_fc1.weight"] = (2 * shared, h)
        out["mlp.shared_experts.linear_fc2.weight"] = (h, shared)
    return out


def _run_args(config: Mapping[str, Any], d: plan.Dims, first_dense: int) -> dict[str, Any]:
    """The MLA and MoE ``args`` a converted run records (``load_args_from_checkpoint``'s)."""
    args: dict[str, Any] = {
        "multi_latent_attention": True,
        "q_lora_rank": config["q_lora_rank"],
        "kv_lora_rank": config["kv_lora_rank"],
        "qk_head_dim": config["qk_nope_head_dim"],
        "qk_pos_emb_head_dim": config["qk_rope_head_dim"],
        "v_head_dim": config["v_head_dim"],
        "rope_type": "rope",
        "rotary_interleaved": False,
        "rotary_scaling_factor": 1.0,
    }
    if not d.experts:
        return args
    groups = config.get("n_group") or 1
    shared = (config.get("n_shared_experts") or 0) * d.moe_ffn
    args.update(
        num_experts=d.experts, moe_ffn_hidden_size=d.moe_ffn,
        moe_router_topk=config["num_experts_per_tok"], moe_router_pre_softmax=False,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=(config.get("topk_group") or 1) if groups > 1 else None,
        moe_shared_expert_intermediate_size=shared or None,
        moe_layer_freq=[0] * first_dense + [1] * (d.layers - first_dense),
        moe_grouped_gemm=False, expert_model_parallel_size=1, expert_tensor_parallel_size=1,
    )  # fmt: skip
    return args


def extra_states(d: plan.Dims, first_dense: int, shared: bool) -> dict[str, list[None]]:
    """The ``_extra_state`` objects Megatron's MLA layer specs save and load (``[None]`` each):
    stacked (dense MLA) ``decoder.layers.<module>._extra_state/shard_<i>_<layers>``; per layer
    ``decoder.layers.<i>.<module>._extra_state/shard_0_1``, each routed expert's
    ``…/shard_<e>_<experts>``."""
    out: dict[str, list[None]] = {}
    if d.stacked:
        for i in range(d.layers):
            for m in (*_ATTENTION, *_DENSE_MLP):
                out[f"{_LAYERS}{m}._extra_state/shard_{i}_{d.layers}"] = [None]
        return out
    for i in range(d.layers):
        pre = f"{_LAYERS}{i}."
        modules = _ATTENTION + (_DENSE_MLP if i < first_dense else _SHARED if shared else ())
        for m in modules:
            out[f"{pre}{m}._extra_state/shard_0_1"] = [None]
        if i >= first_dense:
            for e in range(d.experts):
                for fc in ("linear_fc1", "linear_fc2"):
                    out[f"{pre}mlp.experts.experts.{fc}._extra_state/shard_{e}_{d.experts}"] = [
                        None
                    ]
    return out


def from_hf(
    shapes: Shapes, dtypes: Mapping[str, str], config: Mapping[str, Any], divisor: int, where: str
) -> tuple[KeyMap, plan.Dims, dict[str, Any], dict[str, list[None]]]:
    """The pieces that place a ``DeepseekV3ForCausalLM``'s tensors (``shapes``, ``dtypes``: HF
    name -> shape / dtype) into the Megatron-core model of ``config`` (vocabulary padded to a
    multiple of ``divisor``), its sizes, the MLA / MoE args the run records, and the
    ``_extra_state`` objects of its layer specs.

    Raises:
        UnsupportedCheckpointError: what Megatron would compute otherwise (module docstring),
            or an HF tensor missing, of another shape, or with no place in the model.
        UsageError: the config lacks a size.
    """
    layers = _int(config, "num_hidden_layers", where)
    first_dense = min(int(config.get("first_k_dense_replace") or 0), layers)
    moe_layers = first_dense < layers and bool(config.get("n_routed_experts"))
    if not moe_layers:
        first_dense = layers
    _refuse_config(config, moe_layers, where)
    hidden, vocab = _int(config, "hidden_size", where), _int(config, "vocab_size", where)
    heads = _int(config, "num_attention_heads", where)
    d = plan.Dims(
        layers=layers, hidden=hidden, heads=heads, groups=heads, head_dim=hidden // heads,
        ffn=_int(config, "intermediate_size", where), vocab=vocab,
        padded_vocab=plan.padded_vocab(vocab, divisor), tied=False, qk_norm=True,
        stacked=not moe_layers, experts=int(config["n_routed_experts"]) if moe_layers else 0,
        moe_ffn=_int(config, "moe_intermediate_size", where) if moe_layers else 0,
    )  # fmt: skip
    megatron: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        for suffix, shape in _layer_shapes(config, i >= first_dense, where).items():
            if d.stacked:
                megatron[_LAYERS + suffix] = (layers, *shape)
            else:
                megatron[f"{_LAYERS}{i}.{suffix}"] = shape
    megatron["embedding.word_embeddings.weight"] = (d.padded_vocab, hidden)
    megatron["decoder.final_layernorm.weight"] = (hidden,)
    megatron["output_layer.weight"] = (d.padded_vocab, hidden)
    args = {"num_attention_heads": heads, "vocab_size": vocab, **_run_args(config, d, first_dense)}
    to_hf, _ = mla.to_hf(megatron, args, config, where)
    vocab_rows = ("embedding.word_embeddings.weight", "output_layer.weight")
    pieces: list[Piece] = [p for p in to_hf.pieces if p.memory not in vocab_rows]
    pieces += plan.vocab_pieces(d, vocab_rows[0], "model.embed_tokens.weight", True)
    pieces += plan.vocab_pieces(d, vocab_rows[1], "lm_head.weight", True)
    km = KeyMap(tuple(pieces), to_hf.memory_shapes, to_hf.mapping)
    plan.check_shapes(km, shapes, "disk", where)
    placed = {p.disk for p in km.pieces}
    for name in shapes:
        if name not in placed:
            raise UnsupportedCheckpointError(
                f"{where}: {name!r} has no place in Megatron's {mla.FAMILY} model (multi-token "
                "prediction layers are not written): not written",
                fqn=name,
            )
    model_dtype = dtypes["model.embed_tokens.weight"]
    for name, dtype in dtypes.items():
        if dtype != model_dtype and not (name.endswith(mla.KEPT_FP32) and dtype == "float32"):
            raise UnsupportedCheckpointError(
                f"{where}: {name!r} is {dtype} in a {model_dtype} model (only DeepseekV3's "
                "router weight and expert bias are kept in float32) and ckptools does not cast "
                "one tensor alone: give the model in one dtype",
                fqn=name,
            )
    shared = moe_layers and bool(config.get("n_shared_experts"))
    return km, d, args, extra_states(d, first_dense, shared)
