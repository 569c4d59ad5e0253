"""`ckpt reshard` of verl's per-rank FSDP2 checkpoints (fixtures written by verl 0.9.1's
``FSDPCheckpointManager``) into DCPs that an FSDP2 job at 2 and 3 ranks resumes with
``set_state_dict``: model and AdamW moments bit-exact against what torch gathered from the
job that saved them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ckptools.cli.main import cli
from tests.support.dist import run_ranks
from tests.support.reference import assert_bitwise_equal, load_reference

pytestmark = pytest.mark.distributed
VERL = Path(__file__).resolve().parents[2] / "fixtures" / "verl"
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _resume_and_gather(
    rank: int, world_size: int, config: str, ckpt: str, out: str, optim: bool = True
) -> None:
    """An FSDP2 job (each decoder layer, then the root, as verl wraps it) built from the
    checkpoint's own huggingface/config.json: dcp.load + set_state_dict, then the full state
    gathered; rank 0 saves it for the test."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**json.loads(Path(config).read_text()))).float()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model_sd, optim_sd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd} if optim else {"model": model_sd}
    dcp.load(state, checkpoint_id=ckpt)
    if optim:
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:
        set_model_state_dict(model, model_sd)
    full_model = get_model_state_dict(model, options=_FULL)
    full_optim = get_optimizer_state_dict(model, opt, options=_FULL)
    if rank == 0:
        torch.save({"model": full_model, "optim": full_optim}, out)


@pytest.mark.parametrize("target", [2, 3])
@pytest.mark.parametrize(
    "name",
    [
        "fsdp2_ws2",
        "fsdp2_ws3",
        "fsdp2_hsdp_ws4",
        "fsdp1_ws2",
        "fsdp1_ws3_tied",
        "fsdp1_ws3_tied_orig_params",
        "fsdp1_mesh_ws3_tied",
        "fsdp1_mesh_hsdp_ws4",
    ],
)
def test_resharded_verl_checkpoint_resumes_in_fsdp2(name: str, target: int, tmp_path: Path) -> None:
    """FSDP1 runs included: their optimizer files hold FlatParameter shards, placed on the
    parameters by FSDP's own flattening rule (padding at 3 ranks, the tied embedding once), or,
    with use_orig_params=True, each rank's slice of every parameter."""
    src, out = VERL / name, tmp_path / "dcp"
    result = CliRunner().invoke(
        cli, ["reshard", str(src), str(out), "--world-size", str(target), "--json", "-q"]
    )
    assert result.exit_code == 0, result.output
    assert any("extra_state" in n for n in json.loads(result.output)["notes"])
    got_path = tmp_path / "resumed.pt"
    config = str(src / "huggingface" / "config.json")
    run_ranks(_resume_and_gather, target, config, str(out), str(got_path), timeout=300)
    got: dict[str, Any] = torch.load(got_path, weights_only=True)
    ref = load_reference(VERL / f"{name}.reference.pt")
    assert_bitwise_equal(got["model"], ref["model"])
    assert got["optim"]["state"].keys() == ref["optim"]["state"].keys()
    assert_bitwise_equal(got["optim"]["state"], ref["optim"]["state"])
    # FSDP.optim_state_dict lists FSDP1's parameters FlatParameter by FlatParameter (the root's
    # first); the FSDP2 job lists its own in model order: the same parameters
    got_params = got["optim"]["param_groups"][0]["params"]
    ref_params = ref["optim"]["param_groups"][0]["params"]
    if name.startswith("fsdp1"):
        got_params, ref_params = sorted(got_params), sorted(ref_params)
    assert got_params == ref_params


def test_fsdp1_model_reshards_with_drop_optimizer_and_resumes(tmp_path: Path) -> None:
    """``--drop-optimizer`` carries an FSDP1 run's model alone."""
    src, out = VERL / "fsdp1_ws2", tmp_path / "dcp"
    result = CliRunner().invoke(
        cli, ["reshard", str(src), str(out), "--world-size", "3", "--drop-optimizer", "-q"]
    )
    assert result.exit_code == 0, result.output
    got_path = tmp_path / "resumed.pt"
    config = str(src / "huggingface" / "config.json")
    run_ranks(_resume_and_gather, 3, config, str(out), str(got_path), False, timeout=300)
    got: dict[str, Any] = torch.load(got_path, weights_only=True)
    assert_bitwise_equal(got["model"], load_reference(VERL / "fsdp1_ws2.reference.pt")["model"])
