"""Tensors a source holds as values (:class:`ckptools.core.tensor_value.TensorValue`): planned
and written into a DCP as tensor items that torch's own ``dcp.load`` reads into a tensor target
(an AdamW ``step`` saved as a number), beside a tensor copied from a source file."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

import ckptools
from ckptools.core.manifest import Chunk, FileInfo, Manifest, TensorEntry
from ckptools.core.tensor_value import TensorValue
from ckptools.engine.dcp_writer import write_dcp
from ckptools.plan.dcp import plan_dcp


def test_scalar_bytes_and_size_check() -> None:
    assert TensorValue.scalar(2).data == struct.pack("<f", 2.0)
    assert TensorValue.scalar(7, "int64").data == struct.pack("<q", 7)
    assert repr(TensorValue.scalar(7)) == "tensor(7.0, dtype=float32)"  # what inspect shows
    assert repr(TensorValue("int32", (2,), b"\0" * 8)) == "tensor(dtype=int32, shape=[2], 8 bytes)"
    with pytest.raises(ValueError, match="takes 8 bytes, not 4"):
        TensorValue("float32", (2,), b"\0" * 4)
    with pytest.raises(ValueError, match="bfloat16"):
        TensorValue.scalar(1, "bfloat16")


def test_value_tensors_are_written_for_dcp_load(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "src"
    src.mkdir()
    weights = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    (src / "w.bin").write_bytes(weights.numpy().tobytes())
    entry = TensorEntry("w", "float32", (3, 2), (Chunk((0, 0), (3, 2), "w.bin", 0, 24),))
    manifest = Manifest(
        str(src), "torch_save", "torch_save", {"w": entry}, {}, {"w.bin": FileInfo("w.bin", 24)}
    )
    grid = TensorValue("int64", (2, 2), struct.pack("<4q", 1, -2, 3, 1 << 40))
    values = {
        "optim.state.w.step": TensorValue.scalar(5.0),
        "optim.grid": grid,
        "optim.lr": 0.5,
    }
    paths = {
        "model.w": ("model", "w"),
        "optim.state.w.step": ("optim", "state", "w", "step"),
        "optim.grid": ("optim", "grid"),
        "optim.lr": ("optim", "lr"),
    }
    plan = plan_dcp(manifest, 2, {"model.w": "w"}, paths, objects=[], values=values)
    stored = [t for t in plan.tensors if t.data is not None]
    assert {t.fqn for t in stored} == {"optim.state.w.step", "optim.grid"}
    assert all(t.sources == () for t in stored)
    assert plan.shapes["optim.grid"] == ("int64", (2, 2))
    out = tmp_path / "out"
    out.mkdir()
    write_dcp(manifest, plan, str(out), source_root=str(src))
    # every item whole, its zip CRC-32 that of the bytes written
    assert ckptools.verify(str(out), quiet=True).ok
    target = {
        "model": {"w": torch.zeros(3, 2)},
        "optim": {
            "state": {"w": {"step": torch.tensor(0.0)}},
            "grid": torch.zeros(2, 2, dtype=torch.int64),
            "lr": 0.0,
        },
    }
    dcp.load(target, checkpoint_id=str(out), no_dist=True)
    step = target["optim"]["state"]["w"]["step"]
    assert step.dtype == torch.float32 and step.shape == () and step.item() == 5.0
    assert target["optim"]["grid"].tolist() == [[1, -2], [3, 1 << 40]]
    assert torch.equal(target["model"]["w"], weights)
    assert target["optim"]["lr"] == 0.5
