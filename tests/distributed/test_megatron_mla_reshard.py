"""Megatron-core multi-latent attention runs (``fixtures/megatron/``: ``deepseek_v3_ep2``, MLA +
a dense first layer + a shared expert + a sigmoid router with expert bias at EP 2, and
``mla_dense_tp2``, MLA with dense MLPs at TP 2, written by Megatron-core 0.19.2 itself) resumed
by an FSDP2 job of ``DeepseekV3ForCausalLM``: ``ckpt reshard`` then ``dcp.load`` into
``get_state_dict(fully_shard(model), AdamW)``, and ``ckptools.load(run, model, opt)`` straight
from the run. The job then holds what Megatron's (Chained)Optimizer held, bit for bit: the fp32
masters as the model, exp_avg, exp_avg_sq, step, the decay / no-decay groups; the router's
``e_score_correction_bias`` is a buffer in transformers as in Megatron (``expert_bias``): the
model's, with no optimizer state.

The truth is mapped to transformers' in-memory names by ``tests/integration/test_megatron_mla``
(from the documented layouts, not by ckptools).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.test_megatron_reshard import (
    _load_and_gather,
    _resume_step_and_gather,
    _same_bits,
)
from tests.integration.test_megatron_mla import ATTENTION, _in_memory

pytestmark = [pytest.mark.distributed]

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
CASES = [
    pytest.param("deepseek_v3_ep2", id="deepseek_v3_ep2-to-2"),
    pytest.param("mla_dense_tp2", id="mla_dense_tp2-to-2", marks=[pytest.mark.slow]),
]
BIAS = "mlp.gate.e_score_correction_bias"


def _members(name: str) -> set[str]:
    """The in-memory parameter(s) a truth group member (a Megatron name) is (part of)."""
    top = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }
    if name in top:
        return {top[name]}
    parts = name.split(".")
    pre, rest = f"model.layers.{parts[2]}.", ".".join(parts[3:])
    if rest in ATTENTION:
        return {pre + ATTENTION[rest]}
    mlp = {
        "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
        "mlp.router.weight": ("mlp.gate.weight",),
        "mlp.shared_experts.linear_fc1.weight": (
            "mlp.shared_experts.gate_proj.weight",
            "mlp.shared_experts.up_proj.weight",
        ),
        "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_experts.down_proj.weight",),
    }
    if rest in mlp:
        return {pre + n for n in mlp[rest]}
    assert ".local_experts." in rest, name
    return {pre + ("mlp.experts.gate_up_proj" if "fc1" in rest else "mlp.experts.down_proj")}


def _check(got: dict[str, Any], truth: dict[str, Any], config: Path) -> None:
    import torch
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(config)
    model, state = got["model"], got["optim"]["state"]
    masters = _in_memory(truth, cfg, "masters")
    assert set(model) == set(masters)
    biases = {n for n in masters if n.endswith(BIAS)}
    assert len(biases) == (2 if truth["num_experts"] else 0)
    for name, want in masters.items():
        assert _same_bits(model[name], want), name
        if name in biases:  # a buffer: the model's, no optimizer state
            assert name not in state
            continue
        for kind in ("exp_avg", "exp_avg_sq"):
            assert _same_bits(state[name][kind], _in_memory(truth, cfg, kind)[name]), (name, kind)
        assert _same_bits(state[name]["step"], torch.tensor(float(truth["optimizer_step"])))
    want_groups: dict[float, set[str]] = {}
    for g in truth["param_groups"]:
        want_groups.setdefault(g["weight_decay"], set()).update(*(_members(n) for n in g["params"]))
    got_groups = {g["weight_decay"]: set(g["params"]) for g in got["optim"]["param_groups"]}
    assert got_groups == want_groups


def _config_dir(tmp_path: Path, truth: dict[str, Any]) -> Path:
    config = tmp_path / "hf"
    config.mkdir()
    (config / "config.json").write_text(truth["hf_config"])
    return config


@pytest.mark.parametrize("case", CASES)
def test_megatron_mla_run_resumes_in_fsdp2(tmp_path: Path, case: str) -> None:
    import torch
    from click.testing import CliRunner

    from ckptools.cli.main import cli
    from tests.support.dist import run_ranks

    truth = torch.load(FIXTURES / f"{case}.truth.pt", weights_only=True)
    config = _config_dir(tmp_path, truth)
    out = tmp_path / "dcp"
    args = ["reshard", str(FIXTURES / case), str(out), "--world-size", "2",
            "--config", str(config), "--json", "-q"]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    notes = json.loads(result.output)["notes"]
    assert any("fp32 masters" in n for n in notes), notes
    gathered = tmp_path / "gathered.pt"
    run_ranks(_resume_step_and_gather, 2, str(out), str(config), str(gathered),
              timeout=300)  # fmt: skip
    got = torch.load(gathered, weights_only=True)
    _check(got, truth, config)
    assert math.isfinite(got["loss"])
    assert any(not torch.equal(got["after"][n], got["model"][n]) for n in got["model"])


def test_load_resumes_straight_from_a_megatron_mla_run(tmp_path: Path) -> None:
    """``ckptools.load(run, model, opt)`` into an FSDP2 job reads the DeepSeek-V3-shaped run as
    ``reshard`` maps it: both chained parts' masters, moments and step, the bias the model's."""
    import torch

    from tests.support.dist import run_ranks

    case = "deepseek_v3_ep2"
    truth = torch.load(FIXTURES / f"{case}.truth.pt", weights_only=True)
    config = _config_dir(tmp_path, truth)
    gathered = tmp_path / "gathered.pt"
    run_ranks(_load_and_gather, 2, str(FIXTURES / case), str(config), str(gathered),
              timeout=300)  # fmt: skip
    _check(torch.load(gathered, weights_only=True), truth, config)
