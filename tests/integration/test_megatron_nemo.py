"""NeMo 2 and Megatron-Bridge saves (fixtures/megatron/nemo/: a real Megatron-core 0.19.2 run
laid out as those writers lay out theirs; see its README): detected, listed, inspected and
consolidated to the HF model with the config made from the writer's YAML and its tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from click.testing import CliRunner
from safetensors.torch import load_file

from ckptools.cli.main import cli
from tests.support.megatron_truth import invoke as _invoke
from tests.support.megatron_truth import ok as _ok
from tests.support.megatron_truth import truth

HERE = Path(__file__).resolve().parents[2] / "fixtures" / "megatron" / "nemo"
NEMO_RUN = HERE / "nemo2_tp2"
NEMO_CKPT = NEMO_RUN / "checkpoints" / "llama--val_loss=4.61-step=9-consumed_samples=10.0"
BRIDGE_RUN = HERE / "bridge_pp2"
#: what each source is, its truth, and how inspect names it
SOURCES = {
    "nemo_checkpoint": (NEMO_CKPT, "nemo2_tp2", "nemo2"),
    "nemo_run_checkpoints": (NEMO_RUN / "checkpoints", "nemo2_tp2", "nemo2"),
    "bridge_run": (BRIDGE_RUN, "bridge_pp2", "megatron_bridge"),
    "bridge_iter": (BRIDGE_RUN / "iter_0000010", "bridge_pp2", "megatron_bridge"),
}


def _truth(case: str) -> dict[str, Any]:
    return truth(case, HERE)


def _hf(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_consolidate_is_bit_exact_with_config_and_tokenizer_from_the_writer(
    tmp_path: Path, source: str
) -> None:
    path, case, _layout = SOURCES[source]
    truth = _truth(case)
    out = tmp_path / "hf"
    result = _ok("consolidate", str(path), str(out))
    assert not any("no tokenizer" in n for n in result["notes"]), result["notes"]
    # the config made from model.yaml / run_config.yaml is the run's own (true vocab 100)
    want = json.loads(truth["hf_config"])
    got = json.loads((out / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
                "tie_word_embeddings", "model_type"):  # fmt: skip
        assert got[key] == want[key], key
    assert float(got.get("rope_theta") or got["rope_parameters"]["rope_theta"]) == 10000.0
    # the bytes: what Megatron held (vocab padding dropped), bit for bit
    hf, model, vocab = _hf(out), truth["model"], truth["true_vocab_size"]
    assert torch.equal(
        hf["model.embed_tokens.weight"], model["embedding.word_embeddings.weight"][:vocab]
    )
    assert torch.equal(hf["lm_head.weight"], model["output_layer.weight"][:vocab])
    assert torch.equal(hf["model.norm.weight"], model["decoder.final_layernorm.weight"])
    for i in range(2):
        m = f"decoder.layers.{i}."
        assert torch.equal(
            hf[f"model.layers.{i}.mlp.down_proj.weight"], model[m + "mlp.linear_fc2.weight"]
        )
        fc1 = torch.cat(
            [
                hf[f"model.layers.{i}.mlp.gate_proj.weight"],
                hf[f"model.layers.{i}.mlp.up_proj.weight"],
            ]
        )
        assert torch.equal(fc1, model[m + "mlp.linear_fc1.weight"])
        assert torch.equal(
            hf[f"model.layers.{i}.self_attn.o_proj.weight"],
            model[m + "self_attention.linear_proj.weight"],
        )
    model_hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = model_hf(truth["input_ids"]).logits
    assert (logits - truth["logits"][..., :vocab].float()).abs().max().item() < 1e-5
    # the tokenizer the writer kept beside the weights
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tok) == vocab and tok.convert_tokens_to_ids("w42") == 42


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_inspect_names_the_writer_and_the_run(source: str) -> None:
    path, _case, layout = SOURCES[source]
    found = _ok("inspect", str(path))
    assert found["layout"] == layout
    mg = found["megatron"]
    assert mg["writer"] == ("NeMo 2" if layout == "nemo2" else "Megatron-Bridge")
    assert (mg["num_layers"], mg["hidden_size"], mg["num_query_groups"], mg["vocab_size"]) == (
        2,
        16,
        2,
        100,
    )
    assert mg["iteration"] == 10
    names = [t["fqn"] if isinstance(t, dict) else t for t in found["tensors"]]
    assert "embedding.word_embeddings.weight" in names  # NeMo's module. prefix dropped
    assert not any(n.startswith("module.") for n in names)


def test_list_knows_both_writers_runs() -> None:
    (nemo,) = _ok("list", str(NEMO_RUN / "checkpoints"))["checkpoints"]
    assert (nemo["producer"], nemo["step"], nemo["complete"], nemo["latest"]) == (
        "nemo2", 9, True, True,
    )  # fmt: skip
    (bridge,) = _ok("list", str(BRIDGE_RUN))["checkpoints"]
    assert (bridge["producer"], bridge["name"], bridge["latest"]) == (
        "megatron_bridge", "iter_0000010", True,
    )  # fmt: skip


def test_list_of_the_experiment_directory_names_its_checkpoints_directory() -> None:
    """NeMo's experiment directory holds its saves one level down (``checkpoints/``): listing
    the directory above names it, with the command, instead of "no saves"."""
    shown = _ok("list", str(NEMO_RUN))
    assert shown["checkpoints"] == [] and shown["runs_inside"] == [str(NEMO_RUN / "checkpoints")]
    text = _invoke("list", str(NEMO_RUN)).output
    assert text.strip() == (
        f"{NEMO_RUN}: no saves here; {NEMO_RUN / 'checkpoints'} holds saves: "
        f"`ckpt list {NEMO_RUN / 'checkpoints'}`"
    )


def test_nemo_weights_alone_reads_with_a_config(tmp_path: Path) -> None:
    """A NeMo weights/ copied away from its context/: still NeMo (module. keys), and the sizes
    come from --config (no model.yaml to make them from)."""
    weights = tmp_path / "weights"
    shutil.copytree(NEMO_CKPT / "weights", weights)
    truth = _truth("nemo2_tp2")
    assert _ok("inspect", str(weights))["layout"] == "nemo2"
    config = tmp_path / "config.json"
    config.write_text(truth["hf_config"])
    out = tmp_path / "hf"
    _ok("consolidate", str(weights), str(out), "--config", str(config))
    assert torch.equal(
        _hf(out)["model.norm.weight"], truth["model"]["decoder.final_layernorm.weight"]
    )


def test_reshard_carries_bridges_optimizer_and_refuses_to_drop_nemos_gathered_one(
    tmp_path: Path,
) -> None:
    """Megatron-Bridge's dp_reshardable optimizer reshards as a Megatron-LM run's does; NeMo's
    dp_zero_gather_scatter state (pickled per DP group) is not read: a resume that silently
    lost it would not be the run's, so reshard refuses in one line until --drop-optimizer."""
    bridge = _ok("reshard", str(BRIDGE_RUN), str(tmp_path / "b"), "--world-size", "2")
    assert any("fp32 masters (dp_reshardable)" in n for n in bridge["notes"]), bridge["notes"]
    refused = CliRunner().invoke(
        cli, ["reshard", str(NEMO_CKPT), str(tmp_path / "n"), "--world-size", "2"]
    )
    assert refused.exit_code != 0 and not (tmp_path / "n").exists(), refused.output
    assert "dp_zero_gather_scatter" in refused.output and "--drop-optimizer" in refused.output
    assert len(refused.output.strip().splitlines()) == 1, refused.output
    nemo = _ok(
        "reshard", str(NEMO_CKPT), str(tmp_path / "n"), "--world-size", "2", "--drop-optimizer"
    )
    assert any("--drop-optimizer" in n for n in nemo["notes"]), nemo["notes"]
