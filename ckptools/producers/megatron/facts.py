"""What ``inspect`` shows of a Megatron-core run: its facts, read from the manifest
(``inspect --json``'s ``"megatron"``), and the text lines rendered from them.

Declared by the family's package (``FACTS``) and found through
:func:`ckptools.producers.registry.inspected`: the verb and the CLI never name the producer.
Imports nothing beyond the manifest: asking costs no reader.
"""

from __future__ import annotations

from typing import Any

from ckptools.core.manifest import Manifest
from ckptools.producers.megatron import DETAILS_KEY, PARTS_KEY

#: ``inspect --json``'s key of these facts (the run's facts' key in ``Manifest.details``)
KEY = DETAILS_KEY


def facts(m: Manifest) -> dict[str, Any] | None:
    """A Megatron run's facts and what its entries are; None for any other checkpoint."""
    found = m.details.get(KEY)
    if found is None:
        return None
    return {**found, "parts": dict(m.details.get(PARTS_KEY) or {})}


def lines(mg: dict[str, Any]) -> list[str]:
    """``inspect``'s lines of the facts :func:`facts` gave (read back from its JSON)."""

    def shown(key: str) -> str:
        return "?" if mg.get(key) is None else str(mg[key])

    heads = f"{shown('num_attention_heads')} heads"
    if not mg.get("multi_latent_attention"):  # MLA's heads share no key/value groups
        heads += f" in {shown('num_query_groups')} query groups"
    vocab = (
        f"vocab {shown('padded_vocab_size')} rows, padded (the true size is in the model's "
        "config.json, not in the run's args: kept padded without --config)"
        if mg.get("vocab_size") is None
        else f"vocab {mg['vocab_size']} (padded {shown('padded_vocab_size')})"
    )
    parts = ", ".join(f"{k} {v}" for k, v in sorted(mg["parts"].items()))
    ep = f" x EP {shown('expert_parallel')}" if mg.get("num_experts") else ""
    sharding = str(mg["optimizer_sharding"])
    chained = mg.get("chained_optimizers")
    if chained:
        each = ", ".join(f"chained_{i} {s}" for i, s in enumerate(chained))
        sharding = f"ChainedOptimizer of {len(chained)} ({each})"
    out = [
        f"  megatron: iteration {shown('iteration')}, TP {shown('tensor_parallel')} x PP "
        f"{shown('pipeline_parallel')} x DP {shown('data_parallel')}{ep}, "
        f"{shown('params_dtype')}",
        f"  model: {shown('num_layers')} layers, hidden {shown('hidden_size')}, ffn "
        f"{shown('ffn_hidden_size')}, {heads}, {vocab}",
    ]
    if mg.get("multi_latent_attention"):
        out.append(f"  {mla_line(mg)}")
    if mg.get("num_experts"):
        out.append(f"  {moe_line(mg)}")
    out.append(f"  optimizer sharding: {sharding}; entries: {parts}")
    return out


def router_kind(mg: dict[str, Any]) -> str:
    """The router in words: its score function, where the softmax is taken, the expert bias."""
    score = mg.get("moe_router_score_function") or "softmax"
    if score == "softmax":
        kind = (
            "softmax over all experts"
            if mg.get("moe_router_pre_softmax")
            else ("softmax over the top-k")
        )
    else:
        kind = str(score)
    if mg.get("moe_router_enable_expert_bias"):
        kind += " with expert bias"
    if mg.get("moe_router_num_groups"):
        kind += f", {mg['moe_router_num_groups']} groups top-{mg.get('moe_router_group_topk')}"
    scale = mg.get("moe_router_topk_scaling_factor")
    if scale not in (None, 1, 1.0):
        kind += f", scaling {scale}"
    return kind


def mla_line(mg: dict[str, Any]) -> str:
    """Multi-latent attention's sizes in one line (per head: q/k "nope" + rope dims, v)."""

    def shown(key: str) -> str:
        return "none" if mg.get(key) is None else str(mg[key])

    return (
        f"mla: q low-rank {shown('q_lora_rank')}, kv low-rank {shown('kv_lora_rank')}, q/k "
        f"heads {shown('qk_head_dim')} + rope {shown('qk_pos_emb_head_dim')}, v heads "
        f"{shown('v_head_dim')}, rope type {mg.get('rope_type') or 'rope'}"
    )


def moe_line(mg: dict[str, Any]) -> str:
    """The MoE facts in one line: experts, top-k, router, expert size, EP / ETP, shared experts."""

    def shown(key: str) -> str:
        return "?" if mg.get(key) is None else str(mg[key])

    shared = mg.get("moe_shared_expert_intermediate_size")
    freq = mg.get("moe_layer_freq")
    layers = "" if freq in (None, 1) else f", MoE layers {freq}"
    return (
        f"moe: {mg['num_experts']} experts, top-{shown('moe_router_topk')}, router "
        f"{router_kind(mg)}, expert ffn {shown('moe_ffn_hidden_size')}, EP "
        f"{shown('expert_parallel')} x expert TP {shown('expert_tensor_parallel')}, "
        f"shared experts {f'ffn {shared}' if shared else 'none'}{layers}"
    )
