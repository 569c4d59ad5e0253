"""A Megatron run's model tensors seen as the Hugging Face model's: the I/O half of
:func:`ckptools.producers.megatron.plan.to_hf` (the pieces are split over the stored records by
:func:`ckptools.engine.converted.split_source`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ckptools.core.manifest import Chunk, Manifest, TensorEntry
from ckptools.engine.converted import split_source
from ckptools.engine.reader import SourceCache
from ckptools.errors import UnsupportedCheckpointError
from ckptools.io import storage
from ckptools.plan.conversions import KeyMap
from ckptools.producers.megatron import mla, moe, plan
from ckptools.producers.megatron.layout import DETAILS_KEY

#: the FQN suffix of a stacked expert tensor's entry with its layer and expert dims folded
FOLDED = "/experts_folded"


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

    An MoE run's stacked experts (``[L, E, ...]``) are seen with their layer and expert dims
    folded (:func:`~ckptools.producers.megatron.moe.fold_experts`): each stored chunk, one
    expert of one layer, resolved to its raw bytes and re-boxed, no byte read beyond the items'
    archive directories.
    """
    shapes = {n: manifest.tensors[f].shape for n, f in names.items()}
    folded = moe.fold_experts(shapes)
    if folded:
        manifest, names = _folded(manifest, names, folded)
        shapes.update(folded)
    args = manifest.details.get(DETAILS_KEY) or {}
    is_mla = mla.is_mla(shapes, args)
    to_hf = mla.to_hf if is_mla else plan.to_hf
    keymap, made = to_hf(shapes, args, config, manifest.root)
    derived, out = split_source(manifest, names, keymap, check=check)
    return derived, out, keymap, made


def _folded(
    manifest: Manifest, names: dict[str, str], folded: Mapping[str, tuple[int, ...]]
) -> tuple[Manifest, dict[str, str]]:
    """``manifest`` with an entry per stacked expert tensor of ``folded`` whose chunks are the
    stored ones, resolved to raw bytes, with the layer and expert dims folded into one.

    Raises:
        UnsupportedCheckpointError: a stored chunk spans several layers but not every expert
            (no Megatron writer stores one so), which one box of the folded tensor cannot hold.
    """
    tensors = dict(manifest.tensors)
    names = dict(names)
    with storage.open_reader(manifest.data_dir()) as reader:
        cache = SourceCache(reader, manifest)
        for name, shape in folded.items():
            entry = manifest.tensors[names[name]]
            experts = entry.shape[1]
            chunks = [_fold(cache.raw(entry.fqn, c), experts, entry) for c in entry.chunks]
            fqn = entry.fqn + FOLDED
            tensors[fqn] = TensorEntry(fqn, entry.dtype, shape, tuple(chunks))
            names[name] = fqn
    return replace(manifest, tensors=tensors), names


def _fold(raw: Chunk, experts: int, entry: TensorEntry) -> Chunk:
    """A raw chunk of ``[L, E, ...]`` as a chunk of ``[L*E, ...]``."""
    (layer, expert, *rest), (layers, count, *sizes) = raw.offsets, raw.sizes
    if layers > 1 and count != experts:
        raise UnsupportedCheckpointError(
            f"{entry.fqn}: a stored chunk holds experts {expert}..{expert + count} of layers "
            f"{layer}..{layer + layers}, not one layer's or every expert's; not mapped",
            fqn=entry.fqn,
        )
    strides = raw.strides
    if strides is not None:
        if layers > 1 and strides[0] != count * strides[1]:
            raise UnsupportedCheckpointError(
                f"{entry.fqn}: a stored chunk's layers and experts are not one run of rows "
                f"(strides {list(strides)}); not mapped",
                fqn=entry.fqn,
            )
        strides = (strides[1], *strides[2:])
    return raw._replace(
        offsets=(layer * experts + expert, *rest),
        sizes=(layers * count, *sizes),
        strides=strides,
    )
