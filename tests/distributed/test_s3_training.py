"""CheckpointManager on s3:// with real ranks (gloo): save at 2 ranks, resume bit-exactly.

The ranks are separate processes talking to the loopback S3 server the session fixture started
(they inherit its AWS_* environment). Truth, as in test_training_manager: a run that never
stopped; every rank sees the same micro-batch per step, so the resumed losses must equal the
uninterrupted run's bit for bit.
"""

from __future__ import annotations

import pytest

from tests.support.dist import run_ranks
from tests.support.s3 import objects

pytestmark = pytest.mark.distributed

TOTAL_STEPS = 5
SAVE_AT = 2


def _train(
    rank: int, world_size: int, root: str, resume: bool, async_save: bool
) -> dict[int, bytes]:
    import ckptools
    from tests.support import training

    model, opt = training.build("fsdp2", world_size)
    sched = training.scheduler(opt)
    mgr = ckptools.CheckpointManager(root, keep_last=2, async_save=async_save)
    start = 0
    if resume:
        restored = mgr.restore(model, opt, extra={"sched": sched})
        assert restored is not None
        start, extra = restored
        assert extra["step"] == start == SAVE_AT
    losses: dict[int, bytes] = {}
    for step in range(start, TOTAL_STEPS):
        loss = training.train_step(model, opt, step, sched)
        losses[step] = loss.numpy().tobytes()
        if not resume and step + 1 == SAVE_AT:
            mgr.save(SAVE_AT, model, opt, extra={"step": SAVE_AT, "sched": sched})
    mgr.close()
    return losses


@pytest.mark.parametrize("async_save", [False, True])
def test_fsdp2_save_to_s3_and_resume_bit_exactly(s3_bucket: str, async_save: bool) -> None:
    root = f"{s3_bucket}/run"
    full = run_ranks(_train, 2, root, False, async_save, timeout=240.0)
    held = objects(root)
    assert {"step-2/.metadata", "step-2/__0_0.distcp", "step-2/__1_0.distcp"} <= set(held)
    assert "step-2/.ckptools-complete" in held and "step-2/.ckptools-writing" not in held
    resumed = run_ranks(_train, 2, root, True, False, timeout=240.0)
    reference = full[0]
    assert all(r == reference for r in full), "ranks disagree in the uninterrupted run"
    for rank, losses in enumerate(resumed):
        assert sorted(losses) == list(range(SAVE_AT, TOTAL_STEPS))
        for step, loss in losses.items():
            assert loss == reference[step], f"rank {rank} step {step}: loss differs"
