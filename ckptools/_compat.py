"""Every private torch import and version gate ckptools relies on, in one place.

torch's distributed checkpoint internals move between releases; keeping each private name here
means a new torch breaks one module with one clear error rather than many call sites. Importing
this module imports torch, so only torch-using code (the training hooks) imports it, lazily.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# ``set_element`` rebuilds a nested state dict from DCP's ``planner_data`` key paths (lists
# included); it is private (``torch.distributed.checkpoint._traverse``) but stable since 2.2.
from torch.distributed.checkpoint._nested_dict import flatten_state_dict as _flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element as _set_element

__all__ = [
    "CHECKPOINT_WRAPPED_SEGMENT",
    "COMPILED_SEGMENT",
    "TORCH_VERSION",
    "fsdp1_class",
    "fsdp1_shared_params",
    "fsdp2_class",
    "fsspec_reader",
    "fsspec_writer",
    "is_compiled",
    "set_element",
    "unwrap_model",
]

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split(".")[:2])  # type: ignore[assignment]

# Module-name segments that wrappers insert into FQNs; torch's state_dict API strips them, and
# :func:`unwrap_model` walks through them to find the user's own module.
CHECKPOINT_WRAPPED_SEGMENT = "_checkpoint_wrapped_module"
COMPILED_SEGMENT = "_orig_mod"
_FSDP1_SEGMENT = "_fsdp_wrapped_module"


def flatten_state_dict(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``state`` flattened as ``dcp.save`` flattens it: ``{fqn: value}`` and ``{fqn: key
    path}`` (``model.<name>``, ``optim.state.<fqn>.<name>``, ``optim.param_groups.<i>.<k>``)."""
    flat, mapping = _flatten_state_dict(state)
    return dict(flat), dict(mapping)


def set_element(root: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """Set ``value`` at the nested key ``path`` of ``root`` (creating dicts/lists on the way)."""
    _set_element(root, path, value)


def fsdp1_class() -> type[nn.Module]:
    """``FullyShardedDataParallel`` (FSDP1)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def fsdp2_class() -> type[Any]:
    """``FSDPModule``, the class ``fully_shard`` mixes into a module (public since torch 2.6)."""
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile`` returns (``OptimizedModule``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def unwrap_model(module: nn.Module) -> nn.Module:
    """The user's own module inside DDP, FSDP1, ``torch.compile`` and checkpoint wrappers.

    FSDP2 and tensor parallelism modify the module in place, so it is returned as is.
    """
    from torch.nn.parallel import DistributedDataParallel

    fsdp1 = fsdp1_class()
    seen = 0
    # Wrappers nest in any order (compile(FSDP(checkpoint_wrapper(m)))): peel until none is left.
    while seen < 16:
        seen += 1
        inner: Any
        if is_compiled(module):
            inner = getattr(module, COMPILED_SEGMENT)
        elif isinstance(module, (DistributedDataParallel, fsdp1)):
            inner = module.module
        elif hasattr(module, CHECKPOINT_WRAPPED_SEGMENT):
            inner = getattr(module, CHECKPOINT_WRAPPED_SEGMENT)
        else:
            break
        if not isinstance(inner, nn.Module):  # pragma: no cover - defensive
            break
        module = inner
    return module


def create_cpu_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Allocate CPU tensors shaped like every tensor (DTensor, ShardedTensor local shards
    included) of ``state_dict``: the reusable staging buffer of async saves."""
    from torch.distributed._state_dict_utils import _create_cpu_state_dict

    result: dict[str, Any] = _create_cpu_state_dict(
        state_dict, pin_memory=False, share_memory=False
    )
    return result


def copy_state_dict(source: dict[str, Any], staged: dict[str, Any]) -> dict[str, Any]:
    """Copy every tensor of ``source`` into the same place of ``staged``; non-tensor leaves are
    taken from ``source``. The two must have the same structure, shapes and dtypes (callers check
    with a signature first)."""
    from torch.distributed._state_dict_utils import _copy_state_dict

    result: dict[str, Any] = _copy_state_dict(source, staged, type_check=False)
    return result


def fsspec_writer(path: str, **storage_options: Any) -> Any:
    """torch's DCP ``FsspecWriter`` (``torch.distributed.checkpoint._fsspec_filesystem``, public
    only as a private module path) for a URL, with fsspec storage options."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    # sync_files=False: an fsspec stream has no descriptor to fsync, so torch would fall back to a
    # machine-wide os.sync() per file; an upload is durable once its close() returns.
    return FsspecWriter(path, sync_files=False, **storage_options)


def fsspec_reader(path: str, **storage_options: Any) -> Any:
    """torch's DCP ``FsspecReader`` for a URL, with fsspec storage options."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(path, **storage_options)


def fsdp1_shared_params(model: nn.Module) -> list[tuple[str, str]]:
    """``(name, primary name)`` of each parameter that FSDP1 (without ``use_orig_params``) keeps
    once in a flat parameter under several names (tied weights), from the flat parameters'
    private ``_shared_param_infos``; names still hold FSDP1's ``_fsdp_wrapped_module`` segments."""
    fsdp1 = fsdp1_class()
    out: list[tuple[str, str]] = []
    for prefix, module in model.named_modules():
        if not isinstance(module, fsdp1):
            continue
        flat = getattr(getattr(module, "_handle", None), "flat_param", None)
        base = f"{prefix}.{_FSDP1_SEGMENT}." if prefix else f"{_FSDP1_SEGMENT}."
        for info in getattr(flat, "_shared_param_infos", None) or ():
            shared = f"{info.module_name}.{info.param_name}".lstrip(".")
            primary = f"{info.prim_module_name}.{info.prim_param_name}".lstrip(".")
            out.append((base + shared, base + primary))
    return out
