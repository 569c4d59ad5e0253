"""``ckptools.verify_roundtrip`` on real FSDP2 ranks: save, reload into fresh state, compare."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.dist import run_ranks

pytestmark = pytest.mark.distributed


def _fsdp2_roundtrip(rank: int, world_size: int, path: str, optimizer: bool) -> dict[str, Any]:
    import ckptools
    from tests.support import producers

    cfg = producers.DEFAULT_CONFIG
    model = producers.TinyLlama(cfg)
    from torch.distributed.device_mesh import init_device_mesh

    producers._fsdp2_wrap(model, init_device_mesh("cpu", (world_size,)))
    opt = None
    if optimizer:
        opt, _ = producers._make_optimizer(model)
        producers._train(model, cfg, opt)
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    report = ckptools.verify_roundtrip(model, opt, path)
    after = {k: v.to_local() for k, v in model.state_dict().items()}
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return {**report.to_dict(), "unchanged": unchanged}


@pytest.mark.parametrize("optimizer", [True, False])
def test_fsdp2_roundtrip_is_bit_exact(tmp_path: Path, optimizer: bool) -> None:
    path = str(tmp_path / "roundtrip")
    reports = run_ranks(_fsdp2_roundtrip, 2, path, optimizer, timeout=180.0)
    for rank, r in enumerate(reports):
        assert r["rank"] == rank and r["world_size"] == 2
        assert r["ok"], (r["mismatches"], r["findings"])
        assert r["unchanged"]
        # 21 parameters; with AdamW each also has exp_avg, exp_avg_sq and a step tensor
        assert r["tensors"] == (21 * 4 if optimizer else 21)
        if optimizer:
            assert r["values"] > 0  # param_groups entries (lr, betas, ...) compared too
    assert os.path.exists(os.path.join(path, ".metadata"))


def _roundtrip_in_a_subgroup(rank: int, world_size: int, path: str) -> dict[str, Any] | None:
    import torch.distributed as dist

    import ckptools

    group = dist.new_group([1, 2])  # every rank creates it; only its members use it
    if rank not in (1, 2):
        return None
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return ckptools.verify_roundtrip(model, opt, path, process_group=group).to_dict()


def test_a_process_group_of_some_ranks(tmp_path: Path) -> None:
    # The group's rank 0 (global rank 1) verifies the files; its findings reach global rank 2.
    path = str(tmp_path / "roundtrip")
    reports = run_ranks(_roundtrip_in_a_subgroup, 3, path, timeout=180.0)
    assert reports[0] is None
    for group_rank, r in enumerate(reports[1:]):
        assert (r["rank"], r["world_size"]) == (group_rank, 2)
        assert r["ok"], (r["mismatches"], r["findings"])
        assert r["tensors"] == 2
    assert os.path.exists(os.path.join(path, ".metadata"))


def test_the_comparison_sees_what_a_load_did_not_restore() -> None:
    # Without a load, the fresh state differs in every byte and every value: all reported.
    from ckptools.training.roundtrip import _compare_state, _fresh_state

    state = {
        "model": {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)},
        "flags": torch.tensor([True, False]),
        "optim": {"param_groups": [{"lr": 0.1, "params": ["w", "b"]}], "step": 3},
        "count": torch.tensor(5.0),
        "empty": torch.empty(0, 5),
    }
    fresh = _fresh_state(state)
    out: list[str] = []
    counts = [0, 0]
    _compare_state(state, fresh, "", out, counts)
    assert counts == [5, 3]
    reported = {m.split(":")[0] for m in out}
    assert reported == {
        "model.w",
        "model.b",
        "flags",
        "count",
        "optim.param_groups.0.lr",
        "optim.param_groups.0.params",
        "optim.step",
    }
    assert all("12 of 12" in m for m in out if m.startswith("model.w:"))
