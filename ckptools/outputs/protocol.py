"""The output protocol: stage, write the shares, seal, checksums, commit.

Every writer of a checkpoint or model directory (``consolidate``, ``reshard``, ``shard``,
:func:`ckptools.save_pretrained`, :class:`ckptools.CheckpointManager`) runs the same
steps, by one process or by every rank of a job (:class:`~ckptools.engine.collective.Ranks`:
one process is rank 0 of 1), whatever OUT is:

1. **stage** (:func:`staged`, rank 0): the OUT rules (:func:`ckptools.io.out_rules.check_out`),
   then a staging location (:mod:`ckptools.io.staging`: ``<out>.tmp-<id>/`` beside a local OUT,
   the prefix itself after an in-progress note on an object store; a resumable writer's
   interrupted run's location is reused), then what the writer puts there before the shares
   (``fill``: free space reserved, files created, model files copied); every rank gets it;
2. **shares**: every rank writes its own (the writer's code, through
   :meth:`~ckptools.engine.collective.Ranks.from_all`; a resumable writer journals each file
   it completes, :func:`journal`);
3. **seal** (:func:`commit`, rank 0): the resume journal removed, then the markers the writer
   writes last (the safetensors index, each DCP ``.metadata``);
4. **checksums** where the writer writes them
   (:func:`ckptools.verify.checksums.write_checksums`, every rank hashing a share);
5. **commit** (rank 0): fsync and rename, or, on an object store, the in-progress note
   removed (or the writer's own ``publish``: the manager's marker, which must follow the
   checksum manifest it records, then its rename and retention); a writer whose ranks share
   local files (:attr:`Output.spool`) stages an object-store OUT in a local spool and uploads
   it here (data, then markers).

A failure anywhere, on any rank, removes the staging location (rank 0), so nothing that looks
complete is ever left; Ctrl-C keeps it where the writer resumes (it holds a journal), for the
same command to finish (:func:`ckptools.io.staging.discard`).

Example:
    >>> output = Output(out="hf", kind="model", overwrite=False, what="write")
    >>> with staged(Ranks(), output, lambda tmp: None) as stage:  # doctest: +SKIP
    ...     write_files(stage.tmp)                                # this rank's share
    ...     commit(Ranks(), output, stage, lambda: write_index(stage.tmp))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from ckptools.engine.collective import Ranks
from ckptools.io import spool, staging, storage
from ckptools.io.out_rules import OutputKind, check_out
from ckptools.io.resume import Journal

P = TypeVar("P")
R = TypeVar("R")


@dataclass(frozen=True, kw_only=True)
class Output:
    """Where one writer's output goes and how it is staged.

    Attributes:
        out: the output directory or object-store prefix.
        kind: what it holds, for the OUT rules (``"model"``, ``"dcp"``).
        overwrite: an existing OUT may be replaced.
        what: the step's name in a failure reported on another rank.
        src: the source, which OUT must stay apart from.
        identity: the resume fingerprint (:func:`ckptools.io.resume.fingerprint`) of a writer
            that resumes; "" for one that does not.
        checked: the OUT rules already ran (before planning, on every rank).
        spool: the ranks share local files: an object-store OUT is staged in a local spool
            and uploaded at the commit.
        location: the writer's own staging location, made by rank 0 after the OUT rules
            (:class:`ckptools.CheckpointManager`: ``root/.tmp-step-<N>-<id>/``, which its
            ``clean_stale`` rolls forward or removes); None: :mod:`ckptools.io.staging`'s.
        publish: the writer's own commit of the sealed, checksummed location (the manager:
            its marker, which records the checksum manifest, then the rename and retention);
            None: fsync and rename, or upload.
    """

    out: str
    kind: OutputKind
    overwrite: bool
    what: str
    src: str | None = None
    identity: str = ""
    checked: bool = False
    spool: bool = False
    location: Callable[[], str] | None = None
    publish: Callable[[str], None] | None = None

    @property
    def spooled(self) -> bool:
        return self.spool and storage.is_url(self.out)


@dataclass(frozen=True)
class Stage(Generic[P]):
    """The staging location every rank writes into, and what rank 0's ``fill`` returned."""

    tmp: str
    prepared: P


def _location(output: Output) -> str:
    if output.location is not None:
        return output.location()
    if output.spooled:
        return spool.make_spool_dir("ckptools-pretrained-")
    if output.identity:
        return staging.resumable_staging(output.out, output.identity)
    return staging.make_tmp_dir(output.out)


def _discard(output: Output, tmp: str, error: BaseException | None) -> None:
    """Give up ``tmp`` after ``error``: removed (and its lock and space released), unless an
    interrupt of a writer that resumes (:func:`ckptools.io.staging.discard`)."""
    staging.discard(tmp, error)
    if output.spooled:
        spool.remove_spool_dir(tmp)


@contextmanager
def staged(ranks: Ranks, output: Output, fill: Callable[[str], P]) -> Iterator[Stage[P]]:
    """Step 1, collective: rank 0 checks OUT (unless ``output.checked``), makes the staging
    location and runs ``fill(tmp)``; every rank gets the :class:`Stage` (or rank 0's error).
    When the body raises on any rank (which every rank then does, the body's steps being
    collective), rank 0 discards the staging location."""

    def discard(stage: Stage[P], error: BaseException) -> None:
        _discard(output, stage.tmp, error)

    with ranks.staged(lambda: _prepare(output, fill), discard, output.what) as stage:
        yield stage


def begin(ranks: Ranks, output: Output, fill: Callable[[str], P]) -> Stage[P]:
    """Step 1 alone, collective, for a writer whose shares finish on another thread (the
    manager's asynchronous save), which calls :func:`abandon` when they fail: what
    :func:`staged` does around a block."""
    return ranks.from_root(lambda: _prepare(output, fill), output.what)


def abandon(ranks: Ranks, output: Output, stage: Stage[P], error: BaseException) -> None:
    """After ``error`` on any rank (which every rank learned through a collective step):
    rank 0 discards :func:`begin`'s staging location."""
    if ranks.is_root:
        _discard(output, stage.tmp, error)


def _prepare(output: Output, fill: Callable[[str], P]) -> Stage[P]:
    if not output.checked:
        check_out(output.out, kind=output.kind, overwrite=output.overwrite, src=output.src)
    tmp = _location(output)
    try:
        return Stage(tmp, fill(tmp))
    except BaseException as e:
        _discard(output, tmp, e)
        raise


def journal(ranks: Ranks, output: Output, stage: Stage[P]) -> Journal:
    """This rank's part of the resume journal of a resumable writer's staging location (the
    files every rank's part records as done are what an interrupted run left)."""
    return Journal.open(stage.tmp, output.identity, writer=ranks.rank)


def commit(
    ranks: Ranks,
    output: Output,
    stage: Stage[P],
    seal: Callable[[], R],
    *,
    checksums: Callable[..., object] | None = None,
    workers: int | None = None,
) -> R:
    """Steps 3-5, collective, once every rank has written its share: rank 0 removes the resume
    journal (never part of a committed output) and runs ``seal`` (the markers, last); with
    ``checksums`` (:func:`ckptools.verify.checksums.write_checksums`, passed by the writer:
    verify reads through the verbs) every rank hashes a share and rank 0 writes the checksum
    manifest; then rank 0 makes it durable and commits. Returns what ``seal`` returned, on
    every rank."""

    def sealed() -> R:
        if output.identity:
            Journal.open(stage.tmp, output.identity).discard()
        return seal()

    value = ranks.from_root(sealed, output.what)
    if checksums is not None:
        distributed = ranks.world_size > 1
        checksums(stage.tmp, workers=workers, quiet=True, distributed=distributed)
    ranks.from_root(lambda: _publish(output, stage.tmp), output.what)
    return value


def _publish(output: Output, tmp: str) -> None:
    if output.publish is not None:
        output.publish(tmp)
        return
    staging.fsync_dir(tmp)
    if output.spooled:
        staging.upload_dir(tmp, output.out, output.overwrite)  # data, markers, the commit
        _discard(output, tmp, None)
    else:
        staging.commit(tmp, output.out, output.overwrite)
