"""plan/training: values split into DCP entries exactly as torch's own flatten_state_dict splits
them (the keys `dcp.load` looks up), and plain values stored as torch.save archives that
torch.load reads back."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from ckptools.formats.torch_archive import object_archive
from ckptools.plan.training import _leaves

VALUES: list[Any] = [
    0.001,
    (0.9, 0.999),
    [1, 2, 3],
    ["a.weight", "b.bias"],
    [{"lr": 0.1, "params": ["x"]}, {"lr": 0.2, "params": ["y"], "betas": (0.9, 0.95)}],
    {"a": {"b": [1, [2, {"c": 3}]]}, "d": None},
    [[1, 2], [3]],
    [],
    {},
    {"x": []},
]


@pytest.mark.parametrize("value", VALUES)
def test_leaves_are_torch_flatten_state_dict(value: Any) -> None:
    flat, mapping = flatten_state_dict({"optim": {"v": value}})
    ours = {".".join(path): leaf for path, leaf in _leaves(("optim", "v"), value)}
    assert ours == flat
    for fqn, path in mapping.items():
        assert tuple(str(p) for p in path) == tuple(fqn.split("."))


@pytest.mark.parametrize("value", [*VALUES, "s", None, True, 10**30, b"raw", -0.0])
def test_object_archive_is_what_torch_load_reads(value: Any) -> None:
    got = torch.load(io.BytesIO(object_archive(value)), weights_only=True)
    assert got == value and type(got) is type(value)


def test_object_archive_refuses_what_is_not_plain() -> None:
    with pytest.raises(TypeError, match="not a plain value"):
        object_archive({"t": torch.zeros(1)})
    with pytest.raises(TypeError, match="not a plain value"):
        object_archive([object()])
