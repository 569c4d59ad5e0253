""":meth:`ckptools.engine.collective.Ranks.scatter_from_root` on real gloo ranks: each rank gets
its own value, rank 0's never leaves it, and rank 0's error (in ``fn`` or in pickling a share)
reaches every rank as :meth:`~ckptools.engine.collective.Ranks.from_root`'s does, the group still
in step.

(The whole protocol, through ``torchrun -m ckptools reshard``, is tested in
``tests/distributed/test_scaleout.py``.)
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from ckptools.engine.collective import Ranks
from ckptools.errors import UsageError
from tests.support.dist import run_ranks

pytestmark = pytest.mark.distributed


def _outcome(fn: Any) -> tuple[str, str]:
    """What ``fn()`` did: ``("ok", repr of its value)`` or ``(exception class, message)``."""
    try:
        return "ok", repr(fn())
    except Exception as e:
        return type(e).__name__, str(e)


def _steps(rank: int, world_size: int) -> list[Any]:
    ranks = Ranks(rank, world_size)
    lock = threading.Lock()  # cannot be pickled: rank 0's own value must stay where it is
    results: list[Any] = []

    def shares() -> list[Any]:
        return [lock, *({"rank": r, "items": list(range(r * 3))} for r in range(1, world_size))]

    got = ranks.scatter_from_root(shares, "test")
    results.append(got is lock if rank == 0 else got)

    def usage() -> list[Any]:
        raise UsageError("no such OUT")

    results.append(_outcome(lambda: ranks.scatter_from_root(usage, "test")))

    def broken() -> list[Any]:
        raise OSError("disk gone")

    results.append(_outcome(lambda: ranks.scatter_from_root(broken, "test")))
    # a share that cannot be pickled: rank 0's error, not a hang
    results.append(_outcome(lambda: ranks.scatter_from_root(lambda: [0, lock, 2], "test")))
    results.append(_outcome(lambda: ranks.scatter_from_root(lambda: [0, 1], "test")))
    # after every failure the ranks are still in step: the next collective works
    results.append(ranks.from_all(lambda: rank * 10, "test"))
    return results


def test_each_rank_gets_its_share_and_rank_0s_errors_reach_every_rank() -> None:
    results = run_ranks(_steps, 3, timeout=120.0)
    got, usage, broken, unpicklable, miscounted, after = zip(*results, strict=True)
    assert got == (True, {"rank": 1, "items": [0, 1, 2]}, {"rank": 2, "items": [0, 1, 2, 3, 4, 5]})
    assert usage[0] == ("UsageError", "no such OUT")
    told = "test failed on another rank (rank 0): "
    assert usage[1:] == (("UsageError", told + "UsageError: no such OUT"),) * 2
    assert broken[0] == ("OSError", "disk gone")
    assert broken[1:] == (("CkptError", told + "OSError: disk gone"),) * 2
    assert unpicklable[0][0] == "TypeError" and "lock" in unpicklable[0][1]
    assert unpicklable[1:] == (("CkptError", told + "TypeError: " + unpicklable[0][1]),) * 2
    assert miscounted[0] == ("ValueError", "2 shares for 3 ranks")
    assert miscounted[1:] == (("CkptError", told + "ValueError: 2 shares for 3 ranks"),) * 2
    assert after == ([0, 10, 20],) * 3


def _in_a_group(rank: int, world_size: int) -> Any:
    """Ranks 1 and 2 form a group: its rank 0 is global rank 1."""
    import torch.distributed as dist

    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    ranks = Ranks(rank - 1, 2, group)
    return ranks.scatter_from_root(lambda: [f"kept by {rank}", f"sent by {rank}"], "test")


def test_the_root_of_a_group_is_its_rank_0() -> None:
    assert run_ranks(_in_a_group, 3, timeout=120.0) == [None, "kept by 1", "sent by 1"]
