"""The producers: one package per family (dcp, hf, deepspeed, fsdp1, megatron), found by the
registry (:mod:`ckptools.producers.registry`), and the rules they share (:mod:`.base`: the
Layout contract and detection). A family's readers are imported when detection first tries one
of its layouts; wrappers (which hold DCP directories inside) are tried before the plain formats,
so the outer directory a user has is recognised as what it is (docs/adding-a-producer.md).
"""

from __future__ import annotations

from ckptools.producers.base import Layout, detect, layouts, read_manifest

__all__ = ["Layout", "detect", "layouts", "read_manifest"]
