"""A file that is one part of a multi-file checkpoint, known by its name.

Users point at a file instead of its directory: a ``.distcp`` or the ``.metadata`` of a DCP, a
ZeRO rank file, a verl rank file, one rank's shard of transformers' distributed safetensors,
one ``model-00001-of-00004.safetensors`` of a sharded model directory (each family's package
declares its own names: ``PARTS``, ``COUNTED_PARTS``, ``PARTS_BESIDE``).
Read alone, each is wrong in its own way (an unnamed tensor, ZeRO-3's zero-element
placeholders, a pickle whose producer classes belong to the whole), so :func:`part_of` names
the directory instead, and :func:`ckptools.producers.base.detect` refuses in one line pointing
at it. Only names that never stand alone are listed, and DeepSpeed's ``mp_rank_00_model_states.pt``
beside ZeRO optimizer rank files: ZeRO 1/2 keep there the module's low-precision copy, not the
fp32 masters the directory's reading exports. A ``model_world_size_1_rank_0.pt``, or a
``mp_rank_00_model_states.pt`` with no ZeRO files beside it, holds a whole model and stays
readable as a file.
"""

from __future__ import annotations

import os
import re

from ckptools.io import storage
from ckptools.producers.registry import declared

# The rules are each family's (its package's ``PARTS``, ``COUNTED_PARTS`` and ``PARTS_BESIDE``),
# read only for a file: a directory is no part.


def _counted() -> tuple[tuple[re.Pattern[str], str, int], ...]:
    """(file name whose group ``n`` counts the files of the whole and ``i`` numbers this one,
    layout, the number of the first file): alone when ``n`` is 1."""
    return declared("COUNTED_PARTS")


def part_of(path: str) -> tuple[str, str] | None:
    """``(family, directory)`` when ``path`` is a file that only makes sense with the other
    files of its directory, else None (a directory, or a file that may stand alone)."""
    if storage.is_url(path):
        if not storage.isfile(path):
            return None
        directory = storage.dirname(path)
        name = path.rstrip("/").rsplit("/", 1)[-1]
    else:
        if not os.path.isfile(path):
            return None
        directory = os.path.dirname(path.rstrip(os.sep)) or os.curdir
        name = os.path.basename(path)
    for pattern, family in declared("PARTS"):
        if pattern.match(name):
            return family, directory
    for pattern, family, _ in _counted():
        m = pattern.match(name)
        if m and int(m["n"]) > 1:
            return family, directory
    for pattern, other, family in declared("PARTS_BESIDE"):
        if pattern.match(name):
            try:
                beside = storage.listdir(directory)
            except (FileNotFoundError, NotADirectoryError):
                return None
            if any(other.match(n) for n in beside):
                return family, directory
    return None


def missing_siblings(path: str) -> tuple[int, list[str]]:
    """How many files make the whole that ``path`` (a numbered part,
    ``model_world_size_2_rank_0.pt``) belongs to, and those of them its directory lacks:
    ``(2, ["model_world_size_2_rank_1.pt"])`` for a rank file copied out alone. ``(0, [])`` for
    any other file."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if not storage.is_url(path):
        name = os.path.basename(path.rstrip(os.sep))
    for pattern, _, first in _counted():
        m = pattern.match(name)
        if m is None:
            continue
        start, end = m.span("i")
        width = len(m["i"])
        wanted = [
            name[:start] + str(k).zfill(width) + name[end:]
            for k in range(first, first + int(m["n"]))
        ]
        directory = part_of(path)
        if directory is None:
            return 0, []
        present = set(storage.listdir(directory[1]))
        return len(wanted), [w for w in wanted if w not in present]
    return 0, []
