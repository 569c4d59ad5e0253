"""The storage facade's pure parts (URL recognition, path arithmetic, storage options scoping),
the local durability primitives (io/durable.py) and the choice of staging strategy.

The behaviour shared by every backend (local, ``memory://``, S3) is checked once for all of them
in ``tests/integration/test_storage_conformance.py``."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from ckptools.errors import UsageError
from ckptools.io import durable, staging, storage


@pytest.mark.parametrize(
    ("path", "url"),
    [
        ("s3://b/k", True),
        ("gs://b", True),
        ("memory://x/y", True),
        ("simplecache::s3://b/k", True),
        ("file:///tmp/x", False),
        ("/tmp/x", False),
        ("relative/dir", False),
    ],
)
def test_is_url(path: str, url: bool) -> None:
    assert storage.is_url(path) is url


def test_url_path_arithmetic() -> None:
    assert storage.join("s3://b/run/", "step-1", ".metadata") == "s3://b/run/step-1/.metadata"
    assert storage.join("s3://b", "x") == "s3://b/x"
    assert storage.join("", "x") == "x"
    assert storage.dirname("s3://b/run/step-1/") == "s3://b/run"
    assert storage.dirname("s3://b") == "s3://b"
    assert storage.basename("s3://b/run/step-1/") == "step-1"
    assert storage.protocol_of("simplecache::s3://b/k") == "s3"
    assert storage.protocol_of("/x") == "file"


def test_storage_options_scopes_merge_and_unwind() -> None:
    assert storage.options_for("s3") == {}
    with storage.storage_options('{"anon": true}'):
        assert storage.options_for("s3") == {"anon": True}
        with storage.storage_options({"s3": {"endpoint_url": "http://h"}, "gs": {"project": "p"}}):
            assert storage.options_for("s3") == {"anon": True, "endpoint_url": "http://h"}
            assert storage.options_for("gs") == {"anon": True, "project": "p"}
            # visible from other threads too: executors read through worker threads
            seen: list[dict[str, object]] = []
            t = threading.Thread(target=lambda: seen.append(storage.options_for("gs")))
            t.start()
            t.join()
            assert seen == [{"anon": True, "project": "p"}]
        assert storage.options_for("gs") == {"anon": True}
    assert storage.options_for("s3") == {}


@pytest.mark.parametrize("bad", ["not json", "[1, 2]", '"text"'])
def test_bad_storage_options_are_usage_errors(bad: str) -> None:
    with pytest.raises(UsageError), storage.storage_options(bad):
        pass


def test_accepts_storage_options_enters_the_scope() -> None:
    @storage.accepts_storage_options
    def probe(*, storage_options: storage.StorageOptions | None = None) -> dict[str, object]:
        return storage.options_for("s3")

    assert probe(storage_options={"key": "k"}) == {"key": "k"}
    assert probe() == {}
    assert storage.options_for("s3") == {}


def test_facade_reexports_the_split_modules() -> None:
    from ckptools.io import options, paths, readers

    assert storage.join is paths.join and storage.write_atomic is paths.write_atomic
    assert storage.storage_options is options.storage_options
    assert storage.LocalReader is readers.LocalReader and storage.open_reader is readers.open_reader
    assert set(storage.__all__) <= set(dir(storage))


def test_replace_synced_replaces_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = str(tmp_path / "journal.json")
    durable.replace_synced(path, b"first")
    durable.replace_synced(path, b"second, longer")
    assert (tmp_path / "journal.json").read_bytes() == b"second, longer"
    assert os.listdir(tmp_path) == ["journal.json"]


def test_replace_synced_failure_keeps_the_old_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "marker")
    durable.replace_synced(path, b"old")

    def no_rename(src: str, dst: str) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError, match="I/O error"):
        durable.replace_synced(path, b"new")
    assert (tmp_path / "marker").read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["marker"]  # the temporary file is removed


def test_write_synced_exclusive_refuses_an_existing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "index.json")
    durable.write_synced(path, b"{}", exclusive=True)
    with pytest.raises(FileExistsError):
        durable.write_synced(path, b"{}", exclusive=True)
    durable.write_synced(path, b"[]")
    assert (tmp_path / "index.json").read_bytes() == b"[]"


def test_fsync_dir_tolerates_filesystems_that_refuse_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fsync = os.fsync

    def refusing(fd: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", refusing)
    durable.fsync_dir(str(tmp_path))  # tolerated: nothing more durable to be had
    monkeypatch.setattr(os, "fsync", real_fsync)
    with pytest.raises(FileNotFoundError):
        durable.fsync_dir(str(tmp_path / "missing"))


def test_fsync_tree_syncs_every_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a").write_bytes(b"a")
    (tmp_path / "sub" / "b").write_bytes(b"b")
    synced: list[str] = []
    real = durable.fsync_file
    monkeypatch.setattr(durable, "fsync_file", lambda p: (synced.append(p), real(p)))
    durable.fsync_tree(str(tmp_path))
    assert sorted(os.path.relpath(p, tmp_path) for p in synced) == ["a", os.path.join("sub", "b")]


@pytest.mark.parametrize(
    ("out", "kind"),
    [
        ("/tmp/out", staging.LocalStaging),
        ("relative/out", staging.LocalStaging),
        ("file:///tmp/out", staging.LocalStaging),
        ("s3://bucket/out", staging.ObjectStoreStaging),
        ("memory://out", staging.ObjectStoreStaging),
    ],
)
def test_staging_strategy_is_chosen_by_location(out: str, kind: type) -> None:
    assert isinstance(staging.staging_for(out), kind)


def test_local_staging_names_siblings(tmp_path: Path) -> None:
    local = staging.staging_for(str(tmp_path))
    out = str(tmp_path / "model")
    tmp = local.location(out)
    assert os.path.dirname(tmp) == str(tmp_path) and os.path.basename(tmp).startswith("model.tmp-")
    assert local.location(out, ".tmp-step-3-ab") == str(tmp_path / ".tmp-step-3-ab")
    assert staging.staging_for("s3://b/run/step-3").location("s3://b/run/step-3/", "x") == (
        "s3://b/run/step-3"
    )
