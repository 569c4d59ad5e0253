"""Shared pytest setup: marker policy and a session cache of checkpoints produced by torch."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

#: the loopback S3 server and per-test buckets of the object-storage tests
pytest_plugins = ("tests.support.s3", "tests.support.hub_server")


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


@pytest.fixture(scope="session")
def produced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Produced]]:
    """``produced("fsdp2", world_size=3, optimizer=True)``: made once per session, then shared.

    Tests must not modify the returned checkpoint (copy it first to damage it).
    """
    cache: dict[tuple[str, tuple[tuple[str, Any], ...]], Produced] = {}
    root = tmp_path_factory.mktemp("produced")

    def make(name: str, **opts: Any) -> Produced:
        from tests.support.producers import produce

        key = (name, tuple(sorted(opts.items())))
        if key not in cache:
            tag = "-".join([name, *(f"{k}={v}" for k, v in sorted(opts.items()))])
            out = root / tag / _OUT_NAMES.get(name, "ckpt")
            ref = root / tag / "reference.pt"
            produce(name, str(out), str(ref), **opts)
            cache[key] = Produced(out, ref)
        return cache[key]

    yield make
