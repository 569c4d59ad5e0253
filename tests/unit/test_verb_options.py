"""One options object per verb: validated once, defaults in one place, built from the verbs'
keyword arguments (which the CLI passes)."""

from __future__ import annotations

import pytest

import ckptools
from ckptools.core.manifest import Chunk, Manifest, TensorEntry
from ckptools.core.sizes import parse_size
from ckptools.errors import UsageError
from ckptools.io import tunables
from ckptools.producers.base import read_marker
from ckptools.verbs.consolidate import (
    DEFAULT_MAX_SHARD_SIZE,
    ConsolidateOptions,
    ExportOptions,
    plan_export,
)
from ckptools.verbs.reshard import ReshardOptions


def test_consolidate_options_defaults_and_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tunables.WORKERS_ENV, raising=False)
    monkeypatch.delenv(tunables.MEMORY_BUDGET_ENV, raising=False)
    o = ConsolidateOptions()
    assert o.max_shard_bytes == parse_size(DEFAULT_MAX_SHARD_SIZE)
    assert o.worker_count == tunables.DEFAULT_WORKERS
    assert o.memory_budget_bytes == tunables.DEFAULT_MEMORY_BUDGET_BYTES
    monkeypatch.setenv(tunables.WORKERS_ENV, "3")
    assert ConsolidateOptions().worker_count == 3
    assert ConsolidateOptions(workers=1, memory_budget="1MiB").memory_budget_bytes == 2**20


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dtype": "int8"}, {"dtype": "nonsense"}, {"max_shard_size": "5XB"},
        {"max_shard_size": "0"}, {"workers": 0},
    ],
)  # fmt: skip
def test_consolidate_options_refuse_bad_values(kwargs: dict[str, object]) -> None:
    # the one line names the option it refuses ("size must be positive, got '0'" did not)
    (name,) = kwargs
    with pytest.raises(UsageError, match=name):
        ConsolidateOptions(**kwargs)  # type: ignore[arg-type]


def test_options_take_keywords_only() -> None:
    with pytest.raises(TypeError):
        ExportOptions("5GB")  # type: ignore[misc]
    with pytest.raises(TypeError):
        ReshardOptions(2)  # type: ignore[misc]


def test_reshard_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tunables.WORKERS_ENV, raising=False)
    o = ReshardOptions(world_size=4)
    assert (o.rank_state, o.prefix, o.worker_count) == ("keep", "model.", tunables.DEFAULT_WORKERS)
    with pytest.raises(UsageError, match="world size"):
        ReshardOptions(world_size=0)
    with pytest.raises(UsageError, match="rank_state"):
        ReshardOptions(world_size=2, rank_state="maybe")  # type: ignore[arg-type]


def test_verbs_validate_options_before_reading(tmp_path: object) -> None:
    # A bad option is reported as such, before the (missing) source is looked at.
    with pytest.raises(UsageError, match="--dtype"):
        ckptools.consolidate("/nonexistent/ck", "/nonexistent/out", dtype="int8")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="world size"):
        ckptools.reshard("/nonexistent/ck", "/nonexistent/out", world_size=0)


def _tied_manifest() -> Manifest:
    def entry(fqn: str) -> TensorEntry:
        chunk = Chunk(offsets=(0, 0), sizes=(8, 4), file=fqn, offset=0, length=128)
        return TensorEntry(fqn=fqn, dtype="float32", shape=(8, 4), chunks=(chunk,))

    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    return Manifest(
        root="ck", format="safetensors", layout="hf",
        tensors={n: entry(n) for n in names}, objects={}, files={},
    )  # fmt: skip


@pytest.mark.parametrize("tie", [True, False, None])
def test_plan_export_drops_the_output_embedding_when_the_config_ties_it(tie: bool | None) -> None:
    export = plan_export(_tied_manifest(), ExportOptions(max_shard_size=200), tie)
    assert export.candidates == (("lm_head.weight", "model.embed_tokens.weight"),)
    written = {t.name for t in export.plan.tensors}
    if tie:
        assert export.dropped == (("lm_head.weight", "model.embed_tokens.weight"),)
        assert "lm_head.weight" not in written and "lm_head.weight" not in export.names
    else:
        assert export.dropped == () and "lm_head.weight" in written
    assert (
        len(export.plan.files) == len(written) and export.plan.index is not None
    )  # 200-byte shards: one file per tensor, and an index


def test_read_marker_reads_peeked_bytes_once(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptools.io import storage

    reads: list[str] = []
    real = storage.read_bounded

    def counting(path: str, limit: int = storage.SMALL_FILE_LIMIT, *, what: str = "") -> bytes:
        reads.append(path)
        return real(path, limit, what=what)

    monkeypatch.setattr(storage, "read_bounded", counting)
    marker = f"{tmp_path}/marker"
    with open(marker, "wb") as f:
        f.write(b"abc")

    from ckptools.producers import base

    with base._markers_read_once():
        assert read_marker(marker, peek=True) == b"abc"
        assert read_marker(marker, peek=True) == b"abc"
        assert read_marker(marker) == b"abc"  # taken: the next read goes to storage again
        assert read_marker(marker) == b"abc"
    assert reads == [marker, marker]
    assert read_marker(marker, peek=True) == b"abc"  # outside read_manifest: nothing is kept
    assert len(reads) == 3
    with pytest.raises(FileNotFoundError):
        read_marker(f"{tmp_path}/missing")
