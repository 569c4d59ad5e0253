"""This torch still reads, bit for bit, what the torch named in GENERATED_WITH.json wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.reference import assert_checkpoint_matches, load_reference, tensor_bytes

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.mark.parametrize("name", ["dcp_single", "fsdp2_ws2", "fsdp1_ws2"])
def test_dcp_fixture_loads_with_dcp(name: str) -> None:
    assert_checkpoint_matches(FIXTURES / name, load_reference(FIXTURES / f"{name}.reference.pt"))


def test_hf_sharded_fixture_loads_with_safetensors() -> None:
    from safetensors.torch import load_file

    ref = load_reference(FIXTURES / "hf_sharded.reference.pt")["model"]
    index = json.loads((FIXTURES / "hf_sharded" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ref)
    for shard in sorted(set(index["weight_map"].values())):
        for fqn, t in load_file(FIXTURES / "hf_sharded" / shard).items():
            assert index["weight_map"][fqn] == shard
            assert torch.equal(tensor_bytes(t), tensor_bytes(ref[fqn])), fqn


def test_torch_save_fixture_loads_weights_only() -> None:
    ref = load_reference(FIXTURES / "torch_save.reference.pt")["model"]
    sd = torch.load(FIXTURES / "torch_save" / "model.pt", weights_only=True)
    assert set(sd) == set(ref)
    for fqn, t in ref.items():
        assert torch.equal(tensor_bytes(sd[fqn]), tensor_bytes(t)), fqn
