"""``--tag``: every verb that reads a checkpoint reads a DeepSpeed tag other than the one
``latest`` names, from the run directory DeepSpeed itself wrote (two saves, ``global_step1``
and ``global_step2``; ``latest`` names the second), checked against DeepSpeed's own converter
run on that tag."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckptools.cli.main import cli
from tests.support.deepspeed_producers import (
    EARLIER_TAG,
    TAG,
    case_dir,
    deepspeed_available,
    produce_zero,
)

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.deepspeed,
    pytest.mark.skipif(
        not deepspeed_available(), reason="DeepSpeed is not installed (make setup installs it)"
    ),
]


@pytest.fixture(scope="module")
def run_dir(cached_output: Callable[..., Path]) -> str:
    """A ZeRO-2 run saved at two tags (made once, kept across runs; the tests only read it)."""
    from tests.support import deepspeed_producers as ds

    root = cached_output(
        "zero2-two-tags",
        [Path(ds.__file__)],
        lambda d: produce_zero(str(d), 2, [(2, "fp32")], earlier_tag=True),
    )
    return case_dir(str(root), 2, "fp32")


def _ckpt(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def _tensors(out: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for f in sorted(glob.glob(str(out / "*.safetensors"))):
        tensors.update(load_file(f))
    return tensors


def test_consolidate_reads_the_tag_asked_for(run_dir: str, tmp_path: Path) -> None:
    import torch

    out = tmp_path / "hf"
    code, _, err = _ckpt(
        "consolidate", run_dir, str(out), "--tag", EARLIER_TAG, "-q", "--weights-only"
    )
    assert code == 0, err
    ours = _tensors(out)
    theirs = torch.load(os.path.join(run_dir, f"zero_to_fp32-{EARLIER_TAG}.pt"), weights_only=True)
    latest = torch.load(os.path.join(run_dir, "zero_to_fp32.pt"), weights_only=True)
    assert theirs
    for name, want in theirs.items():
        assert torch.equal(ours[name], want), name
    # the two saves differ: without --tag the other one would have been read
    assert any(not torch.equal(theirs[n], latest[n]) for n in theirs)


@pytest.mark.parametrize(
    "verb", [["inspect"], ["verify", "--quick"], ["diff", "--tag-a"], ["reshard"]]
)
def test_every_reading_verb_takes_it(verb: list[str], run_dir: str, tmp_path: Path) -> None:
    if verb[0] == "diff":  # the earlier save against itself, read as a tag directory
        args = ["diff", run_dir, os.path.join(run_dir, EARLIER_TAG), "--tag-a", EARLIER_TAG]
    elif verb[0] == "reshard":
        args = ["reshard", run_dir, str(tmp_path / "dcp"), "--world-size", "3", "--tag",
                EARLIER_TAG]  # fmt: skip
    else:
        args = [*verb, run_dir, "--tag", EARLIER_TAG]
    code, out, err = _ckpt(*args, "--json")
    assert code == 0, err
    assert EARLIER_TAG in json.dumps(json.loads(out))


def test_a_wrong_tag_lists_the_saves_in_one_line(run_dir: str) -> None:
    code, _, err = _ckpt("inspect", run_dir, "--tag", "global_step7")
    assert code == 1
    assert err.splitlines() == [
        f"error: {run_dir}: no save 'global_step7'; --tag takes one of: {EARLIER_TAG}, {TAG} "
        f"('latest' names {TAG})"
    ]
    code, _, err = _ckpt("inspect", os.path.join(run_dir, TAG), "--tag", EARLIER_TAG)
    assert code == 2
    assert "is a DeepSpeed tag directory itself: drop --tag" in err


def test_list_shows_the_tags_and_which_latest_names(run_dir: str) -> None:
    code, out, err = _ckpt("list", run_dir, "--json")
    assert code == 0, err
    listed = [
        (c["name"], c["step"], c["producer"], c["complete"], c["latest"])
        for c in json.loads(out)["checkpoints"]
    ]
    assert listed == [
        (EARLIER_TAG, 1, "deepspeed", True, False),
        (TAG, 2, "deepspeed", True, True),
    ]


def test_inspect_counts_the_tied_weight_apart_from_shared_step_counters(run_dir: str) -> None:
    """ZeRO keeps one step counter per flat group, named under every parameter of the group:
    shared bytes, but no tied weights. The model ties only head.weight to embed.weight."""
    code, out, err = _ckpt("inspect", run_dir, "--json")
    assert code == 0, err
    totals = json.loads(out)["totals"]
    assert totals["tied_aliases"] == ["head.weight"]
    assert totals["shared_aliases"] and all(
        a.startswith("optimizer.state.") and a.endswith(".step") for a in totals["shared_aliases"]
    )
    code, out, _ = _ckpt("inspect", run_dir)
    n = len(totals["shared_aliases"])
    assert f"(1 tied weight name and {n} other entries sharing another's bytes" in out
    assert "1 object," in out and "name(s)" not in out
