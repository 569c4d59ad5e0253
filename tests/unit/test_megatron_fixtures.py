"""The Megatron-core fixtures are what ``fixtures/megatron/generate.py`` wrote, and their ground
truth is readable without Megatron and consistent with itself and with transformers.

Megatron is never imported here: the truth files are plain tensors, ints and strings
(``torch.load(weights_only=True)``); the layout is documented in ``fixtures/megatron/README.md``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.megatron_truth import MLA_LOW_RANK

HERE = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
SUMS = HERE / "SHA256SUMS"
NOT_FIXTURES = {"SHA256SUMS", "generate.py", "README.md", "make_venv.sh"}
CASES = sorted(p.name[: -len(".truth.pt")] for p in HERE.glob("*.truth.pt"))
# optimizer framing and per-rank RNG state: 0.4 to 0.65 MB; the 4-rank MoE run 0.93 MB
MAX_DIR_BYTES = 1000 * 1024
# 15 runs (issue 38 added MLA, DeepSeek-V3 also in bf16, and Mixtral with PP)
MAX_ALL_BYTES = 14 * 1024 * 1024


def _listed() -> dict[str, str]:
    listed: dict[str, str] = {}
    for line in SUMS.read_text().splitlines():
        digest, _, rel = line.partition("  ")
        assert len(digest) == 64 and rel, f"malformed SHA256SUMS line: {line!r}"
        assert rel not in listed, f"{rel} listed twice"
        listed[rel] = digest
    return listed


def _on_disk() -> set[str]:
    found = set()
    for dirpath, dirs, files in os.walk(HERE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), HERE).replace(os.sep, "/")
            if name not in NOT_FIXTURES and not name.endswith(".pyc"):
                found.add(rel)
    return found


def _truth(case: str) -> dict[str, Any]:
    truth: dict[str, Any] = torch.load(HERE / f"{case}.truth.pt", weights_only=True)
    return truth


@pytest.mark.parametrize("rel", sorted(_listed()))
def test_listed_file_matches_its_sha256(rel: str) -> None:
    path = HERE / rel
    assert path.is_file(), f"fixtures/megatron/{rel} is listed in SHA256SUMS but missing"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == _listed()[rel], (
        f"fixtures/megatron/{rel} changed; these files freeze what Megatron-core wrote: restore "
        "it, or regenerate on purpose with fixtures/megatron/generate.py (Megatron venv)"
    )


def test_every_fixture_file_is_listed_and_the_set_stays_small() -> None:
    unlisted = sorted(_on_disk() - set(_listed()))
    assert not unlisted, f"not in fixtures/megatron/SHA256SUMS: {unlisted}"
    assert CASES, "no *.truth.pt under fixtures/megatron"
    total = 0
    for case in CASES:
        run = HERE / case
        assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "10", case
        size = sum(f.stat().st_size for f in run.rglob("*") if f.is_file())
        assert 0 < size < MAX_DIR_BYTES, f"fixtures/megatron/{case} is {size} bytes"
        total += size + (HERE / f"{case}.truth.pt").stat().st_size
    assert total < MAX_ALL_BYTES, f"fixtures/megatron holds {total} bytes"


@pytest.mark.parametrize("case", CASES)
def test_truth_loads_without_megatron_and_is_consistent(case: str) -> None:
    truth = _truth(case)
    model = truth["model"]
    assert truth["format"] == "megatron-truth/1" and truth["case"] == case
    assert set(truth["masters"]) == set(truth["exp_avg"]) == set(truth["exp_avg_sq"]) == set(model)
    assert set(truth["checkpoint_keys"]) == set(model)
    grouped = [name for group in truth["param_groups"] for name in group["params"]]
    assert sorted(grouped) == sorted(model), "every parameter in exactly one group"
    bf16 = truth["params_dtype"] == "torch.bfloat16"
    for name, weight in model.items():
        master = truth["masters"][name]
        assert master.dtype == torch.float32 and master.shape == weight.shape, name
        assert weight.dtype == (torch.bfloat16 if bf16 else torch.float32), name
        # after a step Megatron copies the fp32 masters into the model (a cast for bf16)
        assert torch.equal(master.to(weight.dtype), weight), name
        assert truth["exp_avg"][name].abs().sum() > 0 and truth["exp_avg_sq"][name].min() >= 0
    assert truth["optimizer_step"] == truth["iteration"] == 10
    assert model["embedding.word_embeddings.weight"].shape[0] == truth["padded_vocab_size"]
    assert truth["true_vocab_size"] < truth["padded_vocab_size"]
    config = json.loads(truth["hf_config"])
    assert config["vocab_size"] == truth["true_vocab_size"]
    ids = truth["input_ids"]
    assert truth["logits"].shape == (1, ids.shape[1], truth["padded_vocab_size"])
    # one DP group (and one set of optimizer.distributed.dp_group_idx_<i> keys) per TP x PP place
    places = {(rank["tp"], rank["pp"]): rank["dp_group_idx"] for rank in truth["ranks"]}
    assert sorted(places.values()) == list(range(truth["tp"] * truth["pp"]))
    if truth.get("num_experts"):
        _check_experts(truth)
    for rank in truth["ranks"]:
        for per_gbuf in rank["per_bucket_numel"]:
            for dtype_key, numels in per_gbuf.items():
                assert dtype_key.startswith("(torch.") and all(n % 64 == 0 for n in numels)
        for buffer in rank["buffers"]:
            assert all(start % 64 == 0 for _, start, _, _ in buffer["params"]), "64-alignment"
            if truth["dp"] > 1 and not truth.get("num_experts"):
                # the dense DP runs exist to cover a parameter cut between two ranks
                (bucket,) = buffer["buckets"]
                cut = bucket["offset"] + bucket["numel"] // truth["dp"]
                assert any(start < cut < end for _, start, end, _ in buffer["params"]), case


def _check_experts(truth: dict[str, Any]) -> None:
    """An MoE run's truth holds every expert of every layer, gathered from every EP rank (not
    rank 0's alone), each expert's state from the optimizer that holds it."""
    model, experts, ep = truth["model"], truth["num_experts"], truth["ep"]
    config = json.loads(truth["hf_config"])
    dense = config.get("first_k_dense_replace") or 0  # DeepSeek-V3: dense first layers
    for i in range(dense, config["num_hidden_layers"]):
        for e in range(experts):
            for fc in ("linear_fc1", "linear_fc2"):
                name = f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{fc}.weight"
                assert name in model, name
                # layers that differ are saved per layer, not stacked
                key = f"decoder.layers.{i}." if dense else "decoder.layers."
                key += f"mlp.experts.experts.{fc}.weight"
                assert truth["checkpoint_keys"][name] == key
    assert {rank["ep"] for rank in truth["ranks"]} == set(range(ep))
    if ep > 1:  # a ChainedOptimizer: dense, then experts (one dp_group_idx per expert
        # TP x EP x PP: the rank in the expert model-parallel group)
        for rank in truth["ranks"]:
            assert len(rank["chained"]) == 2
        idx = {rank["chained"][1]["dp_group_idx"] for rank in truth["ranks"]}
        assert idx == set(range(ep * truth["tp"] * truth["pp"]))
        assert {g["chained"] for g in truth["param_groups"]} == {0, 1}


#: multi-latent attention's tensors (local spec: separate latent norms) -> DeepseekV3's
MLA_NAMES = {"self_attention.linear_q_proj.weight": "self_attn.q_proj.weight", **MLA_LOW_RANK}


def _hf_state_dict(truth: dict[str, Any], config: Any) -> dict[str, torch.Tensor]:
    """Megatron's names and fused layouts as transformers' Llama/Qwen2 keys: an independent
    restatement of the layouts README.md documents, to prove the truth's config and logits
    belong together (ckptools' own conversion is tested against these files elsewhere)."""
    m, vocab, hidden = truth["model"], config.vocab_size, config.hidden_size
    groups, d = config.num_key_value_heads, config.head_dim or 1
    q_rows = config.num_attention_heads // groups * d
    out = {
        "model.embed_tokens.weight": m["embedding.word_embeddings.weight"][:vocab],
        "model.norm.weight": m["decoder.final_layernorm.weight"],
    }
    if "output_layer.weight" in m:
        out["lm_head.weight"] = m["output_layer.weight"][:vocab]
    for i in range(config.num_hidden_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = m[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = m[src + "pre_mlp_layernorm.weight"]
        for suffix in ("weight", "bias"):
            qkv = m.get(f"{src}self_attention.linear_qkv.{suffix}")
            if qkv is None:
                continue
            per_group = qkv.reshape(groups, q_rows + 2 * d, -1)
            parts = (per_group[:, :q_rows], per_group[:, q_rows : q_rows + d], per_group[:, -d:])
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                shape = (-1, hidden) if suffix == "weight" else (-1,)
                out[f"{dst}self_attn.{proj}.{suffix}"] = part.reshape(shape)
        out[dst + "self_attn.o_proj.weight"] = m[src + "self_attention.linear_proj.weight"]
        if src + "self_attention.linear_kv_down_proj.weight" in m:
            # multi-latent attention: each projection is HF's by another name, the rope dims
            # where HF's rope_interleave=True expects them (Megatron's MLA rope de-interleaves)
            for megatron, hf in MLA_NAMES.items():
                if src + megatron in m:
                    out[dst + hf] = m[src + megatron]
        elif src + "self_attention.q_layernorm.weight" in m:
            out[dst + "self_attn.q_norm.weight"] = m[src + "self_attention.q_layernorm.weight"]
            out[dst + "self_attn.k_norm.weight"] = m[src + "self_attention.k_layernorm.weight"]
        if src + "mlp.router.weight" in m:
            # transformers 5 holds the experts fused in memory: [E, 2F, H] (each expert's gate
            # rows, then its up rows, as Megatron's linear_fc1) and [E, H, F]; the router is gate
            experts = range(truth["num_experts"])
            fc = src + "mlp.experts.local_experts.{}.linear_fc{}.weight"
            out[dst + "mlp.gate.weight"] = m[src + "mlp.router.weight"]
            fc1 = [m[fc.format(e, 1)] for e in experts]
            out[dst + "mlp.experts.gate_up_proj"] = torch.stack(fc1)
            out[dst + "mlp.experts.down_proj"] = torch.stack([m[fc.format(e, 2)] for e in experts])
            bias = truth.get("buffers", {}).get(src + "mlp.router.expert_bias")
            if bias is not None:  # DeepSeek-V3: the sigmoid router's expert bias
                out[dst + "mlp.gate.e_score_correction_bias"] = bias
            shared = src + "mlp.shared_experts.linear_fc{}.weight"
            if shared.format(1) in m:
                gate, up = m[shared.format(1)].chunk(2)
                out[dst + "mlp.shared_experts.gate_proj.weight"] = gate
                out[dst + "mlp.shared_experts.up_proj.weight"] = up
                out[dst + "mlp.shared_experts.down_proj.weight"] = m[shared.format(2)]
            continue
        gate, up = m[src + "mlp.linear_fc1.weight"].chunk(2)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
        out[dst + "mlp.down_proj.weight"] = m[src + "mlp.linear_fc2.weight"]
    return out


@pytest.mark.parametrize("case", CASES)
def test_transformers_with_the_truth_weights_gives_megatrons_logits(case: str) -> None:
    transformers = pytest.importorskip("transformers")
    truth = _truth(case)
    raw = json.loads(truth["hf_config"])
    config = transformers.AutoConfig.for_model(raw["model_type"]).from_dict(raw)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    missing, unexpected = model.load_state_dict(
        {k: v.float() for k, v in _hf_state_dict(truth, config).items()}, strict=False
    )
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert set(missing) <= tied and not unexpected, (missing, unexpected)
    with torch.no_grad():
        logits = model(truth["input_ids"]).logits
    expected = truth["logits"][..., : config.vocab_size]
    # fp32 runs agree to rounding; the bf16 run's Megatron forward computes in bf16 (1.6e-3)
    tolerance = 1e-2 if truth["params_dtype"] == "torch.bfloat16" else 1e-5
    assert (logits - expected).abs().max().item() < tolerance
