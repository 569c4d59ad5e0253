"""Megatron-core ``torch_dist`` runs: inspect, consolidate to Hugging Face, shard back.

The Megatron side is real Megatron-core 0.19.2 (Megatron-LM's own ``save_checkpoint``), as
checked in under ``fixtures/megatron/`` with the truth Megatron held in memory and its forward's
logits (``fixtures/megatron/README.md``); the Hugging Face side is transformers'
``save_pretrained`` and ``from_pretrained``.
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
from click.testing import CliRunner
from safetensors.torch import load_file

from ckptools.cli.main import cli
from tests.support.megatron_truth import (
    MEGATRON_PYTHON,
    MLA_CASES,
    MOE_CASES,
    assert_diff_finds,
    assert_same_model,
    hf_tensors,
    megatron_check_load,
    model_entries,
)
from tests.support.megatron_truth import config_file as _config_file
from tests.support.megatron_truth import invoke as _invoke
from tests.support.megatron_truth import logits as _logits
from tests.support.megatron_truth import ok as _ok
from tests.support.megatron_truth import truth as _truth

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
ALL_CASES = sorted(p.name[: -len(".truth.pt")] for p in FIXTURES.glob("*.truth.pt"))
#: the dense runs
CASES = [c for c in ALL_CASES if c not in MOE_CASES + MLA_CASES]
#: logits of from_pretrained (fp32) against Megatron's own forward: fp32 runs agree to float
#: rounding (~1e-7 measured); the bf16 run computed in bf16 (~2e-3 measured)
FP32_TOL, BF16_TOL = 1e-5, 2e-2


def _as_megatron(hf: dict[str, torch.Tensor], config: dict[str, Any], i: int) -> dict[str, Any]:
    """Layer ``i`` of the HF model in Megatron's module layout, built with torch here (per group
    its query heads, key, value; fc1 = [gate; up]) to compare with the truth Megatron held."""
    p = f"model.layers.{i}."
    groups, heads = config["num_key_value_heads"], config["num_attention_heads"]
    out = {}
    for kind in ("weight", "bias"):
        if f"{p}self_attn.q_proj.{kind}" not in hf:
            continue
        q, k, v = (hf[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv")
        per = heads // groups
        q = q.reshape(groups, per * q.shape[0] // heads, *q.shape[1:])
        k = k.reshape(groups, k.shape[0] // groups, *k.shape[1:])
        v = v.reshape(groups, v.shape[0] // groups, *v.shape[1:])
        out[f"self_attention.linear_qkv.{kind}"] = torch.cat([q, k, v], dim=1).flatten(0, 1)
    out["self_attention.linear_proj.weight"] = hf[f"{p}self_attn.o_proj.weight"]
    out["mlp.linear_fc1.weight"] = torch.cat(
        [hf[f"{p}mlp.gate_proj.weight"], hf[f"{p}mlp.up_proj.weight"]]
    )
    out["mlp.linear_fc2.weight"] = hf[f"{p}mlp.down_proj.weight"]
    out["input_layernorm.weight"] = hf[f"{p}input_layernorm.weight"]
    out["pre_mlp_layernorm.weight"] = hf[f"{p}post_attention_layernorm.weight"]
    return out


def test_every_fixture_is_here() -> None:
    assert {"tp2_pp1", "tp1_pp2", "tp2_pp2_bf16"} <= set(CASES), CASES


@pytest.mark.parametrize("case", CASES)
def test_consolidate_is_bit_exact_and_forward_matches_megatron(tmp_path: Path, case: str) -> None:
    truth = _truth(case)
    config = json.loads(truth["hf_config"])
    out = tmp_path / "hf"
    result = _ok("consolidate", str(FIXTURES / case), str(out),
                 "--config", str(_config_file(tmp_path, case)))  # fmt: skip
    assert any("no tokenizer" in n for n in result["notes"])
    hf = hf_tensors(out)
    model, vocab = truth["model"], truth["true_vocab_size"]
    for i in range(config["num_hidden_layers"]):
        for name, tensor in _as_megatron(hf, config, i).items():
            held = model[f"decoder.layers.{i}.{name}"]
            assert tensor.dtype == held.dtype and torch.equal(tensor, held), (i, name)
    embedding = model["embedding.word_embeddings.weight"]
    assert torch.equal(hf["model.embed_tokens.weight"], embedding[:vocab])
    assert torch.equal(hf["model.norm.weight"], model["decoder.final_layernorm.weight"])
    if config["tie_word_embeddings"]:
        assert "lm_head.weight" not in hf and "output_layer.weight" not in model
    else:
        assert torch.equal(hf["lm_head.weight"], model["output_layer.weight"][:vocab])
    assert json.loads((out / "config.json").read_text()) == config
    logits = _logits(out, truth["input_ids"])
    megatron = truth["logits"][..., :vocab].float()
    tol = BF16_TOL if "bfloat16" in truth["params_dtype"] else FP32_TOL
    assert (logits - megatron).abs().max().item() < tol


@pytest.mark.parametrize("case", ALL_CASES)
def test_inspect_shows_the_run(case: str) -> None:
    truth = _truth(case)
    shown = _ok("inspect", str(FIXTURES / case))
    mg = shown["megatron"]
    assert shown["layout"] == "megatron"
    assert (mg["iteration"], mg["tensor_parallel"], mg["pipeline_parallel"]) == (
        truth["iteration"], truth["tp"], truth["pp"],
    )  # fmt: skip
    assert mg["data_parallel"] == truth["dp"]
    assert mg["padded_vocab_size"] == truth["padded_vocab_size"]
    assert mg["vocab_size"] is None  # the run used an HF tokenizer: only the config knows
    config = json.loads(truth["hf_config"])
    sizes = (
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    assert (mg["num_layers"], mg["num_attention_heads"], mg["num_query_groups"]) == sizes
    if truth["ranks"][0].get("chained"):  # an MoE run's dense and expert optimizers
        assert mg["optimizer_sharding"] == "chained"
        assert mg["chained_optimizers"] == [truth["distrib_optim_sharding_type"]] * 2
    else:
        assert mg["optimizer_sharding"] == truth["distrib_optim_sharding_type"]
        assert mg["chained_optimizers"] is None
    assert mg["params_dtype"] == truth["params_dtype"].removeprefix("torch.")
    assert {"model", "optimizer", "rng", "common"} <= set(mg["parts"])
    assert shown["model_part"]["excluded"] == ["optimizer"]
    text = _invoke("inspect", str(FIXTURES / case)).output
    assert f"iteration {truth['iteration']}, TP {truth['tp']} x PP {truth['pp']}" in text


def test_inspect_shows_the_producers_facts_in_its_own_words() -> None:
    """``inspect`` takes a producer's facts and their lines from the module its package declares
    (``registry.inspected``): under its key in the JSON (null for any other checkpoint), in its
    lines in the text, neither verb nor CLI naming it."""
    from ckptools.producers import read_manifest, registry

    producers = registry.inspected()
    (producer,) = [p for p in producers if p.KEY == "megatron"]
    run = str(FIXTURES / "tp2_pp1")
    shown = _ok("inspect", run)
    keys = list(shown)
    assert keys[keys.index("step") + 1 : keys.index("optimizers")] == [p.KEY for p in producers]
    assert all(shown[p.KEY] is None for p in producers if p is not producer)
    assert shown["megatron"] == producer.facts(read_manifest(run))
    assert producer.lines(shown["megatron"]) == [
        "  megatron: iteration 10, TP 2 x PP 1 x DP 1, float32",
        "  model: 2 layers, hidden 16, ffn 32, 4 heads in 2 query groups, vocab 112 rows, padded "
        "(the true size is in the model's config.json, not in the run's args: kept padded without "
        "--config)",
        "  optimizer sharding: dp_reshardable; entries: common 1, extra_state 8, model 9, "
        "optimizer 12, rng 2",
    ]
    text = _invoke("inspect", run).output.splitlines()
    at = text.index(producer.lines(shown["megatron"])[0])
    assert text[at : at + 3] == producer.lines(shown["megatron"])
    other = str(FIXTURES.parent / "dcp_single")
    assert _ok("inspect", other)["megatron"] is None
    lines = _invoke("inspect", other).output.splitlines()
    assert not any(line.startswith("  megatron:") for line in lines)


def test_iteration_picks_a_save_and_a_missing_one_lists_them() -> None:
    run = str(FIXTURES / "tp2_pp1")
    assert _ok("inspect", run, "--iteration", "10")["megatron"]["iteration"] == 10
    result = _invoke("inspect", run, "--iteration", "7")
    assert result.exit_code != 0
    assert "no iteration 7 (iter_0000007/)" in result.output and "iter_0000010" in result.output
    result = _invoke("inspect", f"{run}/iter_0000010", "--iteration", "10")
    assert result.exit_code != 0 and "drop --iteration 10" in result.output
    (listed,) = _ok("list", run)["checkpoints"]
    assert (listed["producer"], listed["name"], listed["latest"]) == (
        "megatron",
        "iter_0000010",
        True,
    )


@pytest.mark.parametrize(
    "case", ["tp2_pp1", "mixtral_ep2", "qwen3_moe_ep2", "deepseek_v3_ep2", "deepseek_v3_ep2_bf16"]
)
def test_the_run_directory_alone_gives_the_model_with_its_padded_vocabulary(
    tmp_path: Path, case: str
) -> None:
    """A run with a Hugging Face tokenizer keeps only the padded vocabulary size in its args:
    with no flag the model keeps Megatron's padded rows (the embedding and head as stored), says
    so with the way to drop them, and computes Megatron's logits, padded columns included."""
    truth = _truth(case)
    out = tmp_path / "hf"
    result = _ok("consolidate", str(FIXTURES / case), str(out))
    assert any("vocab padding kept" in n and "--config" in n for n in result["notes"])
    config = json.loads((out / "config.json").read_text())
    padded = truth["padded_vocab_size"]
    assert padded > truth["true_vocab_size"] and config["vocab_size"] == padded
    sizes = ("model_type", "hidden_size", "num_hidden_layers", "tie_word_embeddings")
    expected = json.loads(truth["hf_config"])
    assert {k: config[k] for k in sizes} == {k: expected[k] for k in sizes}
    hf = hf_tensors(out)
    assert torch.equal(hf["model.embed_tokens.weight"],
                       truth["model"]["embedding.word_embeddings.weight"])  # fmt: skip
    logits = _logits(out, truth["input_ids"])
    tol = BF16_TOL if "bfloat16" in truth["params_dtype"] else FP32_TOL
    assert logits.shape[-1] == padded
    assert (logits - truth["logits"].float()).abs().max().item() < tol
    trimmed = _ok("consolidate", str(FIXTURES / case), str(tmp_path / "trimmed"),
                  "--config", str(_config_file(tmp_path, case)))  # fmt: skip
    assert not any("vocab padding kept" in n for n in trimmed["notes"])
    # reshard writes no config: the note says which vocabulary the FSDP2 job's model needs
    resharded = _ok("reshard", str(FIXTURES / case), str(tmp_path / "fsdp2"), "--world-size", "2")
    assert any(f"build the job's model with vocab_size {padded}" in n
               for n in resharded["notes"]), resharded["notes"]  # fmt: skip


@pytest.mark.parametrize("name", ["iter_0000010/__0_0.distcp", "iter_0000010/metadata.json",
                                  "latest_checkpointed_iteration.txt"])  # fmt: skip
def test_one_file_of_it_points_at_the_directory(tmp_path: Path, name: str) -> None:
    path = FIXTURES / "tp2_pp1" / name
    result = _invoke("consolidate", str(path), str(tmp_path / "out"))
    assert result.exit_code != 0
    assert f"point at {path.parent}" in result.output and "megatron" in result.output


def _save_hf(tmp_path: Path, family: str, config: dict[str, Any], dtype: torch.dtype) -> Path:
    """A model of ``family`` saved by transformers' ``save_pretrained`` (seeded)."""
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_class, model_class = classes[family]
    known = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    model = model_class(config_class(**known)).to(dtype)
    out = tmp_path / f"hf_{family}"
    model.save_pretrained(out)
    return out


_SIZES = {
    "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "vocab_size": 100,
    "max_position_embeddings": 16,
}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "extra", "dtype"),
    [
        ("llama", {"tie_word_embeddings": False}, torch.bfloat16),
        ("qwen2", {"tie_word_embeddings": True}, torch.float32),
        ("qwen3", {"tie_word_embeddings": True}, torch.float32),
    ],
)
def test_hf_to_megatron_and_back_is_bit_exact(
    tmp_path: Path, family: str, extra: dict[str, Any], dtype: torch.dtype
) -> None:
    src = _save_hf(tmp_path, family, {**_SIZES, **extra}, dtype)
    run = tmp_path / "megatron"
    _ok("shard", str(src), str(run), "--world-size", "2", "--to", "megatron",
        "--make-vocab-size-divisible-by", "16")  # fmt: skip
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "1"
    meta = json.loads((run / "iter_0000001" / "metadata.json").read_text())
    assert meta["sharded_backend"] == "torch_dist"
    shown = _ok("inspect", str(run))["megatron"]
    assert (shown["iteration"], shown["num_layers"], shown["padded_vocab_size"]) == (1, 2, 112)
    back = tmp_path / "back"
    _ok("consolidate", str(run), str(back))  # the config made from the args it recorded
    assert_same_model(back, src)


def test_shard_to_megatron_writes_what_megatron_writes(tmp_path: Path) -> None:
    """The same model keys, shapes and dtypes as Megatron's own save of that model (tp2_pp1:
    TP 2 pads the vocabulary to a multiple of 8 x 2), and the objects it needs to load."""
    config = json.loads(_truth("tp2_pp1")["hf_config"])
    src = _save_hf(tmp_path, "llama", config, torch.float32)
    run = tmp_path / "megatron"
    # no --world-size: Megatron loads the run at any TP / PP, one rank file holds it
    written = _ok("shard", str(src), str(run), "--to", "megatron",
                  "--make-vocab-size-divisible-by", "16")  # fmt: skip
    assert written["world_size"] == 1
    ours, theirs = _ok("inspect", str(run)), _ok("inspect", str(FIXTURES / "tp2_pp1"))
    assert model_entries(ours) == model_entries(theirs)
    objects = {o["fqn"] for o in ours["objects"]}
    assert "common_state/shard_0_1" in objects
    extra = {o["fqn"] for o in theirs["objects"] if "._extra_state/" in o["fqn"]}
    assert extra and extra == {o for o in objects if "._extra_state/" in o}


def test_world_size_is_required_for_a_dcp_target(tmp_path: Path) -> None:
    """Only --to megatron may leave --world-size out: a DCP target is laid out for its ranks."""
    src = FIXTURES / "hf_llama"
    for command in ("shard", "reshard"):
        result = CliRunner().invoke(cli, [command, str(src), str(tmp_path / command)])
        assert result.exit_code == 2, result.output
        assert "Missing option '--world-size'" in result.output
        assert not (tmp_path / command).exists()


def test_families_beyond_the_mapped_ones_are_refused_by_name(tmp_path: Path) -> None:
    """Qwen2-MoE (a shared expert, which no mapped family has) is named and nothing written
    (Mixtral and Qwen3-MoE are written: tests/integration/test_megatron_moe.py)."""
    config = transformers.Qwen2MoeConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_experts=2, moe_intermediate_size=8,
        shared_expert_intermediate_size=8, vocab_size=100,
    )  # fmt: skip
    src = tmp_path / "qwen2_moe"
    transformers.Qwen2MoeForCausalLM(config).save_pretrained(src)
    result = _invoke("shard", str(src), str(tmp_path / "out"), "--world-size", "1",
                     "--to", "megatron")  # fmt: skip
    assert result.exit_code != 0 and "qwen2_moe" in result.output
    assert not (tmp_path / "out").exists()


def test_a_config_of_another_model_is_refused(tmp_path: Path) -> None:
    """qwen2_tp2 has a QKV bias; tp2_pp1's Llama config has none: named, nothing written."""
    config = _config_file(tmp_path, "tp2_pp1")
    out = tmp_path / "out"
    result = _invoke("consolidate", str(FIXTURES / "qwen2_tp2"), str(out), "--config", str(config))
    assert result.exit_code != 0 and "QKV bias" in result.output and "--config" in result.output
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(MEGATRON_PYTHON), reason="no megatron-core venv")
def test_megatron_loads_what_shard_writes(
    tmp_path: Path, cached_output: Callable[..., Path]
) -> None:
    """fixtures/megatron/generate.py check-load: Megatron-core builds the model at TP 2,
    ``dist_checkpointing.load`` + ``load_state_dict(strict=True)`` what ``shard --to megatron``
    wrote, and its logits match transformers' on the same HF model (exit 1 above 1e-4).

    Megatron's verdict is kept across sessions (``cached_output``) under a key of every byte
    shard wrote, the HF model, generate.py and the venv's installed distributions: a re-run whose
    shard wrote the same bytes reads the verdict Megatron gave on them (26 s of CPU saved), and a
    single changed byte runs Megatron again."""
    run = tmp_path / "megatron"
    _ok("shard", str(FIXTURES / "hf_qwen2"), str(run), "--world-size", "2", "--to", "megatron",
        "--make-vocab-size-divisible-by", "16")  # fmt: skip
    verdict = megatron_check_load(cached_output, tmp_path, key="megatron-check-load", run=run,
                                  hf=FIXTURES / "hf_qwen2",
                                  command=["check-load", "--tp", "2", "--pp", "1"])  # fmt: skip
    assert "max_abs_diff=" in verdict


#: the local spec's fused norm names as Megatron's loaded modules name them
_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def test_what_shard_writes_is_what_megatron_loaded(tmp_path: Path) -> None:
    """``fixtures/megatron/hf_llama.proof_tp2_pp2.pt`` holds the weights real Megatron-core
    0.19.2 held after ``dist_checkpointing.load`` of ``ckpt shard hf_llama --to megatron`` at
    TP 2 x PP 2 (``generate.py check-load --proof``; its logits matched the HF model's). What
    shard writes today, read by torch's own DCP reader and unstacked here, must be those bytes,
    and those bytes, mapped to HF names independently of ckptools, the HF model's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from tests.support.megatron_truth import hf_truth

    proof = torch.load(FIXTURES / "hf_llama.proof_tp2_pp2.pt", weights_only=True)
    assert proof["max_abs_diff"] <= 1e-4
    hf = load_file(FIXTURES / "hf_llama" / "model.safetensors")
    config = (FIXTURES / "hf_llama" / "config.json").read_text()
    loaded = hf_truth({"hf_config": config, "model": proof["model"]}, "model")
    assert set(loaded) == set(hf)
    for name, want in hf.items():
        assert torch.equal(loaded[name].view(-1), want.view(-1)), name

    run = tmp_path / "megatron"
    _ok("shard", str(FIXTURES / "hf_llama"), str(run), "--to", "megatron")
    save = run / "iter_0000001"
    metadata = FileSystemReader(str(save)).read_metadata()
    stored = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
        if hasattr(m, "size") and not k.startswith("optimizer.")
    }
    dcp.load(stored, checkpoint_id=str(save), no_dist=True)
    written: dict[str, torch.Tensor] = {}
    for key, t in stored.items():
        if key.startswith("decoder.layers.") and not key[len("decoder.layers.") :][0].isdigit():
            rest = key[len("decoder.layers.") :]
            for i in range(t.shape[0]):
                written[f"decoder.layers.{i}.{_NORMS.get(rest, rest)}"] = t[i]
        else:
            written[key] = t
    assert set(written) == set(proof["model"])
    for name, held in proof["model"].items():
        assert torch.equal(written[name].view(-1), held.view(-1)), name


def test_diff_calls_a_megatron_run_identical_to_its_consolidation(tmp_path: Path) -> None:
    """``ckpt diff RUN hf_model`` compares the run as the HF model (the mapping consolidate
    applies) and says so; one changed element of the consolidation is found by its HF name."""

    src, out = FIXTURES / "tp2_pp1", tmp_path / "hf"
    config = str(FIXTURES / "hf_llama" / "config.json")
    _ok("consolidate", str(src), str(out), "--config", config)
    notes = assert_diff_finds(src, out, "model.layers.1.self_attn.k_proj.weight", (3, 2))
    assert any("compared as the HF model" in n for n in notes), notes


def test_inspect_says_where_the_true_vocabulary_is(tmp_path: Path) -> None:
    """A run trained with an HF tokenizer records only the padded rows: inspect says where the
    true size is; a run whose args hold it (what shard writes) shows both."""
    text = _invoke("inspect", str(FIXTURES / "tp2_pp1")).output
    assert "vocab 112 rows, padded (the true size is in the model's config.json" in text
    run = tmp_path / "megatron"
    _ok("shard", str(FIXTURES / "hf_llama"), str(run), "--to", "megatron")
    assert "vocab 100 (padded 128)" in _invoke("inspect", str(run)).output


def test_prune_of_a_megatron_run_is_refused_naming_its_saves(tmp_path: Path) -> None:
    """``ckpt prune`` deletes a CheckpointManager's saves only: pointed at another producer's
    run it says so in one line (it reported "would delete 0 checkpoint(s)" before), and
    nothing is deleted."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "tp2_pp1", run)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    result = _invoke("prune", str(run), "--keep-last", "1")
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "holds 1 megatron save(s) (iter_0000010, ...), not a CheckpointManager's" in (
        result.output
    )
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
