"""Writing a planned DCP output (``reshard``, ``shard``): by one process, or by the ranks of a job.

A :class:`Share` is what one process writes and reports: the whole output, or, under torchrun,
one rank's files. Rank 0 alone reads the source and plans (:mod:`ckptools.reshard`), then hands
every other rank its share (:func:`shares`,
:meth:`ckptools.engine.collective.Ranks.scatter_from_root`):
the plan's items of that rank's files only and, of each source manifest, only what the writer
reads (:func:`ckptools.engine.dcp_writer.share_of`). :func:`write` is the staged, resumable
protocol every rank then runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ckptools.core.manifest import Manifest
from ckptools.engine import collective
from ckptools.engine import dcp_writer as dcp_write
from ckptools.engine.collective import Ranks
from ckptools.engine.dcp_writer import write_dcp
from ckptools.io import storage
from ckptools.io.staging import copy_into, reserve, write_file_synced
from ckptools.outputs.protocol import Output, Stage, commit, journal, staged
from ckptools.plan.dcp import DcpPlan, file_name
from ckptools.verify.checksums import write_checksums

Parts = Mapping[str, tuple[Manifest, DcpPlan]]  # DCP subdirectory ("" for OUT) -> (source, plan)


@dataclass(frozen=True, kw_only=True)
class Share:
    """What one process writes and reports: the whole output (one process; rank 0 of a job,
    which also writes the markers from the whole plans), or one rank's share of it
    (:meth:`of_files`)."""

    kind: str  # "reshard" or "shard": what a failure on another rank is reported as
    src: str
    out: str
    parts: Parts
    source_root: str  # what the parts' file paths and ``copied`` are relative to
    copied: tuple[str, ...]  # files beside the data, copied into OUT by rank 0
    made: Mapping[str, bytes]  # files rank 0 writes after the markers (a producer's own)
    checksums: bool  # the result gets a checksum manifest
    identity: str  # the resume fingerprint (:mod:`ckptools.io.resume`); "" for a dry run
    summary: Mapping[str, dict[str, Any]]  # each part's whole plan, as reported
    rank_items: tuple[str, ...]  # per-rank state found (reported)
    notes: tuple[str, ...]

    def of_files(self, files: Mapping[str, Sequence[int]]) -> Share:
        """This share cut to the rank files ``files`` (per part) of a rank other than 0, which
        neither copies files nor writes markers."""
        parts = {sub: dcp_write.share_of(source, plan, files[sub])
                 for sub, (source, plan) in self.parts.items()}  # fmt: skip
        return replace(self, parts=parts, made={})


def shares(whole: Share, world_size: int) -> list[Share]:
    """Each of ``world_size`` ranks' share of ``whole``: rank 0 all of it, every other rank
    what writing the files :meth:`~ckptools.engine.collective.Ranks.mine` gives it needs."""
    units = _units(whole.parts)
    files: list[dict[str, list[int]]] = [{sub: [] for sub in whole.parts} for _ in
                                         range(world_size)]  # fmt: skip
    owners = collective.balance([size for _, _, size in units], world_size)
    for (sub, r, _), owner in zip(units, owners, strict=True):
        files[owner][sub].append(r)
    return [whole, *(whole.of_files(files[p]) for p in range(1, world_size))]


def _units(parts: Parts) -> list[tuple[str, int, int]]:
    """Every rank file of every part, ``(part, rank file, bytes)``: what the ranks balance."""
    return [(sub, r, size) for sub, (_, plan) in parts.items()
            for r, size in enumerate(plan.file_sizes)]  # fmt: skip


def write(
    ranks: Ranks, share: Share, *, overwrite: bool, workers: int, quiet: bool
) -> tuple[int, int]:
    """Write ``share.parts`` and ``share.copied`` into ``share.out``, atomically (``overwrite``:
    replacing it); ``workers`` copy threads in each process, progress on rank 0 unless ``quiet``.

    Called by every rank, in this order (:mod:`ckptools.outputs.protocol`; one process is rank 0
    of 1):
    rank 0 creates the temporary directory and copies ``copied`` (files beside the DCP data)
    into it; every rank writes the ``__r_0.distcp`` files :meth:`Ranks.mine` gives it (balanced
    by bytes over the files of all parts: the file sizes of a rank's share are whole, so every
    rank finds the same split); once all are written, rank 0 writes each part's ``.metadata``
    from its whole plan; with ``checksums`` every rank hashes a share of the files and rank 0
    writes the checksum manifest (:func:`ckptools.verify.checksums.write_checksums`); rank 0
    renames last. On any rank's failure rank 0 removes the temporary directory and every rank
    raises.

    Resumable (:mod:`ckptools.io.resume`): rank 0 reuses the staging location of an interrupted run
    of the same conversion (``share.identity``); each rank skips the files its journal part, or
    another rank's, records as complete, and journals each file it completes; rank 0 removes
    the journal before the first ``.metadata``. An interrupt keeps the staging location.

    Returns the bytes of the ``.distcp`` files written (every rank's) and how many files an
    interrupted run had already written.
    """
    parts = share.parts
    units = _units(parts)
    mine: dict[str, list[int]] = {sub: [] for sub in parts}
    for i in ranks.mine([size for _, _, size in units]):
        mine[units[i][0]].append(units[i][1])

    def fill(tmp: str) -> None:
        reserve(tmp, sum(sum(plan.file_sizes) for _, plan in parts.values()))
        for name in share.copied:
            copy_into(storage.join(share.source_root, name), storage.join(tmp, name))
        for sub in parts:
            storage.makedirs(_target(tmp, sub))

    def write_share(stage: Stage[None]) -> tuple[int, int]:
        done_files = journal(ranks, output, stage)
        written = kept = 0
        for sub, (part, plan) in parts.items():
            prefix = f"{sub}/" if sub else ""
            todo = [r for r in mine[sub] if not done_files.is_done(prefix + file_name(r))]
            kept += len(mine[sub]) - len(todo)

            def done(
                r: int, prefix: str = prefix, sizes: tuple[int, ...] = plan.file_sizes
            ) -> None:
                done_files.record(prefix + file_name(r), size=sizes[r])

            written += write_dcp(
                part, plan, _target(stage.tmp, sub), source_root=share.source_root,
                workers=workers, quiet=quiet or not ranks.is_root,
                only_files=todo, on_file_done=done,
            )  # fmt: skip
        return written, kept

    def markers(tmp: str) -> None:
        for sub, (_, plan) in parts.items():
            # through the module: tests interrupt a run here
            dcp_write.write_metadata(_target(tmp, sub), plan)
        for name, data in share.made.items():  # a producer's own markers (its writer's), last
            write_file_synced(storage.join(tmp, name), data)

    output = Output(out=share.out, kind="dcp", overwrite=overwrite, what=share.kind,
                    src=share.src, identity=share.identity)  # fmt: skip
    with staged(ranks, output, fill) as stage:
        shares = ranks.from_all(lambda: write_share(stage), share.kind)
        checksums = write_checksums if share.checksums else None
        commit(ranks, output, stage, lambda: markers(stage.tmp), checksums=checksums,
               workers=workers)  # fmt: skip
    return sum(w for w, _ in shares), sum(k for _, k in shares)


def _target(tmp: str, sub: str) -> str:
    return storage.join(tmp, sub) if sub else tmp
