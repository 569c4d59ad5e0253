"""Multi-latent attention runs (DeepSeek-V3 and dense MLA models) in the Megatron -> Hugging Face
mapping (pure): ``DeepseekV3ForCausalLM``, name for name as ``save_pretrained`` writes it.

Every MLA tensor is one HF tensor renamed (Megatron's MLA rope, not ``--rotary-interleaved``,
de-interleaves the rope dims as HF's ``rope_interleave=True`` does, so the rows stay as stored):
``linear_q_down_proj`` -> ``q_a_proj``, ``q_layernorm`` -> ``q_a_layernorm``, ``linear_q_up_proj``
-> ``q_b_proj`` (per head its "nope" rows then its rope rows, HF's split), ``linear_kv_down_proj``
-> ``kv_a_proj_with_mqa`` (the kv latent, then the shared rope key), ``kv_layernorm`` ->
``kv_a_layernorm``, ``linear_kv_up_proj`` -> ``kv_b_proj`` (per head k "nope" then v). Transformer
Engine's spec fuses the latent norms as ``linear_q_up_proj.layer_norm_weight`` /
``linear_kv_up_proj.layer_norm_weight``: the same tensors.

MoE layers (``--moe-layer-freq``: dense first layers, then MoE) keep per-layer keys; their router
is ``mlp.gate`` with ``expert_bias`` -> ``mlp.gate.e_score_correction_bias``, shared experts
``mlp.shared_experts.gate_proj/up_proj/down_proj``, routed experts as
:mod:`ckptools.producers.megatron.moe` cuts them. What DeepseekV3 does not compute (softmax
scores, no expert bias, groups scored otherwise than by their top-2, YaRN scaling, interleaved
rope, a shared-expert gate) is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptools.errors import UnsupportedCheckpointError, UsageError
from ckptools.plan.conversions import KeyMap, Piece, Shapes
from ckptools.producers.megatron import moe
from ckptools.producers.megatron.hf_config import PADDING_KEPT, common_config

_LAYERS = "decoder.layers."
FAMILY = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
#: Megatron layer tensor -> the HF layer tensor it is (local spec's and TE's norm names alike)
RENAMED = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
#: SwiGLU fc1 (all gate rows, then all up rows) -> HF's gate and up projections
GATED = {
    "mlp.linear_fc1.weight": "mlp.",
    "mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts.",
}
_KV_DOWN = "self_attention.linear_kv_down_proj.weight"
_KV_NORMS = (
    "self_attention.kv_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight",
)
_Q_NORMS = (
    "self_attention.q_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight",
)


#: what DeepseekV3 keeps in float32 whatever the model's dtype (transformers'
#: ``DeepseekV3PreTrainedModel._keep_in_fp32_modules_strict``): ``save_pretrained`` writes them so
#: and a model loaded in bf16 holds them so. A bf16 run's router weight (Megatron's
#: ``Float16Module`` casts it; its expert bias stays a float32 buffer) is widened to float32,
#: exactly (:attr:`ckptools.plan.conversions.KeyMap.kept_dtypes`)
KEPT_FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def is_mla(shapes: Shapes, args: Mapping[str, Any]) -> bool:
    """Whether the run's attention is multi-latent (its args say so, or its tensors do)."""
    return bool(args.get("multi_latent_attention")) or any(_KV_DOWN in n for n in shapes)


def _layers(shapes: Shapes) -> tuple[bool, int, list[dict[str, tuple[int, ...]]]]:
    """(stacked, layers, each layer's tensors by suffix: shapes without the stacked dim)."""
    stacked = _LAYERS + _KV_DOWN in shapes
    if stacked:
        count = shapes[_LAYERS + _KV_DOWN][0]
        per = {n[len(_LAYERS) :]: s for n, s in shapes.items() if n.startswith(_LAYERS)}
        one = {k: (s if k in (moe.EXPERT_FC1, moe.EXPERT_FC2) else s[1:]) for k, s in per.items()}
        return True, count, [one] * count
    found: dict[int, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        if name.startswith(_LAYERS):
            head, _, rest = name[len(_LAYERS) :].partition(".")
            if head.isdigit():
                found.setdefault(int(head), {})[rest] = shape
    if not found or set(found) != set(range(len(found))):
        raise UnsupportedCheckpointError(f"{_LAYERS}<i> keys are not layers 0..n-1: not mapped")
    return False, len(found), [found[i] for i in range(len(found))]


def _pick(layer: Mapping[str, tuple[int, ...]], names: tuple[str, ...]) -> tuple[int, ...] | None:
    for name in names:
        if name in layer:
            return layer[name]
    return None


def _refuse(where: str, what: str) -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(
        f"{where}: the run's {what}, which Hugging Face's DeepseekV3 does not compute: not "
        "converted (a model that computed otherwise would give other logits)"
    )


def refuse_unmapped(args: Mapping[str, Any], where: str) -> None:
    """Refuse, by name, the MLA and routing variants DeepseekV3 lacks.

    Raises:
        UnsupportedCheckpointError: naming the run's arg.
    """
    if args.get("rotary_interleaved"):
        raise _refuse(where, "rope is interleaved (args.rotary_interleaved)")
    scaling = args.get("rotary_scaling_factor")
    if args.get("rope_type") == "yarn" and scaling not in (None, 1, 1.0):
        raise _refuse(where, f"rope is YaRN-scaled by {scaling} (args.rope_type yarn)")
    if not args.get("num_experts"):
        return
    if args.get("moe_router_score_function") != "sigmoid":
        raise _refuse(where, f"router scores with {args.get('moe_router_score_function')} "
                      "(args.moe_router_score_function; DeepseekV3's is sigmoid)")  # fmt: skip
    if not args.get("moe_router_enable_expert_bias"):
        raise _refuse(where, "sigmoid router has no expert bias (args.moe_router_enable_"
                      "expert_bias; DeepseekV3 always adds e_score_correction_bias)")  # fmt: skip
    if args.get("moe_router_pre_softmax"):
        raise _refuse(where, "router takes a softmax first (args.moe_router_pre_softmax)")
    groups, topk = args.get("moe_router_num_groups"), args.get("moe_router_topk") or 1
    group_topk = args.get("moe_router_group_topk") or 1
    if groups and groups > 1 and topk // group_topk != 2:
        raise _refuse(where, f"expert groups are scored by their top-{topk // group_topk} "
                      "(args.moe_router_topk / moe_router_group_topk; DeepseekV3 sums each "
                      "group's top-2)")  # fmt: skip


def _pattern(layers: list[dict[str, tuple[int, ...]]], where: str) -> int:
    """How many dense layers come first (every later one MoE).

    Raises:
        UnsupportedCheckpointError: a dense layer after an MoE one.
    """
    is_moe = [moe.ROUTER in layer for layer in layers]
    first = is_moe.index(True) if True in is_moe else len(layers)
    if not all(is_moe[first:]):
        pattern = "".join("1" if m else "0" for m in is_moe)
        raise _refuse(where, f"dense and MoE layers alternate ({pattern}; DeepseekV3's "
                      "first_k_dense_replace has dense layers first only)")  # fmt: skip
    return first


def _whole(disk: str, memory: str, shape: tuple[int, ...], i: int, stacked: bool) -> Piece:
    if stacked:  # one layer of the stacked tensor
        zeros = (0,) * len(shape)
        return Piece(disk, memory, (i, *zeros), (1, *shape), 0, "layer of the stacked layers",
                     at=zeros, whole_shape=shape)  # fmt: skip
    return Piece(disk, memory, (0,) * len(shape), shape, None, "rename")


def _rows(disk: str, memory: str, shape: tuple[int, ...], first: int, n: int, i: int,
          stacked: bool, rule: str) -> Piece:  # fmt: skip
    rest = shape[1:]
    zeros = (0,) * len(rest)
    if stacked:
        offsets, sizes, stack = (i, first, *zeros), (1, n, *rest), 0
    else:
        offsets, sizes, stack = (first, *zeros), (n, *rest), None
    return Piece(disk, memory, offsets, sizes, stack, rule, at=(0, *zeros), whole_shape=(n, *rest))


def _vocab(megatron: str, hf: str, shape: tuple[int, ...], vocab: int, kept: bool) -> Piece:
    if vocab == shape[0]:
        return Piece(hf, megatron, (0, 0), shape, None, PADDING_KEPT if kept else "rename")
    return Piece(hf, megatron, (0, 0), (vocab, shape[1]), None, "vocab padding dropped",
                 at=(0, 0), whole_shape=(vocab, shape[1]))  # fmt: skip


def to_hf(
    shapes: Shapes, args: Mapping[str, Any], config: Mapping[str, Any] | None, where: str
) -> tuple[KeyMap, dict[str, Any]]:
    """The pieces that cut an MLA run's model tensors ``shapes`` (stacked experts folded) into
    ``DeepseekV3ForCausalLM``'s, and its config (``config``, checked, or made from the args).

    Raises:
        UnsupportedCheckpointError: what DeepseekV3 does not compute, or a tensor it lacks.
        UsageError: the head count is nowhere, or the config's vocabulary exceeds the rows.

    Where the true vocabulary size is nowhere (no config, none in the args) the padded rows
    are kept (:data:`~.hf_config.PADDING_KEPT`).
    """
    if config is not None and config.get("model_type") != FAMILY:
        raise UnsupportedCheckpointError(
            f"{where}: the run uses multi-latent attention, which a {config.get('model_type')} "
            f"model does not have: give a {FAMILY} config (or none: it is made from the args)"
        )
    refuse_unmapped(args, where)
    stacked, count, layers = _layers(shapes)
    first_dense = _pattern(layers, where)
    cfg = config or {}
    heads = int(cfg.get("num_attention_heads") or args.get("num_attention_heads") or 0)
    embedding = shapes.get("embedding.word_embeddings.weight")
    vocab = int(cfg.get("vocab_size") or args.get("vocab_size") or 0)
    if not heads or embedding is None:
        raise UsageError(f"{where}: the attention heads or the embedding are missing; give "
                         "the model's config.json with --config")  # fmt: skip
    kept = not vocab  # the true size is nowhere: the padded rows are the model's
    vocab = vocab or embedding[0]
    if vocab > embedding[0]:
        raise UsageError(f"{where}: the config's vocab_size {vocab} exceeds the {embedding[0]} "
                         "embedding rows stored: --config names another model")  # fmt: skip
    made = _config(layers, first_dense, heads, embedding[1], vocab, args, where)
    if config is not None:
        _agrees(made, config, where)
        made = dict(config)
    experts = made.get("n_routed_experts") if first_dense < count else 0
    pieces: list[Piece] = []
    known: set[str] = set()
    for i, layer in enumerate(layers):
        pre = f"model.layers.{i}."
        for suffix, shape in layer.items():
            memory = _LAYERS + suffix if stacked else f"{_LAYERS}{i}.{suffix}"
            known.add(memory)
            if suffix in RENAMED:
                pieces.append(_whole(pre + RENAMED[suffix], memory, shape, i, stacked))
            elif suffix in GATED:
                half = shape[0] // 2
                for j, proj in enumerate(("gate_proj.weight", "up_proj.weight")):
                    pieces.append(_rows(pre + GATED[suffix] + proj, memory, shape, j * half,
                                        half, i, stacked, "linear_fc1 -> gate/up"))  # fmt: skip
            elif suffix in (moe.EXPERT_FC1, moe.EXPERT_FC2):
                continue  # below
            else:
                raise UnsupportedCheckpointError(
                    f"{where}: {memory!r} has no place in a {FAMILY} model (a shared-expert "
                    "gate, biases or another spec's tensor): not converted",
                    fqn=memory,
                )
    if experts:
        pieces.extend(_expert_pieces(layers, first_dense, stacked, int(experts), known))
    embed = "embedding.word_embeddings.weight"
    pieces.append(_vocab(embed, "model.embed_tokens.weight", embedding, vocab, kept))
    pieces.append(Piece("model.norm.weight", "decoder.final_layernorm.weight",
                        (0,), (embedding[1],), None, "rename"))  # fmt: skip
    known |= {embed, "decoder.final_layernorm.weight"}
    if "output_layer.weight" in shapes:
        pieces.append(_vocab("output_layer.weight", "lm_head.weight",
                             shapes["output_layer.weight"], vocab, kept))  # fmt: skip
        known.add("output_layer.weight")
    for name in shapes:
        if name not in known:
            raise UnsupportedCheckpointError(
                f"{where}: {name!r} has no place in a {FAMILY} model: not converted", fqn=name
            )
    memory_shapes = {name: tuple(shapes[name]) for name in known}
    fp32 = {p.disk: "float32" for p in pieces if p.disk.endswith(KEPT_FP32)}
    return KeyMap(tuple(pieces), memory_shapes, f"megatron <-> {FAMILY}", fp32), made


def _expert_pieces(
    layers: list[dict[str, tuple[int, ...]]], first: int, stacked: bool, n: int, known: set[str]
) -> list[Piece]:
    """Each routed expert's gate, up and down projection of each MoE layer (a box of one expert
    of ``linear_fc1`` / ``linear_fc2``; stacked layers folded: expert ``e`` of layer ``i`` is
    row ``i * E + e``)."""
    _, gate, up, down = moe.MOE_NAMES["qwen3_moe"]  # DeepseekV3 saves the same names
    pieces: list[Piece] = []
    for i in range(first, len(layers)):
        known |= set(moe.expert_keys(i, stacked))
        _, rows2f, h = layers[i][moe.EXPERT_FC1]
        pieces += moe.layer_experts((gate, up, down), i, n, rows2f // 2, h, stacked)
    return pieces


def _config(
    layers: list[dict[str, tuple[int, ...]]],
    first_dense: int,
    heads: int,
    hidden: int,
    vocab: int,
    args: Mapping[str, Any],
    where: str,
) -> dict[str, Any]:
    """The ``DeepseekV3Config`` of the run, its MLA sizes read from the tensors."""
    layer = layers[0]
    kv_down = layer[_KV_DOWN]
    kv_norm = _pick(layer, _KV_NORMS)
    q_norm = _pick(layer, _Q_NORMS)
    if kv_norm is None:
        raise _refuse(where, "kv latent has no norm (no --qk-layernorm; DeepseekV3 always "
                      "applies kv_a_layernorm)")  # fmt: skip
    kv_rank = kv_norm[0]
    rope = kv_down[0] - kv_rank
    q_rows = (layer.get("self_attention.linear_q_up_proj.weight")
              or layer["self_attention.linear_q_proj.weight"])[0]  # fmt: skip
    nope = q_rows // heads - rope
    v = layer["self_attention.linear_kv_up_proj.weight"][0] // heads - nope
    made = common_config(
        ARCHITECTURE, FAMILY, hidden=hidden, layers=len(layers), heads=heads, groups=heads,
        head_dim=rope, vocab=vocab, tied=False, args=args, norm_eps=1e-6,
    )  # fmt: skip
    made.update(
        q_lora_rank=q_norm[0] if q_norm is not None else None, kv_lora_rank=kv_rank,
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v, rope_interleave=True,
        attention_bias=False, num_nextn_predict_layers=0, first_k_dense_replace=first_dense,
    )  # fmt: skip
    dense = layers[0].get("mlp.linear_fc1.weight")
    made["intermediate_size"] = dense[0] // 2 if dense else args.get("ffn_hidden_size")
    if first_dense < len(layers):
        moe_layer = layers[first_dense]
        router = moe_layer[moe.ROUTER]
        ffn = moe_layer[moe.EXPERT_FC1][-2] // 2
        shared = moe_layer.get("mlp.shared_experts.linear_fc1.weight")
        shared_ffn = shared[0] // 2 if shared else 0
        if shared_ffn % ffn:
            raise _refuse(where, f"shared experts' hidden size {shared_ffn} is not a multiple of "
                          f"the experts' {ffn} (DeepseekV3: n_shared_experts x "
                          "moe_intermediate_size)")  # fmt: skip
        topk = int(args.get("moe_router_topk") or 1)
        made.update(
            n_routed_experts=router[0], moe_intermediate_size=ffn,
            n_shared_experts=shared_ffn // ffn, num_experts_per_tok=topk,
            n_group=args.get("moe_router_num_groups") or 1,
            topk_group=args.get("moe_router_group_topk") or 1,
            routed_scaling_factor=float(args.get("moe_router_topk_scaling_factor") or 1.0),
            norm_topk_prob=topk > 1,
        )  # fmt: skip
    return made


#: what a given config must say as the run's tensors and args do
_CHECKED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "q_lora_rank",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "first_k_dense_replace", "n_routed_experts", "moe_intermediate_size",
            "n_shared_experts", "num_experts_per_tok", "norm_topk_prob")  # fmt: skip


def _agrees(made: Mapping[str, Any], config: Mapping[str, Any], where: str) -> None:
    """A given config says what the run's tensors and args say.

    Raises:
        UnsupportedCheckpointError: naming the first key that differs.
    """
    for key in _CHECKED:
        if key in made and key in config and config[key] != made[key]:
            raise UnsupportedCheckpointError(
                f"{where}: the config's {key} {config[key]!r} is not the run's {made[key]!r}: "
                "--config names another model"
            )
