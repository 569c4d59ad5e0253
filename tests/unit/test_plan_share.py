"""A rank's share of a DCP plan (what rank 0 hands each other rank under torchrun): the items of
its files only, the file sizes whole, of the source only what the writer reads; and the plan's
own wire form (columns, rebuilt with the collector paused) gives back the same plan."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptools.core.geometry import fsdp2_rows
from ckptools.core.manifest import Chunk, Manifest, ObjectEntry, TensorEntry
from ckptools.core.tensor_value import TensorValue
from ckptools.engine.dcp_writer import share_of, write_dcp
from ckptools.plan.dcp import DcpPlan, plan_dcp


def _manifest(d0: int, cols: int, src_ws: int, col_split: int) -> Manifest:
    """Tensor ``w`` (d0 x cols) stored as FSDP2 rows of ``src_ws`` ranks, each split in
    ``col_split`` column blocks (pieces then read several sources each), ``b`` a bias, and
    an object."""
    chunks = []
    for r, (o, n) in enumerate(fsdp2_rows(d0, src_ws)):
        for c, (co, cn) in enumerate(fsdp2_rows(cols, col_split)):
            if n and cn:
                chunks.append(Chunk((o, co), (n, cn), f"__{r}_0.distcp", 100 * c, 90,
                                    "torch_save", r, None, 7 * r + c))  # fmt: skip
    w = TensorEntry("w", "bfloat16", (d0, cols), tuple(chunks))
    b = TensorEntry("b", "float32", (d0,), (Chunk((0,), (d0,), "__0_0.distcp", 900, 80),))
    obj = ObjectEntry("step", "__0_0.distcp", 1000, 40)
    return Manifest("r", "dcp", "fsdp2", {"w": w, "b": b}, {"step": obj}, {}, world_size=src_ws)


def _plan(d0: int, cols: int, src_ws: int, col_split: int, dst_ws: int) -> DcpPlan:
    values = {"lr": 0.5, "scale": TensorValue.scalar(2.0)}
    return plan_dcp(_manifest(d0, cols, src_ws, col_split), dst_ws, values=values)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 30), st.integers(1, 6), st.integers(1, 6), st.integers(1, 3),
    st.integers(1, 9), st.data(),
)  # fmt: skip
def test_a_plan_and_its_shares_travel_whole(
    d0: int, cols: int, src_ws: int, col_split: int, dst_ws: int, data: st.DataObject
) -> None:
    plan = _plan(d0, cols, src_ws, col_split, dst_ws)
    back = pickle.loads(pickle.dumps(plan))
    assert back == plan
    assert [type(t).__name__ for t in back.tensors] == ["TensorItem"] * len(plan.tensors)
    assert all(type(c) is Chunk for t in back.tensors for c in t.sources)

    files = data.draw(st.sets(st.integers(0, dst_ws - 1)))
    share = plan.of_files(files)
    assert share.file_sizes == plan.file_sizes  # every rank still finds the same split
    assert share.shapes == plan.shapes and share.paths == plan.paths
    assert share.tensors == tuple(t for t in plan.tensors if t.rank in files)
    assert share.objects == tuple(o for o in plan.objects if o.rank in files)
    assert pickle.loads(pickle.dumps(share)) == share


def test_a_share_names_only_the_source_entries_its_items_read() -> None:
    manifest = _manifest(8, 4, 2, 2)
    plan = plan_dcp(manifest, 4, {"w": "w"}, objects=[])  # "b" and "step" left out
    source, share = share_of(manifest, plan, [1, 3])
    assert share == plan.of_files([1, 3])
    assert list(source.tensors) == ["w"] and source.objects == {} and source.files == {}
    entry = source.tensors["w"]
    assert (entry.fqn, entry.dtype, entry.shape, entry.chunks) == ("w", "bfloat16", (8, 4), ())
    # every chunk the writer reads is the items' own
    assert {c for t in share.tensors for c in t.sources} <= set(manifest.tensors["w"].chunks)


def test_the_writer_refuses_a_share_that_does_not_fill_its_files(tmp_path: Path) -> None:
    plan = plan_dcp(_manifest(8, 4, 2, 1), 2)
    short = plan.of_files([0])  # the items of file 0 only
    with pytest.raises(ValueError, match=r"do not fill rank files \[0, 1\]"):
        write_dcp(_manifest(8, 4, 2, 1), short, str(tmp_path), source_root=str(tmp_path),
                  only_files=[0, 1])  # fmt: skip
    assert list(tmp_path.iterdir()) == []  # refused before anything was written
