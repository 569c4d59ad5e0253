"""`ckpt reshard` of `torch.save` training checkpoints (DDP scripts' `{"model", "optimizer",
"step"}` files, written here by real DDP on gloo ranks) into DCPs that an FSDP2 job at another
world size resumes with `set_state_dict`, model and AdamW state bit-exact; and the refusals
when a file does not say which optimizer state belongs to which parameter."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
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
    set_state_dict,
)

from ckptools.cli.main import cli
from tests.conftest import Produced
from tests.support.dist import run_ranks
from tests.support.producers import DEFAULT_CONFIG, TinyLlama
from tests.support.reference import assert_bitwise_equal, load_reference

pytestmark = pytest.mark.distributed
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _groups(model: torch.nn.Module, groups: int, named: bool, prefix: str = "") -> list[Any]:
    """The optimizer's param groups: one, or decay / no-decay as training scripts split them
    (norms and 1-D params without weight decay); with ``named`` as (name, param) pairs, which
    makes torch >= 2.5 store ``param_names``."""
    pairs = [(prefix + n, p) for n, p in model.named_parameters()]
    items: list[Any] = pairs if named else [p for _, p in pairs]
    if groups == 1:
        return [{"params": items}]
    decay = [x for x, (_, p) in zip(items, pairs, strict=True) if p.ndim > 1]
    rest = [x for x, (_, p) in zip(items, pairs, strict=True) if p.ndim <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _ddp_train_and_save(
    rank: int, world_size: int, out: str, ref: str, groups: int, named: bool, tied: bool
) -> None:
    """A DDP script: train two steps on per-rank batches, rank 0 saves the usual file; and the
    reference: the full, FQN-keyed state (torch's own get_state_dict on the unwrapped model)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = TinyLlama(dataclasses.replace(DEFAULT_CONFIG, tied=tied))
    ddp = DDP(model)
    opt = torch.optim.AdamW(_groups(ddp, groups, named), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(2):
        tokens = torch.randint(0, DEFAULT_CONFIG.vocab, (2, 7), generator=g)
        ddp(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    if rank == 0:
        torch.save({"model": ddp.state_dict(), "optimizer": opt.state_dict(), "step": 2}, out)
        torch.save(
            {
                "model": get_model_state_dict(model, options=_FULL),
                "optim": get_optimizer_state_dict(model, opt, options=_FULL),
            },
            ref,
        )


def _resume_and_gather(
    rank: int, world_size: int, ckpt: str, out: str, groups: int, named: bool, tied: bool
) -> None:
    """An FSDP2 job at this world size: dcp.load + set_state_dict from the resharded checkpoint,
    then the full state gathered (rank 0 saves it for the test)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = TinyLlama(dataclasses.replace(DEFAULT_CONFIG, tied=tied))
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(_groups(model, groups, named), lr=1e-2)
    model_sd, optim_sd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    full_model = get_model_state_dict(model, options=_FULL)
    full_optim = get_optimizer_state_dict(model, opt, options=_FULL)
    if rank == 0:
        torch.save({"model": full_model, "optim": full_optim}, out)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _reshard(src: Path, out: Path, world_size: int, *extra: str) -> Any:
    return CliRunner().invoke(
        cli,
        ["reshard", str(src), str(out), "--world-size", str(world_size), "--json", "-q", *extra],
    )


def _json_error(output: str) -> str:
    """The one-line message of a ``--json`` command's error object."""
    report = json.loads(output)
    assert report["exit_code"] == 1 and "\n" not in report["error"], report
    return str(report["error"])


def _written(tmp_path: Path, groups: int, named: bool, tied: bool = False) -> tuple[Path, Path]:
    src, ref = tmp_path / "checkpoint.pth", tmp_path / "reference.pt"
    run_ranks(_ddp_train_and_save, 2, str(src), str(ref), groups, named, tied, timeout=180)
    return src, ref


def _resumes(
    src: Path, ref: Path, tmp_path: Path, world_size: int, *cfg: Any, extra: tuple[str, ...] = ()
) -> None:
    before = _digest(src)
    out = tmp_path / f"dcp-{world_size}"
    result = _reshard(src, out, world_size, *extra)
    assert result.exit_code == 0, result.output
    assert _digest(src) == before
    gathered = tmp_path / f"gathered-{world_size}.pt"
    run_ranks(_resume_and_gather, world_size, str(out), str(gathered), *cfg, timeout=180)
    full = torch.load(gathered, weights_only=True)
    expected = torch.load(ref, weights_only=True)
    assert_bitwise_equal(full["model"], expected["model"], "model")
    assert_bitwise_equal(full["optim"]["state"], expected["optim"]["state"], "optim.state")
    for got, want in zip(full["optim"]["param_groups"], expected["optim"]["param_groups"],
                         strict=True):  # fmt: skip
        if "param_names" in want:
            # named by the DDP-wrapped model (module.<fqn>): the resumed job's names are the FQNs
            want = {**want, "param_names": [n.removeprefix("module.") for n in want["param_names"]]}
            assert got["param_names"] == got["params"]
        assert got == want
    # every entry through torch's own converter: the step rides along under its own key
    whole = _dcp_to_torch_save(out, tmp_path)
    assert whole["step"] == 2
    assert_bitwise_equal(whole["model"], expected["model"], "model")


def _dcp_to_torch_save(ckpt: Path, tmp_path: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = tmp_path / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(flat))
    loaded: dict[str, Any] = torch.load(flat, weights_only=True)
    return loaded


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_one_group_without_names_resumes(tmp_path: Path, world_size: int) -> None:
    # the model's parameter order places integer ids: one group, counts and shapes all match
    src, ref = _written(tmp_path, groups=1, named=False)
    _resumes(src, ref, tmp_path, world_size, 1, False, False)


def test_two_named_groups_resume(tmp_path: Path) -> None:
    # param_names (torch >= 2.5) are the mapping; with two groups the model's order is wrong
    src, ref = _written(tmp_path, groups=2, named=True)
    _resumes(src, ref, tmp_path, 3, 2, True, False)


@pytest.mark.slow
def test_tied_model_resumes(tmp_path: Path) -> None:
    # lm_head shares the embedding's storage: one parameter for the optimizer, two model keys
    src, ref = _written(tmp_path, groups=1, named=False, tied=True)
    _resumes(src, ref, tmp_path, 2, 1, False, True)


def test_two_unnamed_groups_are_refused_then_placed_by_param_order(tmp_path: Path) -> None:
    src, ref = _written(tmp_path, groups=2, named=False)
    before = _digest(src)
    out = tmp_path / "refused"
    result = _reshard(src, out, 2)
    assert result.exit_code == 1, result.output
    lines = [_json_error(result.output)]
    assert "integer ids" in lines[0] and "--param-order" in lines[0], lines[0]
    assert "2 param group(s)" in lines[0], lines[0]
    assert not out.exists() and _digest(src) == before
    # the order the script gave the optimizer: decay group first, then the rest
    model = TinyLlama(DEFAULT_CONFIG)
    order = [n for n, p in model.named_parameters() if p.ndim > 1]
    order += [n for n, p in model.named_parameters() if p.ndim <= 1]
    order_file = tmp_path / "order.txt"
    order_file.write_text("\n".join(order) + "\n")
    _resumes(src, ref, tmp_path, 2, 2, False, False, extra=("--param-order", str(order_file)))
    # a wrong order is caught by the shapes
    order_file.write_text("\n".join(reversed(order)) + "\n")
    result = _reshard(src, tmp_path / "wrong", 2, "--param-order", str(order_file))
    assert result.exit_code == 1 and "shape" in result.output, result.output


@pytest.mark.slow
def test_drop_optimizer_writes_the_model_alone(tmp_path: Path) -> None:
    src, ref = _written(tmp_path, groups=2, named=False)
    out = tmp_path / "model-only"
    result = _reshard(src, out, 2, "--drop-optimizer")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert any("--drop-optimizer" in n for n in report["notes"]), report
    whole = _dcp_to_torch_save(out, tmp_path)
    assert set(whole) == {"model", "step"}, set(whole)
    assert_bitwise_equal(whole["model"], torch.load(ref, weights_only=True)["model"], "model")


# --- files written by the producers of tests/support/producers.py (FSDP1 tutorial, accelerate)


def _producer_resume(rank: int, world_size: int, ckpt: str, out: str) -> None:
    """An FSDP2 job with the producers' model, AdamW and scheduler (``initial_lr`` in the
    groups): dcp.load + set_state_dict, then the full state gathered (rank 0 saves it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.support.producers import _make_optimizer

    model = TinyLlama(DEFAULT_CONFIG)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, _ = _make_optimizer(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    full_model = get_model_state_dict(model, options=_FULL)
    full_optim = get_optimizer_state_dict(model, opt, options=_FULL)
    if rank == 0:
        torch.save({"model": full_model, "optim": full_optim}, out)


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_accelerate_full_state_dict_resumes(
    produced: Callable[..., Produced], tmp_path: Path, world_size: int
) -> None:
    # accelerate's FULL_STATE_DICT save: pytorch_model_fsdp.bin + an FQN-keyed optimizer.bin
    p = produced("accelerate_full")
    before = {f.name: _digest(f) for f in p.path.iterdir() if f.is_file()}
    out = tmp_path / "dcp"
    result = _reshard(p.path, out, world_size)
    assert result.exit_code == 0, result.output
    assert {f.name: _digest(f) for f in p.path.iterdir() if f.is_file()} == before
    gathered = tmp_path / "gathered.pt"
    run_ranks(_producer_resume, world_size, str(out), str(gathered), timeout=180)
    full = torch.load(gathered, weights_only=True)
    ref = load_reference(p.ref_path)
    assert_bitwise_equal(full["model"], ref["model"], "model")
    assert_bitwise_equal(full["optim"]["state"], ref["optim"]["state"], "optim.state")
    assert full["optim"]["param_groups"] == ref["optim"]["param_groups"]
    # the files beside the model (accelerate's scheduler.bin, each rank's random_states_<r>.pkl)
    # are carried over as the sharded layout's are (issue 25, item 6)
    report = json.loads(result.output)
    aux = sorted(f.name for f in p.path.iterdir() if f.name.startswith(("scheduler", "random")))
    assert aux == ["random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"]
    # every file but the model and optimizer read (config.json too)
    model_files = {"pytorch_model_fsdp.bin", "optimizer.bin"}
    assert sorted(report["copied_files"]) == sorted(
        f.name for f in p.path.iterdir() if f.name not in model_files
    )
    assert {f: _digest(out / f) for f in aux} == {f: before[f] for f in aux}
    assert report["rank_state"]["items"] == [f for f in aux if f.startswith("random_states")]
    dropped = tmp_path / "dropped"
    result = _reshard(p.path, dropped, world_size, "--rank-state", "drop")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert "scheduler.bin" in report["copied_files"] and (dropped / "scheduler.bin").exists()
    assert not [f for f in report["copied_files"] if f.startswith("random_states")]
    assert report["rank_state"]["items"] == ["random_states_0.pkl", "random_states_1.pkl"]
    assert not list(dropped.glob("random_states_*"))
    assert any("2 per-rank state item(s)" in n and "dropped" in n for n in report["notes"])


@pytest.mark.parametrize("use_orig_params", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fsdp1_tutorial_optimizer_is_named_not_resumed(
    produced: Callable[..., Produced], tmp_path: Path, use_orig_params: bool
) -> None:
    # optimizer.state_dict() of an FSDP1 model is rank 0's own shard, whatever the model's
    # FULL_STATE_DICT gathered: refused with the numbers; --drop-optimizer keeps the model
    p = produced("fsdp1_full", use_orig_params=use_orig_params)
    result = _reshard(p.path, tmp_path / "refused", 2)
    assert result.exit_code == 1, result.output
    lines = [_json_error(result.output)]
    assert "FSDP1 flat-parameter shard" in lines[0] and "--drop-optimizer" in lines[0], lines
    model = TinyLlama(DEFAULT_CONFIG)
    n_params = sum(1 for _ in model.parameters())
    n_elems = sum(p.numel() for p in model.parameters())
    assert f"the model has {n_params} parameters / {n_elems:,} elements" in lines[0], lines
    if not use_orig_params:
        assert "holds 3 flat entries" in lines[0], lines  # one per FlatParameter
    out = tmp_path / "model-only"
    result = _reshard(p.path, out, 2, "--drop-optimizer")
    assert result.exit_code == 0, result.output
    whole = _dcp_to_torch_save(out, tmp_path)
    assert_bitwise_equal(whole["model"], load_reference(p.ref_path)["model"], "model")
    assert whole["step"] == 2 and "optim" not in whole


@pytest.mark.slow
def test_shard_takes_the_model_part_alone(tmp_path: Path) -> None:
    # `ckpt shard` of a training file: the model's own FQNs (DDP's module. stripped) under model.
    src, ref = _written(tmp_path, groups=1, named=False)
    out = tmp_path / "sharded"
    args = ["shard", str(src), str(out), "--world-size", "2", "--json", "-q"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert any("`ckpt reshard` keeps them" in n for n in json.loads(result.output)["notes"])
    whole = _dcp_to_torch_save(out, tmp_path)
    assert set(whole) == {"model"}
    assert_bitwise_equal(whole["model"], torch.load(ref, weights_only=True)["model"], "model")
