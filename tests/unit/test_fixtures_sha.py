"""The checked-in fixtures are exactly what ``fixtures/generate.py`` wrote and froze."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
SUMS = FIXTURES / "SHA256SUMS"
NOT_FIXTURES = {"SHA256SUMS", "generate.py", "README.md", "verl/generate.py"}
MAX_DIR_BYTES = 100 * 1024


def _listed() -> dict[str, str]:
    listed: dict[str, str] = {}
    for line in SUMS.read_text().splitlines():
        digest, _, rel = line.partition("  ")
        assert len(digest) == 64 and rel, f"malformed SHA256SUMS line: {line!r}"
        assert rel not in listed, f"{rel} listed twice"
        listed[rel] = digest
    return listed


def _on_disk() -> set[str]:
    found = set()
    for dirpath, dirs, files in os.walk(FIXTURES):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if Path(dirpath) == FIXTURES:
            # written by Megatron, and by Orbax, in a venv of their own, each with its own
            # SHA256SUMS (tests/unit/test_megatron_fixtures.py, tests/integration/test_orbax.py)
            dirs[:] = [d for d in dirs if d not in ("megatron", "orbax")]
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), FIXTURES).replace(os.sep, "/")
            if rel not in NOT_FIXTURES and not name.endswith(".pyc"):
                found.add(rel)
    return found


@pytest.mark.parametrize("rel", sorted(_listed()))
def test_listed_file_matches_its_sha256(rel: str) -> None:
    path = FIXTURES / rel
    assert path.is_file(), f"fixtures/{rel} is listed in SHA256SUMS but missing"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == _listed()[rel], (
        f"fixtures/{rel} changed; fixtures freeze what an older torch wrote: restore it, or "
        "regenerate on purpose with `python fixtures/generate.py`"
    )


def test_every_fixture_file_is_listed() -> None:
    unlisted = sorted(_on_disk() - set(_listed()))
    assert not unlisted, f"not in fixtures/SHA256SUMS: {unlisted}; rerun fixtures/generate.py"


def test_every_fixture_has_its_reference_and_stays_small() -> None:
    listed = set(_listed())
    for name in ("dcp_single", "fsdp2_ws2", "fsdp1_ws2", "hf_sharded", "torch_save"):
        assert f"{name}.reference.pt" in listed, name
        size = sum(f.stat().st_size for f in (FIXTURES / name).rglob("*") if f.is_file())
        assert 0 < size < MAX_DIR_BYTES, f"fixtures/{name} is {size} bytes"
