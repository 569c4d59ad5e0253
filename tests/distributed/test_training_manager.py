"""CheckpointManager with real ranks: bit-exact resume, async failures, crash safety.

Resume truth: a run that never stopped. Every rank sees the same micro-batch per step (see
``tests.support.training.batch``), so the averaged gradient is exact at any world size and a run
resumed at another world size must reproduce the uninterrupted losses bit for bit.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.support import zygote
from tests.support.dist import run_ranks
from tests.support.training import train_with_manager

pytestmark = pytest.mark.distributed

TOTAL_STEPS = 6
SAVE_AT = 3
STEPS = (TOTAL_STEPS, SAVE_AT)


def _resume_matches(
    tmp_path: Any, kind: str, ws_before: int, ws_after: int, async_save: bool = False
) -> None:
    root = str(tmp_path / "ckpts")
    full = run_ranks(
        train_with_manager, ws_before, root, kind, False, async_save, *STEPS, timeout=240.0
    )
    resumed = run_ranks(
        train_with_manager, ws_after, root, kind, True, False, *STEPS, timeout=240.0
    )
    reference = full[0]
    assert all(r == reference for r in full), "ranks disagree in the uninterrupted run"
    for rank, losses in enumerate(resumed):
        assert sorted(losses) == list(range(SAVE_AT, TOTAL_STEPS))
        for step, loss in losses.items():
            assert loss == reference[step], f"rank {rank} step {step}: loss differs"


@pytest.mark.parametrize(
    ("kind", "ws_before", "ws_after", "async_save"),
    [
        ("fsdp2", 2, 2, True),
        ("fsdp2", 2, 4, False),
        ("fsdp1-full", 2, 2, False),
        # DDP shares the plain/FSDP code paths; slow only to keep the default run near 2 minutes.
        pytest.param("ddp", 2, 2, False, marks=pytest.mark.slow),
        ("plain", 1, 1, True),
    ],
)
def test_resume_continues_bit_exactly(
    tmp_path: Any, kind: str, ws_before: int, ws_after: int, async_save: bool
) -> None:
    _resume_matches(tmp_path, kind, ws_before, ws_after, async_save)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "ws_before", "ws_after"), [("fsdp2", 4, 2), ("fsdp2+mp", 2, 4)])
def test_resume_at_another_world_size_more(
    tmp_path: Any, kind: str, ws_before: int, ws_after: int
) -> None:
    _resume_matches(tmp_path, kind, ws_before, ws_after)


def _failing_async(rank: int, world_size: int, root: str) -> list[str]:
    """Second async save fails in rank 1's writer; the error must surface on the next call."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    import ckptools
    from ckptools.training import AsyncSaveError
    from tests.support import training

    model, opt = training.build("fsdp2", world_size)
    mgr = ckptools.CheckpointManager(root, keep_last=3, async_save=True)
    seen: list[str] = []
    mgr.save(1, model, opt, extra={"step": 1})
    mgr.wait()
    original = FileSystemWriter.write_data

    def broken(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError(28, "No space left on device (injected)")

    if rank == 1:
        FileSystemWriter.write_data = broken  # type: ignore[method-assign]
    mgr.save(2, model, opt, extra={"step": 2})  # returns once staged: no error yet
    seen.append("staged")
    try:
        mgr.save(3, model, opt, extra={"step": 3})  # raises before starting step 3
    except AsyncSaveError as e:
        seen.append(f"raised step={e.step}")
    # Restored only now: the background writer runs until the next call waits for it.
    FileSystemWriter.write_data = original  # type: ignore[method-assign]
    assert mgr.steps() == [1], mgr.steps()
    mgr.save(4, model, opt, extra={"step": 4})  # the manager keeps working afterwards
    mgr.close()
    seen.append(f"steps={mgr.steps()}")
    return seen


def test_failed_async_save_surfaces_at_next_call(tmp_path: Any) -> None:
    results = run_ranks(_failing_async, 2, str(tmp_path / "ckpts"), timeout=120.0)
    for seen in results:
        assert seen == ["staged", "raised step=2", "steps=[1, 4]"]
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["step-1", "step-4"]


# ------------------------------------------------------------------------------------ crash safety

_CRASH_CHILD = r"""
import sys, torch
sys.path.insert(0, {repo!r})
import ckptools
from tests.support import training
model, opt = training.build("plain", 1)
mgr = ckptools.CheckpointManager({root!r}, keep_last=2, checksums={checksums!r})
restored = mgr.restore(model, opt)
step = restored[0] if restored else 0
print("ready", flush=True)
while True:
    training.train_step(model, opt, step)
    step += 1
    mgr.save(step, model, opt, extra={{"step": step}}, metrics={{"loss": float(step)}})
"""


def _check_latest(root: str) -> tuple[int | None, int]:
    """(latest step, number of complete checkpoints); the latest must verify and load."""
    import torch

    import ckptools
    from ckptools.training import store
    from tests.support import training

    infos = [c for c in store.list_checkpoints(root) if c.complete]
    if not infos:
        return None, 0
    latest = infos[-1].path
    report = ckptools.verify(latest)
    assert report.ok, report.findings
    assert report.checksums_checked
    manifest = ckptools.read_manifest(latest)
    for fqn in manifest.tensors:
        assert ckptools.read_tensor(manifest, fqn).numel() >= 0
    model, opt = training.build("plain", 1)
    extra = ckptools.load(latest, model, opt)
    assert extra["step"] == infos[-1].step
    assert torch.isfinite(next(model.parameters())).all()
    return infos[-1].step, len(infos)


def _crash_trials(tmp_path: Any, trials: int) -> None:
    root = str(tmp_path / "ckpts")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = _CRASH_CHILD.format(repo=repo, root=root, checksums=True)
    rng = random.Random(1234)
    ever_complete = 0
    last_step: int | None = None
    for _ in range(trials):
        # Forked from a zygote that has imported torch (tests/support/zygote.py): a process of
        # its own, killed by a real SIGKILL, without paying torch's import (~2.5 s) per trial.
        child = zygote.start(
            [sys.executable, "-c", code],
            cwd=os.getcwd(),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1", "CKPTOOLS_NO_PROGRESS": "1"},
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.0, 0.6))
        child.send_signal(signal.SIGKILL)
        child.wait()
        step, complete = _check_latest(root)
        # Progress never goes backwards, and retention never leaves fewer than it promises.
        if last_step is not None:
            assert step is not None and step >= last_step
        last_step = step
        ever_complete = max(ever_complete, complete)
        assert complete >= min(2, ever_complete)


def test_sigkill_during_saves_never_leaves_a_bad_latest(tmp_path: Any) -> None:
    _crash_trials(tmp_path, trials=6)


# 20 training processes killed mid-save
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_during_saves_many_times(tmp_path: Any) -> None:
    _crash_trials(tmp_path, trials=20)
