"""The installed transformers' version, which keys the conversion cache, read from its
``.dist-info`` directory's name (:mod:`ckptools.io.installed`): what ``importlib.metadata``
says, without importing it (tests/unit/test_megatron_startup.py: a consolidate never does)."""

from __future__ import annotations

from importlib import metadata

import pytest

from ckptools.io import installed


@pytest.mark.parametrize(
    ("dist", "module"),
    [("transformers", None), ("torch", None), ("huggingface-hub", "huggingface_hub"),
     ("typing-extensions", "typing_extensions")],  # the last: one module, asked of metadata
)  # fmt: skip
def test_version_is_what_importlib_metadata_says(dist: str, module: str | None) -> None:
    installed.version.cache_clear()
    assert installed.version(dist, module) == metadata.version(dist)


def test_a_missing_distribution_has_no_version() -> None:
    assert installed.version("ckptools-no-such-distribution") is None
