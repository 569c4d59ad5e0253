"""FSDP1 LOCAL_STATE_DICT checkpoints, written by torch's own FSDP1 on gloo ranks.

Under ``StateDictType.LOCAL_STATE_DICT`` each rank's ``model.state_dict()`` holds its shard of
every FlatParameter (``<module>._flat_param``, a one-rank ShardedTensor of the padded flat
storage) and nothing else: no parameter names, no shapes. Users save it two ways, both here:

* ``torch.save(model.state_dict(), f"rank{rank}.pt")`` per rank (``out/torch_save/``);
* ``dcp.save({"model": model.state_dict()}, checkpoint_id=out/"dcp")``.

Each for ``use_orig_params`` False and True (``out/orig_<bool>/...``).

Example:
    >>> produce_local_state_dict("/tmp/lsd")  # doctest: +SKIP
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from tests.support.dist import run_ranks
from tests.support.producers import DEFAULT_CONFIG, Block, TinyLlama

__all__ = ["produce_local_state_dict", "saves"]

#: (use_orig_params, how it was saved): the directories :func:`produce_local_state_dict` writes
SAVES = tuple((orig, how) for orig in (False, True) for how in ("torch_save", "dcp"))


def saves(root: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """(case id, path) of each save under ``root``."""
    return [(f"orig_{orig}-{how}", os.path.join(root, f"orig_{orig}", how)) for orig, how in SAVES]


def _rank(rank: int, world_size: int, root: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    for orig in (False, True):
        torch.manual_seed(0)
        model = FSDP(
            TinyLlama(DEFAULT_CONFIG),
            device_id=torch.device("cpu"),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=orig,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # FSDP.state_dict_type is deprecated
            with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
                state: dict[str, Any] = model.state_dict()
        base = os.path.join(root, f"orig_{orig}")
        os.makedirs(os.path.join(base, "torch_save"), exist_ok=True)
        torch.save(state, os.path.join(base, "torch_save", f"rank{rank}.pt"))
        dcp.save({"model": state}, checkpoint_id=os.path.join(base, "dcp"))


def produce_local_state_dict(root: str | os.PathLike[str]) -> None:
    """Write every save of :data:`SAVES` under ``root`` (two gloo ranks)."""
    run_ranks(_rank, 2, os.fspath(root), timeout=120.0)
