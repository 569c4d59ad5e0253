"""ckptools reads the checked-in fixtures (written by an earlier torch) bit-exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.checks import (
    assert_model_tensors_equal,
    assert_reads_match_reference,
    inspect_json,
)
from tests.support.reference import load_reference

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
CASES = [
    ("dcp_single", "dcp"),
    ("fsdp2_ws2", "dcp"),
    ("fsdp1_ws2", "dcp"),
    ("hf_sharded", "safetensors"),
    ("torch_save", "torch_save"),
]


@pytest.mark.parametrize(("name", "fmt"), CASES)
def test_fixture_reads_bit_exactly(name: str, fmt: str) -> None:
    path = FIXTURES / name
    if fmt == "torch_save":
        path = next(path.glob("*.pt"))
    ref_path = FIXTURES / f"{name}.reference.pt"
    assert inspect_json(path)["format"] == fmt
    if fmt == "dcp":
        assert assert_reads_match_reference(path, ref_path) > 0
    else:
        assert_model_tensors_equal(path, load_reference(ref_path)["model"])
