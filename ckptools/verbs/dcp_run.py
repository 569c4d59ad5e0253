"""A reshard or a shard as data: its options, its result, and the run planned by rank 0 and
carried out by every rank (:func:`carry_out`): what ``reshard`` and ``shard`` share."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptools.core.manifest import Manifest
from ckptools.engine import collective
from ckptools.errors import UsageError
from ckptools.io import tunables
from ckptools.io.resume import fingerprint
from ckptools.plan.dcp import DcpPlan
from ckptools.verbs import dcp_output
from ckptools.verbs.dcp_output import Share

#: what ``--rank-state`` takes: keep the per-rank state files, or drop them
RankState = Literal["keep", "drop"]


@dataclass(frozen=True, kw_only=True)
class ReshardOptions:
    """Every option of :func:`reshard` and :func:`shard` (the CLI's options have the same
    names), validated once, on construction.

    Attributes:
        world_size: ranks of the target layout.
        rank_state: ``"keep"`` or ``"drop"`` per-rank state that cannot be split (reshard).
        param_order: the parameters' FQNs in the order the optimizer was given them, for an
            integer-keyed optimizer state that does not say (reshard of a non-DCP source).
        drop_optimizer: leave a non-DCP source's optimizer state out (reshard).
        config: the model's ``config.json`` (a file or its directory) for a non-DCP source
            whose optimizer is keyed by integer ids: the model it builds gives their order
            (reshard; default: the checkpoint's own).
        prefix: the key prefix of every tensor (shard).
        overwrite: replace an existing OUT.
        dry_run: plan only; write nothing.
        workers: copy threads as given (None: :func:`ckptools.io.tunables.workers`).
        quiet: no progress bar.
        format: force the source layout instead of detecting it.
        distributed: split the output files over the ranks of a job
            (:mod:`ckptools.engine.collective`).
        worker_count: the copy threads, resolved (derived).

    Raises:
        UsageError: a world size below 1 or above :func:`ckptools.io.tunables.max_world_size`,
            an unknown ``rank_state``, bad ``workers``.
    """

    world_size: int
    rank_state: RankState = "keep"
    param_order: tuple[str, ...] | None = None
    drop_optimizer: bool = False
    config: str | None = None
    prefix: str = "model."
    overwrite: bool = False
    dry_run: bool = False
    workers: int | None = None
    quiet: bool = False
    format: str | None = None
    distributed: bool = True
    worker_count: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise UsageError(f"world size must be at least 1, got {self.world_size}")
        limit = tunables.max_world_size()
        if self.world_size > limit:
            # before planning: the plan keeps a list per rank and walks the ranks per tensor
            raise UsageError(
                f"world size {self.world_size} is above the limit of {limit} ranks (each rank "
                f"is a file); if it is meant, raise {tunables.MAX_WORLD_SIZE_ENV}"
            )
        if self.rank_state not in ("keep", "drop"):
            raise UsageError(f"rank_state must be 'keep' or 'drop', got {self.rank_state!r}")
        object.__setattr__(self, "worker_count", tunables.workers(self.workers))


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


def carry_out(kind: str, options: ReshardOptions, planned: Callable[[], Run]) -> ReshardResult:
    """Plan (``planned`` reads the source and plans every part) and write, or only plan.

    A dry run plans here and writes nothing, whatever the job. Otherwise one process plans and
    writes everything, or, in a job of several ranks (:func:`ckptools.engine.collective.current`),
    rank 0 alone reads the source and plans, and hands every other rank its share
    (:func:`ckptools.verbs.dcp_output.shares`, through
    :meth:`~ckptools.engine.collective.Ranks.scatter_from_root`): the items of the files it writes
    and what writing and reporting them need. The source is parsed once per job, not once per
    process (a 405B model's 1,024-rank ``.metadata``: ~20 s of CPU and ~2 GiB of memory in
    each). Then every rank writes its files (:func:`ckptools.verbs.dcp_output.write`).
    An error of rank 0's while reading or planning reaches every rank, and every rank raises
    before anything is created.
    """
    started = time.perf_counter()
    if options.dry_run:
        return result(planned().share(), options, 0, (), started)
    ranks = collective.current(options.distributed)
    if ranks.world_size == 1:
        share = planned().share()
    else:
        share = ranks.scatter_from_root(
            lambda: dcp_output.shares(planned().share(), ranks.world_size), kind
        )
    notes = [f"written by {ranks.world_size} ranks"] if ranks.world_size > 1 else []
    written, kept = dcp_output.write(
        ranks, share, overwrite=options.overwrite, workers=options.worker_count,
        quiet=options.quiet,
    )  # fmt: skip
    if kept:
        notes.append(f"resumed: {kept} file(s) written by an interrupted run were kept")
    return result(share, options, written, notes, started)


def result(
    share: Share, options: ReshardOptions, written: int, notes: Sequence[str], started: float
) -> ReshardResult:
    return ReshardResult(
        src=share.src,
        out=share.out,
        world_size=options.world_size,
        parts=dict(share.summary),
        bytes_written=written,
        seconds=time.perf_counter() - started,
        dry_run=options.dry_run,
        rank_state=options.rank_state,
        rank_state_items=share.rank_items,
        copied_files=share.copied,
        notes=(*share.notes, *notes),
    )


@dataclass(frozen=True, kw_only=True)
class Run:
    """One planned reshard or shard, on the process that read the source."""

    kind: str  # "reshard" or "shard": the fingerprint's command
    src: str
    out: str
    options: ReshardOptions
    parts: Mapping[str, tuple[Manifest, DcpPlan]]  # DCP subdirectory -> (source, plan)
    source: Manifest
    source_root: str  # what the parts' file paths and ``copied`` are relative to
    copied: tuple[str, ...] = ()
    made: Mapping[str, bytes] = field(default_factory=dict)  # files written after the markers
    rank_items: tuple[str, ...] = ()
    notes: list[str]
    checksums: bool = False
    #: the command's own options that shape the output, besides the world size and the plan,
    #: which every fingerprint includes
    fingerprint_options: Mapping[str, Any]

    def share(self) -> Share:
        """All of it: what one process writes, or rank 0 of a job, which shares it out
        (:func:`ckptools.verbs.dcp_output.shares`)."""
        summary = {sub: plan.to_dict() for sub, (_, plan) in self.parts.items()}
        identity = "" if self.options.dry_run else fingerprint(
            self.kind,
            self.source,
            {"world_size": self.options.world_size, "plan": summary, **self.fingerprint_options},
        )  # fmt: skip
        return Share(
            kind=self.kind, src=self.src, out=self.out, parts=self.parts,
            source_root=self.source_root, copied=self.copied, made=self.made,
            checksums=self.checksums, identity=identity, summary=summary,
            rank_items=self.rank_items, notes=tuple(self.notes),
        )  # fmt: skip
