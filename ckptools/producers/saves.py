"""The numbered saves of a producer's run directory: what ``ckpt list RUN_DIR`` shows.

Every producer that keeps several saves numbers them in directories of its own naming, and some
record which is the last one they finished: the Trainer's ``checkpoint-N`` (no record: it
resumes from the highest number), DeepSpeed's ``global_stepN`` tags (``latest`` names one),
verl's ``global_step_N`` and Megatron's ``iter_0000010`` (both recorded in
``latest_checkpointed_iteration.txt``) and ``step-N`` (torchtitan's, or a script's
``dcp.save`` per step: labelled by the layout that reads the run directory).
Each is listed with its step, whether it is whole (the very check the layout's own reading of
the run directory applies, :func:`~ckptools.producers.base.newest_numbered`: every rank file the
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
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptools.errors import CkptError
from ckptools.io import storage
from ckptools.producers import numbered
from ckptools.producers.base import detect, directory_names
from ckptools.producers.dcp import layout as dcp
from ckptools.producers.dcp import wrappers
from ckptools.producers.deepspeed import files as dsf
from ckptools.producers.deepspeed import layout as deepspeed
from ckptools.producers.fsdp1 import verl
from ckptools.producers.megatron import layout as megatron


@dataclass(frozen=True)
class Producer:
    """How one producer numbers its saves inside a run directory."""

    name: str
    pattern: re.Pattern[str]  # group 1: the step
    lacks: Callable[[str], str | None]  # what a save lacks to be read (None: whole), as the
    # layout reading the run directory judges it
    recorded: Callable[[str, list[str]], str | None]  # the producer's record of its latest
    ranks: Callable[[str], int | None]  # how many ranks wrote a save, from its file names


def _no_record(root: str, names: list[str]) -> str | None:
    return None


def _deepspeed_latest(root: str, names: list[str]) -> str | None:
    try:
        return dsf.find_tag(root, set(names))[1]
    except (OSError, ValueError):  # a damaged 'latest' records nothing
        return None


def _verl_latest(root: str, names: list[str]) -> str | None:
    recorded = verl._recorded_step(root)
    return recorded[0] if recorded else None


def _verl_lacks(path: str) -> str | None:
    if verl._roles(path):
        return None
    return "no actor/ or critic/ holding fsdp_config.json and rank files"


def _megatron_latest(root: str, names: list[str]) -> str | None:
    try:
        return megatron.tracked(root)
    except (OSError, ValueError):  # a damaged tracker records nothing
        return None


def _megatron_lacks(path: str) -> str | None:
    if megatron.is_save(path):  # megatron.resolve's test
        return None
    return "no metadata.json naming torch_dist with a DCP .metadata"


def _dcp_ranks(path: str) -> int | None:
    """Ranks that wrote the DCP directory ``path`` (or a Trainer save's first accelerate
    directory): one ``__<rank>_<n>.distcp`` file name or more each."""
    names = directory_names(path) or []
    parts = sorted(n for n in names if n.startswith("pytorch_model_fsdp_"))
    if parts and not any(n.endswith(".distcp") for n in names):
        names = directory_names(storage.join(path, parts[0])) or []
    ranks = {dcp.rank_of(n) for n in names if n.endswith(".distcp")}
    ranks.discard(None)
    return len(ranks) or None


_VERL_RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_\d+\.pt$")


def _verl_ranks(path: str) -> int | None:
    for role in verl.ROLES:
        for name in directory_names(storage.join(path, role)) or ():
            m = _VERL_RANK_FILE.match(name)
            if m:
                return int(m.group(1))
    return None


def _steps_label(root: str) -> str:
    """Who reads a run directory of ``step-N/`` saves: torchtitan's layout when they are its,
    else the layout of the save reading the directory takes (a ``dcp.save`` per step)."""
    try:
        return detect(root).name
    except CkptError:
        return "dcp"


PRODUCERS = (
    Producer("trainer", numbered.TRAINER, wrappers.trainer_lacks, _no_record, _dcp_ranks),
    Producer("deepspeed", numbered.DEEPSPEED, deepspeed.save_lacks, _deepspeed_latest,
             deepspeed.save_ranks),
    Producer("verl", numbered.VERL, _verl_lacks, _verl_latest, _verl_ranks),
    # labelled by _steps_label: torchtitan, or whoever reads the newest whole save
    Producer("step", numbered.TORCHTITAN, dcp.dcp_lacks, _no_record, _dcp_ranks),
    Producer("megatron", numbered.MEGATRON, _megatron_lacks, _megatron_latest, _dcp_ranks),
)  # fmt: skip


def _lacks(producer: Producer, path: str) -> str | None:
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
    for producer in PRODUCERS:
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
        label = _steps_label(root) if producer.name == "step" else producer.name
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
