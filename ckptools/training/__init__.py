"""Training hooks: ``save``/``load`` for any wrapping, and a crash-safe ``CheckpointManager``.

Names that need torch are imported on first use, so the torch-free parts (``retention``,
``store``, which back ``ckpt list`` / ``ckpt prune``) import without it.

Example:
    >>> from ckptools.training import CheckpointManager  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AsyncSaveError", "CheckpointManager", "load", "save", "save_pretrained"]

_LAZY = {
    "save": ".state",
    "load": ".state",
    "CheckpointManager": ".manager",
    "AsyncSaveError": ".manager",
    "save_pretrained": ".pretrained",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
