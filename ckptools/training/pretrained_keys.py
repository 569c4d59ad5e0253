"""How :func:`ckptools.load_pretrained` follows ``from_pretrained`` from the published names to
the model's: transformers' conversion mapping on the way in, and transformers' ignore lists.

* **Conversion.** transformers 5 holds a mixture-of-experts layer fused in memory
  (``mlp.experts.gate_up_proj`` [E, 2I, H]) and its ``save_pretrained`` writes one tensor per
  expert and half (``mlp.experts.<e>.gate_proj.weight``; Mixtral's
  ``block_sparse_moe.experts.<e>.w1.weight``). :func:`in_memory_names` applies the same
  conversion rules ``consolidate`` applies on the way out
  (:meth:`ckptools.plan.conversions.Rules.to_memory`, then
  :func:`~ckptools.plan.conversion_entries.merge_entries`): each fused tensor's chunks are the
  published tensors' byte runs placed at their boxes, so each rank still reads only the runs
  that meet its own rows. The rules are those of the model at hand (its config and its
  transformers class), else of the directory's ``config.json``; they are used only when they
  name more of the model's tensors than the published names do (a model of another library
  that happens to keep the published names is left alone).
* **Ignore lists.** ``from_pretrained`` does not call a published tensor unexpected when the
  model's ``_keys_to_ignore_on_load_unexpected`` names it, nor a ``position_ids`` or
  ``rotary_emb.inv_freq`` that is now a non-persistent buffer (older Hub files hold them), nor
  a model tensor missing that ``_keys_to_ignore_on_load_missing`` names. :func:`ignore_filter`
  asks the model's own ``_adjust_missing_and_unexpected_keys`` for exactly that verdict.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from ckptools import _compat
from ckptools.core.manifest import Manifest
from ckptools.errors import CkptError
from ckptools.io import storage
from ckptools.plan.conversion_cache import keymap_for
from ckptools.plan.conversion_entries import merge_entries

if TYPE_CHECKING:
    from torch import nn

__all__ = ["KeyFilter", "ignore_filter", "in_memory_names", "model_config"]

log = logging.getLogger(__name__)

#: (missing, unexpected) → the same without what the model's own loading rules ignore.
KeyFilter = Callable[[Sequence[str], Sequence[str]], tuple[list[str], list[str]]]


def _transformers_model(model: nn.Module) -> Any:
    """The user's transformers ``PreTrainedModel`` inside ``model``'s wrappers, else None.
    Never imports transformers: a model of it has imported it already."""
    transformers = sys.modules.get("transformers")
    inner = _compat.unwrap_model(model)
    base = getattr(transformers, "PreTrainedModel", None) if transformers else None
    return inner if base is not None and isinstance(inner, base) else None


def model_config(model: nn.Module) -> dict[str, Any] | None:
    """The config.json of the transformers model inside ``model`` (its ``architectures`` its
    own transformers class, not FSDP2's ``FSDP<Class>`` subclass nor the user's), else None."""
    inner = _transformers_model(model)
    if inner is None:
        return None
    try:
        config = dict(inner.config.to_dict())
    except Exception:  # a config that does not serialise: no rules from it
        return None
    own = next(
        (c for c in type(inner).__mro__ if c.__module__.startswith("transformers.models.")),
        None,
    )
    if own is not None:
        config["architectures"] = [own.__name__]
    return config


def _source_config(source: str) -> dict[str, Any] | None:
    """The ``config.json`` beside the published files, read, else None."""
    here = source if storage.isdir(source) else storage.dirname(source)
    path = storage.join(here, "config.json")
    try:
        if not storage.isfile(path):
            return None
        config = storage.read_json(path, what="model config")
    except (OSError, CkptError):
        return None  # unreadable: the names stay as published, and the checks name them
    return config if isinstance(config, dict) else None


def in_memory_names(
    model: nn.Module,
    manifest: Manifest,
    source: str,
    wanted: Collection[str],
    *,
    quiet: bool = False,
) -> Manifest:
    """``manifest`` (the published files) with the model's in-memory names, as
    ``from_pretrained`` finds them: transformers' conversion rules for the model, where they
    name more of ``wanted`` (the model's tensors) than the published names do, then the model's
    ``base_model_prefix`` removed or added (:func:`_with_prefix`). The conversion comes from the
    user's cache when an earlier run derived it (``quiet``: no status line while deriving).

    Raises:
        UnsupportedCheckpointError: a tensor meets a rule that is not a byte re-arrangement,
            or its experts or parts are incomplete.
        CorruptCheckpointError: the parts of one fused tensor disagree in shape or dtype.
    """
    if all(name in manifest.tensors for name in wanted):
        return manifest  # nothing to convert: no transformers lookup
    converted = _converted(model, manifest, source, wanted, quiet)
    prefix = getattr(_transformers_model(model), "base_model_prefix", "")
    return _with_prefix(converted, wanted, prefix) if isinstance(prefix, str) else converted


def _converted(
    model: nn.Module, manifest: Manifest, source: str, wanted: Collection[str], quiet: bool
) -> Manifest:
    stored = manifest.tensors
    config = model_config(model) or _source_config(source)
    shapes = {name: entry.shape for name, entry in stored.items()}
    keymap = keymap_for(config, shapes, "memory", quiet=quiet)
    if keymap is None:
        return manifest
    # safetensors chunks are raw runs already: resolving one is the identity
    derived, out, _ = merge_entries(manifest, {n: n for n in stored}, keymap, lambda e, c: c)
    tensors = {memory: replace(derived.tensors[fqn], fqn=memory) for memory, fqn in out.items()}
    if sum(n in tensors for n in wanted) <= sum(n in stored for n in wanted):
        return manifest
    log.info("load_pretrained: %s applied to %s", keymap.mapping, source)
    return replace(manifest, tensors=tensors)


def _with_prefix(manifest: Manifest, wanted: Collection[str], prefix: str) -> Manifest:
    """transformers' rule for a head model's files loaded into its base model and back: a
    published name that starts with ``<prefix>.`` loses it when the rest is a model tensor
    (``LlamaModel`` from a ``LlamaForCausalLM`` directory); else it gains it when that is one
    (the other way). A name another published tensor already gives is left as it is."""
    if not prefix:
        return manifest
    wanted = set(wanted)
    head = f"{prefix}."
    tensors = {}
    for name, entry in manifest.tensors.items():
        new = name
        if name.startswith(head) and name[len(head) :] in wanted:
            new = name[len(head) :]
        elif head + name in wanted:
            new = head + name
        if new != name and (new in manifest.tensors or new in tensors):
            new = name
        tensors[new] = entry if new == name else replace(entry, fqn=new)
    return replace(manifest, tensors=tensors)


def ignore_filter(model: nn.Module) -> KeyFilter | None:
    """The model's own verdict on unmatched keys, as ``from_pretrained`` applies it
    (``_adjust_missing_and_unexpected_keys``); None for a model that has none."""
    inner = _transformers_model(model)
    adjust = getattr(inner, "_adjust_missing_and_unexpected_keys", None)
    if not callable(adjust):
        return None

    def keep(missing: Sequence[str], unexpected: Sequence[str]) -> tuple[list[str], list[str]]:
        info = SimpleNamespace(missing_keys=set(missing), unexpected_keys=set(unexpected))
        adjust(info)
        return (
            [k for k in missing if k in info.missing_keys],
            [k for k in unexpected if k in info.unexpected_keys],
        )

    return keep
