"""kill -9 at random points: ``ckpt consolidate`` and ``ckpt reshard`` (``python -m ckptools``)
killed with SIGKILL at 20 seeded random moments each, spread over a run's duration, then run to
completion, leave nothing behind and write exactly what a run that was never killed writes.

Each round kills a chain of runs into the same OUT (each resuming, or clearing, what the one
before left) and then runs the command to completion. After every round: no ``OUT.tmp-*`` and
no spool directory left, every output file byte-identical to an uninterrupted run (a DCP's
``.metadata`` differs only by its per-save UUID), and at the end every source file hashes as
before. The checkpoint is a real FSDP2 save (``dcp.save`` at 2 ranks) of a model large enough
(~11 MB of tensors with the optimizer state) that the copying, journaling and commit take a good
part of each run, not only the interpreter's start.
"""

from __future__ import annotations

import filecmp
import hashlib
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptools.io import resume
from tests.conftest import Produced
from tests.support.producers import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
#: the tiny Llama scaled up so that writing, not starting, takes most of a run
CONFIG = ModelConfig(vocab=8192, hidden=256, n_heads=8, n_kv_heads=2, head_dim=32,
                     intermediate=1001, n_layers=4)  # fmt: skip
KILLS = 20
KILLS_PER_ROUND = 4
COMMANDS = {
    "consolidate": ["--max-shard-size", "3MB"],  # ~9 model files, each journaled
    "reshard": ["--world-size", "5"],
}
_UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _argv(command: str, src: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "ckptools", command, str(src), str(out), "-q", "--workers",
            "2", *COMMANDS[command]]  # fmt: skip


def _env(spool: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "CKPTOOLS_SPOOL_DIR": str(spool)}


def _run(command: str, src: Path, out: Path, spool: Path) -> float:
    started = time.perf_counter()
    proc = subprocess.run(
        _argv(command, src, out), cwd=ROOT, env=_env(spool), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return time.perf_counter() - started


def _killed(command: str, src: Path, out: Path, spool: Path, delay: float) -> int | None:
    """Start the command and SIGKILL it after ``delay`` seconds; its exit status if it ended
    first (0: it finished), else None."""
    proc = subprocess.Popen(
        _argv(command, src, out), cwd=ROOT, env=_env(spool), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None
    finally:
        assert proc.stderr is not None
        err = proc.stderr.read()
        proc.stderr.close()
    assert proc.returncode == 0, err
    return 0


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _same_metadata(clean: bytes, out: bytes) -> None:
    """Equal but for the per-save UUID torch's metadata pickle carries."""
    assert len(clean) == len(out)
    a, b = _UUID.findall(clean), _UUID.findall(out)
    assert len(a) == len(b) == 1
    assert clean.replace(a[0], b[0]) == out


def _assert_same_output(clean: Path, out: Path) -> None:
    names = sorted(str(p.relative_to(clean)) for p in clean.rglob("*") if p.is_file())
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == names
    data = [n for n in names if os.path.basename(n) != ".metadata"]
    match, mismatch, errors = filecmp.cmpfiles(clean, out, data, shallow=False)
    assert (sorted(match), mismatch, errors) == (data, [], [])
    for name in set(names) - set(data):
        _same_metadata((clean / name).read_bytes(), (out / name).read_bytes())


@pytest.fixture
def src(produced: Callable[..., Produced]) -> Produced:
    return produced("fsdp2", world_size=2, optimizer=True, cfg=CONFIG)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_kill_9_at_random_points_then_finish(command: str, src: Produced, tmp_path: Path) -> None:
    before = _hashes(src.path)
    spool = tmp_path / "spool"
    spool.mkdir()
    clean = tmp_path / "clean"
    duration = _run(command, src.path, clean, spool)
    rng = random.Random(f"kill-sweep-{command}")
    delays = [rng.uniform(0.05, 1.1) * duration for _ in range(KILLS)]
    finished_early = mid_write = 0
    for round_no in range(KILLS // KILLS_PER_ROUND):
        out = tmp_path / f"out-{round_no}"
        for delay in delays[round_no * KILLS_PER_ROUND : (round_no + 1) * KILLS_PER_ROUND]:
            if out.exists():  # an earlier kill in this round came after the commit
                break
            if _killed(command, src.path, out, spool, delay) == 0:
                finished_early += 1
            mid_write += any(tmp_path.glob(f"{out.name}.tmp-*/{resume.JOURNAL_PREFIX}*"))
        if not out.exists():
            _run(command, src.path, out, spool)
        left = sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name)
        assert left == [], f"round {round_no}: left behind {left}"
        assert list(spool.iterdir()) == []
        _assert_same_output(clean, out)
    # the sweep reached both ends: kills while files were being written (a journal left to
    # resume from) and not every kill after the run had finished
    assert mid_write >= 1
    assert finished_early < KILLS // 2
    assert _hashes(src.path) == before
