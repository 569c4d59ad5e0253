"""MoE runs (Mixtral, Qwen3-MoE) in the Megatron <-> Hugging Face mapping (pure): the experts'
boxes, the routing no mapped family computes (refused by name), the HF config of the run and its
agreement with a given one. :mod:`ckptools.producers.megatron.plan` holds the rest of the model.

Megatron-core saves the router ``mlp.router.weight`` ``[L, E, H]`` (HF's ``gate``) and the experts
stacked over layers and experts (SequentialMLP and TEGroupedMLP alike):
``mlp.experts.experts.linear_fc1.weight`` ``[L, E, 2F, H]`` (each expert's gate rows then its up
rows) and ``linear_fc2`` ``[L, E, H, F]``. The plan sees them with the layer and expert dims folded
into one (``[L*E, ...]``, :func:`fold_experts`), so each HF expert tensor is a box with one dim
dropped. HF's names are what ``save_pretrained`` writes per family (transformers 5 fuses the
experts in memory only). ``shard --to megatron`` reads the same boxes the other way
(:func:`sizes_from_hf`, :func:`run_args`, :func:`extra_states`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptools.errors import UnsupportedCheckpointError, UsageError
from ckptools.plan.conversions import Piece, Shapes
from ckptools.producers.megatron.hf_config import common_config

#: :class:`ckptools.producers.megatron.plan.Dims` (which imports this module)
Dims = Any

_LAYERS = "decoder.layers."

#: the MoE families a Megatron run maps to and from
MOE_FAMILIES = ("mixtral", "qwen3_moe")
MOE_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
#: per MoE family, what ``save_pretrained`` names in a layer: the router, then each expert's
#: gate, up and down projections (``{e}``: the expert's index)
MOE_NAMES = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
                  "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
}  # fmt: skip
ROUTER = "mlp.router.weight"
#: the experts' tensors as Megatron-core saves them (SequentialMLP and TEGroupedMLP alike)
EXPERT_FC1 = "mlp.experts.experts.linear_fc1.weight"
EXPERT_FC2 = "mlp.experts.experts.linear_fc2.weight"


def fold_experts(shapes: Shapes) -> dict[str, tuple[int, ...]]:
    """The stacked expert tensors of ``shapes`` (``[L, E, ...]``) with their layer and expert
    dims folded into one (``[L*E, ...]``): the shapes the plan maps (see the module)."""
    out: dict[str, tuple[int, ...]] = {}
    for suffix in (EXPERT_FC1, EXPERT_FC2):
        shape = shapes.get(_LAYERS + suffix)
        if shape is not None and len(shape) == 4:
            out[_LAYERS + suffix] = (shape[0] * shape[1], *shape[2:])
    return out


def folded_experts(shapes: Shapes) -> dict[str, tuple[int, ...]]:
    """The stacked expert tensors of a keymap's Megatron ``shapes``, as the plan sees them
    (layer and expert dims folded: ``[L*E, ...]``); per-layer keys are not folded."""
    return {
        n: tuple(shapes[n]) for n in (_LAYERS + EXPERT_FC1, _LAYERS + EXPERT_FC2) if n in shapes
    }


def expert_pieces(d: Dims, family: str) -> tuple[list[Piece], dict[str, tuple[int, ...]]]:
    """Every expert's gate, up and down projection: a box of one expert of one layer of
    ``linear_fc1`` (its gate rows, then its up rows) or ``linear_fc2``, the expert dim dropped.
    Stacked layers are folded (:func:`fold_experts`): expert ``e`` of layer ``i`` is row
    ``i * E + e``; per-layer keys hold ``[E, ...]``."""
    _, gate, up, down = MOE_NAMES[family]
    h, f, n = d.hidden, d.moe_ffn, d.experts
    pieces: list[Piece] = []
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(d.layers):
        fc1, fc2 = expert_keys(i, d.stacked)
        rows = d.layers * n if d.stacked else n
        shapes[fc1], shapes[fc2] = (rows, 2 * f, h), (rows, h, f)
        pieces += layer_experts((gate, up, down), i, n, f, h, d.stacked)
    return pieces, shapes


def expert_keys(layer: int, stacked: bool) -> tuple[str, str]:
    """The stored ``linear_fc1`` and ``linear_fc2`` of ``layer``'s experts: the stacked
    tensors, or its own when layers are not stacked (they differ: dense first layers)."""
    if stacked:
        return _LAYERS + EXPERT_FC1, _LAYERS + EXPERT_FC2
    return f"{_LAYERS}{layer}.{EXPERT_FC1}", f"{_LAYERS}{layer}.{EXPERT_FC2}"


def layer_experts(
    names: tuple[str, str, str], layer: int, n: int, f: int, h: int, stacked: bool
) -> list[Piece]:
    """Layer ``layer``'s ``n`` experts' gate, up and down projections under ``names`` (HF's,
    ``{e}`` the expert): boxes of one expert of ``linear_fc1`` (gate rows, then up rows) and
    ``linear_fc2``; stacked layers folded, expert ``e`` of layer ``i`` at row ``i * n + e``."""
    gate, up, down = names
    fc1, fc2 = expert_keys(layer, stacked)
    pre = f"model.layers.{layer}."
    pieces: list[Piece] = []
    for e in range(n):
        at = layer * n + e if stacked else e
        pieces.append(Piece(pre + gate.format(e=e), fc1, (at, 0, 0), (1, f, h), 0,
                            "expert linear_fc1 -> gate"))  # fmt: skip
        pieces.append(Piece(pre + up.format(e=e), fc1, (at, f, 0), (1, f, h), 0,
                            "expert linear_fc1 -> up"))  # fmt: skip
        pieces.append(Piece(pre + down.format(e=e), fc2, (at, 0, 0), (1, h, f), 0,
                            "expert linear_fc2 -> down"))  # fmt: skip
    return pieces


def refuse_routing(args: Mapping[str, Any], where: str) -> None:
    """Refuse, by name, the MoE routing no mapped family computes (sigmoid scores and expert
    bias, group-limited or scaled top-k, layers mixing dense and MoE MLPs).

    Raises:
        UnsupportedCheckpointError: naming the run's arg and what it is.
    """

    def refuse(what: str) -> UnsupportedCheckpointError:
        return UnsupportedCheckpointError(
            f"{where}: the run's MoE router uses {what}, which neither {' nor '.join(MOE_FAMILIES)}"
            " computes in Hugging Face: not converted (a model that routed differently would "
            "give other logits)"
        )

    score = args.get("moe_router_score_function")
    if score not in (None, "softmax"):
        raise refuse(f"{score} scores (args.moe_router_score_function; DeepSeek-V3's routing)")
    if args.get("moe_router_enable_expert_bias"):
        raise refuse("an expert bias (args.moe_router_enable_expert_bias)")
    if args.get("moe_router_num_groups"):
        raise refuse("group-limited top-k (args.moe_router_num_groups)")
    scale = args.get("moe_router_topk_scaling_factor")
    if scale not in (None, 1, 1.0):
        raise refuse(f"a top-k scaling factor {scale} (args.moe_router_topk_scaling_factor)")
    if args.get("moe_shared_expert_intermediate_size"):
        raise refuse("shared experts (args.moe_shared_expert_intermediate_size)")
    freq = args.get("moe_layer_freq")
    if freq not in (None, 1) and not (isinstance(freq, list) and all(x == 1 for x in freq)):
        raise refuse(f"MoE in some layers only (args.moe_layer_freq {freq}), dense MLPs in others")


def moe_config(d: Dims, args: Mapping[str, Any]) -> dict[str, Any]:
    """The HF config of an MoE run, from its args: Qwen3-MoE where it has q/k norms, else
    Mixtral (whose router renormalises the top-k: a softmax over the top-k logits, Megatron's
    default; a softmax over all experts is Qwen3-MoE's ``norm_topk_prob`` false)."""
    family = "qwen3_moe" if d.qk_norm else "mixtral"
    made = common_config(
        MOE_ARCHITECTURES[family], family, hidden=d.hidden, layers=d.layers, heads=d.heads,
        groups=d.groups, head_dim=d.head_dim, vocab=d.vocab, tied=d.tied, args=args,
    )  # fmt: skip
    made["num_experts_per_tok"] = args.get("moe_router_topk") or 2
    if family == "mixtral":
        made.update(intermediate_size=d.moe_ffn, num_local_experts=d.experts)
    else:
        made.update(
            intermediate_size=d.ffn, moe_intermediate_size=d.moe_ffn, num_experts=d.experts,
            norm_topk_prob=not args.get("moe_router_pre_softmax"), decoder_sparse_step=1,
            mlp_only_layers=[], attention_bias=False,
        )  # fmt: skip
    return made


def agrees(d: Dims, config: Mapping[str, Any], args: Mapping[str, Any], where: str) -> None:
    """An MoE run's config is an MoE family's, of its experts and routing.

    Raises:
        UnsupportedCheckpointError: naming what the config's model lacks or computes otherwise.
    """
    family = config.get("model_type")
    if (family in MOE_FAMILIES) != bool(d.experts):
        has = f"{d.experts} MoE experts per layer" if d.experts else "a dense MLP"
        raise UnsupportedCheckpointError(
            f"{where}: the run has {has}, which a {family} model does not match: --config "
            "names another model"
        )
    if not d.experts:
        return
    experts = config.get("num_local_experts") or config.get("num_experts")
    topk, wanted = config.get("num_experts_per_tok"), args.get("moe_router_topk")
    if experts != d.experts or (wanted is not None and topk != wanted):
        raise UnsupportedCheckpointError(
            f"{where}: the config's {experts} experts, top-{topk} are not the run's {d.experts} "
            f"experts, top-{wanted}: --config names another model"
        )
    renormalised = not args.get("moe_router_pre_softmax")
    if family == "mixtral" and not renormalised:
        raise UnsupportedCheckpointError(
            f"{where}: the run's router takes its softmax over all experts "
            "(args.moe_router_pre_softmax), which Mixtral's router (renormalised top-k) does "
            "not compute: give a qwen3_moe config with norm_topk_prob false"
        )
    if family == "qwen3_moe" and bool(config.get("norm_topk_prob")) != renormalised:
        raise UnsupportedCheckpointError(
            f"{where}: the config's norm_topk_prob {config.get('norm_topk_prob')} is not the "
            f"run's router (args.moe_router_pre_softmax {not renormalised}): --config names "
            "another model"
        )
    if family == "qwen3_moe" and (
        config.get("mlp_only_layers") or (config.get("decoder_sparse_step") or 1) != 1
    ):
        raise UnsupportedCheckpointError(
            f"{where}: the config has dense MLP layers (mlp_only_layers / decoder_sparse_step); "
            "every layer of the run is MoE"
        )


def _positive(config: Mapping[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"{where}: config.json has no positive integer {key!r}")
    return value


def sizes_from_hf(config: Mapping[str, Any], family: str, where: str) -> tuple[int, int]:
    """(experts per layer, each expert's hidden size) of an HF MoE model's ``config``.

    Raises:
        UsageError: the config lacks a size.
        UnsupportedCheckpointError: dense MLP layers among the MoE ones (Qwen3-MoE's
            ``mlp_only_layers`` / ``decoder_sparse_step``), which stacked layers cannot hold.
    """
    # transformers 5 writes num_local_experts for both (Qwen3-MoE's num_experts an alias)
    key = "num_local_experts" if "num_local_experts" in config else "num_experts"
    if family == "mixtral":
        return _positive(config, key, where), _positive(config, "intermediate_size", where)
    if config.get("mlp_only_layers") or (config.get("decoder_sparse_step") or 1) != 1:
        raise UnsupportedCheckpointError(
            f"{where}: the config has dense MLP layers among the MoE ones (mlp_only_layers "
            f"{config.get('mlp_only_layers')}, decoder_sparse_step "
            f"{config.get('decoder_sparse_step')}): not written to Megatron yet"
        )
    return _positive(config, key, where), _positive(config, "moe_intermediate_size", where)


def run_args(d: Dims, config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The Megatron-LM ``args`` of an MoE model's experts and router that a converted run
    records (what ``--use-checkpoint-args`` reads back: ``load_args_from_checkpoint``): every
    layer MoE, SequentialMLP's layout, a softmax router over the top-k logits (Mixtral's, and
    Qwen3-MoE's ``norm_topk_prob``) or over all experts (``moe_router_pre_softmax``)."""
    topk = _positive(config, "num_experts_per_tok", where)
    pre_softmax = config.get("model_type") == "qwen3_moe" and not config.get("norm_topk_prob")
    return {
        "num_experts": d.experts,
        "moe_ffn_hidden_size": d.moe_ffn,
        "moe_router_topk": topk,
        "moe_router_pre_softmax": pre_softmax,
        "moe_router_score_function": "softmax",
        "moe_router_enable_expert_bias": False,
        "moe_router_topk_scaling_factor": None,
        "moe_shared_expert_intermediate_size": None,
        "moe_layer_freq": 1,
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": 1,
    }


#: the local spec's modules of an MoE layer whose ``_extra_state`` Megatron saves: attention's
#: per layer, each expert's per layer and expert (SequentialMLP's ``linear_fc1``/``linear_fc2``)
_EXTRA_STATE_LAYER = ("self_attention.linear_proj", "self_attention.linear_qkv")
_EXTRA_STATE_EXPERT = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")


def extra_states(layers: int, experts: int) -> dict[str, list[None]]:
    """The ``_extra_state`` objects Megatron's local MoE layer spec saves and loads (``[None]``
    each): ``decoder.layers.<module>._extra_state/shard_<i>_<layers>`` for attention and
    ``…/shard_<i>.<e>_<layers>.<experts>`` for each expert of each layer."""
    out: dict[str, list[None]] = {}
    for i in range(layers):
        for m in _EXTRA_STATE_LAYER:
            out[f"{_LAYERS}{m}._extra_state/shard_{i}_{layers}"] = [None]
        for e in range(experts):
            for m in _EXTRA_STATE_EXPERT:
                out[f"{_LAYERS}{m}._extra_state/shard_{i}.{e}_{layers}.{experts}"] = [None]
    return out
