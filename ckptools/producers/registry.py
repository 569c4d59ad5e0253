"""The registry: every layout's name and the package module that defines it, the one table,
gathered from the family packages below ``ckptools.producers`` (each declares its ``LAYOUTS``,
and its ``WRITE_TARGETS`` where ``shard --to`` writes its layout).

Imports only those packages' ``__init__`` modules (plain data): ``--format``'s names, and what
each family declares without its readers (:func:`declared`), are read from here at no cost;
the layouts themselves are :func:`ckptools.producers.base.layouts`.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from types import ModuleType
from typing import Any


def _family_packages() -> tuple[ModuleType, ...]:
    """Each family's package below ``ckptools.producers`` (a folder with an ``__init__``), by
    name: the registry finds them, so a new family is its package and nothing else. Their
    ``__init__`` modules declare plain data (patterns, names), so importing them is cheap."""
    here = os.path.dirname(__file__)
    found = sorted(m.name for m in pkgutil.iter_modules([here]) if m.ispkg)
    return tuple(importlib.import_module(f"{__package__}.{name}") for name in found)


def _layout_modules(packages: tuple[ModuleType, ...]) -> dict[str, str]:
    """Every declared layout's name → its module below ``ckptools.producers``, in detection
    order: by priority, equal ones by package name, then as their package lists them."""
    declared = [
        (priority, p, i, name, f"{package.__name__.rpartition('.')[2]}.{module}")
        for p, package in enumerate(packages)
        for i, (name, module, priority) in enumerate(getattr(package, "LAYOUTS", ()))
    ]
    return {name: module for *_, name, module in sorted(declared)}


_PACKAGES = _family_packages()

#: Every layout's name, in detection order, and the module of ``ckptools.producers`` that
#: defines and registers it (each family's ``LAYOUTS``). Detection imports a module when it
#: first reaches one of its layouts: a DCP directory is recognised having imported the DCP
#: family's readers, not every other family's (issue 27: start-up).
MODULES: dict[str, str] = _layout_modules(_PACKAGES)

#: ``shard --to NAME`` beside ``dcp`` (ckptools' own writer): the module of
#: ``ckptools.producers`` that plans a save in that producer's layout (each family's
#: ``WRITE_TARGETS``; :func:`ckptools.verbs.reshard.shard` imports it when asked)
WRITE_TARGETS: dict[str, str] = {
    name: f"{package.__name__.rpartition('.')[2]}.{module}"
    for package in _PACKAGES
    for name, module in getattr(package, "WRITE_TARGETS", ())
}


def priority(name: str) -> int:
    """The detection priority the layout ``name``'s family declares for it."""
    for package in _PACKAGES:
        for declared_name, _, value in getattr(package, "LAYOUTS", ()):
            if declared_name == name:
                return int(value)
    raise KeyError(name)


#: the layouts whose stored names are not the model's (a ``Layout.views``: a test checks they
#: are exactly those; each family's ``VIEWED``), so ``dcp.load`` into the model cannot read
#: them; known here so that asking (:func:`ckptools.producers.base.viewed_by`) imports no
#: family's readers
VIEWED: tuple[str, ...] = tuple(n for p in _PACKAGES for n in getattr(p, "VIEWED", ()))

#: the layouts a family recognises only to refuse them (each family's ``REFUSED``): their
#: ``read_manifest`` raises the one line that names what the checkpoint is and what to do
#: instead. A directory one of them recognises is never handed to ``dcp.load``
#: (:func:`ckptools.producers.base.read_by_producer`), so ``ckptools.load`` says that line too.
REFUSED: tuple[str, ...] = tuple(n for p in _PACKAGES for n in getattr(p, "REFUSED", ()))


def names() -> tuple[str, ...]:
    """Every layout's name (what ``--format`` takes), in detection order; imports none."""
    return tuple(MODULES)


def write_targets() -> tuple[str, ...]:
    """What ``shard --to`` takes: ``dcp``, then each producer's writer; imports none."""
    return ("dcp", *WRITE_TARGETS)


def families() -> tuple[ModuleType, ...]:
    """Each family's package (``ckptools.producers.dcp``...), by name: what it declares
    without its readers (numbered save names, run records, part files) is read from there, so
    asking imports no reader (docs/architecture.md, "What a family declares")."""
    return _PACKAGES


def declared(attribute: str) -> tuple[Any, ...]:
    """The ``attribute`` tuples every family's package declares, joined in registry order."""
    return tuple(x for f in families() for x in getattr(f, attribute, ()))


def inspected() -> tuple[ModuleType, ...]:
    """The modules of what ``inspect`` shows of a family's checkpoints (each package's
    ``FACTS``), in registry order: ``KEY`` (its key in ``inspect --json``, null for every other
    checkpoint), ``facts(manifest)`` (that value, or None) and ``lines(facts)`` (its text)."""
    return tuple(importlib.import_module(f"ckptools.producers.{m}") for m in declared("FACTS"))
