"""The source is read once: ``consolidate`` and ``reshard`` open each ``.metadata`` of the source
exactly one time (at 878k chunks a parse costs ~6 s), whatever the layout around it.

Truth: every ``open``/``os.open`` of the process, counted while the command runs.
"""

from __future__ import annotations

import builtins
import io
import os
import shutil
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptools
from tests.conftest import Produced


@contextmanager
def _metadata_opens(monkeypatch: pytest.MonkeyPatch, root: Path) -> Iterator[Counter[str]]:
    """Count the opens of every ``.metadata`` below ``root`` (path relative to root -> opens)."""
    counts: Counter[str] = Counter()
    base = os.path.realpath(root) + os.sep
    real_open, real_os_open = builtins.open, os.open

    def note(file: Any) -> None:
        if isinstance(file, str | os.PathLike):
            path = os.path.realpath(os.fspath(file))
            if path.startswith(base) and path.endswith(".metadata"):
                counts[os.path.relpath(path, base)] += 1

    def counting_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        note(file)
        return real_open(file, *args, **kwargs)

    def counting_os_open(path: Any, *args: Any, **kwargs: Any) -> int:
        note(path)
        return real_os_open(path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", counting_open)
        m.setattr(io, "open", counting_open)
        m.setattr(os, "open", counting_os_open)
        yield counts


def _save(state: dict[str, Any], out: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(out), no_dist=True)


def _accelerate_style(root: Path) -> Path:
    """What accelerate's ``save_state`` writes for FSDP ``SHARDED_STATE_DICT``: a model and an
    optimizer DCP directory, and files beside them."""
    weight = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    _save({"model": {"w": weight, "b": torch.ones(6)}}, root / "pytorch_model_fsdp_0")
    _save({"optimizer": {"state": {"w": {"exp_avg": weight * 2}}}}, root / "optimizer_0")
    (root / "random_states_0.pkl").write_bytes(b"rng")
    (root / "scheduler.bin").write_bytes(b"sched")
    return root


@pytest.fixture
def sources(produced: Callable[..., Produced], tmp_path: Path) -> dict[str, tuple[Path, set[str]]]:
    """name -> (checkpoint, its .metadata files relative to it)."""
    plain = tmp_path / "src" / "plain"
    shutil.copytree(produced("single").path, plain)
    # named like a torchtitan step: that layout's probe looks inside .metadata first
    step = tmp_path / "src" / "step-5"
    shutil.copytree(produced("single").path, step)
    accelerate = _accelerate_style(tmp_path / "src" / "accelerate")
    return {
        "dcp": (plain, {".metadata"}),
        "dcp named step-N": (step, {".metadata"}),
        "accelerate": (
            accelerate,
            {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"},
        ),
    }


@pytest.mark.parametrize("name", ["dcp", "dcp named step-N", "accelerate"])
def test_consolidate_opens_each_metadata_once(
    sources: dict[str, tuple[Path, set[str]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
) -> None:
    src, markers = sources[name]
    with _metadata_opens(monkeypatch, src) as opens:
        ckptools.consolidate(
            str(src), str(tmp_path / "hf"), quiet=True, distributed=False, weights_only=True
        )
    # consolidate reads the model part only, but detection and the manifest cover every part
    assert dict(opens) == dict.fromkeys(markers, 1)


@pytest.mark.parametrize("name", ["dcp", "dcp named step-N", "accelerate"])
def test_reshard_opens_each_metadata_once(
    sources: dict[str, tuple[Path, set[str]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
) -> None:
    src, markers = sources[name]
    out = tmp_path / "resharded"
    with _metadata_opens(monkeypatch, src) as opens:
        result = ckptools.reshard(str(src), str(out), world_size=3, quiet=True, distributed=False)
    assert dict(opens) == dict.fromkeys(markers, 1)
    assert set(result.parts) == {os.path.dirname(m) for m in markers}
    if name == "accelerate":
        # the files beside the DCP data come from the layout's one walk, and are copied
        assert sorted(result.copied_files) == ["random_states_0.pkl", "scheduler.bin"]
        assert (out / "scheduler.bin").read_bytes() == b"sched"
    reread = ckptools.read_manifest(str(out))
    assert reread.world_size == 3
    assert set(reread.tensors) == set(ckptools.read_manifest(str(src)).tensors)
