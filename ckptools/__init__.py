"""ckptools: inspect, consolidate, reshard and verify PyTorch distributed checkpoints.

Example:
    >>> import ckptools
    >>> report = ckptools.inspect("checkpoints/step-1000")  # doctest: +SKIP
    >>> report.to_dict()["totals"]["parameters"]  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .consolidate import ConsolidateResult, consolidate
from .diff import diff
from .errors import CkptError
from .hub import PushResult, push_to_hub
from .inspection import InspectReport, inspect
from .layouts import read_manifest
from .manifest import Manifest
from .reader import read_object, read_tensor
from .reshard import ReshardResult, reshard, shard
from .verify import VerifyReport, verify, verify_roundtrip

if TYPE_CHECKING:
    from .training.manager import CheckpointManager
    from .training.pretrained import save_pretrained
    from .training.state import load, save

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager",
    "CkptError",
    "ConsolidateResult",
    "InspectReport",
    "Manifest",
    "PushResult",
    "ReshardResult",
    "VerifyReport",
    "__version__",
    "consolidate",
    "diff",
    "inspect",
    "load",
    "push_to_hub",
    "read_manifest",
    "read_object",
    "read_tensor",
    "reshard",
    "save",
    "save_pretrained",
    "shard",
    "verify",
    "verify_roundtrip",
]

# The training hooks import torch.distributed; resolving them on first use keeps `import ckptools`
# (and `ckpt --help`) free of that cost.
_TRAINING_NAMES = {
    "save": "state",
    "load": "state",
    "CheckpointManager": "manager",
    "save_pretrained": "pretrained",
}


def __getattr__(name: str) -> Any:
    if name in _TRAINING_NAMES:
        import importlib

        module = importlib.import_module(f".training.{_TRAINING_NAMES[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
