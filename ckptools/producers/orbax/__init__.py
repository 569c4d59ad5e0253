"""Orbax (JAX: MaxText, and other JAX trainers' ``CheckpointManager`` runs): recognised, listed
by ``inspect`` from Orbax's own JSON metadata, refused by every other verb by name."""

from __future__ import annotations

#: (name, module, detection priority; lower first): before every PyTorch layout, so an Orbax
#: directory is never taken for another (none of them reads Orbax's files)
LAYOUTS = (("orbax", "layout", 8),)
#: recognised only to be refused (its read_manifest names it): never handed to dcp.load
REFUSED = ("orbax",)
#: ``ckpt --help``'s row (cli/options.producers_say)
HELP = (("reads", ("Orbax (JAX): inspect only", "ckpt inspect maxtext_run/checkpoints")),)
#: ``inspect``'s facts of an Orbax checkpoint (its arrays)
FACTS = ("orbax.facts",)
#: the key of those facts in ``Manifest.details`` and ``inspect --json``
DETAILS_KEY = "orbax"
