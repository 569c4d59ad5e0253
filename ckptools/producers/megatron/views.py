"""A Megatron-core save seen as the Hugging Face model and as its training state: the views the
verbs reach through the registry (:meth:`ckptools.producers.base.Layout.views`), so that no verb
names this family.

* :func:`as_hf`: the run's model tensors as the HF model's (``consolidate``, ``diff``);
* :func:`as_training`: the HF model's training state (``reshard``, ``load_source``);
* :func:`with_masters`: the distributed optimizer's fp32 masters as the model (``--masters``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptools.core.manifest import Manifest
from ckptools.producers.megatron.converted import as_hf

__all__ = ["CONFIG_NEEDED", "NO_TOKENIZER", "as_hf", "as_training", "with_masters"]

#: what the model's ``config.json`` gives the view as the HF model (shown when it does not fit)
CONFIG_NEEDED = "Megatron's names and sizes come from it"
#: the note of a consolidation whose OUT got no tokenizer from the source
NO_TOKENIZER = (
    "a Megatron checkpoint holds no tokenizer: copy the tokenizer files into OUT, "
    "or give a directory holding them with --config"
)
#: ``--masters`` takes this family's distributed optimizer's fp32 masters
HAS_MASTERS = True


def as_training(
    manifest: Manifest, config: Mapping[str, Any] | None, *, drop_optimizer: bool = False
) -> Manifest:
    """The save as the HF model's training state (:mod:`ckptools.producers.megatron.training`)."""
    # imported here: the optimizer's readers (~20-25 ms) are no part of exporting the model
    from ckptools.producers.megatron.training import training_manifest

    return training_manifest(manifest, config, drop_optimizer=drop_optimizer)


def with_masters(manifest: Manifest) -> Manifest:
    """The save with the distributed optimizer's fp32 masters as the model (``--masters``)."""
    from ckptools.producers.megatron import masters

    return masters.with_masters(manifest, masters.read_optimizer(manifest))
