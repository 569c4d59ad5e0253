"""Megatron-core multi-latent attention runs to Hugging Face ``DeepseekV3ForCausalLM``:
consolidate, inspect, diff, and what is refused by name.

The Megatron side is real Megatron-core 0.19.2 (``fixtures/megatron/``: ``deepseek_v3_ep2``,
MLA with a dense first layer, a shared expert and a sigmoid router with expert bias and groups
at EP 2, and ``deepseek_v3_ep2_bf16``, the same run in bf16; ``mla_dense_tp2``, MLA with dense
MLPs at TP 2), with the truth gathered from every rank and Megatron's logits; the Hugging Face
side is transformers' ``save_pretrained`` (what the directory must be, name for name and dtype
for dtype) and ``from_pretrained`` (whose logits must be Megatron's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from ckptools.producers.megatron import mla
from tests.support.megatron_truth import (
    MLA_CASES,
    MLA_LOW_RANK,
    assert_diff_finds,
    hf_tensors,
    saved_by_transformers,
)
from tests.support.megatron_truth import config_file as _config_file
from tests.support.megatron_truth import invoke as _invoke
from tests.support.megatron_truth import ok as _ok
from tests.support.megatron_truth import truth as _truth

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
CASES = MLA_CASES
BF16 = "deepseek_v3_ep2_bf16"
#: what DeepseekV3 keeps in float32 whatever its dtype (transformers'
#: ``_keep_in_fp32_modules_strict``), restated here
KEPT_FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
#: logits of from_pretrained (fp32) against Megatron's own forward: an fp32 run agrees to float
#: rounding; the bf16 run computed in bf16
FP32_TOL, BF16_TOL = 1e-5, 2e-2
#: Megatron MLA -> DeepseekV3 names (local spec), restated independently of ckptools
ATTENTION = {
    **MLA_LOW_RANK,
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}


def _in_memory(truth: dict[str, Any], config: Any, which: str = "model") -> dict[str, torch.Tensor]:
    """The truth's model (or its optimizer's ``masters``, ``exp_avg``, ``exp_avg_sq``; the expert
    bias is a buffer: the model's) as transformers 5 holds DeepseekV3 in memory (experts fused
    ``gate_up_proj`` [E, 2F, H] and ``down_proj`` [E, H, F]), mapped from the documented
    layouts."""
    m, vocab = truth[which], config.vocab_size
    out = {
        "model.embed_tokens.weight": m["embedding.word_embeddings.weight"][:vocab],
        "model.norm.weight": m["decoder.final_layernorm.weight"],
        "lm_head.weight": m["output_layer.weight"][:vocab],
    }
    for i in range(config.num_hidden_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for megatron, hf in ATTENTION.items():
            out[dst + hf] = m[src + megatron]
        shared = src + "mlp.shared_experts.linear_fc{}.weight"
        if src + "mlp.router.weight" not in m:
            gate, up = m[src + "mlp.linear_fc1.weight"].chunk(2)
            out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
            out[dst + "mlp.down_proj.weight"] = m[src + "mlp.linear_fc2.weight"]
            continue
        fc = src + "mlp.experts.local_experts.{}.linear_fc{}.weight"
        experts = range(truth["num_experts"])
        out[dst + "mlp.gate.weight"] = m[src + "mlp.router.weight"]
        out[dst + "mlp.gate.e_score_correction_bias"] = truth["buffers"][
            src + "mlp.router.expert_bias"
        ]
        out[dst + "mlp.experts.gate_up_proj"] = torch.stack([m[fc.format(e, 1)] for e in experts])
        out[dst + "mlp.experts.down_proj"] = torch.stack([m[fc.format(e, 2)] for e in experts])
        gate, up = m[shared.format(1)].chunk(2)
        out[dst + "mlp.shared_experts.gate_proj.weight"] = gate
        out[dst + "mlp.shared_experts.up_proj.weight"] = up
        out[dst + "mlp.shared_experts.down_proj.weight"] = m[shared.format(2)]
    return {k: v.contiguous() for k, v in out.items()}


def _saved_by_transformers(
    tmp_path: Path, case: str, which: str = "model"
) -> dict[str, torch.Tensor]:
    """``save_pretrained`` of the model holding the truth's ``which``: in the run's dtype for
    the model (a bf16 DeepseekV3 keeps its router in float32: the bf16 weights widened into
    it), in float32 for the masters and moments."""
    truth = _truth(case)
    raw = json.loads(truth["hf_config"])
    config = transformers.AutoConfig.for_model(raw["model_type"]).from_dict(raw)
    bf16 = which == "model" and "bfloat16" in truth["params_dtype"]
    state = _in_memory(truth, config, which)
    return saved_by_transformers(config, state, torch.bfloat16 if bf16 else torch.float32,
                                 tmp_path / f"save_pretrained_{which}")  # fmt: skip


def _logits_gap(out: Path, truth: dict[str, Any]) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = model(truth["input_ids"]).logits
    megatron = truth["logits"][..., : truth["true_vocab_size"]].float()
    return float((logits - megatron).abs().max().item())


def _tol(truth: dict[str, Any]) -> float:
    return BF16_TOL if "bfloat16" in truth["params_dtype"] else FP32_TOL


@pytest.mark.parametrize("case", CASES)
def test_consolidate_writes_what_save_pretrained_writes_and_megatrons_logits(
    tmp_path: Path, case: str
) -> None:
    truth = _truth(case)
    out = tmp_path / "hf"
    _ok(
        "consolidate", str(FIXTURES / case), str(out), "--config", str(_config_file(tmp_path, case))
    )
    ours, theirs = hf_tensors(out), _saved_by_transformers(tmp_path, case)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    assert json.loads((out / "config.json").read_text()) == json.loads(truth["hf_config"])
    assert _logits_gap(out, truth) < _tol(truth)


@pytest.mark.parametrize("case", CASES[:2])
def test_the_optimizer_state_placed_in_the_buckets_is_what_megatron_held(case: str) -> None:
    """Every parameter's fp32 master, exp_avg and exp_avg_sq, read from the buckets where
    ckptools places MLA, shared experts and dense first layers (the dense part of the
    ChainedOptimizer at EP 2; TP 2 splitting the down projections too), is the truth's bit for
    bit; the router's expert bias, a buffer, has none."""
    from ckptools.producers import read_manifest
    from ckptools.producers.megatron import masters
    from tests.integration.test_megatron_optimizer_state import TRUTH_SECTIONS, _read

    truth = _truth(case)
    manifest = read_manifest(str(FIXTURES / case))
    opt = masters.read_optimizer(manifest)
    assert opt is not None and opt.step == truth["optimizer_step"]
    root = Path(manifest.data_dir())
    for kind, section in TRUTH_SECTIONS.items():
        values = {fqn: _read(root, e) for fqn, e in opt.state[kind].items()}
        assert not [f for f in values if f.endswith("expert_bias")]
        for name, want in truth[section].items():
            key, parts = truth["checkpoint_keys"][name], name.split(".")
            got = values[key]
            if name.startswith("decoder.layers.") and not key.split(".")[2].isdigit():  # stacked
                got = got[int(parts[2])]
            if ".local_experts." in name:  # [E, ...] of the layer
                got = got[int(parts[parts.index("local_experts") + 1])]
            assert got.tobytes() == want.numpy().tobytes(), (kind, name)


@pytest.mark.parametrize("case", CASES)
def test_consolidate_masters_is_what_save_pretrained_writes_of_the_masters(
    tmp_path: Path, case: str
) -> None:
    """``--masters``: every tensor is the fp32 master the optimizer (part) holding it kept, as
    ``save_pretrained`` names it; the expert bias (a buffer) is the model's."""
    out = tmp_path / "hf"
    _ok("consolidate", str(FIXTURES / case), str(out), "--masters",
        "--config", str(_config_file(tmp_path, case)))  # fmt: skip
    ours, theirs = hf_tensors(out), _saved_by_transformers(tmp_path, case, "masters")
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("case", CASES[:2])
def test_the_config_made_from_the_args_is_the_runs_model(tmp_path: Path, case: str) -> None:
    """Without --config, the DeepseekV3 config comes from the run's args (as inspect reads
    them) and tensors; the true vocabulary is only in an HF config for these runs, so it alone
    is added here."""
    truth = _truth(case)
    given = json.loads(truth["hf_config"])
    shown = _ok("inspect", str(FIXTURES / case))["megatron"]
    args = {**shown, "vocab_size": given["vocab_size"]}
    _, made = mla.to_hf(_stored_shapes(case), args, None, case)
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "first_k_dense_replace", "num_hidden_layers",
                "intermediate_size"):  # fmt: skip
        assert made[key] == given[key], key
    if truth["num_experts"]:
        for key in ("n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                    "moe_intermediate_size", "routed_scaling_factor", "n_group", "topk_group",
                    "norm_topk_prob"):  # fmt: skip
            assert made[key] == given[key], key
    made_file = tmp_path / "made.json"
    made_file.write_text(json.dumps(made))
    out = tmp_path / "hf"
    _ok("consolidate", str(FIXTURES / case), str(out), "--config", str(made_file))
    assert _logits_gap(out, truth) < 1e-5


def _stored_shapes(case: str) -> dict[str, tuple[int, ...]]:
    """The run's model tensors as the plan sees them (stacked experts folded), from the DCP
    metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(FIXTURES / case / "iter_0000010")).read_metadata()
    out = {}
    for name, meta in md.state_dict_metadata.items():
        size = getattr(meta, "size", None)
        if size is None or name.startswith(("optimizer", "chained_", "rng_state")):
            continue
        out[name] = tuple(size)
    return out


def test_inspect_shows_mla_dims_and_shared_experts() -> None:
    text = _invoke("inspect", str(FIXTURES / "deepseek_v3_ep2")).output
    assert (
        "moe: 4 experts, top-2, router sigmoid with expert bias, 2 groups top-1, scaling 2.5, "
        "expert ffn 8, EP 2 x expert TP 1, shared experts ffn 8, MoE layers [0, 1, 1]" in text
    ), text
    mla = "mla: q low-rank 8, kv low-rank 8, q/k heads 4 + rope 4, v heads 4, rope type rope"
    assert mla in text, text
    assert "ffn 32, 4 heads, vocab 104 rows" in text, text  # no query groups in MLA
    dense = _invoke("inspect", str(FIXTURES / "mla_dense_tp2")).output
    mla = "mla: q low-rank 12, kv low-rank 6, q/k heads 6 + rope 4, v heads 4, rope type rope"
    assert mla in dense, dense


def test_diff_calls_an_mla_run_identical_to_its_export(tmp_path: Path) -> None:
    src, out = FIXTURES / "deepseek_v3_ep2", tmp_path / "hf"
    config = str(_config_file(tmp_path, "deepseek_v3_ep2"))
    _ok("consolidate", str(src), str(out), "--config", config)
    assert_diff_finds(src, out, "model.layers.2.mlp.gate.e_score_correction_bias", (1,))


def test_what_deepseek_v3_does_not_compute_is_refused_by_name(tmp_path: Path) -> None:
    """A config of another family, or routing DeepseekV3 lacks: refused, nothing written."""
    ds = str(FIXTURES / "deepseek_v3_ep2")
    given = json.loads(_truth("deepseek_v3_ep2")["hf_config"])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**given, "n_shared_experts": 2}))
    refused = [
        (["consolidate", ds, "--config", str(FIXTURES / "hf_llama" / "config.json")],
         "multi-latent attention, which a llama model does not have"),
        (["consolidate", ds, "--config", str(other)], "n_shared_experts 2 is not the run's 1"),
    ]  # fmt: skip
    for i, (args, why) in enumerate(refused):
        target = tmp_path / f"out{i}"
        result = _invoke(*args[:2], str(target), *args[2:])
        assert result.exit_code != 0 and why in result.output, (args, result.output)
        assert not target.exists()
    shapes = _stored_shapes("deepseek_v3_ep2")
    args = {
        "num_experts": 4, "moe_router_topk": 2, "num_attention_heads": 4, "vocab_size": 100,
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
    }  # fmt: skip
    for change, why in (
        ({"moe_router_score_function": "softmax"}, "router scores with softmax"),
        ({"moe_router_enable_expert_bias": False}, "has no expert bias"),
        ({"moe_router_num_groups": 2, "moe_router_group_topk": 2}, "scored by their top-1"),
        ({"rotary_interleaved": True}, "rope is interleaved"),
        ({"rope_type": "yarn", "rotary_scaling_factor": 40.0}, "YaRN-scaled by 40.0"),
    ):
        with pytest.raises(Exception, match=why):
            mla.to_hf(shapes, {**args, **change}, None, "run")
    gated = {**shapes, "decoder.layers.1.mlp.shared_experts.gate_weight": (1, 16)}
    with pytest.raises(Exception, match=r"shared_experts\.gate_weight' has no place"):
        mla.to_hf(gated, args, None, "run")


def test_a_bf16_runs_router_is_widened_to_float32_and_dtype_leaves_it_alone(
    tmp_path: Path,
) -> None:
    """The bf16 run stores its router weight in bf16 (Megatron's ``Float16Module``) and its
    expert bias in float32 (a buffer); DeepseekV3 keeps both in float32 whatever its dtype.
    ``consolidate --dtype float16`` casts every other floating tensor and writes those four in
    float32, bit for bit the values Megatron held (bf16 widened exactly); an fp32 run's router
    stays float32 under ``--dtype bfloat16`` (it used to be cast: not what transformers writes)."""
    truth = _truth(BF16)
    out = tmp_path / "f16"
    result = _ok("consolidate", str(FIXTURES / BF16), str(out), "--dtype", "float16",
                 "--config", str(_config_file(tmp_path, BF16)))  # fmt: skip
    assert any(
        "model.layers.1.mlp.gate.weight and 1 more widened, exactly, from bfloat16 to float32" in n
        for n in result["notes"]
    ), result["notes"]
    ours = hf_tensors(out)
    kept = {n for n in ours if n.endswith(KEPT_FP32)}
    assert len(kept) == 4
    assert {str(t.dtype) for n, t in ours.items() if n not in kept} == {"torch.float16"}
    for i in (1, 2):
        router = truth["model"][f"decoder.layers.{i}.mlp.router.weight"]
        bias = truth["buffers"][f"decoder.layers.{i}.mlp.router.expert_bias"]
        assert router.dtype == torch.bfloat16 and bias.dtype == torch.float32
        got = ours[f"model.layers.{i}.mlp.gate.weight"]
        assert got.dtype == torch.float32 and torch.equal(got, router.float())
        got = ours[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
        assert got.dtype == torch.float32 and torch.equal(got, bias)
    fp32 = tmp_path / "bf16_of_fp32"
    _ok("consolidate", str(FIXTURES / "deepseek_v3_ep2"), str(fp32), "--dtype", "bfloat16",
        "--config", str(_config_file(tmp_path, "deepseek_v3_ep2")))  # fmt: skip
    theirs = hf_tensors(fp32)
    assert {n for n, t in theirs.items() if t.dtype == torch.float32} == kept


def test_diff_compares_a_bf16_runs_router_as_float32(tmp_path: Path) -> None:
    """A bf16 run against its own export (router and bias float32) is identical; an export
    whose router differs from the run's only below bf16's precision is not (the run's values
    are widened, the export's not rounded)."""
    src, out = FIXTURES / BF16, tmp_path / "hf"
    _ok("consolidate", str(src), str(out))  # no flag: the config from the run's args
    result = _invoke("diff", str(src), str(out), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["identical"], report
    assert any("widened, exactly, from bfloat16 to float32" in n for n in report["notes"])
    gate = "model.layers.1.mlp.gate.weight"
    assert {t["name"]: t["dtype_a"] for t in report["tensors"]}[gate] == "float32"
    weights = load_file(out / "model.safetensors")
    weights[gate][0, 0] = torch.nextafter(weights[gate][0, 0], torch.tensor(1.0))
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    result = _invoke("diff", str(src), str(out), "--json")
    assert result.exit_code == 3, result.output
    changed = [t for t in json.loads(result.output)["tensors"] if t["status"] != "equal"]
    assert [(t["name"], t["status"], t["mismatched"]) for t in changed] == [(gate, "different", 1)]


def test_reshard_of_the_bf16_run_loads_into_a_bf16_deepseek_v3(tmp_path: Path) -> None:
    """A DeepseekV3 loaded in bf16 holds its router and expert bias in float32
    (``get_model_state_dict``). ``reshard`` of the bf16 run: its model is the optimizer's fp32
    masters, the bias as stored (float32), so those four are stored float32 as the model holds
    them; with ``--drop-optimizer`` the weights as stored, and ``dcp.load`` widens the bf16
    router into the float32 parameter exactly."""
    import torch.distributed.checkpoint as dcp

    from ckptools.producers import read_manifest

    truth = _truth(BF16)
    config = tmp_path / "hf"
    config.mkdir()
    (config / "config.json").write_text(truth["hf_config"])
    cfg = transformers.AutoConfig.from_pretrained(config)
    for flags, which in (((), "masters"), (("--drop-optimizer",), "model")):
        out = tmp_path / f"dcp_{which}"
        _ok("reshard", str(FIXTURES / BF16), str(out), "--world-size", "2",
            "--config", str(config), *flags)  # fmt: skip
        stored = read_manifest(str(out)).tensors
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        held = {n: t.dtype for n, t in model.state_dict().items()}
        assert {n for n, d in held.items() if d == torch.float32} == {
            n for n in held if n.endswith(KEPT_FP32)
        }
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=str(out))
        want = _in_memory(truth, cfg, which)
        for name in (n for n in held if n.endswith(KEPT_FP32)):
            as_stored = "float32" if which == "masters" or "bias" in name else "bfloat16"
            assert stored[f"model.{name}"].dtype == as_stored, name
            got = state["model"][name]
            assert got.dtype == torch.float32 and torch.equal(got, want[name].float()), name
