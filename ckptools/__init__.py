"""ckptools: inspect, consolidate, reshard and verify PyTorch distributed checkpoints.

Example:
    >>> import ckptools
    >>> report = ckptools.inspect("checkpoints/step-1000")  # doctest: +SKIP
    >>> report.to_dict()["totals"]["parameters"]  # doctest: +SKIP
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from ckptools._version import __version__

if TYPE_CHECKING:
    from ckptools.core.manifest import Manifest
    from ckptools.engine.reader import read_object, read_tensor
    from ckptools.errors import CkptError
    from ckptools.hub import PushResult, push_to_hub
    from ckptools.producers import read_manifest
    from ckptools.training.load_pretrained import load_pretrained
    from ckptools.training.manager import CheckpointManager
    from ckptools.training.pretrained import save_pretrained
    from ckptools.training.roundtrip import verify_roundtrip
    from ckptools.training.state import load, save
    from ckptools.verbs.consolidate import ConsolidateResult, consolidate
    from ckptools.verbs.diff import diff
    from ckptools.verbs.inspection import InspectReport, inspect
    from ckptools.verbs.reshard import ReshardResult, reshard, shard
    from ckptools.verify import VerifyReport, verify

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
    "load_pretrained",
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

# Every public name is resolved on first use: `import ckptools` (and every `ckpt` run, and
# `ckpt --help`) then pays only for the modules the command touches, not for every verb and torch.
_LAZY = {
    "ConsolidateResult": "verbs.consolidate",
    "consolidate": "verbs.consolidate",
    "Manifest": "core.manifest",
    "diff": "verbs.diff",
    "read_object": "engine.reader",
    "read_tensor": "engine.reader",
    "CkptError": "errors",
    "PushResult": "hub",
    "push_to_hub": "hub",
    "InspectReport": "verbs.inspection",
    "inspect": "verbs.inspection",
    "read_manifest": "producers",
    "ReshardResult": "verbs.reshard",
    "reshard": "verbs.reshard",
    "shard": "verbs.reshard",
    "CheckpointManager": "training.manager",
    "save_pretrained": "training.pretrained",
    "load_pretrained": "training.load_pretrained",
    "load": "training.state",
    "save": "training.state",
    "VerifyReport": "verify",
    "verify": "verify",
    "verify_roundtrip": "training.roundtrip",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f"ckptools.{_LAZY[name]}")
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


class _Package(types.ModuleType):
    """The package module: importing the subpackage ``ckptools.verify`` would bind that package
    over the public function of the same name; keep the function. (The other verbs live in
    ``ckptools.verbs``, whose modules bind nothing here.)"""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FUNCTION_MODULES and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


_FUNCTION_MODULES = frozenset({"verify"})
sys.modules[__name__].__class__ = _Package
