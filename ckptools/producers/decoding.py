"""Stored forms that read as other tensors: a layout whose checkpoints store some tensors in a
form that is not the model's tensor (quantized data beside its scales, say) declares a
``decodes`` module (:attr:`ckptools.producers.base.Layout.decodes`, found by
:func:`ckptools.producers.base.decodes_of`) whose ``decoded`` says, for
the tensors an export chose, what the model's plain tensors are and how to make them.

``decoded(manifest, names, dtype)`` takes output name → stored FQN (the export's choice) and
returns a :class:`Decoded`:

* ``dtype`` None (a plain copy, or asking which tensors the model has): ``names`` are the names
  the plain model holds (what a config's model is checked against), ``decoders`` empty; nothing
  is refused, since a copy keeps the stored form as it is.
* ``dtype`` given (``consolidate --dtype``): ``names`` are those written, each tensor to be
  computed named in ``decoders`` (output name → :data:`RowDecoder`), everything the computation
  consumed (scales) left out; ``config_drops`` are the ``config.json`` keys the written model no
  longer has. A stored form the layout does not understand raises a ``UsageError`` naming it,
  never a cast.

The engine runs each decoder on blocks of whole rows (:mod:`ckptools.engine.chunk_copier`),
so a computed tensor is written once, in bounded memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from ckptools.core.manifest import Manifest

#: Writes rows ``[first, stop)`` (dim 0) of a computed tensor into ``out`` (its output dtype,
#: row-major) from the same rows of its stored tensor, ``stored`` (the stored dtype, row-major).
RowDecoder = Callable[[int, int, memoryview, memoryview], None]


@dataclass(frozen=True)
class Decoded:
    """What an export writes of a checkpoint whose stored forms are not all the model's.

    Attributes:
        names: output name → stored FQN of every tensor written (for a computed one, the
            stored tensor whose rows its decoder reads).
        decoders: output name → the decoder computing it (the tensor is written in the
            export's dtype).
        config_drops: top-level ``config.json`` keys the written model no longer has.
        notes: facts worth showing (how many tensors were computed, from what).
        plain_names: whether ``names`` are the plain model's (what its config is checked
            against); False for a stored form the layout does not read, whose tensors then
            go unchecked.
    """

    names: dict[str, str]
    decoders: Mapping[str, RowDecoder] = field(default_factory=dict)
    config_drops: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    plain_names: bool = True


class Decodes(Protocol):
    """What a layout's ``decodes`` module holds."""

    def decoded(self, manifest: Manifest, names: dict[str, str], dtype: str | None) -> Decoded:
        """The tensors ``names`` as the plain model's (see the module's docstring)."""
