"""Model builders for the training-hook tests: one TinyLlama, wrapped every way users wrap it.

``build(kind, world_size)`` returns ``(module_to_train, optimizer)``; every rank calls it (FSDP
wrapping is collective). Kinds are ``+``-joined options on a base:

* bases: ``plain``, ``ddp``, ``fsdp2``, ``hsdp2`` (2-D mesh), ``fsdp1-full``, ``fsdp1-grad``
  (SHARD_GRAD_OP), ``fsdp1-hybrid`` (HYBRID_SHARD over a (replicate, shard) mesh), ``fsdp1-none``
  (NO_SHARD);
* options: ``mp`` (bf16 mixed precision), ``offload`` (FSDP1 CPUOffload; CUDA only), ``ac``
  (activation checkpointing wrappers on each block), ``compile`` (``torch.compile`` with the cheap
  "eager" backend: the wrapper and its ``_orig_mod.`` keys are what matters, not Inductor's code,
  which would take minutes to build on a CPU-only CI machine).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.support.producers import DEFAULT_CONFIG, Block, ModelConfig, TinyLlama

LR = 1e-2


def _fsdp1(model: nn.Module, base: str, opts: set[str], world_size: int) -> nn.Module:
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    strategy = {
        "fsdp1-full": ShardingStrategy.FULL_SHARD,
        "fsdp1-grad": ShardingStrategy.SHARD_GRAD_OP,
        "fsdp1-hybrid": ShardingStrategy.HYBRID_SHARD,
        "fsdp1-none": ShardingStrategy.NO_SHARD,
    }[base]
    kwargs: dict[str, Any] = {}
    if base == "fsdp1-hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        # HYBRID_SHARD otherwise derives its groups from CUDA devices per node.
        replicas = 2 if world_size % 2 == 0 and world_size > 2 else 1
        kwargs["device_mesh"] = init_device_mesh(
            "cpu", (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard")
        )
    if "mp" in opts:
        kwargs["mixed_precision"] = MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
        )
    if "offload" in opts:
        # Needs CUDA: FSDP1's offload pins host memory and syncs device streams.
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    return FSDP(
        model,
        device_id=torch.device("cpu"),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=strategy,
        use_orig_params=True,
        **kwargs,
    )


def _fsdp2(model: TinyLlama, base: str, opts: set[str], world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if base == "hsdp2":
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if "mp" in opts:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for block in model.model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def build(
    kind: str, world_size: int, cfg: ModelConfig = DEFAULT_CONFIG
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A freshly initialised (same values on every rank) model wrapped as ``kind``, and AdamW."""
    base, *rest = kind.split("+")
    opts = set(rest)
    torch.manual_seed(0)
    model: nn.Module = TinyLlama(cfg)
    if "ac" in opts:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    if base == "plain":
        pass
    elif base == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif base in ("fsdp2", "hsdp2"):
        _fsdp2(model, base, opts, world_size)  # type: ignore[arg-type]
    elif base.startswith("fsdp1-"):
        model = _fsdp1(model, base, opts, world_size)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    if "compile" in opts:
        model = torch.compile(model, backend="eager")  # type: ignore[assignment]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    return model, opt


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(_warmup, warmup=4))


def _warmup(step: int, warmup: int) -> float:
    return min(1.0, (step + 1) / warmup)


def batch(step: int, cfg: ModelConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """The micro-batch of ``step``: the same on every rank, so the averaged gradient (and thus
    training) does not depend on the world size: a mean of equal values is exact."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, cfg.vocab, (2, 7), generator=g)


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    step: int,
    sched: Any = None,
    cfg: ModelConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    tokens = batch(step, cfg)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()
    return loss.detach().clone()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def train_with_manager(
    rank: int,
    world_size: int,
    root: str,
    kind: str,
    resume: bool,
    async_save: bool,
    total_steps: int,
    save_at: int,
) -> dict[int, bytes]:
    """A rank of a job with a ``CheckpointManager`` at ``root``: train to ``total_steps``,
    saving after step ``save_at`` (or, with ``resume``, restoring from it first). Returns the
    loss of each step run, as raw bytes (for bit-exact comparison with a run that never stopped).
    """
    import ckptools

    model, opt = build(kind, world_size)
    sched = scheduler(opt)
    mgr = ckptools.CheckpointManager(root, keep_last=2, async_save=async_save)
    start = 0
    if resume:
        restored = mgr.restore(model, opt, extra={"sched": sched})
        assert restored is not None
        start, extra = restored
        assert extra["step"] == start == save_at
    losses: dict[int, bytes] = {}
    for step in range(start, total_steps):
        loss = train_step(model, opt, step, sched)
        losses[step] = loss.numpy().tobytes()
        if not resume and step + 1 == save_at:
            mgr.save(save_at, model, opt, extra={"step": save_at, "sched": sched})
    mgr.close()
    return losses
