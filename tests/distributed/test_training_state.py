"""ckptools.save / load under every wrapping users run, with real gloo ranks.

Truth: the checkpoint's full tensors as assembled by ckptools' reader from DCP chunks (independent
of the wrapping that wrote them) — a checkpoint saved under config A, loaded under config B and
saved again must hold bit-identical model and optimizer tensors, and its keys must be the plain
model FQNs (no wrapper segments).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.support.dist import run_ranks

pytestmark = pytest.mark.distributed

WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module.")


def _tensors(path: str) -> dict[str, Any]:
    import ckptools

    manifest = ckptools.read_manifest(path)
    return {fqn: ckptools.read_tensor(manifest, fqn) for fqn in manifest.tensors}


def _round_trips(rank: int, world_size: int, root: str, pairs: list[tuple[str, str]]) -> list[str]:
    """For each (save kind, load kind): train 1 step under one, save; load under the other, save
    again. Returns the failures seen by rank 0 (compared after a barrier)."""
    import torch
    import torch.distributed as dist

    import ckptools
    from tests.support import training

    failures: list[str] = []
    for i, (save_kind, load_kind) in enumerate(pairs):
        a, b = os.path.join(root, f"{i}-a"), os.path.join(root, f"{i}-b")
        model, opt = training.build(save_kind, world_size)
        sched = training.scheduler(opt)
        training.train_step(model, opt, 0, sched)
        ckptools.save(a, model, opt, extra={"step": 1, "sched": sched, "note": save_kind})
        model2, opt2 = training.build(load_kind, world_size)
        sched2 = training.scheduler(opt2)
        extra = ckptools.load(a, model2, opt2, extra={"sched": sched2})
        ckptools.save(b, model2, opt2, extra=extra)
        dist.barrier()
        if rank == 0:
            ta, tb = _tensors(a), _tensors(b)
            label = f"{save_kind} -> {load_kind}"
            bad_keys = [k for k in ta if any(seg in k for seg in WRAPPER_SEGMENTS)]
            if bad_keys:
                failures.append(f"{label}: wrapper segments in keys {bad_keys[:3]}")
            if "model.model.layers.0.self_attn.q_proj.weight" not in ta:
                failures.append(f"{label}: model FQNs missing: {sorted(ta)[:3]}")
            if "optim.state.model.layers.0.self_attn.q_proj.weight.exp_avg" not in ta:
                failures.append(f"{label}: optimizer state not FQN keyed: {sorted(ta)[-3:]}")
            if sorted(ta) != sorted(tb):
                failures.append(f"{label}: keys differ {set(ta) ^ set(tb)}")
            for k in ta:
                if k in tb and not (
                    ta[k].dtype == tb[k].dtype
                    and ta[k].shape == tb[k].shape
                    and torch.equal(
                        ta[k].reshape(-1).view(torch.uint8), tb[k].reshape(-1).view(torch.uint8)
                    )
                ):
                    failures.append(f"{label}: {k} differs after load+save")
            if extra["step"] != 1 or extra["note"] != save_kind:
                failures.append(f"{label}: extra came back as {extra}")
            if sched2.state_dict()["last_epoch"] != 1:
                failures.append(f"{label}: scheduler not restored in place")
        dist.barrier()
    return failures


def _run(tmp_path: Any, pairs: list[tuple[str, str]], world_size: int = 2) -> None:
    results = run_ranks(_round_trips, world_size, str(tmp_path), pairs, timeout=280.0)
    assert results[0] == []


def test_fsdp1_strategies_round_trip_across_configs(tmp_path: Any) -> None:
    # Each FSDP1 strategy, with and without bf16 mixed precision, saved and then loaded under
    # another configuration: every pair crosses wrappings. CPUOffload needs CUDA (see below).
    _run(
        tmp_path,
        [
            ("fsdp1-full", "fsdp1-grad+mp"),
            ("fsdp1-grad", "fsdp1-none"),
            ("fsdp1-none+mp", "fsdp1-hybrid"),
            ("fsdp1-hybrid+mp", "fsdp1-full"),
            ("fsdp1-full+mp", "fsdp2"),
        ],
    )


def test_fsdp2_ddp_plain_ac_compile_round_trip(tmp_path: Any) -> None:
    _run(
        tmp_path,
        [
            ("fsdp2+mp", "fsdp1-full"),
            ("fsdp2+ac", "ddp+compile"),
            ("fsdp2+compile", "plain+ac"),
            ("ddp", "fsdp2+mp+ac"),
            ("plain+compile+ac", "fsdp2"),
        ],
    )


@pytest.mark.gpu
def test_fsdp1_cpu_offload_round_trips(tmp_path: Any) -> None:
    # FSDP1's CPUOffload pins host memory and synchronises CUDA streams, so it cannot run on a
    # CPU-only machine; where CUDA exists, FSDP1 still computes on CPU here (device_id=cpu).
    bases = ("fsdp1-full", "fsdp1-grad", "fsdp1-hybrid", "fsdp1-none")
    kinds = [b + opt for b in bases for opt in ("+offload", "+mp+offload")]
    _run(tmp_path, [(k, kinds[(i + 3) % len(kinds)]) for i, k in enumerate(kinds)])


@pytest.mark.slow
def test_every_fsdp1_combination_round_trips(tmp_path: Any) -> None:
    bases = ("fsdp1-full", "fsdp1-grad", "fsdp1-hybrid", "fsdp1-none")
    kinds = [b + opt for b in bases for opt in ("", "+mp")]
    # Each kind saved, then loaded under the next one (wrapping around): every kind saves and
    # loads once, each time under a different configuration.
    _run(tmp_path, [(k, kinds[(i + 3) % len(kinds)]) for i, k in enumerate(kinds)])


@pytest.mark.slow
def test_hsdp_round_trips_at_world_size_4(tmp_path: Any) -> None:
    _run(tmp_path, [("hsdp2+mp", "fsdp1-hybrid"), ("fsdp1-hybrid+mp", "hsdp2")], world_size=4)


def test_without_a_process_group(tmp_path: Any) -> None:
    import torch

    import ckptools
    from tests.support import training

    model, opt = training.build("plain+ac+compile", 1)
    training.train_step(model, opt, 0)
    ckptools.save(tmp_path / "c", model, opt, extra={"rng": torch.get_rng_state()})
    fresh, fresh_opt = training.build("plain", 1)
    extra = ckptools.load(tmp_path / "c", fresh, fresh_opt)
    assert torch.equal(extra["rng"], torch.get_rng_state())
    for (name, p), (_, q) in zip(
        training.TinyLlama.named_parameters(fresh),  # type: ignore[arg-type]
        ckptools._compat.unwrap_model(model).named_parameters(),
        strict=True,
    ):
        assert torch.equal(p, q), name
    assert not [k for k in _tensors(str(tmp_path / "c")) if "_orig_mod" in k or "_checkpoint" in k]


def test_load_errors_are_clear(tmp_path: Any) -> None:
    import ckptools
    from ckptools.errors import CheckpointNotFoundError, IncompleteCheckpointError
    from tests.support import training

    model, opt = training.build("plain", 1)
    with pytest.raises(CheckpointNotFoundError):
        ckptools.load(tmp_path / "nope", model)
    ckptools.save(tmp_path / "m", model)
    with pytest.raises(IncompleteCheckpointError, match="no optimizer state"):
        ckptools.load(tmp_path / "m", model, opt)
    os.remove(tmp_path / "m" / ".metadata")
    with pytest.raises(IncompleteCheckpointError, match="never finished"):
        ckptools.load(tmp_path / "m", model)
