"""A file that is one part of a multi-file checkpoint, known by its name.

Users point at a file instead of its directory: a ``.distcp`` or the ``.metadata`` of a DCP, a
ZeRO rank file, a verl rank file, one rank's shard of transformers' distributed safetensors,
one ``model-00001-of-00004.safetensors`` of a sharded model directory.
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

#: (file name, the family whose directory it is part of)
_PARTS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r".+\.distcp$"), "dcp"),
    (re.compile(r"^(__\d+)?\.metadata$"), "dcp"),
    (re.compile(r"^(.+_)?zero_pp_rank_\d+_mp_rank_\d+_(model|optim)_states\.pt$"), "deepspeed"),
    (re.compile(r"^(.+_)?mp_rank_\d+_optim_states\.pt$"), "deepspeed"),
    (re.compile(r"^shard-\d+-.+\.safetensors$"), "transformers_distributed"),
    # a Megatron save's marker and a run's tracker: never a checkpoint alone
    (re.compile(r"^metadata\.json$"), "megatron"),
    (re.compile(r"^latest_checkpointed_iteration\.txt$"), "megatron"),
)
#: DeepSpeed's model states of a save, one file of it when ZeRO optimizer rank files lie beside
_DS_MODEL_STATES = re.compile(r"^mp_rank_\d+_model_states\.pt$")
_DS_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt$")
#: (file name whose group ``n`` counts the files of the whole and ``i`` numbers this one,
#: family, the number of the first file): alone when ``n`` is 1
_COUNTED: tuple[tuple[re.Pattern[str], str, int], ...] = (
    (
        re.compile(r"^(model|optim|extra_state)_world_size_(?P<n>\d+)_rank_(?P<i>\d+)\.pt$"),
        "verl",
        0,
    ),
    (re.compile(r"^.+-(?P<i>\d+)-of-(?P<n>\d+)\.(safetensors|bin)$"), "safetensors", 1),
)


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
    for pattern, family in _PARTS:
        if pattern.match(name):
            return family, directory
    for pattern, family, _ in _COUNTED:
        m = pattern.match(name)
        if m and int(m["n"]) > 1:
            return family, directory
    if _DS_MODEL_STATES.match(name):
        try:
            beside = storage.listdir(directory)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if any(_DS_OPTIM.match(n) for n in beside):
            return "deepspeed", directory
    return None


def missing_siblings(path: str) -> tuple[int, list[str]]:
    """How many files make the whole that ``path`` (a numbered part,
    ``model_world_size_2_rank_0.pt``) belongs to, and those of them its directory lacks:
    ``(2, ["model_world_size_2_rank_1.pt"])`` for a rank file copied out alone. ``(0, [])`` for
    any other file."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if not storage.is_url(path):
        name = os.path.basename(path.rstrip(os.sep))
    for pattern, _, first in _COUNTED:
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
