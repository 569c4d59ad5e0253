"""Real DeepSpeed ZeRO checkpoints for tests, written by DeepSpeed itself on CPU ranks (gloo).

:func:`produce_zero` spawns ``world_size`` ranks through :func:`tests.support.dist.run_ranks`;
each rank builds the same tiny model, wraps it with ``deepspeed.initialize`` (torch's AdamW as
the client optimizer, ``DS_ACCELERATOR=cpu``), trains two steps and calls
``engine.save_checkpoint(out/<name>)`` for every requested (stage, dtype), all in one launch so
that DeepSpeed's import (seconds on a busy machine) is paid once per world size.

Beside each checkpoint the ranks leave truths, all DeepSpeed's own (never ckptools'):
``live.pt`` holds ``{fqn: safe_get_full_fp32_param(p)}`` for every trainable parameter (a
collective, so every rank calls it), ``live_optim.pt`` the live optimizer
(``{"moments": {fqn: {"exp_avg", "exp_avg_sq"}}, "steps": [each flat partition's step]}``,
from ``safe_get_full_optimizer_state`` and the client AdamW's own state), and
``zero_to_fp32.pt`` what DeepSpeed's converter ``get_fp32_state_dict_from_zero_checkpoint``
makes of the saved checkpoint (run by rank 0 once every rank has saved), so the test process
never imports DeepSpeed.

The model is chosen to exercise what ZeRO's flattening makes hard: 37x12 tied embedding and
head (one storage, two names), parameter sizes that are not multiples of 2 or 3 (partitions end
mid-row, ZeRO-3 pads every parameter), a frozen linear layer and a float buffer.

Example:
    >>> produce_zero("/tmp/ds", world_size=3, cases=[(2, "fp32")])  # doctest: +SKIP
    {(2, 'fp32'): '/tmp/ds/zero2-fp32'}
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tests.support.dist import run_ranks

__all__ = ["EARLIER_TAG", "MOMENTS", "TAG", "case_dir", "deepspeed_available", "produce_zero"]

#: the tag every producer saves under (DeepSpeed writes it to ``latest``)
TAG = "global_step2"
#: the Adam moments ``live_optim.pt`` holds per parameter
MOMENTS = ("exp_avg", "exp_avg_sq")


def deepspeed_available() -> bool:
    """True when DeepSpeed can be imported (without importing it: that costs seconds)."""
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def case_dir(out: str, stage: int, dtype: str) -> str:
    """Where :func:`produce_zero` writes the checkpoint of one (stage, dtype)."""
    return os.path.join(out, f"zero{stage}-{dtype}")


def _model() -> Any:
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(37, 12)
            self.mid = nn.Linear(12, 13)
            self.norm = nn.LayerNorm(13)
            self.frozen = nn.Linear(13, 12)
            self.frozen.requires_grad_(False)
            self.head = nn.Linear(12, 37, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))

        def forward(self, x: Any) -> Any:
            h = self.frozen(self.norm(self.mid(self.embed(x))))
            return self.head(h) * self.scale.sum()

    torch.manual_seed(0)
    return Tiny()


def _llama() -> Any:
    """A tiny transformers Llama with tied embeddings (``lm_head.weight`` is
    ``model.embed_tokens.weight``), as a Trainer + DeepSpeed run holds it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=37, hidden_size=12, intermediate_size=20, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=6, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


#: the tag :func:`produce_zero` with ``earlier_tag=True`` also saves, after the first step
EARLIER_TAG = "global_step1"


def _train_and_save(
    rank: int, out: str, stage: int, dtype: str, model_kind: str, earlier_tag: bool
) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    model = _llama() if model_kind == "llama" else _model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    gen = torch.Generator().manual_seed(1234 + rank)
    target = case_dir(out, stage, dtype)
    for step in range(2):
        x = torch.randint(0, 37, (2, 5), generator=gen)
        if model_kind == "llama":
            loss = engine(input_ids=x, labels=x).loss
        else:
            loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        if earlier_tag and step == 0:
            engine.save_checkpoint(target, tag=EARLIER_TAG)
    engine.save_checkpoint(target, tag=TAG)
    live, moments = {}, {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            full = safe_get_full_fp32_param(p)
            live[name] = full.detach().clone().cpu()
            moments[name] = {
                k: safe_get_full_optimizer_state(p, k).detach().clone().cpu() for k in MOMENTS
            }
    # the client AdamW's own counters (its state holds ZeRO's flat partitions; one group here)
    steps = [st["step"].clone() for st in engine.optimizer.optimizer.state.values()]
    dist.barrier()  # every rank's files are written before the converter reads them
    if rank == 0:
        if model_kind == "llama":  # the run's config beside its checkpoint, as the Trainer does
            engine.module.config.save_pretrained(target)
        torch.save(live, os.path.join(target, "live.pt"))
        torch.save({"moments": moments, "steps": steps}, os.path.join(target, "live_optim.pt"))
        converted = get_fp32_state_dict_from_zero_checkpoint(target)
        # clones: tied names share a tensor, which torch.save would keep shared
        reference = {k: v.contiguous().clone() for k, v in converted.items()}
        torch.save(reference, os.path.join(target, "zero_to_fp32.pt"))
        if earlier_tag:
            earlier = get_fp32_state_dict_from_zero_checkpoint(target, tag=EARLIER_TAG)
            reference = {k: v.contiguous().clone() for k, v in earlier.items()}
            torch.save(reference, os.path.join(target, f"zero_to_fp32-{EARLIER_TAG}.pt"))
    engine.destroy()


def _rank(
    rank: int,
    world_size: int,
    out: str,
    cases: Sequence[tuple[int, str]],
    model_kind: str,
    earlier_tag: bool,
) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for stage, dtype in cases:
        _train_and_save(rank, out, stage, dtype, model_kind, earlier_tag)


def produce_zero(
    out: str,
    world_size: int,
    cases: Sequence[tuple[int, str]],
    timeout: float = 600.0,
    model_kind: str = "tiny",
    *,
    earlier_tag: bool = False,
) -> dict[tuple[int, str], str]:
    """Write one ZeRO checkpoint per (stage, ``"fp32"`` or ``"bf16"``) under ``out``.

    Called by the test process; spawns ``world_size`` ranks (gloo) once for all cases.
    ``model_kind="llama"``: a tiny transformers Llama with tied embeddings instead, its
    ``config.json`` saved beside ``latest``.

    Returns:
        (stage, dtype) -> the checkpoint directory (holding ``latest``, the tag directory,
        ``live.pt`` and ``zero_to_fp32.pt``). ``earlier_tag``: also a save after the first
        step, tagged :data:`EARLIER_TAG` (``latest`` still names :data:`TAG`), with DeepSpeed's
        converter's output for it in ``zero_to_fp32-<EARLIER_TAG>.pt``.
    """
    os.makedirs(out, exist_ok=True)
    saved = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        run_ranks(_rank, world_size, out, list(cases), model_kind, earlier_tag, timeout=timeout)
    finally:
        if saved is None:
            os.environ.pop("DS_ACCELERATOR", None)
        else:
            os.environ["DS_ACCELERATOR"] = saved
    return {(s, d): case_dir(out, s, d) for s, d in cases}
