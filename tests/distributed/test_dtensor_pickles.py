"""Pickled DTensors (``torch.save`` of real DTensors on gloo ranks) are placed by
:func:`ckptools.formats.dtensor.local_box` exactly where torch's own
``compute_local_shape_and_global_offset`` puts them: 1-D and 2-D meshes, Shard on either
dimension, uneven splits, empty shards, and Replicate kept once."""

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
}


def _save(rank: int, world_size: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    full = torch.arange(35, dtype=torch.float32).reshape(SHAPE)
    truth: dict[str, Any] = {}
    for name, (mesh_shape, names) in CASES.items():
        mesh = init_device_mesh("cpu", mesh_shape)
        placements = [Replicate() if p == "R" else Shard(int(p[1])) for p in names]
        dt = distribute_tensor(full, mesh, placements)
        torch.save({"t": dt}, f"{out}/{name}_{rank}.pt")
        shape, offset = compute_local_shape_and_global_offset(SHAPE, mesh, placements)
        coord = mesh.get_coordinate() or []
        replica = any(p == "R" and c != 0 for p, c in zip(names, coord, strict=True))
        truth[name] = [list(offset), list(shape), replica]
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
            offsets, sizes, replica = truth[name]
            assert (list(box.offsets), list(box.sizes), box.replica) == (
                offsets,
                sizes,
                replica,
            ), (name, rank)
            assert ref.shape == SHAPE
