"""ckptools reads checkpoints written by every distributed producer exactly as torch does.

For each producer (real ranks on gloo): ``ckpt inspect --json`` agrees with torch's own
``read_metadata`` (keys, dtypes, shapes, chunk boxes, byte locations), the detected layout is the
producer's, and every tensor assembled from chunks and every decoded object equals, bit for bit,
what the producer gathered with torch itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import Produced
from tests.support.checks import (
    assert_inspect_agrees_with_torch_metadata,
    assert_reads_match_reference,
    inspect_json,
)
from tests.support.reference import expected_checkpoints, load_reference

pytestmark = pytest.mark.distributed

CASES: list[tuple[str, dict[str, Any], str, str]] = [
    # producer, options, expected layout, expected model prefix
    ("fsdp2", {"world_size": 3, "optimizer": True, "extra": True}, "dcp", "model."),
    ("fsdp2", {"world_size": 2, "nested_app": True, "optimizer": True}, "dcp", "app.model."),
    ("fsdp2", {"world_size": 4, "tied": True}, "dcp", "model."),
    ("fsdp1", {"world_size": 2, "optimizer": True}, "dcp", "model."),
    ("hsdp", {}, "dcp", "model."),
    ("tp_fsdp", {}, "dcp", "model."),
    ("accelerate", {}, "accelerate", "model."),
    ("trainer", {}, "trainer", "model."),
    ("lightning", {}, "lightning", "model."),
    ("torchtitan", {}, "torchtitan", ""),
]


@pytest.mark.parametrize(
    ("name", "opts", "layout", "prefix"),
    CASES,
    ids=[f"{c[0]}-{'-'.join(f'{k}={v}' for k, v in c[1].items())}" for c in CASES],
)
def test_reads_like_torch(
    produced: Callable[..., Produced], name: str, opts: dict[str, Any], layout: str, prefix: str
) -> None:
    p = produced(name, **opts)
    subdirs = sorted(expected_checkpoints(load_reference(p.ref_path)))
    assert_inspect_agrees_with_torch_metadata(p.path, subdirs)
    report = inspect_json(p.path)
    assert report["layout"] == layout
    assert report["model_part"]["prefix"] == prefix
    assert report["model_part"]["tensors"] > 0
    if "world_size" in opts:
        assert report["world_size"] == opts["world_size"]
    assert assert_reads_match_reference(p.path, p.ref_path) > 0


def test_fsdp2_uneven_and_empty_shards(produced: Callable[..., Produced]) -> None:
    p = produced("fsdp2", world_size=4, tied=True)
    report = inspect_json(p.path)
    # k/v projections have 2 rows: over 4 ranks two ranks hold empty shards, which FSDP2 does not
    # store, so those tensors have fewer chunks than ranks.
    kv = [t for t in report["tensors"] if t["fqn"].endswith("k_proj.weight")]
    assert kv and all(t["chunks"] < 4 for t in kv)
    assert any(t["chunks"] == 4 for t in report["tensors"])


def test_torchtitan_checkpoint_folder_resolves_to_newest_step(
    produced: Callable[..., Produced],
) -> None:
    p = produced("torchtitan")
    report = inspect_json(p.path.parent)
    assert report["layout"] == "torchtitan"
    assert report["path"].endswith("step-2")
    # the folder holds one save, and the note says which one was read and why
    assert any("using step-2, the only checkpoint there" in n for n in report["notes"]), report
