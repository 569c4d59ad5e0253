"""Megatron-core's GPT model <-> a Hugging Face Llama-family model, as byte boxes (pure).

One description, read in both directions: every Hugging Face tensor is one or more boxes of a
Megatron tensor (a :class:`~ckptools.plan.conversions.Piece` each), so ``consolidate`` cuts the
stored Megatron chunks into the HF tensors (``split_entries``) and ``shard --to megatron``
places the HF tensors' chunks into the Megatron ones (``merge_entries``), the same planner and
executor as transformers' MoE mapping. What Megatron does differently is all boxes:

* the decoder layers are stacked on a leading dim (``decoder.layers.X`` [L, ...]), or kept per
  layer (``decoder.layers.<i>.X``): layer ``i`` is the box ``[i:i+1]`` (the stacked dim dropped);
* ``linear_qkv`` holds, per query group ``g``, the group's query heads, then its key head, then
  its value head (``head_dim`` rows each): ``q_proj`` is ``num_query_groups`` row ranges of it,
  ``k_proj`` and ``v_proj`` as many single-head ranges (``Piece.at``: where each lands);
* ``linear_fc1`` is all gate rows then all up rows (SwiGLU);
* the local spec saves its norms under the fused names (``linear_qkv.layer_norm_weight`` is
  ``input_layernorm``, ``linear_fc1.layer_norm_weight`` ``post_attention_layernorm``);
* the vocabulary is padded (``make_vocab_size_divisible_by`` x TP): HF's rows are the first
  ``vocab_size``; going to Megatron the padding rows repeat the last row, as Megatron-LM's own
  converter (``tools/checkpoint``) pads.

MoE runs (Mixtral, Qwen3-MoE) map too, both ways: the router is HF's ``gate`` and each
expert's gate / up / down a box of the stacked experts (:mod:`ckptools.producers.megatron.moe`).

Multi-latent attention runs (DeepSeek-V3-shaped, or MLA with dense MLPs) are mapped by
:mod:`ckptools.producers.megatron.mla` instead (``converted`` picks it); this module refuses
them, as it does the families it does not describe (shared experts, sigmoid routers and
expert bias, grouped or scaled routing, layers mixing dense and MoE MLPs, non-SwiGLU MLPs,
LayerNorm with bias), by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptools.errors import UnsupportedCheckpointError, UsageError
from ckptools.plan.conversions import KeyMap, Piece, Shapes
from ckptools.producers.megatron import moe
from ckptools.producers.megatron.hf_config import PADDING_KEPT, common_config

#: the Hugging Face ``model_type`` s whose layers are this module's layout
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
#: Megatron-LM's default ``--make-vocab-size-divisible-by``
VOCAB_DIVISOR = 128
_LAYERS = "decoder.layers."
_QKV = "self_attention.linear_qkv"
_FC1 = "mlp.linear_fc1"
#: MLA and the MoE parts no mapped family has, by a name part only they have, and what they are
_REFUSED = (
    ("linear_q_down_proj", "multi-latent attention (MLA)"),
    ("linear_kv_down_proj", "multi-latent attention (MLA)"),
    ("linear_q_proj", "multi-latent attention (MLA)"),
    ("mlp.shared_experts", "an MoE shared expert (Qwen2-MoE / DeepSeek-V3 shape)"),
    ("router.expert_bias", "an MoE router's expert bias (DeepSeek-V3's sigmoid routing)"),
)
#: the MoE tensors, refused where the model cannot hold them (shard --to megatron)
_MOE_PARTS = (("mlp.experts", "MoE experts"), ("mlp.router", "an MoE router"))


@dataclass(frozen=True)
class Dims:
    """The model's sizes, as both sides must agree on them."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int  # the tokenizer's (HF's) vocabulary
    padded_vocab: int  # Megatron's rows
    tied: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    stacked: bool = True  # Megatron's layers on one leading dim (else decoder.layers.<i>.)
    experts: int = 0  # MoE experts per layer (0: a dense MLP)
    moe_ffn: int = 0  # each expert's hidden size
    padding_kept: bool = False  # the true vocabulary is nowhere: Megatron's rows are HF's

    @property
    def per_group(self) -> int:
        return self.heads // self.groups


def padded_vocab(vocab: int, divisor: int) -> int:
    """Megatron's padded vocabulary: ``vocab`` rounded up to a multiple of ``divisor``."""
    return math.ceil(vocab / divisor) * divisor


@dataclass(frozen=True)
class _Tensor:
    """One Megatron tensor of a layer (or of the model) and the HF tensors it holds, as
    ``(HF name, Megatron first row, HF first row, rows)`` row ranges (rows: dim 0 of the
    layer's slice; the other dims are whole)."""

    megatron: str
    rest: tuple[int, ...]  # the layer slice's dims after dim 0
    parts: tuple[tuple[str, int, int, int], ...]
    rule: str

    @property
    def rows(self) -> int:
        return sum(n for _, _, _, n in self.parts)


def _qkv_parts(d: Dims, suffix: str) -> tuple[tuple[str, int, int, int], ...]:
    """``linear_qkv``'s row ranges: per group its query heads, its key head, its value head."""
    hd, per = d.head_dim, d.per_group
    out = []
    for g in range(d.groups):
        base = g * (per + 2) * hd
        out.append((f"self_attn.q_proj.{suffix}", base, g * per * hd, per * hd))
        out.append((f"self_attn.k_proj.{suffix}", base + per * hd, g * hd, hd))
        out.append((f"self_attn.v_proj.{suffix}", base + (per + 1) * hd, g * hd, hd))
    return tuple(out)


def _layer_tensors(d: Dims, norms: Mapping[str, str], family: str = "") -> list[_Tensor]:
    """The tensors of one decoder layer. ``norms``: the Megatron name of each layer norm (the
    fused names by default; ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight`` when a
    checkpoint has those)."""
    h, hd, qkv_rows = d.hidden, d.head_dim, (d.heads + 2 * d.groups) * d.head_dim
    out = [
        _Tensor(f"{_QKV}.weight", (h,), _qkv_parts(d, "weight"), "linear_qkv -> q/k/v per group"),
        _Tensor("self_attention.linear_proj.weight", (d.heads * hd,),
                (("self_attn.o_proj.weight", 0, 0, h),), "linear_proj -> o_proj"),
        _Tensor(f"{_FC1}.weight", (h,), (("mlp.gate_proj.weight", 0, 0, d.ffn),
                ("mlp.up_proj.weight", d.ffn, 0, d.ffn)), "linear_fc1 -> gate/up"),
        _Tensor("mlp.linear_fc2.weight", (d.ffn,), (("mlp.down_proj.weight", 0, 0, h),),
                "linear_fc2 -> down_proj"),
        _Tensor(norms["input"], (), (("input_layernorm.weight", 0, 0, h),), "layer norm"),
        _Tensor(norms["post"], (), (("post_attention_layernorm.weight", 0, 0, h),),
                "layer norm"),
    ]  # fmt: skip
    if d.experts:  # the router instead of the dense MLP (the experts: _expert_pieces)
        router = moe.MOE_NAMES[family][0]
        out[2:4] = [_Tensor(moe.ROUTER, (h,), ((router, 0, 0, d.experts),), "router -> gate")]
    if d.qkv_bias:
        out.append(_Tensor(f"{_QKV}.bias", (), _qkv_parts(d, "bias"), "linear_qkv bias"))
    if d.qk_norm:
        out.append(_Tensor("self_attention.q_layernorm.weight", (),
                           (("self_attn.q_norm.weight", 0, 0, hd),), "q/k norm"))  # fmt: skip
        out.append(_Tensor("self_attention.k_layernorm.weight", (),
                           (("self_attn.k_norm.weight", 0, 0, hd),), "q/k norm"))  # fmt: skip
    assert out[0].rows == qkv_rows
    return out


FUSED_NORMS = {
    "input": f"{_QKV}.layer_norm_weight",
    "post": f"{_FC1}.layer_norm_weight",
}
SEPARATE_NORMS = {"input": "input_layernorm.weight", "post": "pre_mlp_layernorm.weight"}


def _layer_pieces(d: Dims, t: _Tensor) -> tuple[str, tuple[int, ...], list[Piece]]:
    """The pieces of layer tensor ``t`` over all layers: (stacked name, stacked shape, pieces);
    per-layer keys give one name per layer, each piece naming its own."""
    pieces: list[Piece] = []
    rows = t.rows
    for i in range(d.layers):
        memory = _LAYERS + t.megatron if d.stacked else f"{_LAYERS}{i}.{t.megatron}"
        for hf, first, at, n in t.parts:
            disk = f"model.layers.{i}.{hf}"
            hf_rows = sum(m for name, _, _, m in t.parts if name == hf)
            zeros = (0,) * len(t.rest)
            if d.stacked:
                offsets, sizes, stack = (i, first, *zeros), (1, n, *t.rest), 0
            else:
                offsets, sizes, stack = (first, *zeros), (n, *t.rest), None
            if not d.stacked and n == rows:  # a per-layer key that is the HF tensor, renamed
                pieces.append(Piece(disk, memory, offsets, sizes, None, "rename"))
                continue
            pieces.append(Piece(disk, memory, offsets, sizes, stack, t.rule, at=(at, *zeros),
                                whole_shape=(hf_rows, *t.rest)))  # fmt: skip
    shape = (d.layers, rows, *t.rest) if d.stacked else (rows, *t.rest)
    return _LAYERS + t.megatron, shape, pieces


def vocab_pieces(d: Dims, megatron: str, hf: str, padding: bool) -> list[Piece]:
    """The embedding (or output layer): HF's rows are Megatron's first ``vocab``; with
    ``padding`` (going to Megatron) each padding row is a copy of the last real row."""
    h, v = d.hidden, d.vocab
    if v == d.padded_vocab:
        return [Piece(hf, megatron, (0, 0), (v, h), None, PADDING_KEPT if d.padding_kept else
                      "rename")]  # fmt: skip
    shape = (v, h)
    out = [Piece(hf, megatron, (0, 0), (v, h), None, "vocab padding dropped", at=(0, 0),
                 whole_shape=shape)]  # fmt: skip
    if padding:
        out.extend(
            Piece(
                hf,
                megatron,
                (r, 0),
                (1, h),
                None,
                "vocab padding: last row repeated",
                at=(v - 1, 0),
                whole_shape=shape,
            )
            for r in range(v, d.padded_vocab)
        )
    return out


def keymap(d: Dims, norms: Mapping[str, str], family: str, *, padding: bool) -> KeyMap:
    """Every piece of the model ``d``: HF names as on-disk names, Megatron's as in-memory.

    ``padding``: Megatron's vocabulary padding rows are filled (``shard --to megatron``); else
    they are left out (``consolidate``, whose HF tensors do not hold them).
    """
    pieces: list[Piece] = []
    shapes: dict[str, tuple[int, ...]] = {}
    if d.experts:
        pieces, shapes = moe.expert_pieces(d, family)
    for t in _layer_tensors(d, norms, family):
        name, shape, made = _layer_pieces(d, t)
        pieces.extend(made)
        if d.stacked:
            shapes[name] = shape
        else:
            shapes.update({p.memory: shape for p in made})
    embedding = "embedding.word_embeddings.weight"
    pieces.extend(vocab_pieces(d, embedding, "model.embed_tokens.weight", padding))
    shapes[embedding] = (d.padded_vocab, d.hidden)
    pieces.append(Piece("model.norm.weight", "decoder.final_layernorm.weight", (0,), (d.hidden,),
                        None, "rename"))  # fmt: skip
    shapes["decoder.final_layernorm.weight"] = (d.hidden,)
    if not d.tied:
        pieces.extend(vocab_pieces(d, "output_layer.weight", "lm_head.weight", padding))
        shapes["output_layer.weight"] = (d.padded_vocab, d.hidden)
    return KeyMap(tuple(pieces), shapes, f"megatron <-> {family}")


def refuse_family(names: Any, where: str, *, with_moe: bool = False) -> None:
    """Refuse a model whose tensors only MLA models, or MoE parts no mapped family has, have,
    by name; ``with_moe``: the MoE families' experts and router are mapped (Megatron -> HF), else
    they are refused too.

    Raises:
        UnsupportedCheckpointError: naming the tensor and the family.
    """
    refused = _REFUSED if with_moe else (*_REFUSED, *_MOE_PARTS)
    mapped = FAMILIES + moe.MOE_FAMILIES if with_moe else FAMILIES
    for fqn in names:
        for part, what in refused:
            if part in fqn:
                raise UnsupportedCheckpointError(
                    f"{where}: {fqn!r} is {what}; ckptools maps only "
                    f"{', '.join(mapped)} models between Megatron and Hugging Face: keep the "
                    "stored names (--keep-in-memory-names / --select)",
                    fqn=fqn,
                )


def family_of(config: Mapping[str, Any], where: str, *, with_moe: bool = False) -> str:
    """The config's ``model_type``, one of :data:`FAMILIES` (or :data:`.moe.MOE_FAMILIES` with
    ``with_moe``).

    Raises:
        UnsupportedCheckpointError: another family, named.
    """
    family = config.get("model_type")
    known = FAMILIES + moe.MOE_FAMILIES if with_moe else FAMILIES
    if family not in known:
        raise UnsupportedCheckpointError(
            f"{where}: model_type {family!r}: ckptools maps only {', '.join(known)} between "
            "Megatron and Hugging Face"
        )
    return str(family)


def rope_theta(config: Mapping[str, Any]) -> float | None:
    """The config's RoPE base: ``rope_theta``, or transformers 5's ``rope_parameters``."""
    value = config.get("rope_theta")
    params = config.get("rope_parameters")
    if value is None and isinstance(params, dict):
        value = params.get("rope_theta")
    return float(value) if isinstance(value, int | float) else None


def _int(config: Mapping[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"{where}: config.json has no positive integer {key!r}")
    return value


def dims_from_hf(config: Mapping[str, Any], shapes: Shapes, divisor: int, where: str) -> Dims:
    """:class:`Dims` of the HF model of ``config`` (its tensors' ``shapes`` checked against it),
    Megatron's vocabulary padded to a multiple of ``divisor``.

    Raises:
        UsageError: the config lacks a size; UnsupportedCheckpointError: not this family.
    """
    family = family_of(config, where, with_moe=True)
    is_moe = family in moe.MOE_FAMILIES
    refuse_family(shapes, where, with_moe=is_moe)
    experts, moe_ffn = moe.sizes_from_hf(config, family, where) if is_moe else (0, 0)
    heads = _int(config, "num_attention_heads", where)
    hidden = _int(config, "hidden_size", where)
    groups = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    vocab = _int(config, "vocab_size", where)
    tied = bool(config.get("tie_word_embeddings", False)) or "lm_head.weight" not in shapes
    return Dims(
        layers=_int(config, "num_hidden_layers", where), hidden=hidden, heads=heads,
        groups=int(groups), head_dim=int(head_dim),
        ffn=_int(config, "intermediate_size", where), vocab=vocab,
        padded_vocab=padded_vocab(vocab, divisor), tied=tied,
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in shapes,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in shapes,
        experts=experts, moe_ffn=moe_ffn,
    )  # fmt: skip


def check_shapes(km: KeyMap, shapes: Shapes, side: str, where: str) -> None:
    """Every tensor ``km`` names on ``side`` ("disk": HF, "memory": Megatron) is in ``shapes``
    with the shape the model's sizes give it.

    Raises:
        UnsupportedCheckpointError: a tensor is missing or of another shape.
    """
    wanted: dict[str, tuple[int, ...]] = {}
    for p in km.pieces:
        if side == "disk":
            wanted[p.disk] = p.disk_shape
        else:
            wanted[p.memory] = km.memory_shapes[p.memory]
    for name, shape in wanted.items():
        got = shapes.get(name)
        if got is None:
            raise UnsupportedCheckpointError(
                f"{where}: no tensor {name!r}, which a {km.mapping} model of these sizes has",
                fqn=name,
            )
        if tuple(got) != shape:
            raise UnsupportedCheckpointError(
                f"{where}: {name!r} is {list(got)}, but the model's sizes give {list(shape)} "
                "(check --config and the run's args)",
                fqn=name,
            )


def _layer_count(shapes: Shapes, stacked: str) -> int | None:
    """Layers of the run: the stacked dim, or the per-layer keys' indices."""
    if stacked in shapes:
        return shapes[stacked][0]
    found = set()
    for name in shapes:
        if name.startswith(_LAYERS):
            head = name[len(_LAYERS) :].split(".", 1)[0]
            if head.isdigit():
                found.add(int(head))
    return len(found) if found and found == set(range(len(found))) else None


def _find(shapes: Shapes, suffix: str, stacked: bool) -> tuple[int, ...] | None:
    return shapes.get(_LAYERS + suffix if stacked else f"{_LAYERS}0.{suffix}")


def _moe_sizes(
    shapes: Shapes, args: Mapping[str, Any], stacked: bool, layers: int, where: str
) -> tuple[int, int]:
    """(experts per layer, each expert's hidden size) of an MoE run's tensors.

    Raises:
        UnsupportedCheckpointError: the router or the experts are missing or do not agree.
    """
    router = _find(shapes, moe.ROUTER, stacked)
    fc1 = _find(shapes, moe.EXPERT_FC1, stacked)
    fc2 = _find(shapes, moe.EXPERT_FC2, stacked)
    if router is None or fc1 is None or fc2 is None:
        raise UnsupportedCheckpointError(
            f"{where}: an MoE run without {_LAYERS}{moe.ROUTER}, {moe.EXPERT_FC1} and "
            f"{moe.EXPERT_FC2} as Megatron-core's SequentialMLP / TEGroupedMLP save them: "
            "not mapped"
        )
    experts = router[-2]
    if args.get("num_experts") not in (None, experts):
        raise UnsupportedCheckpointError(
            f"{where}: the router has {experts} experts but args.num_experts is "
            f"{args['num_experts']}"
        )
    rows = layers * experts if stacked else experts
    if fc1[0] != rows or fc1[1] % 2 or fc2[-1] != fc1[1] // 2:
        raise UnsupportedCheckpointError(
            f"{where}: {moe.EXPERT_FC1} is {list(fc1)} (layers and experts folded) and "
            f"{moe.EXPERT_FC2} {list(fc2)}, which {layers} layers of {experts} SwiGLU experts do "
            "not give",
            fqn=_LAYERS + moe.EXPERT_FC1,
        )
    return experts, fc1[1] // 2


def dims_from_run(
    shapes: Shapes, args: Mapping[str, Any], config: Mapping[str, Any] | None, where: str
) -> tuple[Dims, dict[str, str]]:
    """:class:`Dims` of a Megatron run's model tensors ``shapes`` (name -> shape; the stacked
    experts folded, :func:`.moe.fold_experts`), its ``args`` (:class:`~.layout.RunArgs` as a dict)
    and the HF ``config`` when given (it wins where both say), and the layer norms' Megatron
    names.

    Raises:
        UnsupportedCheckpointError: MLA, MoE parts or routing no mapped family has, no SwiGLU,
            or tensors this layout lacks.
        UsageError: the head count is nowhere, or the config's vocabulary exceeds the rows.

    Where the true vocabulary size is nowhere (no config; ``args.vocab_size`` None, as with a
    Hugging Face tokenizer) the padded rows are kept (:data:`PADDING_KEPT`).
    """
    refuse_family(shapes, where, with_moe=True)
    if args.get("multi_latent_attention"):
        raise UnsupportedCheckpointError(
            f"{where}: the run uses multi-latent attention (MLA); ckptools maps only "
            f"{', '.join(FAMILIES + moe.MOE_FAMILIES)} models to Hugging Face"
        )
    if config is not None:
        family_of(config, where, with_moe=True)
    stacked = _LAYERS + f"{_QKV}.weight" in shapes
    qkv = _find(shapes, f"{_QKV}.weight", stacked)
    fc1 = _find(shapes, f"{_FC1}.weight", stacked)
    is_moe = bool(args.get("num_experts")) or any(
        moe.ROUTER in name or "mlp.experts." in name for name in shapes
    )
    embedding = shapes.get("embedding.word_embeddings.weight")
    layers = _layer_count(shapes, _LAYERS + f"{_QKV}.weight")
    if is_moe and fc1 is not None:
        raise UnsupportedCheckpointError(
            f"{where}: the run has both dense MLPs ({_FC1}) and MoE layers (first dense layers "
            "or --moe-layer-freq): not mapped to Hugging Face yet"
        )
    if qkv is None or (fc1 is None and not is_moe) or embedding is None or not layers:
        raise UnsupportedCheckpointError(
            f"{where}: no {_LAYERS}{_QKV}.weight, {_FC1}.weight or embedding.word_embeddings: "
            "not a GPT model of Megatron-core's layer specs"
        )
    if args.get("swiglu") is False:
        raise UnsupportedCheckpointError(
            f"{where}: the run's MLP is not SwiGLU (args.swiglu false); Llama-family models need it"
        )
    experts, moe_ffn = 0, 0
    if is_moe:
        moe.refuse_routing(args, where)
        experts, moe_ffn = _moe_sizes(shapes, args, stacked, layers, where)
    cfg = config or {}
    heads = int(cfg.get("num_attention_heads") or args.get("num_attention_heads") or 0)
    groups = int(cfg.get("num_key_value_heads") or args.get("num_query_groups") or heads)
    vocab = int(cfg.get("vocab_size") or args.get("vocab_size") or 0)
    if not heads:
        raise UsageError(
            f"{where}: the number of attention heads is in neither the run's args nor a config; "
            "give the model's config.json with --config"
        )
    rows = qkv[-2]
    if rows % (heads + 2 * groups) or heads % groups:
        raise UnsupportedCheckpointError(
            f"{where}: linear_qkv has {rows} rows, which {heads} heads in {groups} query groups "
            "do not divide; check --config"
        )
    norms = FUSED_NORMS if _find(shapes, FUSED_NORMS["input"], stacked) else SEPARATE_NORMS
    dims = Dims(
        layers=layers, hidden=embedding[1], heads=int(heads), groups=int(groups),
        head_dim=rows // (heads + 2 * groups), ffn=fc1[-2] // 2 if fc1 is not None else
        int(args.get("ffn_hidden_size") or moe_ffn), vocab=vocab or embedding[0],
        padded_vocab=embedding[0], padding_kept=not vocab, tied="output_layer.weight" not in shapes,
        qkv_bias=_find(shapes, f"{_QKV}.bias", stacked) is not None,
        qk_norm=_find(shapes, "self_attention.q_layernorm.weight", stacked) is not None,
        stacked=stacked, experts=experts, moe_ffn=moe_ffn,
    )  # fmt: skip
    if dims.vocab > dims.padded_vocab:
        raise UsageError(
            f"{where}: the config's vocab_size {dims.vocab} exceeds the {dims.padded_vocab} "
            "embedding rows stored: --config names another model"
        )
    return dims, dict(norms)


def hf_config(d: Dims, args: Mapping[str, Any], config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The HF ``config.json`` of the model: ``config`` as given, else made from the run's args
    (Qwen3 where it has q/k norms, Qwen2 where QKV has a bias, else Llama)."""
    if config is not None:
        return dict(config)
    if d.experts:
        return moe.moe_config(d, args)
    family = "qwen3" if d.qk_norm else "qwen2" if d.qkv_bias else "llama"
    made = common_config(
        ARCHITECTURES[family], family, hidden=d.hidden, layers=d.layers, heads=d.heads,
        groups=d.groups, head_dim=d.head_dim, vocab=d.vocab, tied=d.tied, args=args,
    )  # fmt: skip
    made["intermediate_size"] = d.ffn
    if family == "llama":
        made["attention_bias"] = d.qkv_bias
        made["mlp_bias"] = False
    return made


def _agrees(d: Dims, config: Mapping[str, Any], where: str) -> None:
    """The config's family holds the tensors the run has (a QKV bias, q/k norms).

    Raises:
        UnsupportedCheckpointError: naming what the config's model lacks.
    """
    family = config.get("model_type")
    bias = family == "qwen2" or (family in ("llama", "mistral") and config.get("attention_bias"))
    if d.qkv_bias != bool(bias):
        has = "has" if d.qkv_bias else "has no"
        raise UnsupportedCheckpointError(
            f"{where}: the run {has} a QKV bias, which a {family} model of this config does "
            "not match: --config names another model"
        )
    if d.qk_norm != (family in ("qwen3", "qwen3_moe")):
        has = "has" if d.qk_norm else "has no"
        raise UnsupportedCheckpointError(
            f"{where}: the run {has} q/k layer norms, which a {family} model does not match: "
            "--config names another model"
        )


def to_hf(
    shapes: Shapes, args: Mapping[str, Any], config: Mapping[str, Any] | None, where: str
) -> tuple[KeyMap, dict[str, Any]]:
    """The pieces that cut a Megatron run's model tensors ``shapes`` into a Hugging Face
    model's, and that model's config (``config``, or made from the run's args).

    Raises:
        UnsupportedCheckpointError: a family this does not map, a tensor it does not know, or
            sizes that disagree.
        UsageError: what only a config says is missing (see :func:`dims_from_run`).
    """
    dims, norms = dims_from_run(shapes, args, config, where)
    made = hf_config(dims, args, config)
    moe.agrees(dims, made, args, where)
    _agrees(dims, made, where)
    km = keymap(dims, norms, str(made["model_type"]), padding=False)
    check_shapes(km, shapes, "memory", where)
    known = set(km.memory_shapes)
    for name in shapes:
        if name not in known:
            raise UnsupportedCheckpointError(
                f"{where}: {name!r} has no place in a {made['model_type']} model; ckptools "
                "maps only the tensors of Megatron-core's GPT layer specs (export the stored "
                "names with --select '*' --keep-in-memory-names)",
                fqn=name,
            )
    return km, made


def from_hf(
    shapes: Shapes, config: Mapping[str, Any], divisor: int, where: str
) -> tuple[KeyMap, Dims]:
    """The pieces that place a Hugging Face model's tensors ``shapes`` into Megatron's
    (stacked layers, fused QKV and fc1, vocabulary padded to a multiple of ``divisor``; an MoE
    model's experts as boxes of the stacked experts, layer and expert dims folded:
    :func:`.moe.fold_experts`).

    Raises:
        UnsupportedCheckpointError: a family this does not map, or a tensor missing or of
            another shape than the config gives it.
    """
    dims = dims_from_hf(config, shapes, divisor, where)
    km = keymap(dims, FUSED_NORMS, family_of(config, where, with_moe=True), padding=True)
    check_shapes(km, shapes, "disk", where)
    return km, dims
