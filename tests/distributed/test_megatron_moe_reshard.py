"""Megatron-core MoE runs (``fixtures/megatron/``: Mixtral at EP 1, EP 2 and TP 2 x EP 2 in bf16,
Qwen3-MoE at EP 2, written by Megatron-core 0.19.2 itself) resumed by an FSDP2 job of the
transformers model: ``ckpt reshard`` then ``dcp.load`` into ``get_state_dict(fully_shard(model),
AdamW)``, and ``ckptools.load(run, model, opt)`` straight from the run. The state the job then
holds equals what Megatron's ChainedOptimizer held (the dense part's and the expert part's fp32
masters as the model, exp_avg, exp_avg_sq, step, the router's too) bit for bit, under the names
transformers holds the model by in memory (experts fused: ``mlp.experts.gate_up_proj``
``[E, 2F, H]``, ``down_proj`` ``[E, H, F]``; the router ``mlp.gate``).

The truth is mapped to those names here from the documented layouts, not by ckptools.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.test_megatron_reshard import (
    _load_and_gather,
    _resume_step_and_gather,
    _same_bits,
)
from tests.support.megatron_truth import hf_members, hf_truth

pytestmark = [pytest.mark.distributed]

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
CASES = [
    pytest.param(
        c, w, id=f"{c}-to-{w}", marks=[] if c == "mixtral_tp2_ep2_bf16" else [pytest.mark.slow]
    )
    for c, w in (
        ("mixtral_tp2_ep2_bf16", 2),
        ("mixtral_ep2", 2),
        ("mixtral_ep2_fully_reshardable", 2),
        ("mixtral_ep1", 2),
        ("qwen3_moe_ep2", 2),
        ("mixtral_pp2_ep2", 2),  # each PP stage's expert optimizer (dp_group_idx 0..3)
    )
]
_MOE = (
    ".mlp.router.",
    ".mlp.experts.",
    ".self_attention.q_layernorm.",
    ".self_attention.k_layernorm.",
)


def _moe_truth(truth: dict[str, Any], section: str) -> dict[str, Any]:
    """The truth's ``section`` under the transformers model's in-memory names."""
    import torch

    held = truth[section]
    dense = {k: v for k, v in held.items() if not any(m in k for m in _MOE)}
    out = hf_truth({**truth, section: dense}, section)
    layers = 1 + max(int(k.split(".")[2]) for k in held if k.startswith("decoder.layers."))
    for i in range(layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        fc = src + "mlp.experts.local_experts.{}.linear_fc{}.weight"
        experts = range(truth["num_experts"])
        out[dst + "mlp.gate.weight"] = held[src + "mlp.router.weight"].float()
        out[dst + "mlp.experts.gate_up_proj"] = torch.stack(
            [held[fc.format(e, 1)] for e in experts]
        )
        out[dst + "mlp.experts.down_proj"] = torch.stack([held[fc.format(e, 2)] for e in experts])
        for x in "qk":
            norm = held.get(src + f"self_attention.{x}_layernorm.weight")
            if norm is not None:
                out[dst + f"self_attn.{x}_norm.weight"] = norm
    return {k: v.float().contiguous() for k, v in out.items()}


def _members(name: str) -> set[str]:
    """The in-memory parameter a truth group member (a Megatron name) is part of."""
    parts = name.split(".")
    if not any(m in name for m in _MOE):
        return hf_members(name)
    pre = f"model.layers.{parts[2]}."
    if ".mlp.router." in name:
        return {pre + "mlp.gate.weight"}
    if ".linear_fc1." in name:
        return {pre + "mlp.experts.gate_up_proj"}
    if ".linear_fc2." in name:
        return {pre + "mlp.experts.down_proj"}
    return {pre + f"self_attn.{parts[4][0]}_norm.weight"}


def _config_dir(tmp_path: Path, truth: dict[str, Any]) -> Path:
    config = tmp_path / "hf"
    config.mkdir()
    (config / "config.json").write_text(truth["hf_config"])
    return config


def _check(got: dict[str, Any], truth: dict[str, Any]) -> None:
    import torch

    model, state = got["model"], got["optim"]["state"]
    masters = _moe_truth(truth, "masters")
    assert set(model) == set(masters)
    for name, want in masters.items():
        assert _same_bits(model[name], want), name
        for kind in ("exp_avg", "exp_avg_sq"):
            assert _same_bits(state[name][kind], _moe_truth(truth, kind)[name]), (name, kind)
        assert _same_bits(state[name]["step"], torch.tensor(float(truth["optimizer_step"])))
    # the dense and expert parts' groups: decay on matrices (router and experts too), none on norms
    want_groups: dict[float, set[str]] = {}
    for g in truth["param_groups"]:
        want_groups.setdefault(g["weight_decay"], set()).update(*(_members(n) for n in g["params"]))
    got_groups = {g["weight_decay"]: set(g["params"]) for g in got["optim"]["param_groups"]}
    assert got_groups == want_groups


@pytest.mark.parametrize(("case", "world_size"), CASES)
def test_megatron_moe_run_resumes_in_fsdp2(tmp_path: Path, case: str, world_size: int) -> None:
    import math

    import torch
    from click.testing import CliRunner

    from ckptools.cli.main import cli
    from tests.support.dist import run_ranks

    truth = torch.load(FIXTURES / f"{case}.truth.pt", weights_only=True)
    config = _config_dir(tmp_path, truth)
    out = tmp_path / "dcp"
    args = ["reshard", str(FIXTURES / case), str(out), "--world-size", str(world_size),
            "--config", str(config), "--json", "-q"]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    notes = json.loads(result.output)["notes"]
    assert any("fp32 masters" in n for n in notes), notes
    gathered = tmp_path / "gathered.pt"
    run_ranks(_resume_step_and_gather, world_size, str(out), str(config), str(gathered),
              timeout=300)  # fmt: skip
    got = torch.load(gathered, weights_only=True)
    _check(got, truth)
    assert math.isfinite(got["loss"])
    assert any(not torch.equal(got["after"][n], got["model"][n]) for n in got["model"])


@pytest.mark.parametrize("case", ["mixtral_ep2", "mixtral_ep2_fully_reshardable"])
def test_load_resumes_straight_from_a_megatron_moe_run(tmp_path: Path, case: str) -> None:
    """``ckptools.load(run, model, opt)`` into an FSDP2 job reads the MoE run as ``reshard``
    maps it: the chained optimizer's masters, moments and step, bit for bit (its parts saved
    dp_reshardable, or fully_reshardable: one ``optimizer.state.*`` namespace for both)."""
    import torch

    from tests.support.dist import run_ranks

    truth = torch.load(FIXTURES / f"{case}.truth.pt", weights_only=True)
    config = _config_dir(tmp_path, truth)
    gathered = tmp_path / "gathered.pt"
    run_ranks(_load_and_gather, 2, str(FIXTURES / case), str(config), str(gathered),
              timeout=300)  # fmt: skip
    _check(torch.load(gathered, weights_only=True), truth)
