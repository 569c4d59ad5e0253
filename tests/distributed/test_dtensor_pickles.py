"""Pickled DTensors (``torch.save`` of real DTensors on gloo ranks) are placed by
:func:`ckptools.formats.dtensor.local_box` exactly where torch's own
``compute_local_shape_and_global_offset`` puts them: 1-D and 2-D meshes, Shard on either
dimension, uneven splits, empty shards, and Replicate kept once; ``_StridedShard`` (FSDP2 over
tensor parallelism: cut into split-factor pieces first), including placements that leave a
rank's rows apart in the global tensor, checked element by element."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptools.formats import dtensor, torch_archive
from ckptools.io.storage import open_reader
from tests.support.dist import run_ranks

pytestmark = pytest.mark.distributed
SHAPE = (7, 5)
CASES = {
    "1d_shard0": ((4,), ("S0",)),
    "1d_shard1": ((4,), ("S1",)),
    "2d_replicate_shard0": ((2, 2), ("R", "S0")),
    "2d_shard0_shard1": ((2, 2), ("S0", "S1")),
    "2d_shard0_shard0": ((2, 2), ("S0", "S0")),
    "2d_shard1_replicate": ((2, 2), ("S1", "R")),
    # FSDP2 + TP: fully_shard's placement over the tensor-parallel Shard(0)
    "2d_strided0_shard0": ((2, 2), ("SS0/2", "S0")),
    # the striding left as it is: rows {0, 1, 4, 5} / {2, 3, 6}
    "2d_strided0_replicate": ((2, 2), ("SS0/2", "R")),
    "1d_strided1_by3": ((4,), ("SS1/3",)),
}


def _placement(name: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if name == "R":
        return Replicate()
    if name.startswith("SS"):
        dim, split = name[2:].split("/")
        return _StridedShard(int(dim), split_factor=int(split))
    return Shard(int(name[1]))


def _save(rank: int, world_size: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    full = torch.arange(35, dtype=torch.float32).reshape(SHAPE)
    truth: dict[str, Any] = {}
    for name, (mesh_shape, names) in CASES.items():
        mesh = init_device_mesh("cpu", mesh_shape)
        placements = [_placement(p) for p in names]
        # src_data_rank=None: each rank cuts its own part (torch's scatter pads, which an
        # uneven _StridedShard refuses)
        dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
        torch.save({"t": dt}, f"{out}/{name}_{rank}.pt")
        shape, offset = compute_local_shape_and_global_offset(SHAPE, mesh, placements)
        coord = mesh.get_coordinate() or []
        replica = any(p == "R" and c != 0 for p, c in zip(names, coord, strict=True))
        # the local values are the global elements' indices: where each one lies
        truth[name] = [list(offset), list(shape), replica, dt.to_local().tolist()]
    Path(f"{out}/truth_{rank}.json").write_text(json.dumps(truth))


def test_local_boxes_match_torchs_placement(tmp_path: Path) -> None:
    run_ranks(_save, 4, str(tmp_path), timeout=240)
    reader = open_reader(str(tmp_path))
    for rank in range(4):
        truth = json.loads((tmp_path / f"truth_{rank}.json").read_text())
        for name in CASES:
            rel = f"{name}_{rank}.pt"
            archive = torch_archive.read_archive(reader, rel, 0, reader.size(rel))
            ref = torch_archive.load_pickle(reader, archive, dtensor.GLOBALS)["t"]
            assert isinstance(ref, dtensor.DTensorRef)
            box = dtensor.local_box(ref)
            offsets, sizes, replica, values = truth[name]
            assert (list(box.sizes), box.replica) == (sizes, replica), (name, rank)
            if all(sizes):
                assert list(box.offsets) == offsets, (name, rank)
            assert ref.shape == SHAPE
            local = torch.tensor(values, dtype=torch.float32).reshape(sizes)
            full = torch.arange(35, dtype=torch.float32).reshape(SHAPE)
            placed = 0
            for at, n, lo in box.pieces:
                there = full[tuple(slice(a, a + k) for a, k in zip(at, n, strict=True))]
                here = local[tuple(slice(a, a + k) for a, k in zip(lo, n, strict=True))]
                assert torch.equal(there, here), (name, rank, at, n, lo)
                placed += here.numel()
            assert placed == local.numel(), (name, rank)
        assert len(dtensor.local_box(_load(reader, "2d_strided0_replicate_0.pt")).pieces) == 2


def _load(reader: Any, rel: str) -> Any:
    archive = torch_archive.read_archive(reader, rel, 0, reader.size(rel))
    return torch_archive.load_pickle(reader, archive, dtensor.GLOBALS)["t"]


def _save_fsdp_over_tp(rank: int, world_size: int, out: str) -> None:
    """FSDP2 over tensor parallelism as torchtitan builds it: TP on the inner mesh dimension,
    ``fully_shard`` on the outer, which places the TP-sharded weights ``_StridedShard``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Linear(7, 6))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    state = model.state_dict()
    torch.save(state, f"{out}/model_{rank}.pt")
    torch.save({k: v.to_local() for k, v in state.items()}, f"{out}/local_{rank}.pt")
    full = {k: v.full_tensor() for k, v in state.items()}
    if rank == 0:
        torch.save(full, f"{out}/full.pt")


def test_fsdp_over_tensor_parallel_weights_are_placed_as_gathered(tmp_path: Path) -> None:
    run_ranks(_save_fsdp_over_tp, 4, str(tmp_path), timeout=240)
    reader = open_reader(str(tmp_path))
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    covered = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in full.items()}
    strided = 0
    for rank in range(4):
        local = torch.load(tmp_path / f"local_{rank}.pt", weights_only=True)
        rel = f"model_{rank}.pt"
        archive = torch_archive.read_archive(reader, rel, 0, reader.size(rel))
        for key, ref in torch_archive.load_pickle(reader, archive, dtensor.GLOBALS).items():
            box = dtensor.local_box(ref)
            strided += any(p.startswith("_StridedShard") for p in box.placements)
            if box.replica:
                continue
            for at, n, lo in box.pieces:
                there = tuple(slice(a, a + k) for a, k in zip(at, n, strict=True))
                here = tuple(slice(a, a + k) for a, k in zip(lo, n, strict=True))
                assert torch.equal(full[key][there], local[key][here]), (key, rank)
                covered[key][there] += 1
    assert strided  # the case this test is for: torch placed something _StridedShard
    for key, count in covered.items():
        assert bool((count == 1).all()), key  # every element once
