"""The on-disk side of :class:`~ckptools.training.manager.CheckpointManager`, torch-free.

A manager root holds one directory per committed checkpoint and transient directories::

    root/
      step-100/                    committed: DCP files + config files + .ckptools-complete
      step-200/
      .tmp-step-300-<id>/          a save in progress (or one that crashed)
      .tmp-delete-step-100-<id>/   a checkpoint being deleted

Commit protocol (why a crash at any instant leaves nothing that looks complete): every rank writes
into ``.tmp-step-<step>-<id>/``; after a barrier, one rank fsyncs every file, writes the marker
``.ckptools-complete`` (JSON: step, time, world size, metrics, every file's size) last, fsyncs the
directory, renames it to ``step-<step>/`` and fsyncs the root. Deletion first renames a checkpoint
to ``.tmp-delete-*`` (atomic), then removes it, so a half-deleted checkpoint never keeps its name.
A ``.tmp-step-*`` directory whose marker is complete was committed up to the rename; cleanup rolls
it forward instead of deleting it.

On an object store (a ``s3://``, ``gs://``... root) there is no rename: a save writes straight into
``step-<step>/``, after an in-progress note (``.ckptools-writing``) and after removing what an
earlier save of the same step left (marker first); the marker, written last, is the commit, and
the note is removed after it. A ``step-<step>/`` without a valid marker is incomplete, whatever
else it holds; one that still holds the note is a crashed save, which cleanup removes. Deletion
removes the marker first, so a half-deleted checkpoint never looks complete.

``ckpt list`` and ``ckpt prune`` use this module directly, so they run without importing torch.

Example:
    >>> from ckptools.training.store import list_checkpoints
    >>> [c.step for c in list_checkpoints("checkpoints") if c.complete]  # doctest: +SKIP
    [100, 200]
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptools.errors import CheckpointNotFoundError, UsageError
from ckptools.io import storage
from ckptools.io.staging import IN_PROGRESS, staging_for
from ckptools.producers.dcp import STEP_SAVE
from ckptools.producers.dcp.manager import MARKER_FORMAT, MARKER_NAME, MARKER_VERSION, read_marker
from ckptools.training.retention import RetentionDecision, RetentionPolicy, plan_retention

__all__ = [
    "MARKER_NAME",
    "CheckpointInfo",
    "PruneResult",
    "clean_stale",
    "commit",
    "delete_checkpoint",
    "list_checkpoints",
    "new_tmp_dir",
    "prune",
    "read_marker",
    "step_dir",
    "write_marker",
]

log = logging.getLogger(__name__)

_TMP_STEP_RE = re.compile(r"^\.tmp-step-(\d+)-[0-9a-f]+$")
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory under a manager root.

    Attributes:
        step: the training step.
        path: the directory.
        complete: committed (marker present, parsable, every recorded file present at its size).
        reason: why it is not complete (empty when complete).
        time: commit time (seconds since the epoch), when complete.
        world_size: ranks that wrote it, when complete.
        metrics: the metrics passed to ``save``.
        size_bytes: bytes of all files in the directory.
        latest: the newest complete checkpoint (what ``latest()`` returns); for another
            producer's save, the one reading its run directory picks.
        producer: who wrote it: ``ckptools`` (the manager), or the producer whose run
            directory :func:`list_run` listed (``trainer``, ``deepspeed``, ``verl``,
            ``torchtitan``).
        name: the directory's name in the root.
    """

    step: int
    path: str
    complete: bool
    reason: str = ""
    time: float | None = None
    world_size: int | None = None
    metrics: Mapping[str, Any] = field(default_factory=dict)
    size_bytes: int = 0
    latest: bool = False
    producer: str = "ckptools"
    name: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "producer": self.producer,
            "name": self.name or storage.basename(self.path),
            "step": self.step,
            "path": self.path,
            "complete": self.complete,
            "reason": self.reason,
            "time": self.time,
            "world_size": self.world_size,
            "metrics": dict(self.metrics),
            "size_bytes": self.size_bytes,
            "latest": self.latest,
        }


def step_dir(root: str, step: int) -> str:
    """``root/step-<step>``."""
    return storage.join(root, f"step-{step}")


def new_tmp_dir(root: str, step: int, token: str | None = None) -> str:
    """A fresh name ``root/.tmp-step-<step>-<id>`` (not created). ``token`` must be the same on
    every rank, so the caller picks it on one rank and broadcasts it. On an object store, which
    cannot rename, the final ``root/step-<step>`` itself."""
    name = f".tmp-step-{step}-{token or os.urandom(6).hex()}"
    return staging_for(root).location(step_dir(root, step), name)


def create_tmp_dir(tmp: str) -> None:
    """Create the directory :func:`new_tmp_dir` named. One rank calls it, with no save of this
    root in flight. On an object store: the in-progress note, then whatever an earlier save of
    the same step left is removed, its marker first."""
    staging_for(tmp).begin(tmp)


def fsync_tree(directory: str) -> None:
    """fsync every file and directory below ``directory`` (data reaches the disk before the
    marker that declares it complete). Nothing to do on an object store: an uploaded object
    is durable."""
    staging_for(directory).sync(directory, files=True)


def _json_safe(value: Any) -> Any:
    """Metrics as JSON can hold them: non-finite floats become strings, others via ``float``."""
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    try:  # numpy / 0-dim tensor scalars
        return _json_safe(float(value))
    except (TypeError, ValueError):
        return str(value)


def write_marker(
    tmp: str,
    *,
    step: int,
    world_size: int,
    metrics: Mapping[str, Any] | None = None,
    extra_fields: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the commit marker into ``tmp``, after fsyncing everything else. One rank calls it,
    after every rank has finished writing (a barrier).

    Returns:
        The marker's content.
    """
    fsync_tree(tmp)
    files = {
        k: v
        for k, v in storage.walk_files(tmp).items()
        if not k.startswith(MARKER_NAME) and k != IN_PROGRESS
    }
    marker: dict[str, Any] = {
        "format": MARKER_FORMAT,
        "version": MARKER_VERSION,
        "step": step,
        "time": time.time(),
        "world_size": world_size,
        "metrics": _json_safe(dict(metrics or {})),
        "files": dict(sorted(files.items())),
        **dict(extra_fields or {}),
    }
    # locally a synced temporary file renamed into place, on an object store one PUT: the
    # marker appears whole or not at all
    text = json.dumps(marker, indent=1, sort_keys=True)
    storage.write_atomic(storage.join(tmp, MARKER_NAME), text.encode())
    return marker


@storage.accepts_storage_options
def list_checkpoints(
    root: str,
    *,
    include_tmp: bool = True,
    storage_options: storage.StorageOptions | None = None,
) -> list[CheckpointInfo]:
    """Every ``step-*`` directory (and, with ``include_tmp``, every in-progress save) under
    ``root``, oldest first. Reads markers and sizes only; safe on any rank.

    Raises:
        CheckpointNotFoundError: ``root`` does not exist.

    Example:
        >>> from ckptools.training.store import list_checkpoints
        >>> [(c.step, c.complete) for c in list_checkpoints("ckpts")]  # doctest: +SKIP
        [(100, True), (200, True), (300, False)]
    """
    remote = storage.is_url(root)
    if not storage.isdir(root):
        raise CheckpointNotFoundError(f"{root}: no such directory", path=root)
    infos: list[CheckpointInfo] = []
    for name in sorted(storage.listdir(root)):
        full = storage.join(root, name)
        m = STEP_SAVE.match(name)
        tmp = _TMP_STEP_RE.match(name) if include_tmp else None
        # (an object store lists step-N/ prefixes; asking each whether it is one costs a request)
        if not (m or tmp) or not (remote or os.path.isdir(full)):
            continue
        step = int((m or tmp).group(1))  # type: ignore[union-attr]
        size = sum(storage.walk_files(full).values())
        if tmp:
            infos.append(
                CheckpointInfo(step, full, False, "save in progress or crashed", size_bytes=size)
            )
            continue
        marker, why = read_marker(full)
        if marker is None:
            infos.append(CheckpointInfo(step, full, False, why, size_bytes=size))
            continue
        infos.append(
            CheckpointInfo(
                step,
                full,
                True,
                time=marker.get("time"),
                world_size=marker.get("world_size"),
                metrics=marker.get("metrics") or {},
                size_bytes=size,
            )
        )
    infos.sort(key=lambda c: (c.step, c.complete))
    complete = [c for c in infos if c.complete]
    if complete:
        newest = complete[-1]
        infos = [
            CheckpointInfo(**{**c.__dict__, "latest": True}) if c is newest else c for c in infos
        ]
    return infos


@storage.accepts_storage_options
def list_run(
    root: str, *, storage_options: storage.StorageOptions | None = None
) -> list[CheckpointInfo]:
    """The saves under ``root``: the checkpoint manager's (:func:`list_checkpoints`), or, in a
    producer's run directory (a Trainer's ``output_dir``, a DeepSpeed or verl run, torchtitan's
    checkpoint folder), that producer's numbered saves
    (:func:`ckptools.producers.saves.list_saves`). Reads listings, markers and sizes only.

    Raises:
        CheckpointNotFoundError: ``root`` does not exist.
    """
    from ckptools.producers.base import is_managed
    from ckptools.producers.run_dirs import directory_names
    from ckptools.producers.saves import list_saves

    managed = list_checkpoints(root)
    # torchtitan's step-N look like the manager's: the manager's have its marker (a root where
    # none is committed yet is still the manager's: reading it says none is complete)
    if is_managed(root, directory_names(root) or []):
        return managed
    others = [
        CheckpointInfo(
            s.step, s.path, s.complete, s.reason, world_size=s.world_size,
            size_bytes=s.size_bytes, latest=s.latest, producer=s.producer, name=s.name,
        )
        for s in list_saves(root)
    ]  # fmt: skip
    return others or managed


def _trash_name(label: str) -> str:
    """Where a checkpoint is renamed before it is removed: a ``.tmp-`` name, so
    :func:`clean_stale` finishes the removal should the process die half-way."""
    return f"{_TMP_PREFIX}delete-{label}-{os.urandom(6).hex()}"


def commit(tmp: str, final: str) -> None:
    """Rename a marked ``tmp`` directory to ``final`` and fsync the parent. One rank calls it.

    An existing ``final`` (the same step saved again) is moved away first; should the process die
    between the two renames, :func:`clean_stale` rolls ``tmp`` forward. On an object store
    ``tmp`` is ``final``, committed by its marker; the in-progress note is removed.
    """
    name = _trash_name(storage.basename(final))
    if staging_for(final).commit(tmp, final, overwrite=True, name=name):
        log.warning("replaced existing checkpoint %s", final)


def delete_checkpoint(root: str, step: int) -> None:
    """Delete ``root/step-<step>`` so that no partial state ever keeps its name. One rank."""
    staging_for(root).delete(step_dir(root, step), name=_trash_name(f"step-{step}"))


def clean_stale(root: str) -> list[str]:
    """Remove what crashed saves and deletions left, rolling committed-but-unrenamed saves
    forward. One rank calls it, while no save of this root is in flight.

    Returns:
        The names removed or rolled forward (for logging).
    """
    if storage.is_url(root):
        return _clean_stale_remote(root)
    if not os.path.isdir(root):
        return []
    local = staging_for(root)
    handled: list[str] = []
    for name in sorted(os.listdir(root)):
        if not name.startswith(_TMP_PREFIX):
            continue
        full = os.path.join(root, name)
        m = _TMP_STEP_RE.match(name)
        if m:
            final = step_dir(root, int(m.group(1)))
            marker, _ = read_marker(full)
            if marker is not None and not os.path.exists(final):
                log.info("rolling forward committed save %s -> %s", full, final)
                local.commit(full, final, overwrite=False)
                handled.append(name)
                continue
        log.info("removing stale %s", full)
        local.discard(full)
        handled.append(name)
    return handled


def _clean_stale_remote(root: str) -> list[str]:
    """Object stores: remove ``step-N/`` prefixes that a crashed save left (in-progress note, no
    valid marker). Prefixes without the note are never touched: they are not ours to delete."""
    handled: list[str] = []
    try:
        names = storage.listdir(root)
    except FileNotFoundError:
        return []
    for name in sorted(names):
        if not STEP_SAVE.match(name):
            continue
        full = storage.join(root, name)
        held = storage.walk_files(full)
        if IN_PROGRESS in held and MARKER_NAME not in held:
            log.info("removing crashed save %s", full)
            storage.remove_tree(full)
            handled.append(name)
    return handled


@dataclass(frozen=True)
class PruneResult:
    """What :func:`prune` deleted (or, with ``dry_run``, would delete).

    Attributes:
        root: the manager root.
        decision: kept and deleted steps, with the reasons.
        dry_run: nothing was deleted.
        freed_bytes: bytes of the deleted checkpoints.
    """

    root: str
    decision: RetentionDecision
    dry_run: bool
    freed_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "keep": list(self.decision.keep),
            "delete": list(self.decision.delete),
            "reasons": {str(k): list(v) for k, v in self.decision.reasons.items()},
            "dry_run": self.dry_run,
            "freed_bytes": self.freed_bytes,
        }


def _producers_saves(root: str, *, itself: bool = False) -> str | None:
    """What another producer saved in the run directory ``root`` (a Trainer's, DeepSpeed's,
    verl's saves; with ``itself``, ``root`` a DCP checkpoint too), or None for a
    CheckpointManager's root, an empty one, or one of other files."""
    from ckptools.producers.base import is_managed
    from ckptools.producers.dcp.layout import METADATA_FILE
    from ckptools.producers.run_dirs import directory_names
    from ckptools.producers.saves import list_saves

    names = directory_names(root)
    if names is None or is_managed(root, names):
        return None
    if itself and METADATA_FILE in names:
        return "is a DCP checkpoint itself"
    # an incomplete step-N may be a manager's first save, not committed yet (on an object
    # store it is written in place, its marker last): never refused for it
    theirs = [s for s in list_saves(root) if s.complete or not STEP_SAVE.match(s.name)]
    if not theirs:
        return None
    return f"holds {len(theirs)} {theirs[0].producer} save(s) ({theirs[0].name}, ...)"


@storage.accepts_storage_options
def _refuse_a_producers_run(root: str) -> None:
    """Refuse a run directory whose saves another producer wrote: ``prune`` deletes a
    CheckpointManager's saves only, and would otherwise report deleting nothing as though there
    were nothing to delete."""
    theirs = _producers_saves(root)
    if theirs is not None:
        raise UsageError(
            f"{root}: {theirs}, not a CheckpointManager's: ckpt prune deletes only the step-N "
            "saves a CheckpointManager committed (delete the producer's saves with its own tools)"
        )


def check_root(root: str) -> None:
    """Refuse a CheckpointManager root that is a checkpoint or another producer's run
    directory: its step-N saves would be written into it, beside saves its list and retention
    do not know.

    Raises:
        UsageError: one line naming the root and what it holds.
    """
    theirs = _producers_saves(root, itself=True)
    if theirs is not None:
        raise UsageError(
            f"{root}: {theirs}; a CheckpointManager root is a directory of its own step-N saves: "
            "choose another root (e.g. a new directory beside it)"
        )


def _refuse_no_saves(root: str) -> None:
    """Refuse a directory that holds something but no CheckpointManager save (no ``step-N/``,
    none in progress): a save itself or the directory above the root, where ``prune`` would
    report deleting nothing as though the policy held. An empty directory is a root before its
    first save."""
    from ckptools.errors import CkptError
    from ckptools.producers.base import detect
    from ckptools.producers.run_dirs import directory_names
    from ckptools.producers.saves import runs_inside

    names = directory_names(root)
    if not names or any(STEP_SAVE.match(n) or _TMP_STEP_RE.match(n) for n in names):
        return
    inside = runs_inside(root)
    if inside:
        way = f"saves lie one level down ({', '.join(inside[:3])}): point at the root holding them"
    else:
        try:
            layout: str | None = detect(root).name
        except CkptError:
            layout = None
        what = f"it is one {layout} checkpoint, not" if layout is not None else "point at"
        way = f"{what} a CheckpointManager root (the directory holding its step-N saves)"
    raise UsageError(f"{root}: holds no CheckpointManager save (step-N/), nothing pruned; {way}")


def prune(
    root: str,
    policy: RetentionPolicy,
    *,
    dry_run: bool = False,
    storage_options: storage.StorageOptions | None = None,
) -> PruneResult:
    """Apply a retention policy to the complete checkpoints under ``root``. One process calls it
    (rank 0 in training, or a person through ``ckpt prune``); incomplete directories are never
    counted as kept nor deleted here (stale ones are :func:`clean_stale`'s).

    Example:
        >>> from ckptools.training.retention import RetentionPolicy
        >>> from ckptools.training.store import prune
        >>> result = prune("ckpts", RetentionPolicy(keep_last=2), dry_run=True)  # doctest: +SKIP
        >>> result.decision.delete  # doctest: +SKIP
        (100,)
    """
    if not isinstance(policy, RetentionPolicy):  # pragma: no cover - typed callers
        raise UsageError("policy must be a RetentionPolicy")
    _refuse_a_producers_run(root)
    _refuse_no_saves(root)
    complete = {c.step: c for c in list_checkpoints(root, include_tmp=False) if c.complete}
    decision = plan_retention({s: c.metrics for s, c in complete.items()}, policy)
    freed = sum(complete[s].size_bytes for s in decision.delete)
    if not dry_run:
        for s in decision.delete:
            log.info("retention: deleting %s", complete[s].path)
            delete_checkpoint(root, s)
    return PruneResult(root=root, decision=decision, dry_run=dry_run, freed_bytes=freed)
