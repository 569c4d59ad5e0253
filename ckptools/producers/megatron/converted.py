"""A Megatron run's model tensors seen as the Hugging Face model's: the I/O half of
:func:`ckptools.producers.megatron.plan.to_hf` (the pieces are split over the stored records by
:func:`ckptools.engine.converted.split_source`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptools.core.manifest import Manifest
from ckptools.engine.converted import split_source
from ckptools.plan.conversions import KeyMap
from ckptools.producers.megatron import plan
from ckptools.producers.megatron.layout import DETAILS_KEY


def as_hf(
    manifest: Manifest,
    names: dict[str, str],
    config: Mapping[str, Any] | None,
    *,
    check: bool = True,
) -> tuple[Manifest, dict[str, str], KeyMap, dict[str, Any]]:
    """A Megatron run's model tensors ``names`` (stored name -> FQN) as the Hugging Face model's
    (:func:`ckptools.producers.megatron.plan.to_hf`): the manifest with the HF tensors' entries,
    HF name -> FQN in it, the pieces, and the HF config (``config``, or made from the run's args).
    ``check``: CRC-check the split records now (:func:`~ckptools.engine.converted.split_source`).

    ``names`` maps each Megatron model name to the entry that holds its values, so another
    source of the same shapes goes through the same pieces: ``--masters`` (the distributed
    optimizer's fp32 masters) passes the model names mapped to entries of the masters added
    to ``manifest``, and gets the HF model in fp32.
    """
    shapes = {n: manifest.tensors[f].shape for n, f in names.items()}
    args = manifest.details.get(DETAILS_KEY) or {}
    keymap, made = plan.to_hf(shapes, args, config, manifest.root)
    derived, out = split_source(manifest, names, keymap, check=check)
    return derived, out, keymap, made
