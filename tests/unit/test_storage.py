"""storage.py's pure parts: URL recognition, path arithmetic, storage options scoping."""

from __future__ import annotations

import threading

import pytest

from ckptools.errors import UsageError
from ckptools.io import storage


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
