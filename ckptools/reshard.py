"""``ckptools.reshard`` and ``ckptools.shard``: any checkpoint → DCP laid out for N ranks.

``reshard`` rewrites a DCP checkpoint (and the DCP directories inside accelerate / Trainer /
Lightning / torchtitan layouts) as if FSDP2 ``fully_shard`` on N ranks had saved it: model,
optimizer state and every other entry, in one process, with bounded memory. ``shard`` is the way
back from a published model: a safetensors directory or ``torch.save`` file becomes a DCP
checkpoint whose keys sit under ``--prefix`` (``model.``, what ``dcp.save({"model": ...})``
writes), so training starts from it without any rank loading the whole model.

Per-rank state that cannot be split (RNG state files ``rng_state_<r>.pth`` /
``random_states_<r>.pkl``, torchtitan's ``dataloader.dp_rank_<r>`` entries) follows the
``rank_state`` policy: ``keep`` carries it over unchanged (ranks that did not exist before have
none, and the result lists what was kept), ``drop`` leaves it out. Either way it is reported.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptools import collective, tunables
from ckptools.collective import Ranks
from ckptools.core.manifest import Manifest
from ckptools.engine import dcp_writer as dcp_write
from ckptools.engine.dcp_writer import write_dcp
from ckptools.errors import UsageError
from ckptools.io import storage
from ckptools.io.resume import Journal, fingerprint
from ckptools.io.staging import (
    IN_PROGRESS,
    check_writable,
    commit,
    copy_into,
    discard,
    fsync_dir,
    resumable_staging,
)
from ckptools.layouts import read_manifest
from ckptools.layouts.dcp import read_dcp, require_plain
from ckptools.plan.dcp import DcpPlan, file_name, plan_dcp
from ckptools.verify.checksums import CHECKSUM_FILE, write_checksums

RankState = Literal["keep", "drop"]
#: files a framework writes once per rank, which no resharding can split
RANK_STATE_FILES = re.compile(r"^(rng_state|random_states)_\d+\.(pth|pkl|pt)$")
#: object entries keyed by rank (torchtitan's dataloader state)
RANK_STATE_OBJECTS = re.compile(r"(^|\.)dp_rank_\d+$")
#: files that describe the source's own bytes (checksums, the training manager's commit marker)
_OWN_RECORDS = frozenset({CHECKSUM_FILE, ".ckptools-complete", IN_PROGRESS})


@dataclass(frozen=True)
class ReshardResult:
    """What :func:`reshard` / :func:`shard` wrote (or, with ``dry_run``, would write)."""

    src: str
    out: str
    world_size: int
    parts: dict[str, dict[str, Any]]  # DCP subdirectory ("" for the root) -> plan summary
    bytes_written: int
    seconds: float
    dry_run: bool
    rank_state: str
    rank_state_items: tuple[str, ...] = ()
    copied_files: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "src": self.src,
            "out": self.out,
            "world_size": self.world_size,
            "dry_run": self.dry_run,
            "parts": self.parts,
            "bytes": self.bytes_written,
            "seconds": round(self.seconds, 3),
            "rank_state": {"policy": self.rank_state, "items": list(self.rank_state_items)},
            "copied_files": list(self.copied_files),
            "notes": list(self.notes),
        }


def _parts(manifest: Manifest) -> list[str]:
    parts = manifest.details.get("parts")
    return list(parts) if parts else [""]


@storage.accepts_storage_options
def reshard(
    src: str,
    out: str,
    *,
    world_size: int,
    rank_state: RankState = "keep",
    overwrite: bool = False,
    dry_run: bool = False,
    workers: int | None = None,
    quiet: bool = False,
    format: str | None = None,
    distributed: bool = True,
    storage_options: storage.StorageOptions | None = None,
) -> ReshardResult:
    """Rewrite the DCP checkpoint ``src`` into ``out`` laid out for ``world_size`` FSDP2 ranks.

    Args:
        src: a DCP directory, or the outer directory of accelerate / Trainer / Lightning /
            torchtitan layouts (each DCP directory inside is resharded, other files copied).
        out: the new checkpoint directory (refused if it exists, unless ``overwrite``).
        world_size: ranks of the target layout.
        rank_state: ``"keep"`` or ``"drop"`` per-rank state that cannot be split (see module).
        dry_run: plan only; write nothing.
        distributed: under torchrun, or called by every rank of an initialised process group,
            split the output files over the ranks (:func:`_write`; every rank must call it);
            False: this process writes everything alone.
        storage_options: fsspec options for URL paths (credentials, endpoint...), a mapping
            or its JSON text; see :func:`ckptools.io.storage.storage_options`.

    Example:
        >>> ckptools.reshard("ckpt/step-100", "ckpt16/step-100", world_size=16)  # doctest: +SKIP
    """
    started = time.perf_counter()
    if rank_state not in ("keep", "drop"):
        raise UsageError(f"rank_state must be 'keep' or 'drop', got {rank_state!r}")
    manifest = read_manifest(src, format)
    if manifest.format != "dcp":
        raise UsageError(
            f"{src}: a {manifest.format} checkpoint is not sharded; use `ckpt shard` to make a "
            "DCP checkpoint from it"
        )
    root = manifest.root
    if not dry_run:
        check_writable(out, overwrite)
    plans: dict[str, tuple[Manifest, DcpPlan]] = {}
    rank_items: list[str] = []
    for sub in _parts(manifest):
        part = read_dcp(root, subdir=sub)
        require_plain(part)
        objects = []
        for fqn in part.objects:
            if RANK_STATE_OBJECTS.search(fqn):
                rank_items.append(f"{sub + '/' if sub else ''}{fqn}")
                if rank_state == "drop":
                    continue
            objects.append(fqn)
        plans[sub] = (part, plan_dcp(part, world_size, objects=objects))
    aux = _aux_files(root, list(plans))
    for name in aux:
        if RANK_STATE_FILES.match(os.path.basename(name)):
            rank_items.append(name)
    copied = tuple(
        a for a in aux if not (rank_state == "drop" and RANK_STATE_FILES.match(os.path.basename(a)))
    )
    summary = {sub: plan.to_dict() for sub, (_, plan) in plans.items()}
    notes = list(manifest.notes)
    if rank_items:
        notes.append(
            f"{len(rank_items)} per-rank state item(s) written by {manifest.world_size} ranks were "
            + ("kept unchanged" if rank_state == "keep" else "dropped")
            + " (--rank-state)"
        )
    if dry_run:
        return ReshardResult(
            src, out, world_size, summary, 0, time.perf_counter() - started, True, rank_state,
            tuple(rank_items), copied, tuple(notes),
        )  # fmt: skip
    ranks = collective.current(distributed)
    if ranks.world_size > 1:
        notes.append(f"written by {ranks.world_size} ranks")
    identity = fingerprint(
        "reshard", manifest,
        {"world_size": world_size, "rank_state": rank_state, "plan": summary, "copied": copied},
    )  # fmt: skip
    written, kept = _write(
        ranks, out, overwrite, plans, root, copied, identity,
        # The source was protected by a checksum manifest: so is the result.
        checksums=storage.exists(storage.join(root, CHECKSUM_FILE)),
        workers=workers, quiet=quiet,
    )  # fmt: skip
    if kept:
        notes.append(f"resumed: {kept} file(s) written by an interrupted run were kept")
    return ReshardResult(
        src, out, world_size, summary, written, time.perf_counter() - started, False, rank_state,
        tuple(rank_items), copied, tuple(notes),
    )  # fmt: skip


def _write(
    ranks: Ranks,
    out: str,
    overwrite: bool,
    parts: Mapping[str, tuple[Manifest, DcpPlan]],
    source_root: str,
    copied: Sequence[str],
    identity: str,
    *,
    checksums: bool,
    workers: int | None,
    quiet: bool,
) -> tuple[int, int]:
    """Write ``parts`` (DCP subdirectory -> source, plan) and ``copied`` into ``out``, atomically.

    Called by every rank, in this order (:mod:`ckptools.collective`; one process is rank 0 of 1):
    rank 0 creates the temporary directory and copies ``copied`` (files beside the DCP data)
    into it; every rank writes the ``__r_0.distcp`` files :meth:`Ranks.mine` gives it (balanced
    by bytes over the files of all parts); once all are written, rank 0 writes each part's
    ``.metadata``; with ``checksums`` every rank hashes a share of the files and rank 0 writes
    the checksum manifest (:func:`ckptools.verify.checksums.write_checksums`); rank 0 renames last.
    On any rank's failure rank 0 removes the temporary directory and every rank raises.

    Resumable (:mod:`ckptools.io.resume`): rank 0 reuses the staging location of an interrupted run
    of the same conversion (``identity``); each rank skips the files its journal part, or
    another rank's, records as complete, and journals each file it completes; rank 0 removes
    the journal before the first ``.metadata``. An interrupt keeps the staging location.

    Returns the bytes of the ``.distcp`` files written (every rank's) and how many files an
    interrupted run had already written.
    """
    workers = tunables.workers(workers)  # copy threads: one output file each
    units = [(sub, r) for sub, (_, plan) in parts.items() for r in range(plan.world_size)]
    mine: dict[str, list[int]] = {sub: [] for sub in parts}
    for i in ranks.mine([parts[sub][1].file_sizes[r] for sub, r in units]):
        mine[units[i][0]].append(units[i][1])

    def prepare() -> str:
        check_writable(out, overwrite)
        tmp = resumable_staging(out, identity)
        try:
            for name in copied:
                copy_into(storage.join(source_root, name), storage.join(tmp, name))
            for sub in parts:
                storage.makedirs(_target(tmp, sub))
        except BaseException:
            discard(tmp)
            raise
        return tmp

    def write_share(tmp: str) -> tuple[int, int]:
        journal = Journal.open(tmp, identity, writer=ranks.rank)
        written = kept = 0
        for sub, (part, plan) in parts.items():
            prefix = f"{sub}/" if sub else ""
            todo = [r for r in mine[sub] if not journal.is_done(prefix + file_name(r))]
            kept += len(mine[sub]) - len(todo)

            def done(
                r: int, prefix: str = prefix, sizes: tuple[int, ...] = plan.file_sizes
            ) -> None:
                journal.record(prefix + file_name(r), size=sizes[r])

            written += write_dcp(
                part, plan, _target(tmp, sub), source_root=source_root, workers=workers,
                quiet=quiet or not ranks.is_root, only_files=todo, on_file_done=done,
            )  # fmt: skip
        return written, kept

    def markers(tmp: str) -> None:
        Journal.open(tmp, identity).discard()  # never part of a committed checkpoint
        for sub, (_, plan) in parts.items():
            # through the module: tests interrupt a run here
            dcp_write.write_metadata(_target(tmp, sub), plan)

    def rename(tmp: str) -> None:
        fsync_dir(tmp)
        commit(tmp, out, overwrite)

    with ranks.staged(prepare, _discard, "reshard") as tmp:
        shares = ranks.from_all(lambda: write_share(tmp), "reshard")
        written = sum(w for w, _ in shares)
        kept = sum(k for _, k in shares)
        ranks.from_root(lambda: markers(tmp), "reshard")
        if checksums:
            write_checksums(tmp, workers=workers, quiet=True, distributed=ranks.world_size > 1)
        ranks.from_root(lambda: rename(tmp), "reshard")
    return written, kept


def _target(tmp: str, sub: str) -> str:
    return storage.join(tmp, sub) if sub else tmp


def _discard(tmp: str, error: BaseException) -> None:
    discard(tmp, error)


def _aux_files(root: str, parts: list[str]) -> list[str]:
    """Files beside the DCP data that belong to the checkpoint (trainer_state.json, meta.pt...)."""
    out: list[str] = []
    for rel in storage.walk_files(root):  # one listing on an object store
        rel_dir, _, name = rel.replace(os.sep, "/").rpartition("/")
        if any(d.startswith(".") for d in rel_dir.split("/") if d):
            continue
        if rel_dir in parts and (name.endswith(".distcp") or name == ".metadata"):
            continue  # DCP data and marker are rewritten; anything else in a DCP directory is kept
        if name in _OWN_RECORDS:
            continue  # ckptools' own records describe the source's bytes; rewritten, not copied
        out.append(f"{rel_dir}/{name}" if rel_dir else name)
    return sorted(out)


@storage.accepts_storage_options
def shard(
    src: str,
    out: str,
    *,
    world_size: int,
    prefix: str = "model.",
    overwrite: bool = False,
    dry_run: bool = False,
    workers: int | None = None,
    quiet: bool = False,
    format: str | None = None,
    distributed: bool = True,
    storage_options: storage.StorageOptions | None = None,
) -> ReshardResult:
    """Make a DCP checkpoint for ``world_size`` ranks from a full model.

    ``src`` is a Hugging Face safetensors directory or file, or a ``torch.save`` full state
    dict; each tensor ``name`` is stored as ``prefix + name`` (key path ``("model", name)`` for
    the default prefix), which is what ``dcp.load({"model": model_state_dict})`` reads.
    Under torchrun the output files are split over the ranks, as :func:`reshard` does.

    Example:
        >>> ckptools.shard("Llama-3-8B/", "ckpt/step-0", world_size=8)  # doctest: +SKIP
    """
    started = time.perf_counter()
    manifest = read_manifest(src, format)
    if manifest.format not in ("safetensors", "torch_save"):
        raise UsageError(
            f"{src}: a {manifest.format} checkpoint is already sharded; use `ckpt reshard`"
        )
    if not dry_run:
        check_writable(out, overwrite)
    path = tuple(p for p in prefix.split(".") if p)
    names = {f"{prefix}{fqn}": fqn for fqn in manifest.tensors}
    paths = {f"{prefix}{fqn}": (*path, fqn) for fqn in manifest.tensors}
    plan = plan_dcp(manifest, world_size, names, paths, objects=[])
    notes = list(manifest.notes)
    if manifest.objects:
        notes.append(
            f"{len(manifest.objects)} non-tensor value(s) of the source were not carried over "
            f"(e.g. {next(iter(manifest.objects))!r})"
        )
    summary = {"": plan.to_dict()}
    if dry_run:
        return ReshardResult(
            src, out, world_size, summary, 0, time.perf_counter() - started, True, "keep",
            notes=tuple(notes),
        )  # fmt: skip
    ranks = collective.current(distributed)
    if ranks.world_size > 1:
        notes.append(f"written by {ranks.world_size} ranks")
    identity = fingerprint("shard", manifest, {"world_size": world_size, "prefix": prefix,
                                               "plan": summary})  # fmt: skip
    written, kept = _write(
        ranks, out, overwrite, {"": (manifest, plan)}, manifest.data_dir(), (), identity,
        checksums=False, workers=workers, quiet=quiet,
    )  # fmt: skip
    if kept:
        notes.append(f"resumed: {kept} file(s) written by an interrupted run were kept")
    return ReshardResult(
        src, out, world_size, summary, written, time.perf_counter() - started, False, "keep",
        notes=tuple(notes),
    )  # fmt: skip
