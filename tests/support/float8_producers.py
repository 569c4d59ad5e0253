"""Real torchao float8 training checkpoints, written by torchao 0.18 and torch's ``dcp.save``.

``convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))``
swaps each ``nn.Linear`` for a ``Float8Linear`` whose weight is a
``torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor`` holding the high-precision weight
in ``_tensor``; ``dcp.save`` pickles those items as the subclass. Each producer writes, beside the
checkpoint, the truth taken by torchao's own attribute (``weight._tensor``), never by ckptools:

* :func:`one_process`: ``dcp.save(model.state_dict())`` of a bf16 model in one process
  (``float8/``), the same weights saved as plain tensors (``plain/``) and ``truth.pt``;
* :func:`fsdp2`: a 2-rank FSDP2 job (gloo, ``init_device_mesh("cpu")``, ``fully_shard``) with
  float8 all-gather and AdamW, saved as ``{"model", "optim"}`` from ``get_state_dict``
  (``ckpt/``), and ``truth.pt``: every saved tensor whole (rank 0 gathers the local plain
  shards, dim 0 in rank order, as FSDP2 shards them). Gloo cannot all-gather float8, so the
  job does not run forward: each step sets fixed gradients and takes an AdamW step, which
  makes the optimizer state a trained run saves, in the same form.

``torchao`` is imported inside the producers only, so a process that loads the outputs (the
tests' "without torchao" checks) never imports it through this module.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

IN, HIDDEN, OUT = 32, 48, 16


def plain_model(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """The model's plain form (no float8): what a job without torchao loads the weights into."""
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT, bias=False)).to(
        dtype
    )


def _float8_model(dtype: torch.dtype) -> nn.Sequential:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = plain_model(dtype)
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config)
    return model


def _unwrapped(value: Any) -> Any:
    """The plain tensor torchao keeps in a float8 training wrapper (its own ``_tensor``)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    if isinstance(value, WeightWithDynamicFloat8CastTensor):
        return value._tensor
    return value


def one_process(root: Path) -> None:
    """``float8/`` (torchao's wrappers), ``plain/`` (the same weights as plain tensors) and
    ``truth.pt`` ({fqn: plain tensor}) under ``root``."""
    import torch.distributed.checkpoint as dcp
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    model = _float8_model(torch.bfloat16)
    state = model.state_dict()
    assert isinstance(state["0.weight"], WeightWithDynamicFloat8CastTensor)
    plain = {k: _unwrapped(v).detach().clone() for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(root / "float8"), no_dist=True)
        dcp.save(plain, checkpoint_id=str(root / "plain"), no_dist=True)
    torch.save(plain, root / "truth.pt")


def fsdp2(rank: int, world_size: int, out: str) -> None:
    """The FSDP2 float8 job (every rank calls it; see the module's docstring)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    model = _float8_model(torch.float32)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(2):
        for i, p in enumerate(model.parameters()):
            # a gradient that differs per element, so every moment's rows are told apart
            p.grad = p.detach() * 0.1 + 0.01 * (i + 1 + step)
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    local = model_sd["0.weight"].to_local()
    assert isinstance(local, WeightWithDynamicFloat8CastTensor), type(local)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.save(state, checkpoint_id=os.path.join(out, "ckpt"))

    # the truth: each saved tensor's local plain shard, gathered whole on rank 0
    flat: dict[str, Any] = {f"model.{k}": v for k, v in model_sd.items()}
    for fqn, per_param in optim_sd["state"].items():
        flat.update({f"optim.state.{fqn}.{k}": v for k, v in per_param.items()})
    mine = {
        k: _unwrapped(v.to_local() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in flat.items()
    }
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        truth = {
            k: torch.cat([g[k] for g in gathered]) if isinstance(flat[k], DTensor) else mine[k]
            for k in mine
        }
        torch.save(truth, os.path.join(out, "truth.pt"))


def produce_fsdp2(root: Path) -> None:
    """``ckpt/`` and ``truth.pt`` under ``root``, from a 2-rank run."""
    from tests.support.dist import run_ranks

    run_ranks(fsdp2, 2, str(root))


def load_plain_fsdp2(rank: int, world_size: int, path: str, out: str) -> None:
    """A plain FSDP2 job (no float8, torchao unimportable) that ``dcp.load``s ``path`` into its
    model and the AdamW moments, then saves what it holds, gathered whole, to ``out``."""
    import sys

    for name in [m for m in sys.modules if m.split(".")[0] == "torchao"]:
        del sys.modules[name]  # a forked rank may have inherited it
    sys.modules["torchao"] = None  # type: ignore[assignment]  # importing it now fails
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = plain_model()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for p in model.parameters():  # AdamW's state exists to be loaded into
        p.grad = torch.zeros_like(p)
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_sd, optim_sd = get_state_dict(model, opt)
    flat: dict[str, Any] = {f"model.{k}": v for k, v in model_sd.items()}
    for fqn, per_param in optim_sd["state"].items():
        flat.update({f"optim.state.{fqn}.{k}": v for k, v in per_param.items()})
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in flat.items()}
    assert "torchao" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in full.items()}, out)
    dist.barrier()
