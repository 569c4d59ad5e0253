"""On-disk layouts, one module each, registered in detection order.

Wrapper layouts (which hold DCP directories inside) register before the plain formats, so the
outer directory a user has is recognised as what it is.
"""

from __future__ import annotations

from ckptools.layouts import (
    dcp,  # noqa: F401  (registers dcp)
    dcp_rank_local,  # noqa: F401  (registers dcp_rank_local)
    deepspeed,  # noqa: F401  (registers deepspeed)
    hf_distributed,  # noqa: F401  (registers transformers_distributed)
    megatron,  # noqa: F401  (registers megatron)
    safetensors,  # noqa: F401  (registers safetensors)
    torch_save,  # noqa: F401  (registers torch_save)
    verl,  # noqa: F401  (registers verl)
    wrappers,  # noqa: F401  (registers trainer, accelerate, lightning, torchtitan)
)
from ckptools.layouts.base import Layout, detect, layouts, read_manifest

__all__ = ["Layout", "detect", "layouts", "read_manifest"]
