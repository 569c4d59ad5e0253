"""`ckpt reshard` of Megatron-core ``torch_dist`` saves (written by Megatron-core 0.19.2 itself,
``fixtures/megatron/generate.py``) into the DCP an FSDP2 job of the Hugging Face model resumes
from: ``dcp.load`` + ``set_state_dict`` into ``AutoModelForCausalLM.from_config`` (the HF config
in the fixture's truth) with torch's AdamW in two groups, then the gathered state equals what
Megatron's DistributedOptimizer held (its fp32 masters as the model; exp_avg, exp_avg_sq split
per query group and gate/up as the weights are; its step; its decay / no-decay groups), bit for
bit, and the job takes a training step.

The truth is mapped to HF names here from the documented layout (per query group: its q heads,
then k, then v; fc1: gate rows then up rows; the padded vocabulary cut), not by ckptools.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.megatron_truth import hf_members, hf_truth

pytestmark = [pytest.mark.distributed]

FIXTURES = Path(
    os.environ.get("CKPTOOLS_MEGATRON_FIXTURES")
    or Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
)
#: (case, FSDP2 world size); all but one are slow
CASES = [
    pytest.param(c, w, id=f"{c}-to-{w}", marks=[] if c == "dp2" else [pytest.mark.slow])
    for c, w in (
        ("dp2", 2),
        ("tp2_pp2_bf16", 3),
        ("tp2_pp1", 1),
        ("tp1_pp2", 2),
        ("qwen2_tp2", 2),
        ("dp2_fully_reshardable", 2),
    )
]
SECTIONS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def _hf_job(world_size: int, config: str) -> tuple[Any, Any]:
    """An FSDP2 job of the HF model (layers, then the root, sharded) with AdamW in Megatron-LM's
    two groups: decay on matrices, none on norms and biases."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.ndim >= 2 and not n.endswith(".bias")]
    flat = [p for n, p in named if not (p.ndim >= 2 and not n.endswith(".bias"))]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": flat, "weight_decay": 0.0}], lr=1e-3
    )
    return model, opt


def _resume_step_and_gather(rank: int, world_size: int, ckpt: str, config: str, out: str) -> None:
    """An FSDP2 job of the HF model with AdamW in Megatron-LM's two groups: dcp.load +
    set_state_dict, the full state gathered (rank 0 saves it), then one training step."""
    import copy

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_state_dict,
    )

    model, opt = _hf_job(world_size, config)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # copied: the step below advances the state the gathered dict may share
    gathered = copy.deepcopy(
        {
            "model": get_model_state_dict(model, options=full),
            "optim": get_optimizer_state_dict(model, opt, options=full),
        }
    )
    ids = torch.tensor([[1, 17, 42, 99, 3, 64, 8, 27]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    after = get_model_state_dict(model, options=full)
    if rank == 0:
        gathered["loss"] = float(loss.detach())
        gathered["after"] = after
        torch.save(gathered, out)


def _same_bits(a: Any, b: Any) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))


@pytest.mark.parametrize(("case", "world_size"), CASES)
def test_megatron_save_resumes_in_fsdp2(tmp_path: Path, case: str, world_size: int) -> None:
    import math

    import torch
    from click.testing import CliRunner

    from ckptools.cli.main import cli
    from tests.support.dist import run_ranks

    src = FIXTURES / case
    if not src.is_dir():
        pytest.skip(f"no Megatron fixture {src} (fixtures/megatron/generate.py writes it)")
    truth = torch.load(FIXTURES / f"{case}.truth.pt", weights_only=False)
    config = tmp_path / "hf"
    config.mkdir()
    cfg = truth["hf_config"]
    (config / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    out = tmp_path / "dcp"
    args = ["reshard", str(src), str(out), "--world-size", str(world_size), "--config",
            str(config), "--json", "-q"]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    notes = json.loads(result.output)["notes"]
    assert any("fp32 masters" in n for n in notes), notes
    assert any("not carried" in n and "RNG" in n for n in notes), notes

    gathered = tmp_path / "gathered.pt"
    run_ranks(_resume_step_and_gather, world_size, str(out), str(config), str(gathered),
              timeout=300)  # fmt: skip
    got = torch.load(gathered, weights_only=True)
    model, state = got["model"], got["optim"]["state"]
    masters = hf_truth(truth, "masters")
    tied = "lm_head.weight" not in masters
    assert set(model) == set(masters) | ({"lm_head.weight"} if tied else set())
    for name, want in masters.items():
        assert _same_bits(model[name], want), name
        for kind, section in SECTIONS.items():
            assert _same_bits(state[name][kind], hf_truth(truth, section)[name]), (name, kind)
        assert _same_bits(state[name]["step"], torch.tensor(float(truth["optimizer_step"])))
    # Megatron's groups kept: decay on matrices, none on norms and biases
    want_groups = {
        g["weight_decay"]: set().union(*(hf_members(n) for n in g["params"]))
        for g in truth["param_groups"]
    }
    got_groups = {g["weight_decay"]: set(g["params"]) for g in got["optim"]["param_groups"]}
    assert got_groups == want_groups
    # and it trains
    assert math.isfinite(got["loss"])
    changed = [n for n in masters if not torch.equal(got["after"][n], model[n])]
    assert changed, "the step changed no parameter"


def _load_and_gather(rank: int, world_size: int, src: str, config: str, out: str) -> None:
    """An FSDP2 job of the HF model resumes straight from the Megatron run with
    ``ckptools.load`` (no reshard first); rank 0 saves the gathered state."""
    import torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    import ckptools

    model, opt = _hf_job(world_size, config)
    ckptools.load(src, model, opt)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    gathered = {
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, opt, options=full),
    }
    if rank == 0:
        torch.save(gathered, out)


def test_load_resumes_straight_from_a_megatron_run(tmp_path: Path) -> None:
    """``ckptools.load(run, model, opt)`` reads the Megatron save as ``reshard`` maps it: the
    fp32 masters, moments and step equal Megatron's truth bit for bit (DP 2's buckets, a
    parameter cut between DP ranks), at another world size."""
    import torch

    from tests.support.dist import run_ranks

    case = "dp2"
    truth = torch.load(FIXTURES / f"{case}.truth.pt", weights_only=False)
    config = tmp_path / "hf"
    config.mkdir()
    cfg = truth["hf_config"]
    (config / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    gathered = tmp_path / "gathered.pt"
    run_ranks(_load_and_gather, 3, str(FIXTURES / case), str(config), str(gathered),
              timeout=300)  # fmt: skip
    got = torch.load(gathered, weights_only=True)
    model, state = got["model"], got["optim"]["state"]
    masters = hf_truth(truth, "masters")
    for name, want in masters.items():
        assert _same_bits(model[name], want), name
        for kind, section in SECTIONS.items():
            assert _same_bits(state[name][kind], hf_truth(truth, section)[name]), (name, kind)
        assert _same_bits(state[name]["step"], torch.tensor(float(truth["optimizer_step"])))
