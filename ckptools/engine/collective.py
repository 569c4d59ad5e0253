"""One conversion run by several processes (``torchrun``): who does what, and in which order.

Under ``torchrun`` (one node or many) ``consolidate``, ``reshard``, ``shard``, ``verify`` and
``checksum`` split their work over the processes. Who does what is decided by a pure,
deterministic split (:func:`balance`) of a pure plan. ``consolidate``, ``verify`` and
``checksum`` have every process read the same manifest and make the same plan, so they need no
communication for it; ``reshard`` and ``shard`` have rank 0 alone read the source and plan, and
hand every other rank its share of the plan (:meth:`Ranks.scatter_from_root`: the items of the
files that rank writes), so a large source's metadata is parsed once per job rather than once
per process (a 405B model's 1,024-rank ``.metadata``: ~20 s of CPU and ~2 GiB each). Beyond
that the processes talk only to hand out rank 0's temporary directory, to learn whether every
share succeeded (and, for ``verify``, what each found), and to learn rank 0's commit outcome. A
single process is the default and the degenerate case: ``Ranks()`` (rank 0 of 1) runs the same
code without torch and without communication.

The protocol of a writing command (:meth:`Ranks.scatter_from_root`, :meth:`Ranks.staged`,
:meth:`Ranks.from_all`, :meth:`Ranks.from_root`), run by every rank in this order:

0. (``reshard``, ``shard``) rank 0 reads the source and plans; a scatter hands every other rank
   its share, or rank 0's error (then every rank raises: nothing was created);
1. rank 0 checks OUT and creates the temporary directory (and whatever every rank needs in it);
   a broadcast hands its name, or rank 0's error, to every rank;
2. every rank writes its share; an all-gather tells every rank which ranks failed and why;
3. rank 0 writes the marker last, after every share is written (the all-gather is the barrier),
   and renames; a broadcast tells every rank the outcome.

On a failure anywhere, rank 0 removes the temporary directory and every rank raises (the rank
that failed its own error, the others a :class:`~ckptools.errors.CkptError` naming that rank), so
nothing that looks complete is left and every process exits non-zero. Only a process that dies
outright (killed, or Ctrl-C) leaves the others waiting; torchrun then stops them.

torch is imported only when the job really has several ranks.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from ckptools.errors import CkptError, PieceAbortedError, UsageError

T = TypeVar("T")
S = TypeVar("S")

# What travels for a failed step: (rank, exception class name, message, was a UsageError, gave
# up because another piece failed, when it failed: seconds since the epoch).
_Failure = tuple[int, str, str, bool, bool, float]


def _rank_and_world() -> tuple[int, int] | None:
    """``(rank, world_size)`` when running as one of several ranks, else None.

    Several ranks means: a process group of more than one rank is already initialised (the
    caller's training script), or torchrun's environment (``WORLD_SIZE`` > 1 with ``RANK`` and
    ``MASTER_ADDR``), in which case a gloo group is initialised here (torchrun's c10d rendezvous
    has set ``MASTER_ADDR``/``MASTER_PORT`` for it, on one node or many).
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        world = int(dist.get_world_size())
        return (int(dist.get_rank()), world) if world > 1 else None
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and "RANK" in os.environ:
        if "MASTER_ADDR" not in os.environ:
            return None
        import atexit

        import torch.distributed as tdist

        tdist.init_process_group("gloo")
        # A rank may leave as soon as the group exists (a usage error that every rank decides
        # alike, without a collective): only once every rank is out of init_process_group, which
        # a peer's exit could fail. (A full-suite run once saw a rank end 1, not the shared 2.)
        tdist.barrier()
        # The group is ours: tear it down at exit (the caller may still use it until then).
        atexit.register(tdist.destroy_process_group)
        global _GROUP_STARTED_HERE
        _GROUP_STARTED_HERE = True
        return int(tdist.get_rank()), int(tdist.get_world_size())
    return None


#: Whether :func:`current` initialised the process group (a command run under torchrun).
_GROUP_STARTED_HERE = False


def leave_if_launched(code: int) -> None:
    """End this process now with ``code`` when it is one rank of a command run under torchrun
    (its process group initialised here); otherwise return.

    Every rank has the same result once the last all-gather returns; ending at once, without the
    interpreter's teardown and gloo's (which sometimes aborts), makes the ranks leave together.
    torchrun stops the workers still running when the first one fails, so a rank slow to tear
    down would otherwise end killed rather than with the code it decided.
    """
    if not _GROUP_STARTED_HERE:
        return
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def current(distributed: bool = True) -> Ranks:
    """This process's place in the job: ``Ranks(rank, world_size)``.

    Args:
        distributed: False: this process works alone whatever the job (what a command that only
            some ranks call needs). True: the ranks of the initialised process group, or of
            torchrun (a gloo group is then initialised here); one process when there is neither.
    """
    if distributed:
        found = _rank_and_world()
        if found is not None:
            return Ranks(*found)
    return Ranks()


def of_group(group: Any | None) -> Ranks:
    """This process's place in ``group`` (None: the default group) of the initialised process
    group; one process when none is initialised. For code that a training job's ranks call with
    their own group (``verify_roundtrip``); unlike :func:`current` it never initialises one."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return Ranks()
    return Ranks(int(dist.get_rank(group)), int(dist.get_world_size(group)), group)


def reports_here() -> bool:
    """Whether this process prints the result: False only on the non-zero ranks of a job.

    For the CLI, which must not import torch: reads the process group when one exists, else
    torchrun's ``RANK``.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()) == 0
    return os.environ.get("RANK", "0") in ("", "0")


def plans_elsewhere(dry_run: bool) -> bool:
    """Whether this process leaves a ``--dry-run`` to another: a torchrun worker other than
    rank 0. A dry run writes nothing and only rank 0 prints its plan, so the others would only
    repeat its reading (a 405B model's 1,024-rank ``.metadata``: ~20 s of CPU and ~2 GB each,
    every worker at once); they end at once, with 0, printing nothing."""
    return dry_run and not reports_here()


def balance(sizes: Sequence[int], world_size: int) -> list[int]:
    """The process that handles each unit (a file): about the same bytes for every process.

    Pure and deterministic, so every rank computes the same split: the largest units first, each
    to the process with the fewest bytes so far (the lowest index on ties). Within 4/3 of the best
    split; a unit is never divided (on object stores a file is one upload).

    Example:
        >>> balance([100, 10, 60, 50], 2)
        [0, 0, 1, 1]
    """
    owners = [0] * len(sizes)
    loads = [0] * world_size
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        p = min(range(world_size), key=lambda p: loads[p])
        owners[i] = p
        loads[p] += sizes[i]
    return owners


@dataclass(frozen=True)
class Ranks:
    """Rank ``rank`` of ``world_size`` processes sharing one command (see the module docstring).

    Every method except :meth:`mine` is collective when ``world_size`` > 1: every rank calls it,
    in the same order. With ``world_size`` 1 each just runs the function.
    """

    rank: int = 0
    world_size: int = 1
    #: the torch process group the ranks belong to; None: the default group (the world)
    group: Any = field(default=None, compare=False, repr=False)

    @property
    def is_root(self) -> bool:
        """Rank 0: the one that prepares, writes markers and commits."""
        return self.rank == 0

    def mine(self, sizes: Sequence[int]) -> list[int]:
        """Indices of the units (sized ``sizes``) this rank handles (:func:`balance`)."""
        return [i for i, p in enumerate(balance(sizes, self.world_size)) if p == self.rank]

    def from_root(self, fn: Callable[[], T], what: str) -> T:
        """Rank 0 runs ``fn``; its value, or its error, reaches every rank (a broadcast).

        Rank 0 re-raises its own exception; the other ranks raise a
        :class:`~ckptools.errors.CkptError` (a ``UsageError`` when rank 0's was one).
        """
        if self.world_size == 1:
            return fn()
        import torch.distributed as dist

        box: list[Any] = [None, None]
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                box = [fn(), None]
            except Exception as e:  # handed to the other ranks, then re-raised below
                failure = e
                box = [None, _describe(e)]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.group)
        if failure is not None:
            raise failure
        if box[1] is not None:
            _raise_for([box[1]], what)
        return cast(T, box[0])

    def scatter_from_root(self, fn: Callable[[], Sequence[T]], what: str) -> T:
        """Rank 0 runs ``fn``, which returns one value per rank; each rank gets its own (a
        scatter). For what only rank 0 works out (it alone read the source) and the others
        need a share of: rank r receives value r, never the others' (a 405B reshard's plan is
        millions of items; each process gets those of the files it writes).

        Rank 0 keeps its own value as it is (never pickled). Rank 0 pickles the others' values
        before the scatter, so an error there is rank 0's error too: rank 0 re-raises it and
        the other ranks raise a :class:`~ckptools.errors.CkptError` (a ``UsageError`` when
        rank 0's was one), as :meth:`from_root` does.
        """
        if self.world_size == 1:
            return _own_share(fn(), 1)
        import pickle

        import torch.distributed as dist

        own: Any = None
        failure: BaseException | None = None
        sent: list[Any] | None = None
        if self.rank == 0:
            try:
                values = fn()
                own = _own_share(values, self.world_size)
                sent = [None] + [
                    (pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL), None) for v in values[1:]
                ]
            except Exception as e:  # handed to the other ranks, then re-raised below
                failure = e
                sent = [None] + [(None, _describe(e))] * (self.world_size - 1)
        received: list[Any] = [None]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.scatter_object_list(received, sent, src=src, group=self.group)
        if failure is not None:
            raise failure
        if self.rank == 0:
            return cast(T, own)
        data, error = received[0]
        if error is not None:
            _raise_for([error], what)
        return cast(T, pickle.loads(data))

    def from_all(self, fn: Callable[[], T], what: str) -> list[T]:
        """Every rank runs ``fn``; every rank gets all values in rank order (an all-gather).

        The all-gather is also the barrier that ends a step: when it returns, every rank has
        finished ``fn``. When any rank failed, every rank raises: the failed ones their own
        exception, the others a :class:`~ckptools.errors.CkptError` naming the rank whose error
        came first (a real error before one that only gave up because another piece failed).
        """
        if self.world_size == 1:
            return [fn()]
        import torch.distributed as dist

        failure: BaseException | None = None
        mine: list[Any] = [None, None]
        try:
            mine = [fn(), None]
        except Exception as e:  # handed to the other ranks, then re-raised below
            failure = e
            mine = [None, _describe(e, self.rank)]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.group)
        if failure is not None:
            raise failure
        failures = [g[1] for g in gathered if g[1] is not None]
        if failures:
            _raise_for(failures, what)
        return [cast(T, g[0]) for g in gathered]

    @contextmanager
    def staged(
        self, prepare: Callable[[], S], discard: Callable[[S, BaseException], None], what: str
    ) -> Iterator[S]:
        """Rank 0 prepares (e.g. the temporary directory) and every rank gets the result; when
        the body raises on any rank, rank 0 discards what it prepared.

        The body must call the collective steps on every rank in the same order, so that a
        failure reaches every rank (every rank then leaves the block by raising).
        """
        staged = self.from_root(prepare, what)
        try:
            yield staged
        except BaseException as e:
            if self.is_root:
                discard(staged, e)  # given the error: an interrupted resumable run keeps it
            raise


def _own_share(values: Sequence[T], world_size: int) -> T:
    """Rank 0's value of :meth:`Ranks.scatter_from_root`'s, once they are one per rank."""
    if len(values) != world_size:
        raise ValueError(f"{len(values)} shares for {world_size} ranks")  # a caller's bug
    return values[0]


def _describe(e: BaseException, rank: int = 0) -> _Failure:
    aborted = isinstance(e, PieceAbortedError)
    return (rank, type(e).__name__, str(e), isinstance(e, UsageError), aborted, time.time())


def _raise_for(failures: list[_Failure], what: str) -> None:
    """Raise the error of the failure that came first (real errors before those that gave up
    because of another), naming its rank, on a rank that did not fail itself."""
    first = min(failures, key=lambda f: (f[4], f[5], f[0]))
    rank, name, message, usage = first[:4]
    more = f" and {len(failures) - 1} more" if len(failures) > 1 else ""
    text = f"{what} failed on another rank (rank {rank}{more}): {name}: {message}"
    raise UsageError(text) if usage else CkptError(text)
