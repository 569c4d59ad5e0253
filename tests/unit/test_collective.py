"""The pure and one-process parts of :mod:`ckptools.engine.collective` (the collective steps on real
ranks are tested through torchrun in ``tests/distributed/test_scaleout.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptools.engine.collective import Ranks, balance, current, reports_here


@given(st.lists(st.integers(0, 10**9), max_size=60), st.integers(1, 9))
def test_balance_gives_every_unit_one_owner_and_evens_the_bytes(
    sizes: list[int], world: int
) -> None:
    owners = balance(sizes, world)
    assert len(owners) == len(sizes) and all(0 <= o < world for o in owners)
    assert balance(sizes, world) == owners  # every rank computes the same split
    loads = [sum(s for s, o in zip(sizes, owners, strict=True) if o == p) for p in range(world)]
    # Greedy largest-first: no process gets more than its fair share plus one unit.
    assert max(loads) <= sum(sizes) / world + max(sizes, default=0)
    mine = [Ranks(r, world).mine(sizes) for r in range(world)]
    assert sorted(i for m in mine for i in m) == list(range(len(sizes)))


def test_one_process_runs_each_step_itself() -> None:
    ranks = Ranks()
    assert ranks.is_root and ranks.world_size == 1
    assert ranks.from_root(lambda: 7, "x") == 7
    assert ranks.from_all(lambda: 7, "x") == [7]
    discarded: list[tuple[str, str]] = []

    def discard(staged: str, error: BaseException) -> None:
        discarded.append((staged, str(error)))

    with (
        pytest.raises(OSError, match="disk full"),
        ranks.staged(lambda: "tmp", discard, "x") as staged,
    ):
        assert staged == "tmp"
        raise OSError("disk full")
    assert discarded == [("tmp", "disk full")]  # the error goes along (Ctrl-C may keep it)
    with ranks.staged(lambda: "tmp2", discard, "x"):
        pass
    assert discarded == [("tmp", "disk full")]  # kept when the body succeeds
    assert ranks.scatter_from_root(lambda: ["mine"], "x") == "mine"
    with pytest.raises(ValueError, match="2 shares for 1 ranks"):
        ranks.scatter_from_root(lambda: ["a", "b"], "x")


def test_no_job_means_one_process_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    code = (
        "import sys\n"
        "from ckptools.engine.collective import current, reports_here\n"
        "assert current() == current(False) and current().world_size == 1\n"
        "assert reports_here()\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    env = {"PATH": "/usr/bin:/bin", "WORLD_SIZE": "4", "RANK": "0"}  # no MASTER_ADDR: no job
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "NO-TORCH"
    monkeypatch.setenv("RANK", "2")
    assert not reports_here()
    assert current(False) == Ranks()


@pytest.mark.parametrize("command", ["consolidate", "reshard", "shard"])
def test_a_dry_run_is_rank_0s_alone(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torchrun only rank 0 plans a --dry-run (it alone prints); the other workers end at
    once with 0 and read nothing: here SRC does not even exist."""
    from click.testing import CliRunner

    from ckptools.cli.main import cli

    missing = str(tmp_path / "missing")
    args = [command, missing, str(tmp_path / "out"), "--dry-run", "--json"]
    if command != "consolidate":
        args += ["--world-size", "4"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens: a process group would fail
    monkeypatch.setenv("RANK", "1")
    done = CliRunner().invoke(cli, args)
    assert (done.exit_code, done.output) == (0, "")
    monkeypatch.setenv("RANK", "0")  # rank 0 plans: and finds no checkpoint there
    done = CliRunner().invoke(cli, args)
    assert done.exit_code != 0 and "missing" in done.output
