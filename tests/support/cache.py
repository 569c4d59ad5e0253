"""Producer outputs kept across test sessions, rebuilt whenever what made them changes.

Writing a checkpoint with a real producer (FSDP2 on gloo ranks, DeepSpeed engines, accelerate,
the Trainer) is most of what a distributed test costs, and the output depends only on the
producer's code and the installed versions of the libraries it runs. So each output is kept
under a directory named by a digest of exactly those (:func:`cache_key`): a re-run of the suite
reuses it, and a change to the producer's source or an upgrade of torch, transformers, DeepSpeed,
accelerate, peft or lightning lands in a new directory, which starts empty.

An entry is trusted only when it is complete and untouched: it is built in place while holding a
file lock (so two pytest-xdist workers never build the same one twice, nor read a half-built one),
and its ``.complete`` marker, written last, records every file's size and mtime. A missing marker
(a build that died) or a file that no longer matches it (a test that modified a shared checkpoint)
makes the entry be removed and built again.

Where: ``$CKPTOOLS_TEST_CACHE``, else ``$XDG_CACHE_HOME/ckptools-tests``, else
``~/.cache/ckptools-tests``. ``CKPTOOLS_TEST_CACHE=off`` builds every output afresh in the
session's temporary directory, as a fresh machine would.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from filelock import FileLock

__all__ = ["VERSIONED_PACKAGES", "cache_key", "cache_root", "cached_build", "installed_versions"]

#: the libraries whose version can change what a producer writes
VERSIONED_PACKAGES = (
    "torch",
    "transformers",
    "safetensors",
    "accelerate",
    "deepspeed",
    "peft",
    "lightning",
    "huggingface-hub",
)
_MARKER = ".complete"
# Key directories of older producer code or versions are removed once they have gone unused this
# long, so the cache does not grow without bound as the producers evolve.
_STALE_AFTER_S = 14 * 24 * 3600


def cache_root() -> Path | None:
    """Where outputs are kept across sessions; None when ``CKPTOOLS_TEST_CACHE=off``."""
    configured = os.environ.get("CKPTOOLS_TEST_CACHE")
    if configured == "off":
        return None
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "ckptools-tests"


def installed_versions(packages: Iterable[str] = VERSIONED_PACKAGES) -> dict[str, str]:
    """``{package: version}`` of what is installed (``"absent"`` for a missing one)."""
    found = {}
    for name in packages:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def cache_key(sources: Iterable[str | os.PathLike[str]], versions: Mapping[str, str]) -> str:
    """A digest of the producers' source files (their bytes) and the installed versions."""
    h = hashlib.sha256()
    h.update(f"python {sys.version_info[:2]}\n".encode())
    for name, version in sorted(versions.items()):
        h.update(f"{name}=={version}\n".encode())
    for src in sorted(os.fspath(s) for s in sources):
        h.update(os.path.basename(src).encode() + b"\0")
        h.update(Path(src).read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:20]


def _signature(entry: Path) -> list[list[object]]:
    rows: list[list[object]] = []
    for dirpath, _dirs, files in os.walk(entry):
        for name in files:
            path = Path(dirpath, name)
            if path == entry / _MARKER:
                continue
            st = path.stat()
            rows.append([str(path.relative_to(entry)), st.st_size, st.st_mtime_ns])
    return sorted(rows)


def _intact(entry: Path) -> bool:
    marker = entry / _MARKER
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return bool(recorded == _signature(entry))


def cached_build(key_dir: Path, tag: str, build: Callable[[Path], None]) -> Path:
    """The directory ``key_dir/tag``, made by ``build(directory)`` unless an intact one exists.

    ``build`` writes into the (empty) directory it is given. Returns that directory.
    """
    key_dir.mkdir(parents=True, exist_ok=True)
    entry = key_dir / tag
    if _intact(entry):
        return entry
    with FileLock(str(key_dir / f"{tag}.lock")):
        if _intact(entry):  # another worker built it while this one waited
            return entry
        shutil.rmtree(entry, ignore_errors=True)
        entry.mkdir()
        build(entry)
        (entry / _MARKER).write_text(json.dumps(_signature(entry)))
    return entry


def prune_stale(root: Path, keep: str) -> None:
    """Remove key directories other than ``keep`` that have not been used for two weeks."""
    if not root.is_dir():
        return
    now = time.time()
    for child in root.iterdir():
        if child.name == keep or not child.is_dir():
            continue
        try:
            if now - child.stat().st_mtime > _STALE_AFTER_S:
                shutil.rmtree(child, ignore_errors=True)
        except OSError:
            continue
