"""The numbered saves of a producer's run directory: what ``ckpt list RUN_DIR`` shows.

Every producer that keeps several saves numbers them in directories of its own naming, and some
record which is the last one they finished: the Trainer's ``checkpoint-N`` (no record: it
resumes from the highest number), DeepSpeed's ``global_stepN`` tags (``latest`` names one),
verl's ``global_step_N`` and Megatron's ``iter_0000010`` (both recorded in
``latest_checkpointed_iteration.txt``) and ``step-N`` (torchtitan's, or a script's
``dcp.save`` per step: labelled by the layout that reads the run directory).
Each is listed with its step, whether it is whole (the very check the layout's own reading of
the run directory applies, :func:`~ckptools.producers.run_dirs.newest_numbered`: every rank file the
save's own metadata names is there), its size, the ranks its file names show, and which one
reading the run directory picks: the recorded one when it is whole, else the newest whole one.
The checkpoint manager's own ``step-N`` (with its ``.ckptools-complete`` marker) is listed by
:func:`ckptools.training.store.list_checkpoints`.

Example:
    >>> [(s.name, s.complete, s.latest) for s in list_saves("output_dir")]  # doctest: +SKIP
    [('checkpoint-1', True, False), ('checkpoint-2', True, True)]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ckptools.errors import CkptError
from ckptools.io import storage
from ckptools.producers.base import Layout, NumberedSaves, layouts
from ckptools.producers.run_dirs import directory_names


def producers() -> tuple[tuple[Layout, NumberedSaves], ...]:
    """Each layout whose producer numbers its saves, with how (:meth:`Layout.numbered_saves`),
    in detection order: the registry is the one list."""
    found = ((layout, layout.numbered_saves()) for layout in layouts())
    return tuple((layout, saves) for layout, saves in found if saves is not None)


def _lacks(producer: NumberedSaves, path: str) -> str | None:
    try:
        return producer.lacks(path)
    except CkptError as e:  # a hostile or damaged record: not whole, and reading says why
        return str(e)


@dataclass(frozen=True)
class Save:
    """One numbered save in a run directory."""

    producer: str
    name: str
    step: int
    path: str
    complete: bool
    reason: str  # what it lacks, when not complete
    size_bytes: int
    latest: bool  # the one reading the run directory picks
    world_size: int | None = None  # ranks that wrote it, where its file names say

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def list_saves(root: str) -> list[Save]:
    """Every numbered save of every producer in the run directory ``root``, oldest first.

    Reads listings, sizes and the producers' small records only. A name leading out of
    ``root`` (a link) is left out, as reading the run directory never follows one.
    """
    names = directory_names(root) or []
    saves: list[Save] = []
    for layout, producer in producers():
        found = []
        for name in names:
            m = producer.pattern.match(name)
            full = storage.join(root, name)
            if m and storage.outside_reason(root, name) is None and storage.isdir(full):
                found.append((int(m.group(1)), name, full))
        if not found:
            continue
        lacks = {name: _lacks(producer, full) for _, name, full in found}
        whole = {name: lacks[name] is None for name in lacks}
        recorded = producer.recorded(root, names)
        if recorded not in whole or not whole[recorded]:
            recorded = max(((s, n) for s, n, _ in found if whole[n]), default=(0, None))[1]
        label = layout.name if producer.label is None else producer.label(root)
        for step, name, full in sorted(found):
            saves.append(
                Save(
                    producer=label,
                    name=name,
                    step=step,
                    path=full,
                    complete=whole[name],
                    reason=lacks[name] or "",
                    size_bytes=sum(storage.walk_files(full).values()),
                    latest=name == recorded,
                    world_size=producer.ranks(full),
                )
            )
    return saves


#: the child directories :func:`runs_inside` looks into, at the most
_CHILDREN_MAX = 64


def runs_inside(root: str) -> list[str]:
    """The child directories of ``root`` that hold numbered saves (one level down: a NeMo
    experiment's ``checkpoints/``, a launcher's output directory), by their names alone: what
    ``ckpt list`` names when ``root`` itself holds none. Nothing when ``root`` has more than
    :data:`_CHILDREN_MAX` entries."""
    names = directory_names(root) or []
    if len(names) > _CHILDREN_MAX:
        return []
    patterns = [producer.pattern for _, producer in producers()]
    found = []
    for name in sorted(names):
        if name.startswith(".") or storage.outside_reason(root, name) is not None:
            continue
        child = storage.join(root, name)
        inside = directory_names(child)  # None for a file
        if inside and any(p.match(n) for p in patterns for n in inside):
            found.append(child)
    return found
