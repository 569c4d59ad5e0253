"""One storage contract, three backends: a local directory, ``memory://`` and S3 (moto on loopback).

The same tests run on each (fsspec's own approach: a few primitives, one conformance suite), so a
behaviour the layouts, verify, list/prune and the writers rely on cannot hold on a disk and
silently differ on an object store. Truth is what the test wrote, read back through the backend's
own client where it matters (``os`` for local paths, fsspec for URLs).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from ckptools.errors import CheckpointNotFoundError, CorruptCheckpointError, UsageError
from ckptools.io import out_rules, staging, storage
from ckptools.io.resume import Journal

BACKENDS = ["local", "memory", "s3"]
MARKER = ".ckptools-complete"


@pytest.fixture(params=BACKENDS)
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty directory or prefix on one backend."""
    if request.param == "local":
        path = tmp_path / "root"
        path.mkdir()
        yield str(path)
    elif request.param == "memory":
        url = f"memory://conformance-{uuid.uuid4().hex[:8]}"
        yield url
        fs = fsspec.filesystem("memory")
        inner = url.removeprefix("memory://")
        if fs.exists(inner):
            fs.rm(inner, recursive=True)
    else:
        yield f"{request.getfixturevalue('s3_bucket')}/root"


def _put(root: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = storage.join(root, rel)
        storage.makedirs(storage.dirname(path))
        storage.write_bytes(path, data)


# --------------------------------------------------------------------------------------------------
# Path primitives
# --------------------------------------------------------------------------------------------------


def test_write_read_exists(root: str) -> None:
    path = storage.join(root, "a.bin")
    assert not storage.exists(path)
    storage.write_bytes(path, b"hello")
    assert storage.exists(path) and storage.lexists(path)
    assert storage.isfile(path) and not storage.isdir(path)
    assert storage.read_bytes(path) == b"hello"
    assert storage.size(path) == 5
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(storage.join(root, "missing"))


def test_write_atomic_replaces(root: str) -> None:
    path = storage.join(root, "index.json")
    storage.write_atomic(path, b"old")
    storage.write_atomic(path, b"new content")
    assert storage.read_bytes(path) == b"new content"
    assert storage.listdir(root) == ["index.json"]  # no temporary file left beside it


def test_listdir_walk_and_sizes(root: str) -> None:
    _put(root, {"a": b"1", "b": b"22", "sub/c": b"333", "sub/deep/d": b"4444"})
    assert sorted(storage.listdir(root)) == ["a", "b", "sub"]
    assert storage.isdir(storage.join(root, "sub"))
    assert storage.walk_files(root) == {"a": 1, "b": 2, "sub/c": 3, "sub/deep/d": 4}
    assert storage.file_sizes(root) == {"a": 1, "b": 2}
    assert storage.file_sizes(root, ["b", "missing"]) == {"b": 2}
    assert storage.file_sizes(root, ["a", "sub/c", "sub/nope"]) == {"a": 1, "sub/c": 3}
    with pytest.raises(FileNotFoundError):
        storage.listdir(storage.join(root, "nowhere"))
    assert storage.file_sizes(storage.join(root, "nowhere")) == {}


def test_read_range(root: str) -> None:
    data = bytes(range(256)) * 4
    _put(root, {"f": data})
    path = storage.join(root, "f")
    assert storage.read_range(path, 10, 20) == data[10:30]
    assert storage.read_range(path, len(data) - 4, 100) == data[-4:]  # fewer at the end


def test_remove_and_remove_tree(root: str) -> None:
    _put(root, {"keep": b"k", "x": b"x", "tree/a": b"a", "tree/sub/b": b"b"})
    storage.remove(storage.join(root, "x"))
    storage.remove(storage.join(root, "x"))  # missing is fine
    assert not storage.exists(storage.join(root, "x"))
    storage.remove_tree(storage.join(root, "tree"))
    storage.remove_tree(storage.join(root, "tree"))  # missing is fine
    assert storage.walk_files(root) == {"keep": 1}


def test_get_and_put_file(root: str, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(b"payload" * 100)
    url = storage.join(root, "up.bin")
    storage.put_file(str(src), url)
    back = tmp_path / "back.bin"
    storage.get_file(url, str(back))
    assert back.read_bytes() == src.read_bytes()


def test_path_arithmetic(root: str) -> None:
    path = storage.join(root, "step-1", ".metadata")
    assert storage.basename(path) == ".metadata"
    assert storage.dirname(path) == storage.join(root, "step-1")
    assert storage.dirname(storage.dirname(path)).rstrip("/") == root.rstrip("/")


# --------------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------------


def test_reader_reads_exact_ranges(root: str) -> None:
    data = os.urandom(100_000)
    _put(root, {"r/0.distcp": data})
    with storage.open_reader(root) as reader:
        assert reader.size("r/0.distcp") == len(data)
        assert reader.read("r/0.distcp", 0, len(data)) == data
        assert reader.read("r/0.distcp", 12_345, 7) == data[12_345:12_352]
        buf = bytearray(1000)
        reader.readinto("r/0.distcp", 500, memoryview(buf))
        assert bytes(buf) == data[500:1500]
        reader.prefetch("r/0.distcp", [(0, 64), (len(data) - 64, 64)])
        assert reader.read("r/0.distcp", len(data) - 10, 10) == data[-10:]


def test_reader_short_read_names_the_file(root: str) -> None:
    _put(root, {"short.bin": b"x" * 100})
    with storage.open_reader(root) as reader:
        with pytest.raises(CorruptCheckpointError, match=r"short\.bin.*truncated") as info:
            reader.read("short.bin", 90, 20)
        assert "short.bin" in str(info.value.path)
        with pytest.raises(CorruptCheckpointError, match=r"short\.bin"):
            reader.readinto("short.bin", 50, memoryview(bytearray(60)))


def test_reader_missing_file_names_it(root: str) -> None:
    _put(root, {"present": b"1"})
    with (
        storage.open_reader(root) as reader,
        pytest.raises(CheckpointNotFoundError, match=r"gone\.distcp.*missing"),
    ):
        reader.read("gone.distcp", 0, 1)


# --------------------------------------------------------------------------------------------------
# Staging: a committed output is whole, anything else never looks complete
# --------------------------------------------------------------------------------------------------


def _write_output(tmp: str, files: dict[str, bytes]) -> None:
    """A writer: data files, then the marker last."""
    _put(tmp, files)
    storage.write_bytes(storage.join(tmp, MARKER), b"{}")


def _leftovers(root: str, out: str) -> list[str]:
    """What a write left beside or inside ``out`` that is not the output itself."""
    names = [n for n in storage.listdir(root) if n != storage.basename(out)]
    if storage.exists(out):
        names += [n for n in storage.walk_files(out) if n == staging.IN_PROGRESS]
    return names


def test_committed_output_has_marker_and_all_files(root: str) -> None:
    out = storage.join(root, "out")
    files = {"a.safetensors": b"a" * 10, "sub/b.bin": b"b" * 20}
    with staging.output_dir(out) as tmp:
        _write_output(tmp, files)
    assert storage.walk_files(out) == {MARKER: 2, "a.safetensors": 10, "sub/b.bin": 20}
    assert _leftovers(root, out) == []


def test_failed_write_leaves_nothing_complete(root: str) -> None:
    out = storage.join(root, "out")
    with pytest.raises(RuntimeError, match="disk full"), staging.output_dir(out) as tmp:
        _put(tmp, {"a.safetensors": b"a" * 10})
        raise RuntimeError("disk full")
    assert not storage.exists(storage.join(out, MARKER))
    assert storage.walk_files(root) == {}  # the staging location went with it


def test_interrupted_write_is_incomplete_and_cleared_by_the_next(root: str) -> None:
    out = storage.join(root, "out")
    out_rules.check_out(out, kind="dcp", overwrite=False)
    tmp = staging.make_tmp_dir(out)
    _put(tmp, {"a.safetensors": b"half"})  # killed here: no marker, no discard
    assert not storage.exists(storage.join(out, MARKER))
    # what we left does not block the next run
    out_rules.check_out(out, kind="dcp", overwrite=False)
    with staging.output_dir(out) as again:
        _write_output(again, {"b.safetensors": b"whole"})
    assert storage.walk_files(out) == {MARKER: 2, "b.safetensors": 5}


def test_overwrite_rules(root: str) -> None:
    out = storage.join(root, "out")
    with staging.output_dir(out) as tmp:
        _write_output(tmp, {"old.bin": b"old"})
    with pytest.raises(UsageError, match="overwrite"):
        out_rules.check_out(out, kind="dcp", overwrite=False)
    with staging.output_dir(out, overwrite=True) as tmp:
        _write_output(tmp, {"new.bin": b"new!"})
    assert storage.walk_files(out) == {MARKER: 2, "new.bin": 4}  # nothing of the old one
    assert _leftovers(root, out) == []


def test_foreign_content_is_refused_without_overwrite(root: str) -> None:
    out = storage.join(root, "out")
    _put(out, {"notes.txt": b"mine"})
    with pytest.raises(UsageError, match="overwrite"):
        out_rules.check_out(out, kind="dcp", overwrite=False)
    assert storage.walk_files(out) == {"notes.txt": 4}


def test_delete_removes_a_committed_output(root: str) -> None:
    out = storage.join(root, "out")
    with staging.output_dir(out) as tmp:
        _write_output(tmp, {"a.bin": b"a", "sub/b.bin": b"b"})
    staging.staging_for(out).delete(out)
    assert not storage.exists(storage.join(out, MARKER))
    assert storage.walk_files(root) == {}


def test_resume_reuses_the_same_conversions_staging(root: str) -> None:
    out = storage.join(root, "out")
    out_rules.check_out(out, kind="dcp", overwrite=False)
    tmp = staging.resumable_staging(out, "fp-1")
    _put(tmp, {"shard-1.bin": b"done"})
    Journal.open(tmp, "fp-1").record("shard-1.bin", size=4)
    staging.discard(tmp, KeyboardInterrupt())  # Ctrl-C: the journaled files are kept
    assert storage.read_bytes(storage.join(tmp, "shard-1.bin")) == b"done"
    assert not storage.exists(storage.join(out, MARKER))

    again = staging.resumable_staging(out, "fp-1")
    assert again == tmp
    journal = Journal.open(again, "fp-1")
    assert journal.resumed and journal.is_done("shard-1.bin")
    journal.discard()
    storage.write_bytes(storage.join(again, MARKER), b"{}")
    staging.fsync_dir(again)
    staging.commit(again, out, overwrite=False)
    assert storage.walk_files(out) == {MARKER: 2, "shard-1.bin": 4}
    assert _leftovers(root, out) == []


def test_resume_ignores_another_conversions_staging(root: str) -> None:
    out = storage.join(root, "out")
    tmp = staging.resumable_staging(out, "fp-1")
    _put(tmp, {"shard-1.bin": b"done"})
    Journal.open(tmp, "fp-1").record("shard-1.bin", size=4)
    staging.discard(tmp, KeyboardInterrupt())

    other = staging.resumable_staging(out, "fp-2")
    assert not Journal.open(other, "fp-2").resumed
    assert not storage.exists(storage.join(other, "shard-1.bin")) or other != tmp
    staging.discard(other)
    staging.discard(tmp)
    assert storage.walk_files(root) == {}


def test_discard_without_journal_removes_even_on_interrupt(root: str) -> None:
    out = storage.join(root, "out")
    tmp = staging.make_tmp_dir(out)
    _put(tmp, {"a.bin": b"a"})
    staging.discard(tmp, KeyboardInterrupt())
    assert storage.walk_files(root) == {}
