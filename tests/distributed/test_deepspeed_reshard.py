"""`ckpt reshard` of DeepSpeed ZeRO 1/2/3 checkpoints (written by real DeepSpeed engines on gloo
ranks, :mod:`tests.support.deepspeed_producers`) into DCPs that an FSDP2 job with torch's AdamW
resumes with ``dcp.load`` + ``set_state_dict``: the gathered model equal to DeepSpeed's live fp32
masters (the tied head included) and exp_avg / exp_avg_sq / step equal to its live optimizer,
bit for bit; what FSDP2 has no place for (the loss scaler) named in the result."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support import deepspeed_producers
from tests.support.deepspeed_producers import (
    MOMENTS,
    TAG,
    case_dir,
    deepspeed_available,
    produce_zero,
)

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.deepspeed,
    pytest.mark.skipif(
        not deepspeed_available(), reason="DeepSpeed is not installed (make setup installs it)"
    ),
]

STAGES = (1, 2, 3)
#: (source world, stage, dtype, target world): one DeepSpeed launch per source world (~20 s at
#: 2, ~40 s at 3) and one FSDP2 job per case; all but one case are slow
CASES = [
    pytest.param(
        sw,
        s,
        d,
        tw,
        id=f"w{sw}-zero{s}-{d}-to-{tw}",
        marks=[] if (sw, s, d, tw) == (2, 2, "fp32", 3) else [pytest.mark.slow],
    )
    for sw, dtypes, targets in ((2, ("fp32",), (2, 3)), (3, ("fp32", "bf16"), (2,)))
    for s in STAGES
    for d in dtypes
    for tw in targets
]


@pytest.fixture(scope="module")
def zero(cached_output: Callable[..., Path]) -> Callable[..., str]:
    """``zero(stage, world=2, dtype="fp32")``: the run directory of that checkpoint, made once
    per world size (fp32 at 2 ranks; fp32 and bf16 at 3), kept across sessions while DeepSpeed
    and its producer are unchanged."""
    made: dict[int, str] = {}

    def get(stage: int, world: int = 2, dtype: str = "fp32") -> str:
        if world not in made:
            dts = ("fp32",) if world == 2 else ("fp32", "bf16")
            cases = [(s, d) for s in STAGES for d in dts]
            out = cached_output(
                f"zero-w{world}-" + "-".join(f"{s}{d}" for s, d in cases),
                [Path(deepspeed_producers.__file__)],
                lambda d: produce_zero(str(d), world, cases),
            )
            made[world] = str(out)
        return case_dir(made[world], stage, dtype)

    return get


def _resume_and_gather(rank: int, world_size: int, ckpt: str, out: str) -> None:
    """An FSDP2 job with the producers' model and the same AdamW: dcp.load + set_state_dict from
    the resharded checkpoint, then the full state gathered (rank 0 saves it for the test)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.support.deepspeed_producers import _model

    model = _model()
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model, mesh=mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_model = get_model_state_dict(model, options=full)
    full_optim = get_optimizer_state_dict(model, opt, options=full)
    if rank == 0:
        torch.save({"model": full_model, "optim": full_optim}, out)


def _same_bits(a: Any, b: Any) -> bool:
    import torch

    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
        )
    )


def _digests(path: str) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            p = os.path.join(root, name)
            out[os.path.relpath(p, path)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


@pytest.mark.parametrize(("source_world", "stage", "dtype", "world_size"), CASES)
def test_zero_checkpoint_resumes_in_fsdp2(
    zero: Callable[..., str],
    tmp_path: Path,
    source_world: int,
    stage: int,
    dtype: str,
    world_size: int,
) -> None:
    import torch
    from click.testing import CliRunner

    from ckptools.cli.main import cli
    from tests.support.dist import run_ranks

    path = zero(stage, source_world, dtype)
    before = _digests(path)
    out = tmp_path / "dcp"
    args = ["reshard", path, str(out), "--world-size", str(world_size), "--json", "-q"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert _digests(path) == before  # the source is never modified
    notes = json.loads(result.output)["notes"]
    assert any("not carried over" in n and "loss scaler" in n for n in notes), notes
    # the files that are not the checkpoint's data (DeepSpeed's own zero_to_fp32.py...) are named
    # as not carried over, as every layout's are (issue 25, item 6)
    import ckptools

    manifest = ckptools.read_manifest(path)
    left = sorted(set(before) - set(manifest.files) - set(manifest.markers))
    assert "zero_to_fp32.py" in left, left
    assert any(
        n.startswith(f"{len(left)} file(s) of the source were not carried over: {left[0]}")
        for n in notes
    ), notes
    gathered = tmp_path / "gathered.pt"
    run_ranks(_resume_and_gather, world_size, str(out), str(gathered), timeout=180)
    got = torch.load(gathered, weights_only=True)
    live = torch.load(os.path.join(path, "live.pt"), weights_only=True)
    live_optim = torch.load(os.path.join(path, "live_optim.pt"), weights_only=True)
    model, state = got["model"], got["optim"]["state"]
    assert set(live) == set(state) == {
        "embed.weight", "mid.weight", "mid.bias", "norm.weight", "norm.bias",
    }  # fmt: skip
    for name, want in live.items():
        assert _same_bits(model[name], want), name
        for kind in MOMENTS:
            assert _same_bits(state[name][kind], live_optim["moments"][name][kind]), (name, kind)
        (step,) = {float(s) for s in live_optim["steps"]}  # one group: one counter
        assert _same_bits(state[name]["step"], torch.tensor(step)), name
    # the tied head is present (dcp.load would fail without it) and is the embedding's masters
    assert _same_bits(model["head.weight"], live["embed.weight"])
    # frozen parameters and the buffer: as DeepSpeed's zero_to_fp32 restores them, or (its
    # stage 1 does not list frozen parameters) as the 16-bit module holds them whole
    ref = torch.load(os.path.join(path, "zero_to_fp32.pt"), weights_only=True)
    module = _module(path, stage)
    for name in ("frozen.weight", "frozen.bias", "scale"):
        want = ref[name] if name in ref else module[name]
        # saved in 16 bits by a bf16 run: loaded into the fp32 model, an exact widening
        assert _same_bits(model[name], want.to(model[name].dtype)), name
    (group,) = got["optim"]["param_groups"]
    assert group["params"] == list(live)
    assert (group["lr"], group["weight_decay"], tuple(group["betas"])) == (1e-2, 0.1, (0.9, 0.999))


def _module(path: str, stage: int) -> dict[str, Any]:
    import torch

    name = (
        "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    )
    sd = torch.load(os.path.join(path, TAG, name), weights_only=False)
    return dict(sd["module"])


def test_inspect_and_consolidate_keep_to_the_model(
    zero: Callable[..., str], tmp_path: Path
) -> None:
    """The optimizer named in the manifest stays out of what exports the model."""
    import ckptools
    from ckptools.core.keys import model_keys
    from ckptools.producers import read_manifest

    path = zero(2)
    manifest = read_manifest(path)
    model = set(model_keys(manifest))
    assert "head.weight" in model and not any(n.startswith("optimizer") for n in model)
    assert "optimizer.state.embed.weight.exp_avg_sq" in manifest.tensors
    result = ckptools.consolidate(path, str(tmp_path / "hf"), quiet=True, weights_only=True)
    assert result.to_dict()["tensors"] == len(model)
    assert ckptools.verify(path, quiet=True).ok


def test_step_saved_as_a_number_is_written_as_a_tensor(
    zero: Callable[..., str], tmp_path: Path
) -> None:
    """An optimizer that keeps ``step`` as a number (older torch; re-saved here by hand) still
    gives ``dcp.load`` the 0-dim float32 tensor torch's AdamW expects, for every parameter."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import ckptools

    path = str(tmp_path / "ckpt")
    shutil.copytree(zero(2), path)
    for r in range(2):
        rank_file = os.path.join(path, TAG, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        sd = torch.load(rank_file, weights_only=False)
        state = sd["optimizer_state_dict"]["base_optimizer_state"]["state"]
        assert isinstance(state[0]["step"], torch.Tensor)
        state[0]["step"] = 7
        torch.save(sd, rank_file)
    out = tmp_path / "dcp"
    ckptools.reshard(path, str(out), world_size=2, quiet=True)
    flat = tmp_path / "flat.pt"
    dcp_to_torch_save(str(out), str(flat))
    optim = torch.load(flat, weights_only=True)["optim"]
    assert set(optim["state"]) == {
        "embed.weight",
        "mid.weight",
        "mid.bias",
        "norm.weight",
        "norm.bias",
    }
    for name, entry in optim["state"].items():
        assert _same_bits(entry["step"], torch.tensor(7.0)), name
