"""A producer's own views of its checkpoints, reached through the registry: the verbs ask the
layout that read a manifest (:meth:`ckptools.producers.base.Layout.views`) and never compare a
producer's name."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from ckptools.core.manifest import Manifest
from ckptools.producers.base import layout_of

if TYPE_CHECKING:  # a consolidate without a conversion imports none of its machinery
    from ckptools.plan.conversions import KeyMap


class Views(Protocol):
    """What a family's views module (``Layout.views``) holds."""

    #: what the model's ``config.json`` gives the view as the HF model (shown when it misfits)
    CONFIG_NEEDED: str
    #: the note of a consolidation whose OUT got no tokenizer from the source
    NO_TOKENIZER: str

    def as_hf(
        self,
        manifest: Manifest,
        names: dict[str, str],
        config: Mapping[str, Any] | None,
        *,
        check: bool = True,
    ) -> tuple[Manifest, dict[str, str], KeyMap, dict[str, Any]]:
        """The model tensors ``names`` as the HF model's: manifest, names, pieces, config."""

    def as_training(
        self, manifest: Manifest, config: Mapping[str, Any] | None, *, drop_optimizer: bool = False
    ) -> Manifest:
        """The checkpoint as the HF model's training state."""

    def with_masters(self, manifest: Manifest) -> Manifest:
        """The checkpoint with its optimizer's fp32 masters as the model (``--masters``)."""


def views_of(manifest: Manifest) -> Views | None:
    """The views of the producer that wrote ``manifest``, None when its names are the model's."""
    layout = layout_of(manifest)
    if layout is None or layout.views is None:
        return None
    return cast(Views, importlib.import_module(f"ckptools.producers.{layout.views}"))
