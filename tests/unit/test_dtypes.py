"""The torch-free dtype table agrees with torch itself."""

from __future__ import annotations

import pytest
import torch

from ckptools.core import dtypes


@pytest.mark.parametrize("name", sorted(dtypes.BY_NAME))
def test_itemsize_and_floating_match_torch(name: str) -> None:
    dt = getattr(torch, name, None)
    if dt is None:
        pytest.skip(f"torch {torch.__version__} has no {name}")
    entry = dtypes.dtype(name)
    assert entry.itemsize == torch.empty(0, dtype=dt).element_size()
    if not name.startswith("q"):
        assert entry.is_floating == dt.is_floating_point


def test_aliases() -> None:
    assert dtypes.canonical("half") == "float16"
    assert dtypes.canonical("long") == "int64"
