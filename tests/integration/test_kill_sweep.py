"""kill -9 at random points: ``ckpt consolidate`` and ``ckpt reshard`` (``python -m ckptools``)
killed with SIGKILL at 20 seeded random moments each, spread over a run's duration, then run to
completion, leave nothing behind and write exactly what a run that was never killed writes. The
same with Ctrl-C (SIGINT) on consolidate's buffered copy path, which keeps the staging directory
to resume from (this sweep found a file journaled complete whose last piece had stopped early).

Each round kills a chain of runs into the same OUT (each resuming, or clearing, what the one
before left) and then runs the command to completion. After every round: no ``OUT.tmp-*`` and
no spool directory left, every output file byte-identical to an uninterrupted run (a DCP's
``.metadata`` differs only by its per-save UUID), and at the end every source file hashes as
before. The checkpoint is a real FSDP2 save (``dcp.save`` at 2 ranks) of a model large enough
(~11 MB of tensors with the optimizer state) that the copying, journaling and commit take a good
part of each run, not only the interpreter's start.

The sweeps' processes are forked from a zygote that has imported torch once
(``tests/support/zygote.py``): each is still its own process, running ``python -m ckptools``'s
code (``runpy``, ckptools imported afresh from this tree) under the sweep's environment, and
killed by a real signal; only torch's import (~2.5 s of CPU, most of a cast run's start) is not
paid again. The spool test starts the real ``python -m ckptools`` interpreter, so the entry point
itself stays covered here.
"""

from __future__ import annotations

import filecmp
import hashlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptools.io import resume
from tests.conftest import Produced
from tests.support import zygote
from tests.support.producers import ModelConfig
from tests.support.s3 import download

ROOT = Path(__file__).resolve().parents[2]
#: the tiny Llama scaled up so that writing, not starting, takes most of a run
CONFIG = ModelConfig(vocab=8192, hidden=256, n_heads=8, n_kv_heads=2, head_dim=32,
                     intermediate=1001, n_layers=4)  # fmt: skip


@dataclass(frozen=True)
class Sweep:
    command: str
    args: tuple[str, ...]
    sig: signal.Signals = signal.SIGKILL
    env: tuple[tuple[str, str], ...] = ()
    kills: int = 20
    per_round: int = 4  # kills into one OUT before it is run to completion
    window: tuple[float, float] = (0.05, 1.1)  # when, in clean-run durations


#: the source is the tiny FSDP2 job without its config: its weights are what is swept
SWEEPS = {
    "consolidate": Sweep("consolidate", ("--max-shard-size", "3MB", "--weights-only")),  # 8 files
    "reshard": Sweep("reshard", ("--world-size", "5")),
    # Ctrl-C while copying on the buffered path (a cast, 64 KB blocks), where a piece told to
    # stop returns between blocks: the file it was copying must not be journaled as complete.
    # (Ctrl-C before the copy is the SIGKILL sweeps' ground; a cast run takes ~5 s.)
    "consolidate-ctrl-c": Sweep(
        "consolidate",
        ("--max-shard-size", "3MB", "--dtype", "bfloat16", "--weights-only"),
        signal.SIGINT,
        (("CKPTOOLS_MEMORY_BUDGET", "64KB"),),
        kills=8,
        per_round=1,
        window=(0.6, 1.0),
    ),
}
_UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _argv(sweep: Sweep, src: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "ckptools", sweep.command, str(src), str(out), "-q",
            "--workers", "2", *sweep.args]  # fmt: skip


def _env(sweep: Sweep, spool: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CKPTOOLS_SPOOL_DIR": str(spool),
        **dict(sweep.env),
    }


def _run(sweep: Sweep, src: Path, out: Path, spool: Path) -> float:
    started = time.perf_counter()
    proc = zygote.run(_argv(sweep, src, out), cwd=str(ROOT), env=_env(sweep, spool), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return time.perf_counter() - started


def _killed(sweep: Sweep, src: Path, out: Path, spool: Path, delay: float) -> bool:
    """Start the command and send it the sweep's signal after ``delay`` seconds; True if it
    had finished first."""
    proc = zygote.start(
        _argv(sweep, src, out), cwd=str(ROOT), env=_env(sweep, spool), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(sweep.sig)
        proc.wait(timeout=60)
        return False
    finally:
        assert proc.stderr is not None
        err = proc.stderr.read().decode(errors="replace")
        proc.stderr.close()
    assert proc.returncode == 0, err
    return True


def _killed_mid_write(sweep: Sweep, src: Path, out: Path, spool: Path) -> bool:
    """Start the command and send it the sweep's signal as soon as its first file is journaled
    (a kill that lands mid-write whatever the machine's speed); True if it had finished first."""
    proc = zygote.start(
        _argv(sweep, src, out), cwd=str(ROOT), env=_env(sweep, spool), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    journal = f"{out.name}.tmp-*/{resume.JOURNAL_PREFIX}*.json"
    while proc.poll() is None and not any(out.parent.glob(journal)):
        time.sleep(0.002)
    if proc.poll() is None:
        proc.send_signal(sweep.sig)
    proc.wait(timeout=60)
    return proc.returncode == 0


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


# Each sweep is a soak of many killed CLI processes (12-60 s): slow, so `make check`'s inner
# loop leaves them to `make test`.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["consolidate", "reshard", "consolidate-ctrl-c"])
def test_killed_at_random_points_then_finished(name: str, src: Produced, tmp_path: Path) -> None:
    sweep = SWEEPS[name]
    before = _hashes(src.path)
    spool = tmp_path / "spool"
    spool.mkdir()
    clean = tmp_path / "clean"
    duration = _run(sweep, src.path, clean, spool)
    rng = random.Random(f"kill-sweep-{name}")
    delays = [rng.uniform(*sweep.window) * duration for _ in range(sweep.kills)]
    finished_early = mid_write = 0
    for round_no in range(sweep.kills // sweep.per_round):
        out = tmp_path / f"out-{round_no}"
        if round_no == 0:  # one kill sure to land mid-write, then the random ones
            finished_early += _killed_mid_write(sweep, src.path, out, spool)
            mid_write += any(tmp_path.glob(f"{out.name}.tmp-*/{resume.JOURNAL_PREFIX}*"))
        for delay in delays[round_no * sweep.per_round : (round_no + 1) * sweep.per_round]:
            if out.exists():  # an earlier kill in this round came after the commit
                break
            finished_early += _killed(sweep, src.path, out, spool, delay)
            mid_write += any(tmp_path.glob(f"{out.name}.tmp-*/{resume.JOURNAL_PREFIX}*"))
        if not out.exists():
            _run(sweep, src.path, out, spool)
        left = sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name)
        assert left == [], f"round {round_no}: left behind {left}"
        assert list(spool.iterdir()) == []
        _assert_same_output(clean, out)
    # the sweep reached both ends: kills while files were being written (a journal left to
    # resume from) and not every kill after the run had finished. (A Ctrl-C journals nothing
    # after it, and a cast run journals its first file in its last tenth, after importing
    # torch: its interrupted runs mostly leave nothing to resume, and must still finish right.)
    assert mid_write >= 1 or sweep.sig == signal.SIGINT
    assert finished_early <= sweep.kills  # at least one of the kills + 1 interrupted a run
    assert _hashes(src.path) == before


def test_a_spool_left_by_kill_9_is_removed_by_the_next_run(
    src: Produced, tmp_path: Path, s3_bucket: str
) -> None:
    """A reshard into an object store writes each rank file into a local spool first; a run
    SIGKILLed while spooling leaves that directory (with whole output files in it), and the
    next run into the same place removes it, then finishes the output."""
    sweep = SWEEPS["reshard"]
    clean = tmp_path / "clean"
    spool = tmp_path / "spool"
    spool.mkdir()
    _run(sweep, src.path, clean, spool)
    out = f"{s3_bucket}/out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptools", "reshard", str(src.path), out, "-q", *sweep.args],
        cwd=ROOT, env=_env(sweep, spool), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not any(p.name.endswith(".distcp") for p in spool.rglob("*")):
        assert proc.poll() is None and time.monotonic() < deadline, "never spooled"
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    left = sorted(p.name for p in spool.iterdir())
    assert any(name.endswith(".owner") for name in left) and len(left) == 2, left

    subprocess.run(
        [sys.executable, "-m", "ckptools", "reshard", str(src.path), out, "-q", *sweep.args],
        cwd=ROOT, env=_env(sweep, spool), check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    assert list(spool.iterdir()) == []
    got = tmp_path / "got"
    download(out, str(got))
    _assert_same_output(clean, got)
