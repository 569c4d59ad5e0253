"""``ckpt shard --to megatron`` of Hugging Face ``DeepseekV3ForCausalLM`` models: DeepSeek-V3-shaped
(multi-latent attention, a dense first layer, a shared expert, a sigmoid router with
``e_score_correction_bias`` and group-limited top-k) and dense MLA.

The HF side is transformers' own ``save_pretrained`` (``fixtures/megatron/hf_deepseek_v3``,
``hf_mla_dense``: seeded random init, the expert bias drawn too; ``hf_deepseek_v3_bf16``: the
first loaded in bf16, its router weight and expert bias float32 as DeepseekV3 keeps them); the
Megatron side is what real
Megatron-core 0.19.2 saves for those shapes (``deepseek_v3_ep2``, ``mla_dense_tp2``) and what
its ``load_checkpoint`` held after loading ckptools' output at another TP / EP
(``fixtures/megatron/generate.py check-load-mla``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.support.megatron_truth import (
    MEGATRON_PYTHON,
    MLA_LOW_RANK,
    assert_same_model,
    hf_tensors,
    megatron_check_load,
    model_entries,
)
from tests.support.megatron_truth import invoke as _invoke
from tests.support.megatron_truth import ok as _ok

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
#: HF fixture -> (Megatron's own save of that shape, the vocabulary divisor it padded with x TP)
HF_MLA = {
    "hf_deepseek_v3": ("deepseek_v3_ep2", 8),
    "hf_deepseek_v3_bf16": ("deepseek_v3_ep2_bf16", 8),
    "hf_mla_dense": ("mla_dense_tp2", 16),
}
#: the MLA / MoE args Megatron's own save records that the converted run must record alike
_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
         "num_query_groups", "kv_channels", "multi_latent_attention", "q_lora_rank",
         "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
         "rotary_interleaved", "qk_layernorm", "num_experts", "moe_ffn_hidden_size",
         "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
         "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
         "moe_router_num_groups", "moe_router_group_topk", "moe_shared_expert_intermediate_size",
         "moe_layer_freq", "moe_grouped_gemm", "untie_embeddings_and_output_weights",
         "params_dtype")  # fmt: skip
#: a bf16 DeepseekV3's router weight: float32 in HF (and as shard writes it), bf16 in Megatron's
#: own save (Float16Module); Megatron's load casts the stored float32 into its bf16 parameter
_ROUTER = "mlp.router.weight"


def _shard(hf: str, run: Path) -> None:
    divisor = str(HF_MLA[hf][1])
    _ok("shard", str(FIXTURES / hf), str(run), "--to", "megatron", "--world-size", "2",
        "--make-vocab-size-divisible-by", divisor)  # fmt: skip


@pytest.mark.parametrize("hf", sorted(HF_MLA))
def test_shard_writes_what_megatron_saves_and_comes_back_bit_exact(tmp_path: Path, hf: str) -> None:
    """The same model keys (per-layer ``decoder.layers.<i>.`` with experts ``[E, 2F, H]`` for
    DeepSeek-V3; stacked for dense MLA), shapes, dtypes, ``_extra_state`` objects and MLA / MoE
    args as Megatron-core's own save of that shape (but a bf16 model's router weight: written
    float32 as stored, which Megatron's own bf16 save holds in bf16); consolidated back, the
    very tensors ``save_pretrained`` wrote, dtypes included, and the same logits."""
    src, run, back = FIXTURES / hf, tmp_path / "megatron", tmp_path / "back"
    _shard(hf, run)
    ours, theirs = _ok("inspect", str(run)), _ok("inspect", str(FIXTURES / HF_MLA[hf][0]))
    mine, megatrons = model_entries(ours), model_entries(theirs)
    assert mine.keys() == megatrons.keys()
    for key, (dtype, shape) in megatrons.items():
        if dtype == "bfloat16" and key.endswith(_ROUTER):
            assert mine[key] == ("float32", shape), key
        else:
            assert mine[key] == (dtype, shape), key
    extra = {o["fqn"] for o in theirs["objects"] if "._extra_state/" in o["fqn"]}
    assert extra and extra == {o["fqn"] for o in ours["objects"] if "._extra_state/" in o["fqn"]}
    for key in _ARGS:
        assert ours["megatron"].get(key) == theirs["megatron"].get(key), key
    _ok("consolidate", str(run), str(back))
    assert_same_model(back, src)


#: HF fixture -> (the proof of Megatron-LM's load_checkpoint of what shard wrote, how it loaded)
PROOFS = {
    "hf_deepseek_v3": ("hf_deepseek_v3.proof_tp2sp_ep2.pt",
                       ["--tp", "2", "--sp", "--ep", "2", "--etp", "1"]),
    "hf_deepseek_v3_bf16": ("hf_deepseek_v3_bf16.proof_tp2sp_ep2.pt",
                            ["--tp", "2", "--sp", "--ep", "2", "--etp", "1", "--tol", "2e-2"]),
    "hf_mla_dense": ("hf_mla_dense.proof_tp2.pt", ["--tp", "2"]),
}  # fmt: skip
#: the logits tolerance of each proof: Megatron computes a bf16 model in bf16
_TOL = {"hf_deepseek_v3_bf16": 2e-2}
#: Megatron's module names of the MLA and MLP tensors -> HF's (mapped here, not by ckptools)
_AS_HF = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    **MLA_LOW_RANK,
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}


def _loaded_as_hf(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights Megatron held (global names, TP-gathered, every EP rank's experts) under the
    names ``save_pretrained`` writes for DeepseekV3."""
    vocab = 100
    out = {
        "model.embed_tokens.weight": model["embedding.word_embeddings.weight"][:vocab],
        "lm_head.weight": model["output_layer.weight"][:vocab],
        "model.norm.weight": model["decoder.final_layernorm.weight"],
    }
    for name, t in model.items():
        if not name.startswith("decoder.layers."):
            continue
        i, _, rest = name.removeprefix("decoder.layers.").partition(".")
        pre = f"model.layers.{i}."
        if rest in _AS_HF:
            out[pre + _AS_HF[rest]] = t
        elif rest.endswith("linear_fc1.weight"):
            gate, up = t.chunk(2)
            mlp = rest.removesuffix("linear_fc1.weight").replace("experts.local_experts.",
                                                                 "experts.")  # fmt: skip
            out[pre + mlp + "gate_proj.weight"], out[pre + mlp + "up_proj.weight"] = gate, up
        elif rest.endswith("linear_fc2.weight"):
            mlp = rest.removesuffix("linear_fc2.weight").replace("experts.local_experts.",
                                                                 "experts.")  # fmt: skip
            out[pre + mlp + "down_proj.weight"] = t
        else:
            raise AssertionError(name)
    return out


def _per_module(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torch's DCP read of a run under the names Megatron's loaded modules have: stacked layers
    unstacked, each layer's experts ``…local_experts.<e>.linear_fc1.weight``."""
    out: dict[str, torch.Tensor] = {}
    for key, t in stored.items():
        if not key.startswith("decoder.layers."):
            out[key] = t
            continue
        head, _, rest = key.removeprefix("decoder.layers.").partition(".")
        layers = [(int(head), rest, t)] if head.isdigit() else list(
            (i, key.removeprefix("decoder.layers."), t[i]) for i in range(t.shape[0])
        )  # fmt: skip
        for i, name, tensor in layers:
            if name.startswith("mlp.experts.experts."):
                fc = name.removeprefix("mlp.experts.experts.")
                for e in range(tensor.shape[0]):
                    out[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{fc}"] = tensor[e]
            else:
                out[f"decoder.layers.{i}.{name}"] = tensor
    return out


@pytest.mark.parametrize("hf", sorted(PROOFS))
def test_what_shard_writes_is_what_megatron_loaded(tmp_path: Path, hf: str) -> None:
    """``fixtures/megatron/<hf>.proof_*.pt``: the weights (and routers' expert bias) real
    Megatron-core 0.19.2 held after Megatron-LM's ``load_checkpoint`` (strict) of ``ckpt shard
    <hf> --to megatron`` at another TP / EP than it was written for (DeepSeek-V3 at TP 2 with
    sequence parallelism x EP 2, dense MLA at TP 2; gathered from every rank), whose logits
    matched transformers' within 1e-5 (2e-2 for the bf16 model, which Megatron computes in
    bf16). Those weights, named as HF's independently of ckptools, are the HF model's; what
    shard writes today, read by torch's DCP reader, is those bytes.

    A bf16 DeepseekV3's float32 router weight is written as stored, and Megatron held it in its
    bf16 parameter as that float32 rounded to bf16 (its load casts; the bias stays float32)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    proof = torch.load(FIXTURES / PROOFS[hf][0], weights_only=True)
    assert proof["max_abs_diff"] <= _TOL.get(hf, 1e-5)
    want = hf_tensors(FIXTURES / hf)
    loaded = _loaded_as_hf(proof["model"])
    assert loaded.keys() == want.keys()
    cast = set()
    for name, tensor in want.items():
        held = loaded[name]
        assert torch.equal(held, tensor.to(held.dtype)), name
        if held.dtype != tensor.dtype:
            assert (tensor.dtype, held.dtype) == (torch.float32, torch.bfloat16), name
            assert not torch.equal(held.float(), tensor), name  # it was rounded: a real cast
            cast.add(name)
    routers = {n for n, t in want.items() if n.endswith("mlp.gate.weight")}
    assert cast == (routers if "bf16" in hf else set())

    run = tmp_path / "megatron"
    _shard(hf, run)
    save = run / "iter_0000001"
    metadata = FileSystemReader(str(save)).read_metadata()
    stored = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
        if hasattr(m, "size")
    }
    dcp.load(stored, checkpoint_id=str(save), no_dist=True)
    written = _per_module(stored)
    assert written.keys() == proof["model"].keys()
    for name, held in proof["model"].items():
        if written[name].dtype != held.dtype:
            assert name.endswith(_ROUTER) and written[name].dtype == torch.float32, name
        assert torch.equal(written[name].to(held.dtype), held), name


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(MEGATRON_PYTHON), reason="no megatron-core venv")
@pytest.mark.parametrize("hf", sorted(PROOFS))
def test_megatron_loads_what_shard_writes_at_another_tp_ep(
    tmp_path: Path, hf: str, cached_output: Callable[..., Path]
) -> None:
    """fixtures/megatron/generate.py check-load-mla: Megatron-LM builds the model of the HF
    config at the TP / EP of ``PROOFS`` (ckptools wrote TP 1, EP 1), ``load_checkpoint``
    (strict) loads what ``shard --to megatron`` wrote, the MLA / MoE args it recorded are the
    ones its parser makes, and its logits are transformers' within 1e-5 (fp32; 2e-2 for
    ``hf_deepseek_v3_bf16``, whose float32 router weight it casts into its bf16 model). The
    verdict is kept across sessions under a key of every byte shard wrote (``cached_output``)."""
    run = tmp_path / "megatron"
    _shard(hf, run)
    verdict = megatron_check_load(cached_output, tmp_path, key=f"megatron-check-load-mla-{hf}",
                                  run=run, hf=FIXTURES / hf,
                                  command=["check-load-mla", *PROOFS[hf][1]])  # fmt: skip
    assert "args_differ={}" in verdict


def test_shard_refuses_what_megatron_computes_otherwise_by_name(tmp_path: Path) -> None:
    """Config keys Megatron's MLA or sigmoid router cannot honour as DeepseekV3 does, a plain
    q projection (no q low-rank), and a tensor in float32 in a bf16 model that DeepseekV3 does
    not keep in float32 (an attention weight; its router it does) are named; nothing is
    written."""
    src = FIXTURES / "hf_deepseek_v3"
    config = json.loads((src / "config.json").read_text())
    cases: list[tuple[dict[str, Any], str]] = [
        ({"rope_interleave": False}, "rope_interleave is false"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 40.0, "rope_theta": 1e4}},
         "rope is yarn-scaled"),
        ({"norm_topk_prob": False}, "norm_topk_prob is False with top-2"),
        ({"num_experts_per_tok": 4, "topk_group": 1, "n_group": 2, "n_routed_experts": 4},
         "scored by their top-2"),
    ]  # fmt: skip
    for i, (change, why) in enumerate(cases):
        given = tmp_path / f"config{i}.json"
        given.write_text(json.dumps({**config, **change}))
        out = tmp_path / f"out{i}"
        result = _invoke("shard", str(src), str(out), "--to", "megatron", "--config", str(given))
        assert result.exit_code != 0 and why in result.output, (change, result.output)
        assert not out.exists()
    plain_q = tmp_path / "plain_q"  # DeepSeek-V2-Lite's q_proj: save_pretrained's own
    made = transformers.DeepseekV3Config.from_dict({**config, "q_lora_rank": None})
    transformers.DeepseekV3ForCausalLM(made).save_pretrained(plain_q)
    result = _invoke("shard", str(plain_q), str(tmp_path / "out-q"), "--to", "megatron")
    assert result.exit_code != 0 and "q_lora_rank is null" in result.output, result.output
    assert not (tmp_path / "out-q").exists()
    bf16 = FIXTURES / "hf_deepseek_v3_bf16"  # save_pretrained's: the router float32
    model = tmp_path / "bf16"
    model.mkdir()
    (model / "config.json").write_text((bf16 / "config.json").read_text())
    made = hf_tensors(bf16)
    name = "model.layers.1.self_attn.o_proj.weight"
    made[name] = made[name].float()
    save_file(made, str(model / "model.safetensors"), metadata={"format": "pt"})
    result = _invoke("shard", str(model), str(tmp_path / "out-bf16"), "--to", "megatron")
    assert result.exit_code != 0, result.output
    assert f"'{name}' is float32 in a bfloat16 model" in result.output, result.output
    assert not (tmp_path / "out-bf16").exists()
