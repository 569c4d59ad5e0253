"""``shard --to megatron``: the HF model as Megatron-core saves it, planned as one DCP save of a
run directory. Reached through the registry's write targets
(:data:`ckptools.producers.registry.WRITE_TARGETS`); ``ckpt shard`` reads the source, finds its
config and writes what this plans."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckptools.core.manifest import Chunk, Manifest, TensorEntry
from ckptools.engine.converted import merge_source
from ckptools.errors import UnsupportedCheckpointError, UsageError
from ckptools.formats import torch_archive
from ckptools.plan.dcp import Archived, DcpPlan, plan_dcp
from ckptools.producers.megatron import layout, mla, mla_shard, moe, plan

#: what the model's ``config.json`` gives the writer (shown when none is found or it misfits)
CONFIG_NEEDED = "Megatron's sizes and the true vocabulary come from it"
#: the source is a whole model; an error tail for one that is not
REFUSED = "is already sharded; consolidate it first"


def check_options(make_vocab_size_divisible_by: int) -> None:
    """Refuse options this writer cannot honour, before anything is read."""
    if make_vocab_size_divisible_by < 1:
        raise UsageError(
            f"--make-vocab-size-divisible-by {make_vocab_size_divisible_by}: must be at least 1"
        )


@dataclass(frozen=True)
class Planned:
    """One target save, planned: written into ``out/sub`` with ``made`` (the run's markers)."""

    sub: str
    source: Manifest
    plan: DcpPlan
    notes: list[str]
    made: dict[str, bytes]
    fingerprint_options: dict[str, Any]


def planned(
    manifest: Manifest,
    tensors: Mapping[str, str],
    cfg: Mapping[str, Any],
    src: str,
    world_size: int,
    make_vocab_size_divisible_by: int,
) -> Planned:
    """The HF model ``tensors`` (name -> FQN of ``manifest``) of ``src`` as Megatron-core saves
    it: a run directory with ``latest_checkpointed_iteration.txt`` and ``iter_0000001/`` (the
    DCP with Megatron's names, stacked layers, fused QKV and fc1, padded vocabulary,
    ``common_state``, and ``metadata.json``), its files split over ``world_size`` ranks.

    An MoE model's experts (Mixtral, Qwen3-MoE) go into the stacked ``[L, E, 2F, H]`` /
    ``[L, E, H, F]`` expert tensors: each HF expert tensor's stored bytes placed as one box
    (:func:`_unfolded`), never read into memory. A DeepSeek-V3 model (multi-latent attention,
    dense first layers, shared experts, a sigmoid router with expert bias) is placed as
    :mod:`.mla_shard` describes: per-layer keys, each MoE layer's experts ``[E, ...]``."""
    divisor = make_vocab_size_divisible_by
    shapes = {n: manifest.tensors[f].shape for n, f in tensors.items()}
    family_args: dict[str, Any] = {}
    if cfg.get("model_type") == mla.FAMILY:
        dtypes = {n: manifest.tensors[f].dtype for n, f in tensors.items()}
        keymap, dims, family_args, extra = mla_shard.from_hf(shapes, dtypes, cfg, divisor, src)
    else:
        keymap, dims = plan.from_hf(shapes, cfg, divisor, src)
        if dims.experts:
            family_args = moe.run_args(dims, cfg, src)
            extra = moe.extra_states(dims.layers, dims.experts)
        else:
            extra = layout.extra_states(dims.layers)
    source, names = merge_source(manifest, dict(tensors), keymap)
    if dims.experts:
        source = _unfolded(source, names, moe.folded_experts(keymap.memory_shapes), dims)
    dtype = source.tensors[names["embedding.word_embeddings.weight"]].dtype
    args = converted_args(dims, dtype)
    args.update(make_vocab_size_divisible_by=divisor, layernorm_epsilon=cfg.get("rms_norm_eps"),
                rotary_base=plan.rope_theta(cfg),
                max_position_embeddings=cfg.get("max_position_embeddings"))  # fmt: skip
    args.update(family_args)
    common = Archived(torch_archive.pickled_archive(run_namespace(args)))
    values: dict[str, Any] = {layout.COMMON_STATE: common, **extra}
    paths = {n: (n,) for n in (*names, *values)}
    dcp_plan = plan_dcp(source, world_size, names, paths, objects=[], values=values)
    notes = [
        *manifest.notes,
        f"{keymap.mapping}: " + "; ".join(keymap.rules),
        f"vocabulary {dims.vocab} padded to {dims.padded_vocab} rows (a multiple of {divisor}; "
        "Megatron pads to --make-vocab-size-divisible-by x TP: pass that product for TP > 1)",
    ]
    return Planned(
        sub=layout.iteration_dir_name(layout.CONVERTED_ITERATION),
        source=source,
        plan=dcp_plan,
        notes=notes,
        made=layout.marker_files(),
        fingerprint_options={"to": "megatron", "divisor": divisor},
    )


def _unfolded(
    source: Manifest, names: dict[str, str], folded: Mapping[str, tuple[int, ...]], dims: Any
) -> Manifest:
    """``source`` with each stacked expert tensor of ``folded`` (memory name -> folded shape
    ``[L*E, ...]``) in Megatron's shape ``[L, E, ...]``: the placed HF chunks re-boxed, the
    reverse of :func:`ckptools.producers.megatron.converted._fold`.

    Raises:
        UnsupportedCheckpointError: a placed chunk spans experts of two layers (no HF tensor
            holds one).
    """
    tensors = dict(source.tensors)
    experts = dims.experts
    for name, shape in folded.items():
        entry = tensors[names[name]]
        chunks = []
        for c in entry.chunks:
            row, count = c.offsets[0], c.sizes[0]
            if row % experts + count > experts:
                raise UnsupportedCheckpointError(
                    f"{name}: a source chunk holds rows {row}..{row + count} of the folded "
                    f"experts, across two layers of {experts} experts; not written",
                    fqn=name,
                )
            strides = c.strides
            if strides is not None:
                strides = (strides[0] * experts, *strides)
            chunks.append(_reboxed(c, experts, strides))
        unfolded = (dims.layers, experts, *shape[1:])
        tensors[entry.fqn] = TensorEntry(entry.fqn, entry.dtype, unfolded, tuple(chunks))
    return replace(source, tensors=tensors)


def _reboxed(c: Chunk, experts: int, strides: tuple[int, ...] | None) -> Chunk:
    row, count = c.offsets[0], c.sizes[0]
    return c._replace(
        offsets=(row // experts, row % experts, *c.offsets[1:]),
        sizes=(1, count, *c.sizes[1:]),
        strides=strides,
    )


def run_namespace(args: Mapping[str, Any]) -> bytes:
    """The pickle of ``torch.save``'s ``[common_state]`` for a converted model: the model's
    ``args`` as the ``argparse.Namespace`` Megatron-LM keeps, the checkpoint version and
    iteration (what ``load_checkpoint`` reads; Megatron admits a ``Namespace`` on load)."""
    import argparse
    import pickle

    common = {
        "args": argparse.Namespace(**args),
        "checkpoint_version": layout.CHECKPOINT_VERSION,
        "iteration": layout.CONVERTED_ITERATION,
    }
    return pickle.dumps([common], protocol=2)


def converted_args(d: Any, params_dtype: str) -> dict[str, Any]:
    """The Megatron-LM ``args`` of a model of sizes ``d`` (:class:`.plan.Dims`) that a converted
    checkpoint records: what ``--use-checkpoint-args`` would read back."""
    return {
        "num_layers": d.layers,
        "hidden_size": d.hidden,
        "ffn_hidden_size": d.ffn,
        "num_attention_heads": d.heads,
        "group_query_attention": d.groups != d.heads,
        "num_query_groups": d.groups,
        "kv_channels": d.head_dim,
        "vocab_size": d.vocab,
        "padded_vocab_size": d.padded_vocab,
        "untie_embeddings_and_output_weights": not d.tied,
        "normalization": "RMSNorm",
        "swiglu": True,
        "position_embedding_type": "rope",
        "add_bias_linear": False,
        "add_qkv_bias": d.qkv_bias,
        "qk_layernorm": d.qk_norm,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "bf16": params_dtype == "bfloat16",
        "fp16": params_dtype == "float16",
        "ckpt_format": layout.BACKEND,
        "iteration": layout.CONVERTED_ITERATION,
    }
