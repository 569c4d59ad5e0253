"""The producer cache (tests/support/cache.py) reuses an output only while its makers are unchanged.

Each test drives ``cached_build`` as ``conftest.produced`` does, with the real key derivation over a
copy of the real producer module, and counts how often the builder runs.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from tests.conftest import PRODUCER_SOURCES
from tests.support import cache


class _Builder:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, entry: Path) -> None:
        self.calls += 1
        (entry / "ckpt").mkdir()
        (entry / "ckpt" / "__0_0.distcp").write_bytes(b"x" * 64)
        (entry / "reference.pt").write_bytes(b"ref")


def _key_dir(tmp_path: Path, source: Path, versions: dict[str, str]) -> Path:
    return tmp_path / f"produced-{cache.cache_key([source], versions)}"


@pytest.fixture
def source(tmp_path: Path) -> Path:
    copy = tmp_path / "producers.py"
    shutil.copyfile(PRODUCER_SOURCES[0], copy)
    return copy


def test_a_second_session_reuses_the_output(tmp_path: Path, source: Path) -> None:
    versions = cache.installed_versions()
    build = _Builder()
    first = cache.cached_build(_key_dir(tmp_path, source, versions), "fsdp2", build)
    again = cache.cached_build(_key_dir(tmp_path, source, versions), "fsdp2", build)
    assert first == again and build.calls == 1
    assert (again / "ckpt" / "__0_0.distcp").read_bytes() == b"x" * 64


def test_a_changed_producer_source_is_rebuilt(tmp_path: Path, source: Path) -> None:
    versions = cache.installed_versions()
    build = _Builder()
    before = _key_dir(tmp_path, source, versions)
    cache.cached_build(before, "fsdp2", build)
    source.write_text(source.read_text() + "\n# a producer changed\n")
    after = _key_dir(tmp_path, source, versions)
    assert after != before
    cache.cached_build(after, "fsdp2", build)
    assert build.calls == 2


@pytest.mark.parametrize("package", ["torch", "transformers", "deepspeed"])
def test_a_changed_version_is_rebuilt(tmp_path: Path, source: Path, package: str) -> None:
    versions = cache.installed_versions()
    build = _Builder()
    cache.cached_build(_key_dir(tmp_path, source, versions), "fsdp2", build)
    bumped = {**versions, package: versions[package] + ".post1"}
    assert _key_dir(tmp_path, source, bumped) != _key_dir(tmp_path, source, versions)
    cache.cached_build(_key_dir(tmp_path, source, bumped), "fsdp2", build)
    assert build.calls == 2


def test_an_interrupted_build_is_not_trusted(tmp_path: Path, source: Path) -> None:
    key_dir = _key_dir(tmp_path, source, cache.installed_versions())

    def dies(entry: Path) -> None:
        (entry / "half").write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cache.cached_build(key_dir, "fsdp2", dies)
    build = _Builder()
    entry = cache.cached_build(key_dir, "fsdp2", build)
    assert build.calls == 1 and not (entry / "half").exists()


@pytest.mark.parametrize("damage", ["modified", "removed", "added"])
def test_a_touched_output_is_rebuilt(tmp_path: Path, source: Path, damage: str) -> None:
    key_dir = _key_dir(tmp_path, source, cache.installed_versions())
    build = _Builder()
    entry = cache.cached_build(key_dir, "fsdp2", build)
    shard = entry / "ckpt" / "__0_0.distcp"
    if damage == "modified":
        shard.write_bytes(b"y" * 63)
    elif damage == "removed":
        shard.unlink()
    else:
        (entry / "ckpt" / "extra").write_bytes(b"")
    cache.cached_build(key_dir, "fsdp2", build)
    assert build.calls == 2 and shard.read_bytes() == b"x" * 64


def test_concurrent_workers_build_once(tmp_path: Path, source: Path) -> None:
    key_dir = _key_dir(tmp_path, source, cache.installed_versions())
    build = _Builder()
    seen: list[Path] = []
    threads = [
        threading.Thread(target=lambda: seen.append(cache.cached_build(key_dir, "t", build)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert build.calls == 1 and len(set(seen)) == 1


def test_off_and_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CKPTOOLS_TEST_CACHE", "off")
    assert cache.cache_root() is None
    monkeypatch.setenv("CKPTOOLS_TEST_CACHE", str(tmp_path))
    assert cache.cache_root() == tmp_path
    monkeypatch.delenv("CKPTOOLS_TEST_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "ckptools-tests"


def test_stale_keys_are_pruned(tmp_path: Path) -> None:
    old, current = tmp_path / "produced-old", tmp_path / "produced-new"
    old.mkdir()
    current.mkdir()
    os.utime(old, (0, 0))
    os.utime(current, (0, 0))
    cache.prune_stale(tmp_path, keep=current.name)
    assert not old.exists() and current.exists()
