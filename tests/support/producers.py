"""Deterministic producers of REAL checkpoints, written by torch's own APIs, for tests and fixtures.

Every producer writes a checkpoint and, next to it, the ground truth it gathered itself through
torch (never through ckptools), so a test can compare ckptools' output with an independent truth.

Distributed producers have the signature ``fn(rank, world_size, out, ref_path, **opts)`` and are run
through :func:`tests.support.dist.run_ranks` (or :func:`produce`, which picks the world size).
Single process producers take ``(out, ref_path)``.

The reference file (``torch.save``, loadable with ``weights_only=True``) is a dict:

* ``"model"``: ``{fqn: full tensor}`` from ``get_model_state_dict(full_state_dict=True)``;
* ``"optim"``: the full optimizer state dict in the form it was saved (FQN keyed; flattened for
  torchtitan), or None;
* ``"extra"``: every other saved entry, ``io.BytesIO`` stored as ``bytes``;
* ``"layout"``: ``{part: (subdir, key_path) or None}`` for each of "model"/"optim"/"extra": the DCP
  directory relative to ``out`` and the nested key path inside it (``()`` = merged at top level).

:mod:`tests.support.reference` turns that into the exact nested state dict each DCP directory holds,
loads it back with ``dcp.load`` and compares bit-exactly.

The model is a tiny Llama with deliberately uneven dim-0 sizes (vocab 37, hidden 10, 5 heads of 2,
one KV head so k/v projections have 2 rows, MLP 23): over 3 or 4 ranks some shards are uneven and
the k/v shards of the last ranks are empty.

Example:
    >>> from tests.support.producers import produce
    >>> produce("fsdp2", "/tmp/ck", "/tmp/ck.reference.pt", extra=True)  # doctest: +SKIP
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import glob
import io
import json
import math
import os
import pathlib
import pickle
import random
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
)

from tests.support.dist import run_ranks

__all__ = [
    "DEFAULT_CONFIG",
    "FIXTURE_CONFIG",
    "PRODUCERS",
    "TP_CONFIG",
    "ModelConfig",
    "TinyLlama",
    "accelerate_fsdp",
    "accelerate_full",
    "big_many_tensors_metadata",
    "ddp_torch_save",
    "flip_bit",
    "fsdp1",
    "fsdp1_full",
    "fsdp2",
    "fsdp2_rank_local",
    "garble_metadata",
    "hf_sharded",
    "hsdp",
    "lightning_ckpt",
    "lightning_fsdp",
    "malicious_metadata",
    "malicious_object",
    "produce",
    "remove_rank_file",
    "single",
    "torch_save",
    "torchtitan",
    "tp_fsdp",
    "trainer_fsdp",
    "trainer_full",
    "truncate",
]

Layout = dict[str, tuple[str, tuple[str, ...]] | None]

# Seeds are fixed so every rank builds the same initial model (fully_shard/FSDP do not broadcast)
# and so two runs produce the same tensor values (file bytes still differ: DCP writes uuids).
_INIT_SEED = 1234
_BATCH_SEED = 7
_LR = 1e-2
_TRAIN_STEPS = 2
_TORCH_SAVE_OVERHEAD_BYTES = 1513

# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the tiny Llama. Sizes are uneven on purpose (see module docstring)."""

    vocab: int = 37
    hidden: int = 10
    n_heads: int = 5
    n_kv_heads: int = 1
    head_dim: int = 2
    intermediate: int = 23
    n_layers: int = 2
    tied: bool = False
    style: Literal["hf", "titan"] = "hf"


DEFAULT_CONFIG = ModelConfig()
# Tensor parallelism splits heads across the tp ranks, so heads and KV heads must divide by tp=2;
# the MLP width must too, because RowwiseParallel rebuilds its input with DTensor.from_local, which
# assumes even shards. FSDP's dim-0 shards stay uneven (vocab 37, MLP 22 -> 11 per tp rank -> 6/5).
TP_CONFIG = ModelConfig(n_heads=4, n_kv_heads=2, head_dim=2, intermediate=22)

# Checked-in fixtures must stay well under 100 KB per directory, and DCP stores every chunk as its
# own torch.save blob (~1.5 KB of zip records each): with AdamW state a parameter costs 7 blobs at
# world size 2, so fixtures use the embedding, final norm and head only (still uneven: 37 -> 19/18,
# 5 -> 3/2).
FIXTURE_CONFIG = ModelConfig(hidden=5, n_layers=0)

# Module names as HF Llama (LlamaForCausalLM) and torchtitan's Llama spell them, so checkpoints
# carry the FQNs the real tools write.
_NAMES: dict[str, dict[str, str]] = {
    "hf": {
        "attn": "self_attn", "q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
        "mlp": "mlp", "gate": "gate_proj", "up": "up_proj", "down": "down_proj",
        "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
    },
    "titan": {
        "attn": "attention", "q": "wq", "k": "wk", "v": "wv", "o": "wo",
        "mlp": "feed_forward", "gate": "w1", "up": "w3", "down": "w2",
        "attn_norm": "attention_norm", "mlp_norm": "ffn_norm",
    },
}  # fmt: skip


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, names: dict[str, str]) -> None:
        super().__init__()
        self._n = names
        self._head_dim = cfg.head_dim
        q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.add_module(names["q"], nn.Linear(cfg.hidden, q_out, bias=False))
        self.add_module(names["k"], nn.Linear(cfg.hidden, kv_out, bias=False))
        self.add_module(names["v"], nn.Linear(cfg.hidden, kv_out, bias=False))
        self.add_module(names["o"], nn.Linear(q_out, cfg.hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Head counts come from the local output width, so the same code runs tensor-parallel (each
        # tp rank holds whole heads) and unsharded.
        q = self.get_submodule(self._n["q"])(x).view(b, t, -1, self._head_dim).transpose(1, 2)
        k = self.get_submodule(self._n["k"])(x).view(b, t, -1, self._head_dim).transpose(1, 2)
        v = self.get_submodule(self._n["v"])(x).view(b, t, -1, self._head_dim).transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(b, t, -1)
        result: torch.Tensor = self.get_submodule(self._n["o"])(out)
        return result


class _MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, names: dict[str, str]) -> None:
        super().__init__()
        self._n = names
        self.add_module(names["gate"], nn.Linear(cfg.hidden, cfg.intermediate, bias=False))
        self.add_module(names["up"], nn.Linear(cfg.hidden, cfg.intermediate, bias=False))
        self.add_module(names["down"], nn.Linear(cfg.intermediate, cfg.hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.get_submodule(self._n["gate"])(x)
        up = self.get_submodule(self._n["up"])(x)
        result: torch.Tensor = self.get_submodule(self._n["down"])(F.silu(gate) * up)
        return result


class Block(nn.Module):
    """One decoder layer: the unit FSDP wraps."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = _NAMES[cfg.style]
        self._n = n
        self.add_module(n["attn"], _Attention(cfg, n))
        self.add_module(n["mlp"], _MLP(cfg, n))
        self.add_module(n["attn_norm"], nn.RMSNorm(cfg.hidden, eps=1e-6))
        self.add_module(n["mlp_norm"], nn.RMSNorm(cfg.hidden, eps=1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self._n
        x = x + self.get_submodule(n["attn"])(self.get_submodule(n["attn_norm"])(x))
        result: torch.Tensor = x + self.get_submodule(n["mlp"])(
            self.get_submodule(n["mlp_norm"])(x)
        )
        return result


class _Backbone(nn.Module):
    """``LlamaModel``: what HF keeps under the ``model.`` prefix."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=1e-6)


class TinyLlama(nn.Module):
    """Llama-shaped model with HF FQNs (``model.layers.0.self_attn.q_proj.weight``,
    ``lm_head.weight``)
    or torchtitan FQNs (``layers.0.attention.wq.weight``, ``output.weight``), per ``cfg.style``."""

    def __init__(self, cfg: ModelConfig = DEFAULT_CONFIG) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.style == "hf":
            self.model = _Backbone(cfg)
            self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        else:
            self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
            self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.norm = nn.RMSNorm(cfg.hidden, eps=1e-6)
            self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied:
            self._head().weight = self._embedding().weight
        _init_deterministically(self)

    def _embedding(self) -> nn.Embedding:
        return self.model.embed_tokens if self.cfg.style == "hf" else self.tok_embeddings

    def _head(self) -> nn.Linear:
        return self.lm_head if self.cfg.style == "hf" else self.output

    def blocks(self) -> list[Block]:
        layers = self.model.layers if self.cfg.style == "hf" else self.layers
        return [b for b in layers if isinstance(b, Block)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self._embedding()(tokens)
        # Every layer, wrapped or not: FSDP1 and checkpoint wrappers replace the Block instances
        # in the ModuleList, so ``blocks()`` (which finds what to wrap) must not drive forward.
        for layer in self.model.layers if self.cfg.style == "hf" else self.layers:
            x = layer(x)
        norm = self.model.norm if self.cfg.style == "hf" else self.norm
        logits: torch.Tensor = self._head()(norm(x))
        return logits


class LitModule(nn.Module):
    """Stands in for a ``LightningModule`` holding the network as ``self.model`` (FQNs
    ``model.<network fqn>``)."""

    def __init__(self, cfg: ModelConfig = DEFAULT_CONFIG) -> None:
        super().__init__()
        self.model = TinyLlama(cfg)

    def blocks(self) -> list[Block]:
        return self.model.blocks()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(tokens)
        return logits


def _init_deterministically(model: nn.Module) -> None:
    # Default inits give RMSNorm weights of all ones, which would hide a misplaced chunk; every
    # parameter gets distinct values instead.
    g = torch.Generator().manual_seed(_INIT_SEED)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _batch(cfg: ModelConfig) -> torch.Tensor:
    g = torch.Generator().manual_seed(_BATCH_SEED)
    return torch.randint(0, cfg.vocab, (2, 7), generator=g)


def _linear_warmup(step: int, warmup_steps: int) -> float:
    return min(1.0, (step + 1) / warmup_steps)


def _make_optimizer(
    model: nn.Module,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    opt = torch.optim.AdamW(model.parameters(), lr=_LR, weight_decay=0.01)
    # functools.partial, as torchtitan and transformers build theirs, so the scheduler state_dict
    # looks the same (lr_lambdas holds the partial's empty __dict__).
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, functools.partial(_linear_warmup, warmup_steps=4)
    )
    return opt, sched


def _train(
    model: nn.Module,
    cfg: ModelConfig,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler | None = None,
    steps: int = _TRAIN_STEPS,
) -> None:
    """A few AdamW steps on a fixed batch so exp_avg, exp_avg_sq and step exist."""
    tokens = _batch(cfg)
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


# --------------------------------------------------------------------------------------------------
# Helpers shared by producers
# --------------------------------------------------------------------------------------------------

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _gather_reference(
    model: nn.Module,
    opt: torch.optim.Optimizer | None,
    *,
    flatten_optimizer: bool = False,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Full model/optimizer state dicts gathered by torch. Collective: every rank calls it; rank 0
    gets the values (the others get empty dicts with cpu_offload, full copies without)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    # torch 2.13: for an FSDP1 model on CPU, full_state_dict=True with cpu_offload=True (FSDP1's
    # FullStateDictConfig(offload_to_cpu=True, rank0_only=True)) segfaults in
    # fsdp/_state_dict_utils.py _full_post_state_dict_hook -> param_hook (the clone of an unsharded
    # param). Without offload every rank gathers the full tensors, which is fine at this size.
    offload = not isinstance(model, FSDP)
    opts = dataclasses.replace(
        _FULL, cpu_offload=offload, flatten_optimizer_state_dict=flatten_optimizer
    )
    model_sd = get_model_state_dict(model, options=opts)
    optim_sd = get_optimizer_state_dict(model, opt, options=opts) if opt is not None else None
    return model_sd, optim_sd


def _plain(value: Any) -> Any:
    """Copy of a saved value as the reference stores it: tensors cloned contiguous, BytesIO as
    bytes."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().contiguous()
    if isinstance(value, io.BytesIO):
        return value.getvalue()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def _save_reference(
    ref_path: str | os.PathLike[str],
    model_sd: dict[str, Any],
    optim_sd: dict[str, Any] | None,
    layout: Layout,
    extra: dict[str, Any] | None = None,
) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(ref_path)), exist_ok=True)
    torch.save(
        {
            "model": _plain(model_sd),
            "optim": _plain(optim_sd),
            "extra": _plain(extra or {}),
            "layout": layout,
        },
        os.fspath(ref_path),
    )


def _save_one_process(state: dict[str, Any], out: str, *, zstd: bool = False) -> None:
    with warnings.catch_warnings():
        # no_dist=True is the intent; torch still warns that it is assuming it.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if zstd:  # every item through torch's own ZStandard storage extension
            from torch.distributed.checkpoint import FileSystemWriter
            from torch.distributed.checkpoint._extension import ZStandard

            writer = FileSystemWriter(out, _extensions=[ZStandard()])
            dcp.save(state, storage_writer=writer, no_dist=True)
        else:
            dcp.save(state, checkpoint_id=out, no_dist=True)


def _describe(model: nn.Module) -> dict[str, str]:
    """This rank's view of the sharded model state dict: FQN -> type, placements and local shape.
    Collective for FSDP1 (every rank calls it). Producers return it through run_ranks."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    described: dict[str, str] = {}
    model_sd: dict[str, Any] = get_model_state_dict(model)
    for fqn, value in model_sd.items():
        if isinstance(value, DTensor):
            described[fqn] = f"DTensor {value.placements} local={tuple(value.to_local().shape)}"
        elif isinstance(value, ShardedTensor):
            shapes = [tuple(s.tensor.shape) for s in value.local_shards()]
            described[fqn] = f"ShardedTensor local={shapes}"
        else:
            described[fqn] = f"Tensor {tuple(value.shape)}"
    return described


def _reference_and_describe(
    rank: int,
    model: nn.Module,
    opt: torch.optim.Optimizer | None,
    ref_path: str | os.PathLike[str],
) -> dict[str, str]:
    """Gather the reference of a ``{"model", "optim"}`` checkpoint (rank 0 writes it) and
    describe this rank's shards. Collective."""
    ref_model, ref_optim = _gather_reference(model, opt)
    if rank == 0:
        layout: Layout = {
            "model": (".", ("model",)),
            "optim": (".", ("optim",)) if opt is not None else None,
            "extra": None,
        }
        _save_reference(ref_path, ref_model, ref_optim, layout)
    return _describe(model)


def _train_save_reference(
    rank: int,
    model: nn.Module,
    cfg: ModelConfig,
    optimizer: bool,
    out: str,
    ref_path: str | os.PathLike[str],
) -> dict[str, str]:
    """Train (with ``optimizer``), ``dcp.save`` ``{"model", "optim"}``, gather the reference on
    rank 0. Collective: every rank calls it on its wrapped model."""
    opt = None
    if optimizer:
        opt, _ = _make_optimizer(model)
        _train(model, cfg, opt)
        model_sd, optim_sd = get_state_dict(model, opt)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model)}
    dcp.save(state, checkpoint_id=out)

    return _reference_and_describe(rank, model, opt, ref_path)


def _fresh_dir(path: str | os.PathLike[str]) -> str:
    """Rank 0 empties ``path``; everyone waits. Called by every rank (collective when
    initialised)."""
    path = os.fspath(path)
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    if dist.is_initialized():
        dist.barrier()
    return path


def _fsdp2_wrap(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks():  # type: ignore[operator]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _fsdp1_wrap(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(
        model,
        device_id=torch.device("cpu"),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=True,
    )


@functools.cache
def _fsdp1_sharded_configs() -> tuple[Any, Any, Any]:
    from torch.distributed.fsdp import (
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )

    # offload_to_cpu=True: what accelerate and Lightning set for SHARDED_STATE_DICT.
    return (
        StateDictType.SHARDED_STATE_DICT,
        ShardedStateDictConfig(offload_to_cpu=True),
        ShardedOptimStateDictConfig(offload_to_cpu=True),
    )


def _fsdp1_sharded_state(
    model: nn.Module, opt: torch.optim.Optimizer | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """FSDP1 SHARDED_STATE_DICT model (ShardedTensor values) and ``FSDP.optim_state_dict``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    sd_type, sd_cfg, osd_cfg = _fsdp1_sharded_configs()
    with FSDP.state_dict_type(model, sd_type, sd_cfg, osd_cfg):
        model_sd = model.state_dict()
        optim_sd = FSDP.optim_state_dict(model, opt) if opt is not None else None
    return model_sd, optim_sd


# --------------------------------------------------------------------------------------------------
# Plain DCP producers
# --------------------------------------------------------------------------------------------------


def _extra_entries() -> dict[str, Any]:
    rng = torch.Generator().manual_seed(5).get_state().numpy().tobytes()
    return {
        "step": 7,
        "name": "run-a",
        "cfg": {"lr": 0.1, "sched": [1, 2]},
        "rng": io.BytesIO(rng),
        "dataloader": io.BytesIO(b"dataloader-state:epoch=1;offset=42"),
    }


def fsdp2(
    rank: int,
    world_size: int,
    out: str | os.PathLike[str],
    ref_path: str | os.PathLike[str],
    *,
    optimizer: bool = True,
    tied: bool = False,
    nested_app: bool = False,
    extra: bool = False,
    cfg: ModelConfig = DEFAULT_CONFIG,
    zstd: bool = False,
) -> dict[str, str]:
    """FSDP2 (``fully_shard`` per block and root, 1-D CPU mesh) saved with ``dcp.save``.

    Saves ``{"model": ..., "optim": ...}`` from ``get_state_dict`` (FQN-keyed optimizer state), or
    ``{"app": {"model": ..., "optim": ...}}`` when ``nested_app``. ``extra`` adds top-level
    non-tensor entries (int, str, nested dict with a list, two io.BytesIO). ``zstd``: every item
    compressed by torch's own ``FileSystemWriter(out, _extensions=[ZStandard()])``. Every rank
    calls it.
    """
    from torch.distributed.device_mesh import init_device_mesh

    out = _fresh_dir(out)
    cfg = dataclasses.replace(cfg, tied=tied)
    model = TinyLlama(cfg)
    _fsdp2_wrap(model, init_device_mesh("cpu", (world_size,)))
    opt = None
    if optimizer:
        opt, _ = _make_optimizer(model)
        _train(model, cfg, opt)
        model_sd, optim_sd = get_state_dict(model, opt)
        parts: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    else:
        parts = {"model": get_model_state_dict(model)}
    state: dict[str, Any] = {"app": parts} if nested_app else dict(parts)
    extras = _extra_entries() if extra else {}
    state.update(extras)
    if zstd:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint._extension import ZStandard

        dcp.save(state, storage_writer=FileSystemWriter(out, _extensions=[ZStandard()]))
    else:
        dcp.save(state, checkpoint_id=out)

    ref_model, ref_optim = _gather_reference(model, opt)
    if rank == 0:
        prefix = ("app",) if nested_app else ()
        layout: Layout = {
            "model": (".", (*prefix, "model")),
            "optim": (".", (*prefix, "optim")) if optimizer else None,
            "extra": (".", ()) if extra else None,
        }
        _save_reference(ref_path, ref_model, ref_optim, layout, extras)
    return _describe(model)


def fsdp1(
    rank: int,
    world_size: int,
    out: str | os.PathLike[str],
    ref_path: str | os.PathLike[str],
    *,
    optimizer: bool = True,
    cfg: ModelConfig = DEFAULT_CONFIG,
) -> dict[str, str]:
    """FSDP1 (auto-wrap per block, ``use_orig_params=True``) under SHARDED_STATE_DICT: saves
    ``{"model": model.state_dict()}`` (ShardedTensor) and, with ``optimizer``, ``"optim":
    FSDP.optim_state_dict(...)``. Every rank calls it."""
    out = _fresh_dir(out)
    model = _fsdp1_wrap(TinyLlama(cfg))
    opt = None
    if optimizer:
        opt, _ = _make_optimizer(model)
        _train(model, cfg, opt)
    model_sd, optim_sd = _fsdp1_sharded_state(model, opt)
    state: dict[str, Any] = {"model": model_sd}
    if optim_sd is not None:
        state["optim"] = optim_sd
    dcp.save(state, checkpoint_id=out)

    return _reference_and_describe(rank, model, opt, ref_path)


def hsdp(
    rank: int,
    world_size: int,
    out: str | os.PathLike[str],
    ref_path: str | os.PathLike[str],
    *,
    optimizer: bool = True,
    cfg: ModelConfig = DEFAULT_CONFIG,
) -> dict[str, str]:
    """HSDP: ``fully_shard`` on a 2-D mesh (2 replicas x 2 shards, world size 4); placements
    (Replicate(), Shard(0)). Saves ``{"model", "optim"}`` like :func:`fsdp2`.
    Every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    if world_size != 4:
        raise ValueError(f"hsdp needs world_size 4, got {world_size}")
    out = _fresh_dir(out)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = TinyLlama(cfg)
    _fsdp2_wrap(model, mesh)
    return _train_save_reference(rank, model, cfg, optimizer, out, ref_path)


def _tp_plan(cfg: ModelConfig) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    n = _NAMES[cfg.style]
    plan: dict[str, Any] = {}
    for key in ("q", "k", "v"):
        plan[f"{n['attn']}.{n[key]}"] = ColwiseParallel()
    plan[f"{n['attn']}.{n['o']}"] = RowwiseParallel()
    for key in ("gate", "up"):
        plan[f"{n['mlp']}.{n[key]}"] = ColwiseParallel()
    plan[f"{n['mlp']}.{n['down']}"] = RowwiseParallel()
    return plan


def tp_fsdp(
    rank: int,
    world_size: int,
    out: str | os.PathLike[str],
    ref_path: str | os.PathLike[str],
    *,
    optimizer: bool = True,
    cfg: ModelConfig = TP_CONFIG,
) -> dict[str, str]:
    """2-D parallelism, world size 4, mesh (dp=2, tp=2): ``parallelize_module`` with
    ColwiseParallel on q/k/v/gate/up (Shard(0) on tp) and RowwiseParallel on o/down (Shard(1) on
    tp), then
    ``fully_shard(..., mesh=mesh["dp"])``, which gives colwise weights a ``_StridedShard(0)`` dp
    placement. Embedding, norms and lm_head stay plain and are sharded on dp only. Saves
    ``{"model", "optim"}`` like :func:`fsdp2`. Every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    if world_size != 4:
        raise ValueError(f"tp_fsdp needs world_size 4, got {world_size}")
    out = _fresh_dir(out)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = TinyLlama(cfg)
    plan = _tp_plan(cfg)
    for block in model.blocks():
        parallelize_module(block, mesh["tp"], plan)
    _fsdp2_wrap(model, mesh["dp"])
    return _train_save_reference(rank, model, cfg, optimizer, out, ref_path)


def fsdp2_rank_local(
    rank: int,
    world_size: int,
    out: str | os.PathLike[str],
    ref_path: str | os.PathLike[str],
    *,
    optimizer: bool = True,
    extra: bool = False,
    cfg: ModelConfig = DEFAULT_CONFIG,
) -> dict[str, str]:
    """FSDP2 as :func:`fsdp2`, saved with ``dcp.save(..., use_collectives=False)`` (torch >= 2.9):
    no global plan and no ``.metadata``; each rank writes ``__{rank}_0.distcp`` and
    ``__{rank}.metadata``, which describes only that rank's chunks (and its own copy of every
    replicated entry: ``step``, ``param_groups``, ``extra`` values). Every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    out = _fresh_dir(out)
    model = TinyLlama(cfg)
    _fsdp2_wrap(model, init_device_mesh("cpu", (world_size,)))
    opt = None
    state: dict[str, Any]
    if optimizer:
        opt, _ = _make_optimizer(model)
        _train(model, cfg, opt)
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model)}
    extras = _extra_entries() if extra else {}
    state.update(extras)
    dcp.save(state, checkpoint_id=out, use_collectives=False)

    ref_model, ref_optim = _gather_reference(model, opt)
    if rank == 0:
        layout: Layout = {
            "model": (".", ("model",)),
            "optim": (".", ("optim",)) if optimizer else None,
            "extra": (".", ()) if extra else None,
        }
        _save_reference(ref_path, ref_model, ref_optim, layout, extras)
    return _describe(model)


# --------------------------------------------------------------------------------------------------
# Single-process producers
# --------------------------------------------------------------------------------------------------

# dtypes that torch.save (hence DCP) can write; uint16/32/64 are "shell" dtypes with little math
# support but they serialise.
ALL_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
    torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.uint16, torch.uint32, torch.uint64,
)  # fmt: skip


def _dtype_tensor(
    dtype: torch.dtype, g: torch.Generator, shape: tuple[int, ...] = (3, 5)
) -> torch.Tensor:
    if dtype.is_complex:
        return torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g)).to(
            dtype
        )
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).to(torch.bool)
    # Unsigned wide types: draw the signed type of the same width and reinterpret, so high bits are
    # set.
    signed = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}
    base = signed.get(dtype, dtype)
    info = torch.iinfo(base)
    drawn = torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(base)
    return drawn.view(dtype) if base != dtype else drawn


def _single_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    dtypes = {str(d).removeprefix("torch."): _dtype_tensor(d, g) for d in ALL_DTYPES}
    base = torch.randn(4, 6, generator=g)
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-45, 3.0e38])
    return {
        "model": {
            "dtypes": dtypes,
            "special_f32": special,
            "special_bf16": special.to(torch.bfloat16),
            "scalar_f32": torch.tensor(3.5),
            "scalar_i64": torch.tensor(-7),
            "scalar_bf16": torch.tensor(-1.25, dtype=torch.bfloat16),
            "empty_0x3": torch.empty((0, 3)),
            "empty_i64": torch.empty((0,), dtype=torch.int64),
            # A transposed view is saved with its strides: DCP's bytes are column-major for it.
            "transposed": base.t(),
            "strided": base[::2, 1::2],
            "list_of_tensors": [
                torch.arange(4, dtype=torch.int32),
                torch.ones(2, 2, dtype=torch.float16),
            ],
            "nested": {"deeper": {"w": torch.randn(2, 3, generator=g)}},
        },
        "extra": {
            "epoch": 3,
            "name": "single",
            "lr": 0.25,
            "none": None,
            "flag": True,
            "pair": (1, "a"),
            "milestones": [10, 20, 30],
            "nested": {"a": 1, "b": {"c": "deep"}},
            "blob": io.BytesIO(b"\x00\x01binary\xff"),
        },
    }


def single(
    out: str | os.PathLike[str], ref_path: str | os.PathLike[str], *, zstd: bool = False
) -> None:
    """One process, no process group: ``dcp.save`` of every dtype torch can save, 0-dim, zero-size
    and non-contiguous tensors, and non-tensor entries, under
    ``{"model": {...}, "extra": {...}}``; ``zstd``: through torch's ZStandard extension."""
    out = _fresh_dir(out)
    state = _single_state()
    _save_one_process(state, out, zstd=zstd)
    layout: Layout = {"model": (".", ("model",)), "optim": None, "extra": (".", ("extra",))}
    _save_reference(ref_path, state["model"], None, layout, state["extra"])


def torch_save(out_file: str | os.PathLike[str], ref_path: str | os.PathLike[str]) -> None:
    """A plain ``torch.save`` of the full (unsharded) model state dict after training."""
    cfg = DEFAULT_CONFIG
    model = TinyLlama(cfg)
    opt, _ = _make_optimizer(model)
    _train(model, cfg, opt)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
    torch.save(sd, os.fspath(out_file))
    _save_reference(ref_path, sd, None, {"model": None, "optim": None, "extra": None})


def hf_config_dict(cfg: ModelConfig = DEFAULT_CONFIG) -> dict[str, Any]:
    """A ``LlamaConfig``-shaped config.json for :class:`TinyLlama` (HF style), loadable by
    transformers."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64,
        "tie_word_embeddings": cfg.tied,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def hf_sharded(
    out: str | os.PathLike[str], ref_path: str | os.PathLike[str], *, n_shards: int = 2
) -> None:
    """HF sharded safetensors: ``model-0000i-of-0000n.safetensors`` +
    ``model.safetensors.index.json``
    (written last, as the commit) + ``config.json``; tensors are the trained TinyLlama's."""
    from safetensors.torch import save_file

    out = _fresh_dir(out)
    cfg = DEFAULT_CONFIG
    model = TinyLlama(cfg)
    opt, _ = _make_optimizer(model)
    _train(model, cfg, opt)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    names = list(sd)
    per_shard = math.ceil(len(names) / n_shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(n_shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        shard = {k: sd[k] for k in names[i * per_shard : (i + 1) * per_shard]}
        save_file(shard, os.path.join(out, fname), metadata={"format": "pt"})
        for k, t in shard.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg), f, indent=2, sort_keys=True)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(
            {"metadata": {"total_size": total}, "weight_map": weight_map},
            f,
            indent=2,
            sort_keys=True,
        )
    _save_reference(ref_path, sd, None, {"model": None, "optim": None, "extra": None})


# --------------------------------------------------------------------------------------------------
# Wrapper layouts of real tools
# --------------------------------------------------------------------------------------------------


def _accelerate_save_fsdp(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    output_dir: str,
    fsdp_version: int,
) -> None:
    """What accelerate's ``save_fsdp_model`` + ``save_fsdp_optimizer`` do for SHARDED_STATE_DICT
    (accelerate/utils/fsdp_utils.py): ``{"model": sd}`` into ``pytorch_model_fsdp_0/`` and
    ``{"optimizer": osd}`` into ``optimizer_0/``, each with its own ``dist_cp.save``.

    FSDP2: ``get_model_state_dict`` / ``get_optimizer_state_dict`` with
    ``StateDictOptions(full_state_dict=False, cpu_offload=True)`` (``_prepare_sd_options``).
    FSDP1: ``model.state_dict()`` / ``FSDP.optim_state_dict`` inside ``FSDP.state_dict_type``."""
    if fsdp_version == 2:
        opts = StateDictOptions(full_state_dict=False, cpu_offload=True, broadcast_from_rank0=False)
        model_sd: dict[str, Any] = get_model_state_dict(model, options=opts)
        optim_sd: dict[str, Any] | None = get_optimizer_state_dict(model, opt, options=opts)
    else:
        model_sd, optim_sd = _fsdp1_sharded_state(model, opt)
    model_dir = os.path.join(output_dir, "pytorch_model_fsdp_0")
    optim_dir = os.path.join(output_dir, "optimizer_0")
    os.makedirs(model_dir, exist_ok=True)
    os.makedirs(optim_dir, exist_ok=True)
    dcp.save({"model": model_sd}, storage_writer=dcp.FileSystemWriter(model_dir))
    dcp.save({"optimizer": optim_sd}, storage_writer=dcp.FileSystemWriter(optim_dir))


def _train_wrapped(
    fsdp_version: int, world_size: int, module: nn.Module, cfg: ModelConfig
) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    if fsdp_version == 2:
        from torch.distributed.device_mesh import init_device_mesh

        _fsdp2_wrap(module, init_device_mesh("cpu", (world_size,)))
        model = module
    elif fsdp_version == 1:
        model = _fsdp1_wrap(module)
    else:
        raise ValueError(f"fsdp_version must be 1 or 2, got {fsdp_version}")
    opt, sched = _make_optimizer(model)
    _train(model, cfg, opt, sched)
    return model, opt, sched


def accelerate_fsdp(
    rank: int,
    world_size: int,
    out: str | os.PathLike[str],
    ref_path: str | os.PathLike[str],
    *,
    fsdp_version: int = 2,
    step: int = _TRAIN_STEPS,
) -> dict[str, str]:
    """``Accelerator.save_state(out)`` with FSDP and SHARDED_STATE_DICT.

    Layout (accelerate ``Accelerator.save_state`` -> ``save_fsdp_model`` / ``save_fsdp_optimizer`` /
    ``checkpointing.save_accelerator_state``)::

        out/pytorch_model_fsdp_0/   DCP {"model": model state dict}
        out/optimizer_0/            DCP {"optimizer": FQN-keyed optimizer state dict}
        out/scheduler.bin           torch.save(scheduler.state_dict()), main process
        out/random_states_{rank}.pkl  torch.save({"step", "random_state", "numpy_random_seed",
                                       "torch_manual_seed"}), every process

    Every rank calls it.
    """
    import numpy as np

    out = _fresh_dir(out)
    cfg = DEFAULT_CONFIG
    model, opt, sched = _train_wrapped(fsdp_version, world_size, TinyLlama(cfg), cfg)
    _accelerate_save_fsdp(model, opt, out, fsdp_version)
    if rank == 0:
        torch.save(sched.state_dict(), os.path.join(out, "scheduler.bin"))
    random.seed(rank)
    np.random.seed(rank)
    states = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    torch.save(states, os.path.join(out, f"random_states_{rank}.pkl"))

    ref_model, ref_optim = _gather_reference(model, opt)
    if rank == 0:
        layout: Layout = {
            "model": ("pytorch_model_fsdp_0", ("model",)),
            "optim": ("optimizer_0", ("optimizer",)),
            "extra": None,
        }
        _save_reference(ref_path, ref_model, ref_optim, layout)
    return _describe(model)


def _trainer_state(global_step: int, world_size: int) -> Any:
    """A real ``transformers.TrainerState`` as ``Trainer`` has it after ``global_step`` steps."""
    from transformers.trainer_callback import TrainerState

    state = TrainerState(
        epoch=1.0,
        global_step=global_step,
        max_steps=global_step,
        logging_steps=1,
        eval_steps=500,
        save_steps=global_step,
        train_batch_size=2,
        num_train_epochs=1,
        num_input_tokens_seen=global_step * 12 * world_size,
        total_flos=1234.0,
        log_history=[
            {
                "epoch": s / global_step,
                "grad_norm": 1.5,
                "learning_rate": _LR,
                "loss": 4.0 - s * 0.1,
                "step": s,
            }
            for s in range(1, global_step + 1)
        ],
    )
    # What Trainer._save_checkpoint stores for its ExportableState callbacks (TrainerControl).
    state.stateful_callbacks = {
        "TrainerControl": {
            "args": {
                "should_epoch_stop": False,
                "should_evaluate": False,
                "should_log": False,
                "should_save": True,
                "should_training_stop": True,
            },
            "attributes": {},
        }
    }
    return state


def _training_args_pickle(output_dir: str) -> Any:
    """A ``transformers.TrainingArguments`` built without running ``__post_init__`` (which needs
    accelerate, absent here); its pickle names the real class, as ``training_args.bin`` does."""
    from transformers import TrainingArguments

    args = TrainingArguments.__new__(TrainingArguments)
    for f in dataclasses.fields(TrainingArguments):
        if f.default is not dataclasses.MISSING:
            setattr(args, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(args, f.name, f.default_factory())
    args.output_dir = output_dir
    return args


def trainer_fsdp(
    rank: int,
    world_size: int,
    out: str | os.PathLike[str],
    ref_path: str | os.PathLike[str],
    *,
    fsdp_version: int = 2,
    global_step: int = _TRAIN_STEPS,
    hf_model_files: bool = False,
) -> dict[str, str]:
    """A transformers ``Trainer`` ``checkpoint-N/`` directory with FSDP SHARDED_STATE_DICT.

    Follows ``Trainer._save_checkpoint`` (transformers 5.23, trainer.py): ``save_model`` writes
    nothing for SHARDED_STATE_DICT (only FULL_STATE_DICT calls ``_save``), then
    ``_save_optimizer_and_scheduler`` calls accelerate's ``save_fsdp_model`` /
    ``save_fsdp_optimizer``
    (same dirs and keys as :func:`accelerate_fsdp`) and ``torch.save``s ``scheduler.pt``;
    ``_save_rng_state`` writes ``rng_state_{rank}.pth`` ({"python", "numpy", "cpu"}) on every rank
    when world size > 1; ``trainer_state.json`` last. ``out`` should be named ``checkpoint-N``.

    ``hf_model_files=True`` adds what ``_save`` writes when a version saves the full model as well
    (some 4.x versions did for FSDP2): ``config.json``, ``model.safetensors``,
    ``training_args.bin``.
    Every rank calls it.
    """
    import numpy as np

    out = _fresh_dir(out)
    cfg = DEFAULT_CONFIG
    model, opt, sched = _train_wrapped(fsdp_version, world_size, TinyLlama(cfg), cfg)
    _accelerate_save_fsdp(model, opt, out, fsdp_version)
    if rank == 0:
        torch.save(sched.state_dict(), os.path.join(out, "scheduler.pt"))
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    rng_states = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    torch.save(rng_states, os.path.join(out, f"rng_state_{rank}.pth"))

    ref_model, ref_optim = _gather_reference(model, opt)
    if rank == 0:
        if hf_model_files:
            from safetensors.torch import save_file

            full = {k: v.contiguous() for k, v in ref_model.items()}
            save_file(full, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
            with open(os.path.join(out, "config.json"), "w") as f:
                json.dump(hf_config_dict(cfg), f, indent=2, sort_keys=True)
            torch.save(
                _training_args_pickle(os.path.dirname(os.path.abspath(out))),
                os.path.join(out, "training_args.bin"),
            )
        _trainer_state(global_step, world_size).save_to_json(
            os.path.join(out, "trainer_state.json")
        )
        layout: Layout = {
            "model": ("pytorch_model_fsdp_0", ("model",)),
            "optim": ("optimizer_0", ("optimizer",)),
            "extra": None,
        }
        _save_reference(ref_path, ref_model, ref_optim, layout)
    return _describe(model)


def _lightning_meta(
    sched: torch.optim.lr_scheduler.LRScheduler, global_step: int
) -> dict[str, Any]:
    """What is left of Lightning's ``_CheckpointConnector.dump_checkpoint`` dict after
    ``FSDPStrategy.save_checkpoint`` popped "state_dict" and "optimizer_states"."""
    progress = {
        "total": {"ready": global_step, "completed": global_step},
        "current": {"ready": 0, "completed": 0},
    }
    return {
        "epoch": 0,
        "global_step": global_step,
        "pytorch-lightning_version": "2.5.0",
        "loops": {
            "fit_loop": {
                "state_dict": {},
                "epoch_loop.state_dict": {"_batches_that_stepped": global_step},
                "epoch_loop.batch_progress": progress,
                "epoch_progress": progress,
            },
            "validate_loop": {"state_dict": {}, "batch_progress": progress},
            "test_loop": {"state_dict": {}, "batch_progress": progress},
            "predict_loop": {"state_dict": {}, "batch_progress": progress},
        },
        "callbacks": {
            "ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 0,"
            " 'every_n_epochs': 1,"
            " 'train_time_interval': None}": {
                "monitor": None,
                "best_model_score": None,
                "best_model_path": "",
                "current_score": None,
                "dirpath": "checkpoints",
                "last_model_path": "",
            }
        },
        "lr_schedulers": [sched.state_dict()],
        "hparams_name": "kwargs",
        "hyper_parameters": {
            "vocab": DEFAULT_CONFIG.vocab,
            "hidden": DEFAULT_CONFIG.hidden,
            "lr": _LR,
        },
    }


def lightning_fsdp(
    rank: int,
    world_size: int,
    out: str | os.PathLike[str],
    ref_path: str | os.PathLike[str],
    *,
    global_step: int = _TRAIN_STEPS,
) -> dict[str, str]:
    """Lightning ``FSDPStrategy(state_dict_type="sharded")`` checkpoint directory (FSDP1).

    Follows ``lightning/pytorch/strategies/fsdp.py`` ``FSDPStrategy.save_checkpoint``: the
    LightningModule state dict (SHARDED_STATE_DICT, FQNs ``model.<network fqn>``) and one
    ``FSDP.optim_state_dict`` per optimizer are saved with DCP as
    ``{"model": ..., "optimizer_0": ...}``; rank 0 then ``torch.save``s the rest of the checkpoint
    dict (epoch, global_step, loops, callbacks, lr_schedulers, hyper_parameters, ...) as
    ``meta.pt``.
    ``out`` is the checkpoint "file" path, e.g. ``epoch=0-step=2.ckpt``. Every rank calls it.
    """
    out = _fresh_dir(out)
    cfg = DEFAULT_CONFIG
    model, opt, sched = _train_wrapped(1, world_size, LitModule(cfg), cfg)
    model_sd, optim_sd = _fsdp1_sharded_state(model, opt)
    dcp.save({"model": model_sd, "optimizer_0": optim_sd}, checkpoint_id=out)
    if rank == 0:
        torch.save(_lightning_meta(sched, global_step), os.path.join(out, "meta.pt"))

    ref_model, ref_optim = _gather_reference(model, opt)
    if rank == 0:
        layout: Layout = {
            "model": (".", ("model",)),
            "optim": (".", ("optimizer_0",)),
            "extra": None,
        }
        _save_reference(ref_path, ref_model, ref_optim, layout)
    return _describe(model)


def _titan_dataloader_state(rank: int, world_size: int, step: int) -> bytes:
    # torchtitan's ParallelAwareDataloader pickles its StatefulDataLoader state per dp rank.
    state = {
        "_num_yielded": step,
        "_sampler_iter_yielded": step,
        "_IterableDataset_len_called": None,
        "_shared_seed": None,
        "fetcher_state": {"dataset_iter_state": None, "fetcher_ended": False},
        "dataset_state": {"rank": rank, "world_size": world_size, "sample_idx": step * 2},
        "_iterator_finished": False,
    }
    return pickle.dumps(state, protocol=4)


def torchtitan(
    rank: int,
    world_size: int,
    out: str | os.PathLike[str],
    ref_path: str | os.PathLike[str],
    *,
    model_only: bool = False,
    export_dtype: Literal["float32", "bfloat16"] = "float32",
    step: int = _TRAIN_STEPS,
) -> dict[str, str]:
    """A torchtitan ``step-N/`` DCP checkpoint (FSDP2, torchtitan FQNs).

    Follows ``torchtitan/components/checkpoint.py`` ``CheckpointManager``:

    * full state (``save`` -> ``_flattened_model_states_sd``): the model state dict is merged
      into the TOP level (no "model." prefix), next to ``"optimizer"``
      (``OptimizersContainer.state_dict``:
      ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``, keys like
      ``state.layers.0.attention.wq.weight.exp_avg``), ``"lr_scheduler"`` (first scheduler's
      state_dict), ``"dataloader"`` (``{"dp_rank_<r>": pickled bytes, "world_size": n}``) and
      ``"train_state"`` (``Trainer.state_dict``: ``{"step", "ntokens_seen"}``);
    * ``model_only=True`` (``_save_last_step`` with ``last_save_model_only``): only the model state
      dict at top level, cast to ``export_dtype``.

    ``out`` should be named ``step-N``. Every rank calls it.
    """
    from torch.distributed.device_mesh import init_device_mesh

    out = _fresh_dir(out)
    cfg = dataclasses.replace(DEFAULT_CONFIG, style="titan")
    model = TinyLlama(cfg)
    _fsdp2_wrap(model, init_device_mesh("cpu", (world_size,)))
    opt, sched = _make_optimizer(model)
    _train(model, cfg, opt, sched)
    model_sd: dict[str, Any] = get_model_state_dict(model)
    ref_model, ref_optim = _gather_reference(model, opt, flatten_optimizer=True)
    if model_only:
        dtype = getattr(torch, export_dtype)
        if dtype != torch.float32:
            model_sd = {k: v.to(dtype) for k, v in model_sd.items()}
            ref_model = {k: v.to(dtype) for k, v in ref_model.items()}
        dcp.save(model_sd, checkpoint_id=out)
        if rank == 0:
            _save_reference(
                ref_path, ref_model, None, {"model": (".", ()), "optim": None, "extra": None}
            )
        return _describe(model)

    optim_sd = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    extras: dict[str, Any] = {
        "lr_scheduler": sched.state_dict(),
        "train_state": {"step": step, "ntokens_seen": step * 12 * world_size},
    }
    dataloader = {
        f"dp_rank_{rank}": _titan_dataloader_state(rank, world_size, step),
        "world_size": world_size,
    }
    state: dict[str, Any] = {"optimizer": optim_sd, "dataloader": dataloader, **extras}
    state.update(model_sd)
    dcp.save(state, checkpoint_id=out)
    if rank == 0:
        extras["dataloader"] = {
            **{
                f"dp_rank_{r}": _titan_dataloader_state(r, world_size, step)
                for r in range(world_size)
            },
            "world_size": world_size,
        }
        layout: Layout = {"model": (".", ()), "optim": (".", ("optimizer",)), "extra": (".", ())}
        _save_reference(ref_path, ref_model, ref_optim, layout, extras)
    return _describe(model)


# --------------------------------------------------------------------------------------------------
# Hostile and damaged checkpoints
# --------------------------------------------------------------------------------------------------


class _Gadget:
    """Pickles as a call that creates ``sentinel`` when UNPICKLED (never when pickled)."""

    def __init__(self, sentinel: str, how: Literal["exec", "os.system"] = "exec") -> None:
        self.sentinel = sentinel
        self.how = how

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        if self.how == "os.system":
            return (os.system, (f"touch '{self.sentinel}'",))
        return (builtins.exec, (f"open({self.sentinel!r}, 'w').close()",))


def malicious_metadata(
    out: str | os.PathLike[str], *, how: Literal["exec", "os.system"] = "exec"
) -> str:
    """A valid-looking DCP directory whose ``.metadata`` pickle creates a sentinel file when loaded
    with plain ``pickle`` (the gadget sits in ``Metadata.planner_data``). Returns the sentinel path
    (inside ``out``), which generating never creates."""
    out = _fresh_dir(out)
    sentinel = os.path.join(os.path.abspath(out), "PWNED_BY_METADATA")
    _save_one_process({"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}}, out)
    meta_path = os.path.join(out, ".metadata")
    with open(meta_path, "rb") as f:
        metadata = pickle.load(f)  # our own file, written just above
    metadata.planner_data = {"model.w": ("model", "w"), "__payload__": _Gadget(sentinel, how)}
    with open(meta_path, "wb") as f:
        pickle.dump(metadata, f)
    return sentinel


def malicious_object(
    out: str | os.PathLike[str], *, how: Literal["exec", "os.system"] = "exec"
) -> str:
    """A real ``dcp.save`` checkpoint whose object entry ``extra.payload`` creates a sentinel file
    when its bytes are ``torch.load(weights_only=False)``-ed (what ``dcp.load`` does). Returns the
    sentinel path (inside ``out``), which generating never creates."""
    out = _fresh_dir(out)
    sentinel = os.path.join(os.path.abspath(out), "PWNED_BY_OBJECT")
    state = {
        "model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
        "extra": {"payload": _Gadget(sentinel, how), "step": 3},
    }
    _save_one_process(state, out)
    return sentinel


def truncate(path: str | os.PathLike[str], nbytes: int) -> None:
    """Truncate ``path`` to ``nbytes`` bytes; a negative ``nbytes`` cuts that many off the end."""
    size = os.path.getsize(path)
    os.truncate(path, max(0, size + nbytes) if nbytes < 0 else nbytes)


def remove_rank_file(ckpt: str | os.PathLike[str], rank: int) -> list[str]:
    """Delete every ``__{rank}_*.distcp`` in ``ckpt``; returns the removed paths (sorted)."""
    removed = sorted(glob.glob(os.path.join(os.fspath(ckpt), f"__{rank}_*.distcp")))
    if not removed:
        raise FileNotFoundError(f"no __{rank}_*.distcp in {ckpt}")
    for p in removed:
        os.remove(p)
    return removed


def garble_metadata(ckpt: str | os.PathLike[str]) -> None:
    """Keep the pickle protocol header of ``.metadata`` and zero everything after it, so it looks
    like a pickle but fails to load (invalid opcode)."""
    path = os.path.join(os.fspath(ckpt), ".metadata")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:2] + bytes(len(data) - 2))


def flip_bit(path: str | os.PathLike[str], offset: int, bit: int = 0) -> None:
    """Flip bit ``bit`` (0 = least significant) of the byte at ``offset`` in ``path``, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        if len(byte) != 1:
            raise ValueError(f"offset {offset} is past the end of {path}")
        f.seek(offset)
        f.write(bytes([byte[0] ^ (1 << bit)]))


def big_many_tensors_metadata(
    out: str | os.PathLike[str],
    n_tensors: int = 1000,
    world_size: int = 64,
    *,
    cols: int = 16,
    sized_files: bool = False,
) -> str:
    """Write ONLY a synthetic but valid DCP ``.metadata`` (torch's own metadata classes, pickled as
    ``FileSystemWriter.finish`` does) describing ``n_tensors`` float32 tensors, each sharded on
    dim 0 over ``world_size`` ranks with uneven row counts, plus one empty ``__{r}_0.distcp`` per
    rank.

    ``sized_files=True`` extends each ``.distcp`` (sparsely) to the bytes the metadata records, so
    file-size checks pass. Returns ``out``. For timing metadata-only inspection.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    out = _fresh_dir(out)
    props = TensorProperties(dtype=torch.float32)
    state_md: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    planner: dict[str, tuple[str, ...]] = {}
    file_end = [0] * world_size
    for i in range(n_tensors):
        inner = f"layers.{i // 8}.w{i % 8}.weight"
        fqn = f"model.{inner}"
        rows = world_size * 2 + (i % 7) - 3
        per = math.ceil(rows / world_size)
        chunks: list[ChunkStorageMetadata] = []
        for r in range(world_size):
            start = min(r * per, rows)
            size = min(per, rows - start)
            if size == 0 and chunks and chunks[-1].sizes[0] == 0:
                # DCP dedups identical chunks: trailing empty shards (all at offset == rows) are
                # recorded once, as a real FSDP2 save at more ranks than rows shows.
                continue
            chunk = ChunkStorageMetadata(
                offsets=torch.Size([start, 0]), sizes=torch.Size([size, cols])
            )
            chunks.append(chunk)
            # DCP records the length of each chunk's torch.save blob: the raw bytes plus about
            # 1.5 KB of zip records (measured on torch 2.13 for small tensors).
            length = size * cols * 4 + _TORCH_SAVE_OVERHEAD_BYTES
            storage[MetadataIndex(fqn, chunk.offsets, len(chunks) - 1)] = _StorageInfo(
                relative_path=f"__{r}_0.distcp", offset=file_end[r], length=length
            )
            file_end[r] += length
        state_md[fqn] = TensorStorageMetadata(
            properties=props, size=torch.Size([rows, cols]), chunks=chunks
        )
        planner[fqn] = ("model", inner)
    metadata = Metadata(
        state_dict_metadata=state_md,
        planner_data=planner,
        storage_data=storage,
        # FileSystemWriter records checkpoint_id as a pathlib.Path and save_id as str(uuid4()).
        storage_meta=StorageMeta(checkpoint_id=pathlib.Path(out), save_id=str(uuid.UUID(int=0))),
        version="1.0.0",
    )
    for r in range(world_size):
        path = os.path.join(out, f"__{r}_0.distcp")
        with open(path, "wb"):
            pass
        if sized_files:
            os.truncate(path, file_end[r])
    tmp = os.path.join(out, ".metadata.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(metadata, f)
    os.replace(tmp, os.path.join(out, ".metadata"))
    return out


# --------------------------------------------------------------------------------------------------
# torch.save training checkpoints (full state dicts written by one rank)
# --------------------------------------------------------------------------------------------------


def _write_hf_config(out: str, cfg: ModelConfig = DEFAULT_CONFIG) -> None:
    # Training scripts keep the model's config beside their checkpoints; consolidate copies it.
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg), f, indent=2, sort_keys=True)


def _reference_only_model(
    rank: int, model: nn.Module, opt: torch.optim.Optimizer, ref_path: str | os.PathLike[str]
) -> None:
    """The full model and optimizer state gathered by torch (collective); rank 0 writes them
    with no DCP layout (a torch.save checkpoint has none)."""
    ref_model, ref_optim = _gather_reference(model, opt)
    if rank == 0:
        _save_reference(
            ref_path, ref_model, ref_optim, {"model": None, "optim": None, "extra": None}
        )


def fsdp1_full(
    rank: int,
    world_size: int,
    out: str | os.PathLike[str],
    ref_path: str | os.PathLike[str],
    *,
    use_orig_params: bool = True,
    step: int = _TRAIN_STEPS,
) -> dict[str, str]:
    """The FSDP1 tutorial's checkpoint: ``out/checkpoint.pth`` written by rank 0.

    Follows the pattern training scripts copy (pytorch.org FSDP tutorial)::

        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(rank0_only=True)):
            state = model.state_dict()
        if rank == 0:
            torch.save({"model_state_dict": state,
                        "optimizer_state_dict": optimizer.state_dict(), "step": step}, path)

    The gathered tensors carry FSDP's ``_has_been_cloned`` attribute, so torch pickles them with
    ``_rebuild_from_type_v2``; ``optimizer.state_dict()`` is rank 0's own state: with
    ``use_orig_params=False`` one integer-keyed entry per FlatParameter holding rank 0's shard.
    ``offload_to_cpu`` stays False: with True torch 2.13 segfaults on CPU (see
    :func:`_gather_reference`). Every rank calls it.
    """
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    out = _fresh_dir(out)
    cfg = DEFAULT_CONFIG
    model = FSDP(
        TinyLlama(cfg),
        device_id=torch.device("cpu"),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=use_orig_params,
    )
    opt, _ = _make_optimizer(model)
    _train(model, cfg, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # FSDP.state_dict_type is deprecated
        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            state = model.state_dict()
    if rank == 0:
        checkpoint = {
            "model_state_dict": state,
            "optimizer_state_dict": opt.state_dict(),
            "step": step,
        }
        torch.save(checkpoint, os.path.join(out, "checkpoint.pth"))
        _write_hf_config(out, cfg)
    _reference_only_model(rank, model, opt, ref_path)
    return {"flat_params": str(sum(1 for _ in opt.param_groups[0]["params"]))}


def accelerate_full(
    rank: int,
    world_size: int,
    out: str | os.PathLike[str],
    ref_path: str | os.PathLike[str],
) -> dict[str, str]:
    """What ``Accelerator.save_state(out)`` writes with FSDP and ``FULL_STATE_DICT``, by
    accelerate's own code: ``save_fsdp_model`` (``pytorch_model_fsdp.bin``, rank 0),
    ``save_fsdp_optimizer`` (``optimizer.bin``, FQN-keyed, rank 0), then
    ``save_accelerator_state`` (``scheduler.bin``, ``random_states_<rank>.pkl``).

    The plugin reads ``FSDP_STATE_DICT_TYPE=FULL_STATE_DICT`` from the environment, as
    ``accelerate launch`` sets it. accelerate enables FSDP only on accelerators, so the
    ``Accelerator`` here is a CPU one and the model is wrapped with ``fully_shard`` as
    accelerate's FSDP2 path does; the save functions are the ones ``save_state`` calls
    (accelerate 1.15, accelerator.py). Every rank calls it.
    """
    # accelerate's CPU state reads the launcher's variables; the gloo group is already up (its
    # file rendezvous), so the address is checked for presence and never connected to.
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        FSDP_STATE_DICT_TYPE="FULL_STATE_DICT",
        FSDP_VERSION="2",
    )
    from accelerate import Accelerator
    from accelerate.checkpointing import save_accelerator_state
    from accelerate.utils import (
        FullyShardedDataParallelPlugin,
        save_fsdp_model,
        save_fsdp_optimizer,
    )

    out = _fresh_dir(out)
    accelerator = Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin()
    cfg = DEFAULT_CONFIG
    model, opt, sched = _train_wrapped(2, world_size, TinyLlama(cfg), cfg)
    save_fsdp_model(plugin, accelerator, model, out)
    save_fsdp_optimizer(plugin, accelerator, opt, model, out)
    save_accelerator_state(out, [], [], [sched], [], accelerator.process_index, _TRAIN_STEPS)
    if rank == 0:
        _write_hf_config(out, cfg)
    _reference_only_model(rank, model, opt, ref_path)
    return {"state_dict_type": str(plugin.state_dict_type)}


def ddp_torch_save(
    rank: int,
    world_size: int,
    out: str | os.PathLike[str],
    ref_path: str | os.PathLike[str],
    *,
    param_names: bool = False,
) -> dict[str, str]:
    """A DDP script's checkpoint: ``out/checkpoint.pt`` = ``{"model": ddp.state_dict(),
    "optimizer": opt.state_dict(), "epoch": 1}`` by rank 0, every model key under ``module.``.

    AdamW with two param groups, as transformers builds them (weight decay for matrices, none
    for norms), so integer ids follow group order, not the model's. ``param_names`` passes
    named parameters, so torch (>= 2.5) stores each group's ``param_names``. Every rank calls it.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = _fresh_dir(out)
    cfg = DEFAULT_CONFIG
    model = DDP(TinyLlama(cfg))
    named = list(model.module.named_parameters())
    norms = [(n, p) for n, p in named if p.ndim == 1]
    matrices = [(n, p) for n, p in named if p.ndim != 1]
    groups: list[dict[str, Any]] = [
        {"params": norms if param_names else [p for _, p in norms], "weight_decay": 0.0},
        {"params": matrices if param_names else [p for _, p in matrices], "weight_decay": 0.1},
    ]
    opt = torch.optim.AdamW(groups, lr=_LR)
    _train(model, cfg, opt)
    if rank == 0:
        checkpoint = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}
        torch.save(checkpoint, os.path.join(out, "checkpoint.pt"))
        _write_hf_config(out, cfg)
    _reference_only_model(rank, model, opt, ref_path)
    return {"groups": str([len(g["params"]) for g in opt.param_groups])}


def _hf_llama(cfg: ModelConfig = DEFAULT_CONFIG) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(_INIT_SEED)
    kwargs = {
        k: v for k, v in hf_config_dict(cfg).items() if k not in ("architectures", "torch_dtype")
    }
    return LlamaForCausalLM(LlamaConfig(**kwargs))


def trainer_full(
    out: str | os.PathLike[str], ref_path: str | os.PathLike[str], *, steps: int = _TRAIN_STEPS
) -> None:
    """A real transformers ``Trainer`` run on CPU without FSDP: ``out`` is its ``output_dir``,
    holding ``checkpoint-<steps>/`` with ``model.safetensors``, ``optimizer.pt``,
    ``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json`` and ``training_args.bin``."""
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    class Tokens(Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.arange(i, i + 6) % DEFAULT_CONFIG.vocab
            return {"input_ids": ids, "labels": ids}

    out = _fresh_dir(out)
    model = _hf_llama()
    args = TrainingArguments(
        output_dir=out,
        max_steps=steps,
        save_steps=steps,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        weight_decay=0.01,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # the live optimizer's state by FQN (what the job held, not what the files say)
    names = {id(p): n for n, p in model.named_parameters()}
    live = trainer.optimizer.optimizer  # accelerate's AcceleratedOptimizer wraps torch's AdamW
    state = {
        names[id(p)]: {k: v.detach().clone() for k, v in live.state[p].items()}
        for g in live.param_groups
        for p in g["params"]
    }
    optim = {
        "state": state,
        "param_groups": [[names[id(p)] for p in g["params"]] for g in live.param_groups],
    }
    _save_reference(ref_path, sd, optim, {"model": None, "optim": None, "extra": None})


def lightning_ckpt(out: str | os.PathLike[str], ref_path: str | os.PathLike[str]) -> None:
    """``lightning.Trainer.save_checkpoint`` after two steps on CPU: ``out/last.ckpt`` with
    ``state_dict`` (the LightningModule's keys: its ``model.`` attribute in front of the
    model's own FQNs), ``optimizer_states``, ``lr_schedulers``, ``loops``, ``callbacks``,
    ``hyper_parameters``. The reference is the inner model's state dict."""
    import lightning as L

    cfg = DEFAULT_CONFIG

    class Lit(L.LightningModule):
        def __init__(self, lr: float = _LR) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.model = TinyLlama(cfg)

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            tokens = batch[0]
            logits = self.model(tokens[:, :-1])
            return F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, functools.partial(_linear_warmup, warmup_steps=4)
            )
            return [opt], [sched]

    out = _fresh_dir(out)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_batch(cfg)), batch_size=2)
    module = Lit()
    trainer = L.Trainer(
        max_steps=_TRAIN_STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data)
    trainer.save_checkpoint(os.path.join(out, "last.ckpt"))
    sd = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    _save_reference(ref_path, sd, None, {"model": None, "optim": None, "extra": None})


# --------------------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------------------

#: name -> (distributed producer, world size it is meant for)
PRODUCERS: dict[str, tuple[Callable[..., dict[str, str]], int]] = {
    "fsdp2": (fsdp2, 2),
    "fsdp2_rank_local": (fsdp2_rank_local, 2),
    "fsdp1": (fsdp1, 2),
    "hsdp": (hsdp, 4),
    "tp_fsdp": (tp_fsdp, 4),
    "accelerate": (accelerate_fsdp, 2),
    "trainer": (trainer_fsdp, 2),
    "lightning": (lightning_fsdp, 2),
    "torchtitan": (torchtitan, 2),
    "fsdp1_full": (fsdp1_full, 2),
    "accelerate_full": (accelerate_full, 2),
    "ddp": (ddp_torch_save, 2),
}


def produce(
    name: str,
    out: str | os.PathLike[str],
    ref_path: str | os.PathLike[str],
    *,
    world_size: int | None = None,
    timeout: float = 120.0,
    **opts: Any,
) -> list[dict[str, str]] | None:
    """Run the distributed producer ``name`` (a key of :data:`PRODUCERS`) on its ranks, or
    ``single`` / ``hf_sharded`` / ``torch_save`` in this process.

    Returns, for distributed producers, each rank's description of its shards (FQN -> placements
    and local shape); None for single-process ones.
    """
    local: dict[str, Callable[..., None]] = {
        "single": single,
        "hf_sharded": hf_sharded,
        "torch_save": torch_save,
        "trainer_full": trainer_full,
        "lightning_ckpt": lightning_ckpt,
    }
    if name in local:
        local[name](out, ref_path, **opts)
        return None
    fn, default_ws = PRODUCERS[name]
    ws = world_size or default_ws
    return run_ranks(fn, ws, os.fspath(out), os.fspath(ref_path), timeout=timeout, **opts)


def iter_files(root: str | os.PathLike[str]) -> Iterator[str]:
    """Every regular file under ``root``, sorted, as paths relative to ``root`` with ``/``."""
    root = os.fspath(root)
    found = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            found.append(rel.replace(os.sep, "/"))
    yield from sorted(found)
