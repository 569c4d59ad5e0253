"""The registry: every layout's name and the package module that defines it, the one table.

Imports nothing of ckptools: ``--format``'s names, and what each family's package declares
without its readers (:func:`declared`), are read from here at no cost; the layouts themselves
are :func:`ckptools.producers.base.layouts`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

#: Every layout's name, in detection order (their ``priority``; equal ones in this order), and
#: the module of ``ckptools.producers`` that defines and registers it. Detection imports a module
#: when it first reaches one of its layouts: a DCP directory is recognised having imported 4 of
#: the 9, not every other family's reader (issue 27: start-up).
MODULES: dict[str, str] = {
    "trainer": "dcp.wrappers",
    "accelerate": "dcp.wrappers",
    "lightning": "dcp.wrappers",
    "torchtitan": "dcp.wrappers",
    "megatron": "megatron.layout",
    "dcp_rank_local": "dcp.rank_local",
    "dcp": "dcp.layout",
    "verl": "fsdp1.verl",
    "deepspeed": "deepspeed.layout",
    "transformers_distributed": "hf.distributed",
    "torch_save": "hf.torch_save",
    "safetensors": "hf.safetensors",
}

#: ``shard --to NAME`` beside ``dcp`` (ckptools' own writer): the module of
#: ``ckptools.producers`` that plans a save in that producer's layout
#: (:func:`ckptools.verbs.reshard.shard` imports it when asked)
WRITE_TARGETS: dict[str, str] = {"megatron": "megatron.writer"}


#: the layouts whose stored names are not the model's (a ``Layout.views``: a test checks they
#: are exactly those), so ``dcp.load`` into the model cannot read them; known here so that
#: asking (:func:`ckptools.producers.base.viewed_by`) imports no other family's modules
VIEWED: tuple[str, ...] = ("megatron",)


def names() -> tuple[str, ...]:
    """Every layout's name (what ``--format`` takes), in detection order; imports none."""
    return tuple(MODULES)


def write_targets() -> tuple[str, ...]:
    """What ``shard --to`` takes: ``dcp``, then each producer's writer; imports none."""
    return ("dcp", *WRITE_TARGETS)


def families() -> tuple[ModuleType, ...]:
    """Each family's package (``ckptools.producers.dcp``...), in the registry's order: what it
    declares without its readers (numbered save names, run records, part files) is read from
    there, so asking imports no reader (docs/architecture.md, "What a family declares")."""
    packages = dict.fromkeys(m.split(".")[0] for m in MODULES.values())
    return tuple(importlib.import_module(f"ckptools.producers.{p}") for p in packages)


def declared(attribute: str) -> tuple[Any, ...]:
    """The ``attribute`` tuples every family's package declares, joined in registry order."""
    return tuple(x for f in families() for x in getattr(f, attribute, ()))


def inspected() -> tuple[ModuleType, ...]:
    """The modules of what ``inspect`` shows of a family's checkpoints (each package's
    ``FACTS``), in registry order: ``KEY`` (its key in ``inspect --json``, null for every other
    checkpoint), ``facts(manifest)`` (that value, or None) and ``lines(facts)`` (its text)."""
    return tuple(importlib.import_module(f"ckptools.producers.{m}") for m in declared("FACTS"))
