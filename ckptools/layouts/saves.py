"""The numbered saves of a producer's run directory: what ``ckpt list RUN_DIR`` shows.

Every producer that keeps several saves numbers them in directories of its own naming, and some
record which is the last one they finished: the Trainer's ``checkpoint-N`` (no record: it
resumes from the highest number), DeepSpeed's ``global_stepN`` tags (``latest`` names one),
verl's ``global_step_N`` and Megatron's ``iter_0000010`` (both recorded in
``latest_checkpointed_iteration.txt``) and torchtitan's ``step-N``.
Each is listed with its step, whether it is whole (the test the layout's own reading of the run
directory applies, :func:`~ckptools.layouts.base.newest_numbered`), its size, and which one
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

from ckptools.io import storage
from ckptools.layouts import deepspeed_files as dsf
from ckptools.layouts import megatron, numbered, verl, wrappers
from ckptools.layouts.base import directory_names


@dataclass(frozen=True)
class Producer:
    """How one producer numbers its saves inside a run directory."""

    name: str
    pattern: re.Pattern[str]  # group 1: the step
    whole: Callable[[str], bool]  # whether the save directory holds a whole checkpoint
    lacks: str  # what a save that is not whole lacks
    recorded: Callable[[str, list[str]], str | None]  # the producer's record of its latest


def _no_record(root: str, names: list[str]) -> str | None:
    return None


def _deepspeed_latest(root: str, names: list[str]) -> str | None:
    try:
        return dsf.find_tag(root, set(names))[1]
    except (OSError, ValueError):  # a damaged 'latest' records nothing
        return None


def _deepspeed_whole(path: str) -> bool:
    return any(dsf.OPTIM_RE.match(n) for n in directory_names(path) or ())


def _verl_latest(root: str, names: list[str]) -> str | None:
    recorded = verl._recorded_step(root)
    return recorded[0] if recorded else None


def _megatron_latest(root: str, names: list[str]) -> str | None:
    try:
        return megatron.tracked(root)
    except (OSError, ValueError):  # a damaged tracker records nothing
        return None


PRODUCERS = (
    Producer("trainer", numbered.TRAINER, wrappers._trainer_checkpoint_complete,
             "no DCP .metadata, no model file", _no_record),
    Producer("deepspeed", numbered.DEEPSPEED, _deepspeed_whole,
             "no *_optim_states.pt rank files", _deepspeed_latest),
    Producer("verl", numbered.VERL, lambda p: bool(verl._roles(p)),
             "no actor/ or critic/ holding fsdp_config.json and rank files", _verl_latest),
    Producer("torchtitan", numbered.TORCHTITAN, wrappers._is_dcp, "no DCP .metadata",
             _no_record),
    Producer("megatron", numbered.MEGATRON, megatron.is_save,
             "no metadata.json naming torch_dist with a DCP .metadata", _megatron_latest),
)  # fmt: skip


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
        whole = {name: producer.whole(full) for _, name, full in found}
        recorded = producer.recorded(root, names)
        if recorded not in whole or not whole[recorded]:
            recorded = max(((s, n) for s, n, _ in found if whole[n]), default=(0, None))[1]
        for step, name, full in sorted(found):
            saves.append(
                Save(
                    producer=producer.name,
                    name=name,
                    step=step,
                    path=full,
                    complete=whole[name],
                    reason="" if whole[name] else producer.lacks,
                    size_bytes=sum(storage.walk_files(full).values()),
                    latest=name == recorded,
                )
            )
    return saves
