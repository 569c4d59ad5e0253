"""The numbered saves of a run directory, and the one a run resolves to (pure listing, no
layout): :func:`newest_numbered` picks the newest whole save a producer numbered
(``checkpoint-N``, ``global_stepN``, ``step-N``...), never following a link out of the run.
The layouts and the run-directory readers import these from here."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from ckptools.core.manifest import Manifest
from ckptools.errors import IncompleteCheckpointError
from ckptools.io import storage

__all__ = ["Chosen", "directory_names", "newest_numbered"]


def directory_names(path: str) -> list[str] | None:
    """The names in the directory ``path``, for a probe; None when it is not a directory (or
    stopped being one between the check and the listing)."""
    if not storage.isdir(path):
        return None
    try:
        return list(storage.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return None


@dataclass(frozen=True)
class Chosen:
    """The numbered checkpoint directory a run's outer directory resolves to."""

    parent: str
    name: str  # the entry of ``parent`` chosen
    total: int  # how many numbered entries there were
    skipped: tuple[str, ...] = ()  # newer ones, ignored (incomplete, or not recorded)
    linked: tuple[str, ...] = ()  # newer links leading out of ``parent``, never followed
    why: str = "the newest complete"
    skipped_as: str = "incomplete"

    def note(self) -> str:
        """Which directory was read, and why."""
        if self.total == 1:
            note = f"{self.parent}: using {self.name}, the only checkpoint there"
        else:
            note = f"{self.parent}: using {self.name}, {self.why} of {self.total} checkpoints"
        if self.skipped:
            note += f" ({self.skipped_as}, ignored: {', '.join(self.skipped)})"
        if self.linked:
            note += f" (links leading elsewhere, not followed: {', '.join(self.linked)})"
        return note

    def noted(self, manifest: Manifest) -> Manifest:
        """``manifest`` with :meth:`note` added to its notes."""
        return replace(manifest, notes=(*manifest.notes, self.note()))


def newest_numbered(
    path: str,
    pattern: re.Pattern[str],
    complete: Callable[[str], bool],
    missing: str,
    *,
    prefer: tuple[str, str] | None = None,
) -> Chosen | None:
    """The newest complete directory of ``path`` whose name ``pattern`` matches (its group 1 is
    the number): what a run's output directory resolves to. None when there is none at all.

    Only the chosen directory and those newer are looked into (a run of hundreds of saves costs
    one listing), and never one that is a link leading out of ``path``.

    Args:
        complete: whether a matching directory holds a whole checkpoint.
        missing: what an incomplete one lacks, for the error.
        prefer: (name, file): the entry the producer's own record of its last completed save
            (``file``) names, used instead of the newest when it is complete.

    Raises:
        IncompleteCheckpointError: there are some, none complete.
        OutsideCheckpointError: none complete inside, and one is a link leading elsewhere.
    """
    found = []
    for name in directory_names(path) or ():
        m = pattern.match(name)
        if m and storage.isdir(storage.join(path, name)):
            found.append((int(m.group(1)), name))
    if not found:
        return None
    names = [n for _, n in sorted(found)]
    inside: dict[str, bool] = {}

    def stays(name: str) -> bool:
        if name not in inside:
            inside[name] = storage.outside_reason(path, name) is None
        return inside[name]

    def usable(name: str) -> bool:
        return stays(name) and complete(storage.join(path, name))

    if prefer is not None and prefer[0] in names and usable(prefer[0]):
        at: int | None = names.index(prefer[0])
        why, skipped_as = f"the last save {prefer[1]} records,", "newer than that record"
    else:
        at = next((i for i in range(len(names) - 1, -1, -1) if usable(names[i])), None)
        why, skipped_as = "the newest complete", "incomplete"
    if at is None:
        linked = [n for n in names if not stays(n)]
        if linked:
            storage.contained(path, linked[-1], named_by=path, entry="holds")  # raises
        raise IncompleteCheckpointError(
            f"{path}: none of {', '.join(names)} is complete ({missing})", path=path
        )
    newer = names[at + 1 :]
    return Chosen(
        path,
        names[at],
        len(names),
        skipped=tuple(n for n in newer if stays(n)),
        linked=tuple(n for n in newer if not stays(n)),
        why=why,
        skipped_as=skipped_as,
    )
