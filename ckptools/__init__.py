"""ckptools: inspect, consolidate, reshard and verify PyTorch distributed checkpoints.

Example:
    >>> import ckptools
    >>> report = ckptools.inspect("checkpoints/step-1000")  # doctest: +SKIP
    >>> report.to_dict()["totals"]["parameters"]  # doctest: +SKIP
"""

from __future__ import annotations

from .errors import CkptError
from .inspection import InspectReport, inspect
from .layouts import read_manifest
from .manifest import Manifest
from .reader import read_object, read_tensor

__version__ = "0.1.0"

__all__ = [
    "CkptError",
    "InspectReport",
    "Manifest",
    "__version__",
    "inspect",
    "read_manifest",
    "read_object",
    "read_tensor",
]
