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
from tests.support.training import train_with_manager

pytestmark = pytest.mark.distributed

TOTAL_STEPS = 5
SAVE_AT = 2
STEPS = (TOTAL_STEPS, SAVE_AT)


@pytest.mark.parametrize("async_save", [False, True])
def test_fsdp2_save_to_s3_and_resume_bit_exactly(s3_bucket: str, async_save: bool) -> None:
    root = f"{s3_bucket}/run"
    full = run_ranks(train_with_manager, 2, root, "fsdp2", False, async_save, *STEPS, timeout=240.0)
    held = objects(root)
    assert {"step-2/.metadata", "step-2/__0_0.distcp", "step-2/__1_0.distcp"} <= set(held)
    assert "step-2/.ckptools-complete" in held and "step-2/.ckptools-writing" not in held
    resumed = run_ranks(train_with_manager, 2, root, "fsdp2", True, False, *STEPS, timeout=240.0)
    reference = full[0]
    assert all(r == reference for r in full), "ranks disagree in the uninterrupted run"
    for rank, losses in enumerate(resumed):
        assert sorted(losses) == list(range(SAVE_AT, TOTAL_STEPS))
        for step, loss in losses.items():
            assert loss == reference[step], f"rank {rank} step {step}: loss differs"
