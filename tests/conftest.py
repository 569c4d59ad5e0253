"""Shared pytest setup: marker policy and a session cache of checkpoints produced by torch."""

from __future__ import annotations

import gc
import hashlib
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

#: the loopback S3 server and per-test buckets of the object-storage tests, the local Hub, and
#: the order in which files are dealt to the xdist workers (longest first)
pytest_plugins = ("tests.support.s3", "tests.support.hub_server", "tests.support.file_order")

# DeepSpeed's CPU engines JIT-build an op (deepspeed_shm_comm: ~130 s of both cores, in the first
# DeepSpeed test of a run) into torch's extensions directory, where it is kept under a key of its
# compile command, which names the venv's path: two clones of this repository on one machine (a
# CI run beside a working tree) rebuilt it for each other on every run. So one directory per
# venv; a directory chosen by whoever runs the tests is kept. (Set before any rank, zygote or
# fork server starts: they all take this process's environment.)
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
        "torch_extensions",
        "ckptools-tests-" + hashlib.sha256(sys.prefix.encode()).hexdigest()[:12],
    ),
)


#: The thread removing the temporary directories of earlier sessions (see pytest_sessionstart).
_old_basetemps: threading.Thread | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    """Remove the earlier sessions' temporary directories while this one runs, not after it.

    pytest keeps the last ``tmp_path_retention_count`` (3) sessions' directories and removes the
    older ones when the session finishes, after the last test: a run of this suite leaves ~8,300
    files (3.7 GiB), and on a disk mounted with ``discard`` (this project's machines) removing them
    took 6-10 s of wall time in which nothing else ran. The same removal, with pytest's own
    function and the same rule (locked directories of live sessions are kept), starts here in a
    thread of the controller (or the only process) and overlaps the tests; at the end pytest finds
    nothing left to remove. Where pytest's internals differ, pytest's own cleanup does it all.
    """
    global _old_basetemps
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: its directory is inside the controller's
    try:
        from _pytest.pathlib import LOCK_TIMEOUT, cleanup_numbered_dir

        factory = session.config._tmp_path_factory
        if factory._given_basetemp is not None:
            return  # --basetemp: pytest numbers and removes nothing
        keep = int(session.config.getini("tmp_path_retention_count"))
        if session.config.getini("tmp_path_retention_policy") != "all" or keep < 1:
            return
        basetemp = factory.getbasetemp()
    except (ImportError, AttributeError, ValueError):
        return
    _old_basetemps = threading.Thread(
        target=cleanup_numbered_dir,
        args=(basetemp.parent, "pytest-", keep, basetemp.stat().st_mtime - LOCK_TIMEOUT),
        name="remove-old-basetemps",
        daemon=True,
    )
    _old_basetemps.start()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if _old_basetemps is not None:
        _old_basetemps.join()  # before pytest's own cleanup looks at the same directories


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection made (torch, transformers and every test module: ~600k objects) out
    of the cyclic collector's reach (``gc.freeze()``).

    A worker then runs hundreds of tests, and each full collection walked that heap again:
    17 and 11 of them in the two workers of one run of ``tests/integration``, 4.8 and 3.1 s of
    CPU. What tests make afterwards is collected as before; only cycles among the modules
    imported at collection would never be freed, and they live as long as the process anyway.
    """
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    has_token = bool(os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"))
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if "hub" in item.keywords and not has_token:
            item.add_marker(pytest.mark.skip(reason="live Hub test: set HF_TOKEN to run"))


@pytest.fixture(autouse=True, scope="session")
def _user_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The user's cache directory (derived conversion rules) in a temporary directory: tests
    never write into the home of whoever runs them. Spawned ranks inherit it."""
    from ckptools.io.user_cache import CACHE_DIR_ENV

    before = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(tmp_path_factory.mktemp("user-cache"))
    yield
    if before is None:
        os.environ.pop(CACHE_DIR_ENV, None)
    else:
        os.environ[CACHE_DIR_ENV] = before


# Where producers write, named as the real tools name their output.
_OUT_NAMES = {"torchtitan": "checkpoint/step-2", "torch_save": "model.pt"}


class Produced:
    """A checkpoint written by a real torch producer, and the reference it gathered itself."""

    def __init__(self, path: Path, ref_path: Path) -> None:
        self.path = path
        self.ref_path = ref_path

    def reference(self) -> dict[str, Any]:
        import torch

        ref: dict[str, Any] = torch.load(self.ref_path, weights_only=True)
        return ref


#: the files whose bytes decide what ``produced`` writes (with the installed versions)
PRODUCER_SOURCES = (Path(__file__).parent / "support" / "producers.py",)


@pytest.fixture(scope="session")
def cached_output(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str, Sequence[Path], Callable[[Path], None]], Path]:
    """``cached_output(tag, sources, build)``: the directory ``build(directory)`` wrote, kept across
    sessions under a key of ``sources``' bytes and the installed versions (tests/support/cache.py).

    For producers that ``produced`` does not cover (DeepSpeed engines, the Trainer callback):
    ``sources`` must name every file whose code decides what ``build`` writes.
    """
    from tests.support import cache as producer_cache

    persistent = producer_cache.cache_root()
    fresh = tmp_path_factory.mktemp("outputs")

    def get(tag: str, sources: Sequence[Path], build: Callable[[Path], None]) -> Path:
        if persistent is None:
            root = fresh
        else:
            key = producer_cache.cache_key(sources, producer_cache.installed_versions())
            root = persistent / f"outputs-{key}"
        return producer_cache.cached_build(root, tag, build)

    return get


@pytest.fixture(scope="session")
def produced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Produced]]:
    """``produced("fsdp2", world_size=3, optimizer=True)``: made once, then shared.

    Outputs are kept across sessions (and shared by pytest-xdist workers) under
    ``tests/support/cache.py``'s directory, keyed by the producers' source and the installed
    versions; ``CKPTOOLS_TEST_CACHE=off`` makes them afresh in this session's temporary directory.
    Tests must not modify the returned checkpoint (copy it first to damage it); one that does
    only makes the next session rebuild it.
    """
    from tests.support import cache as producer_cache

    persistent = producer_cache.cache_root()
    if persistent is None:
        root = tmp_path_factory.mktemp("produced")
    else:
        key = producer_cache.cache_key(PRODUCER_SOURCES, producer_cache.installed_versions())
        root = persistent / f"produced-{key}"
        root.mkdir(parents=True, exist_ok=True)
        os.utime(root)  # in use: not stale
        producer_cache.prune_stale(persistent, keep=root.name)
    made: dict[tuple[str, tuple[tuple[str, Any], ...]], Produced] = {}

    def make(name: str, **opts: Any) -> Produced:
        key = (name, tuple(sorted(opts.items())))
        if key not in made:
            tag = "-".join([name, *(f"{k}={v}" for k, v in sorted(opts.items()))])
            out_name = _OUT_NAMES.get(name, "ckpt")

            def build(entry: Path) -> None:
                from tests.support.producers import produce

                produce(name, str(entry / out_name), str(entry / "reference.pt"), **opts)

            entry = producer_cache.cached_build(root, tag, build)
            made[key] = Produced(entry / out_name, entry / "reference.pt")
        return made[key]

    yield make
