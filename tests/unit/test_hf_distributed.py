"""The transformers-distributed layout on hand-made hostile inputs (real producer files are in
tests/distributed/test_transformers_distributed.py): damaged ``DCP_SHARDING_INFO``, a rank file
missing, names that are not shard files; and detection, which looks at one header."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from ckptools.errors import CorruptCheckpointError, IncompleteCheckpointError
from ckptools.producers import detect, read_manifest
from ckptools.producers.hf.distributed import HfDistributedLayout, shard_name


def _write(
    d: Path, rank: int, tensors: dict[str, torch.Tensor], info: Any, *, raw: str | None = None
) -> Path:
    path = d / shard_name(rank)
    meta = {"DCP_SHARDING_INFO": raw if raw is not None else json.dumps(info), "format": "pt"}
    save_file(tensors, str(path), metadata=meta)
    return path


def _two_ranks(d: Path) -> None:
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    _write(d, 0, {"w": w[:2].clone()}, {"w": {"saved_offsets": [0, 0]}})
    _write(
        d,
        1,
        {"w": w[2:].clone(), "b": torch.ones(3)},
        {"w": {"saved_offsets": [2, 0]}, "b": {"saved_offsets": [0]}},
    )


def test_reads_slices_as_one_tensor(tmp_path: Path) -> None:
    _two_ranks(tmp_path)
    assert detect(str(tmp_path)).name == "transformers_distributed"
    m = read_manifest(str(tmp_path))
    assert m.world_size == 2 and m.tensors["w"].shape == (4, 3) and m.tensors["b"].shape == (3,)
    assert [(c.offsets, c.sizes, c.rank) for c in m.tensors["w"].chunks] == [
        ((0, 0), (2, 3), 0),
        ((2, 0), (2, 3), 1),
    ]


def test_plain_shard_names_without_sharding_info_are_not_this_layout(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, str(tmp_path / shard_name(0)), metadata={"format": "pt"})
    reason = HfDistributedLayout().probe(str(tmp_path))
    assert reason is not None and "DCP_SHARDING_INFO" in reason


@pytest.mark.parametrize(
    ("info", "raw", "says"),
    [
        (None, "{not json", "is not JSON"),
        (None, "[" * 100_000, "is not JSON"),
        ([1, 2], None, "is not a JSON object"),
        ({}, None, "no offsets for tensor 'w'"),
        ({"w": {"saved_offsets": [0]}}, None, "not 2 non-negative integer"),
        ({"w": {"saved_offsets": [True, 0]}}, None, "not 2 non-negative integer"),
        ({"w": {"saved_offsets": [-1, 0]}}, None, "not 2 non-negative integer"),
        ({"w": {"saved_offsets": [0.0, 0]}}, None, "not 2 non-negative integer"),
        ({"w": {"saved_offsets": [0, 0]}, "x": {"saved_offsets": [0]}}, None, "places 'x'"),
    ],
)
def test_damaged_sharding_info_is_refused(
    tmp_path: Path, info: Any, raw: str | None, says: str
) -> None:
    _two_ranks(tmp_path)
    path = _write(tmp_path, 0, {"w": torch.zeros(2, 3)}, info, raw=raw)
    with pytest.raises(CorruptCheckpointError, match="DCP_SHARDING_INFO") as e:
        read_manifest(str(tmp_path))
    assert says in str(e.value) and str(path) in str(e.value)
    assert "\n" not in str(e.value)


def test_gap_and_overlap_are_refused(tmp_path: Path) -> None:
    _two_ranks(tmp_path)
    _write(tmp_path, 0, {"w": torch.zeros(1, 3)}, {"w": {"saved_offsets": [0, 0]}})  # row 1 gone
    with pytest.raises(CorruptCheckpointError, match="do not place every element of 'w'"):
        read_manifest(str(tmp_path))
    _write(tmp_path, 0, {"w": torch.zeros(3, 3)}, {"w": {"saved_offsets": [0, 0]}})  # row 2 twice
    with pytest.raises(CorruptCheckpointError, match="do not place every element of 'w'"):
        read_manifest(str(tmp_path))


def test_slices_of_different_dtypes_are_refused(tmp_path: Path) -> None:
    _two_ranks(tmp_path)
    half = torch.zeros(2, 3, dtype=torch.float16)
    _write(tmp_path, 0, {"w": half}, {"w": {"saved_offsets": [0, 0]}})
    with pytest.raises(CorruptCheckpointError, match="different kinds"):
        read_manifest(str(tmp_path))


def test_missing_rank_files_are_named(tmp_path: Path) -> None:
    _two_ranks(tmp_path)
    (tmp_path / shard_name(1)).unlink()  # a lone shard-00001: the others are gone
    with pytest.raises(IncompleteCheckpointError) as e:
        read_manifest(str(tmp_path))
    assert shard_name(1) in str(e.value) and e.value.rank == 1
    _two_ranks(tmp_path)
    _write(tmp_path, 3, {"c": torch.ones(1)}, {"c": {"saved_offsets": [0]}})  # ranks 2 missing
    with pytest.raises(IncompleteCheckpointError) as e:
        read_manifest(str(tmp_path))
    assert shard_name(2) in str(e.value) and "rank 2 of at least 4" in str(e.value)


def test_shard_number_zero_is_refused(tmp_path: Path) -> None:
    _two_ranks(tmp_path)
    save_file({"w": torch.ones(1)}, str(tmp_path / "shard-00000-model-00001-of-00001.safetensors"))
    with pytest.raises(CorruptCheckpointError, match="shard number 00000"):
        read_manifest(str(tmp_path))


def test_a_huge_shard_number_names_a_few_missing_ranks(tmp_path: Path) -> None:
    """A name that claims rank 9,999,999 costs no list of ten million ranks."""
    _two_ranks(tmp_path)
    _write(tmp_path, 9_999_999, {"c": torch.ones(1)}, {"c": {"saved_offsets": [0]}})
    with pytest.raises(IncompleteCheckpointError) as e:
        read_manifest(str(tmp_path))
    message = str(e.value)
    assert "9999997 rank file(s) missing" in message and "17, ..." in message
