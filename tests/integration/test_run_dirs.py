"""Run directories and their saves, one rule: ``ckpt list RUN`` marks latest the save that
reading ``RUN`` takes (the newest whole one, or the one the producer records), judged whole by
the same check the reader makes, on real producers' directories (a Trainer's checkpoints, a
DeepSpeed run, a CheckpointManager root, ``dcp.save`` per step); and what is no checkpoint at
all (an empty directory, one file of a DeepSpeed save) is one line saying so."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptools.cli.main import cli
from tests.support.deepspeed_producers import case_dir, deepspeed_available, produce_zero

_needs_deepspeed = pytest.mark.skipif(
    not deepspeed_available(), reason="DeepSpeed is not installed (make setup installs it)"
)


def _ckpt(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def _listed(root: Path) -> dict[str, dict[str, object]]:
    code, out, err = _ckpt("list", str(root), "--json")
    assert code == 0, err
    return {c["name"]: c for c in json.loads(out)["checkpoints"]}


@pytest.fixture(scope="module")
def zero2_run(cached_output: Callable[..., Path]) -> Path:
    """A ZeRO-2 run DeepSpeed saved at two tags on 2 ranks (``latest`` names global_step2)."""
    from tests.support import deepspeed_producers as ds

    root = cached_output(
        "zero2-two-tags",
        [Path(ds.__file__)],
        lambda d: produce_zero(str(d), 2, [(2, "fp32")], earlier_tag=True),
    )
    return Path(case_dir(str(root), 2, "fp32"))


# --- 3: a ZeRO-1/2 model states file given alone ------------------------------------------------


@_needs_deepspeed
@pytest.mark.parametrize(
    "verb",
    [["inspect"], ["verify"], ["consolidate", "OUT"], ["reshard", "OUT", "--world-size", "1"]],
)
def test_zero2_model_states_file_alone_is_refused_naming_the_directory(
    zero2_run: Path, tmp_path: Path, verb: list[str]
) -> None:
    tag = zero2_run / "global_step2"
    path = tag / "mp_rank_00_model_states.pt"
    args = [verb[0], str(path), *(str(tmp_path / "out") if a == "OUT" else a for a in verb[1:])]
    code, out, err = _ckpt(*args)
    assert code == 2, out + err
    assert err.splitlines() == [
        f"error: {path}: this is one file of the deepspeed checkpoint at {tag}; point at {tag}"
    ]
    assert not (tmp_path / "out").exists()
    # as the other ZeRO files are, and the directory pointed at reads
    other = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert f"point at {tag}" in _ckpt("inspect", str(other))[2]
    assert _ckpt("inspect", str(tag))[0] == 0


# --- 16a: an empty directory, and one no layout reads, in one line ---------------------------


@pytest.mark.parametrize("verb", [["inspect"], ["verify"], ["consolidate", "OUT"]])
def test_empty_directory_is_one_line(tmp_path: Path, verb: list[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _ckpt(verb[0], str(empty), *(str(tmp_path / "out") for _ in verb[1:]))
    assert code == 1
    assert err.splitlines() == [f"error: {empty}: empty directory, no checkpoint here"]


def test_directory_no_layout_reads_is_one_line_reasons_under_debug(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("lr 3e-4\n")
    code, _, err = _ckpt("inspect", str(junk))
    assert code == 1
    assert err.splitlines() == [
        f"error: {junk}: not a checkpoint ckptools recognises (--debug lists why each layout "
        "refused it; --format NAME forces one and shows its full error)"
    ]
    result = CliRunner().invoke(cli, ["inspect", str(junk), "--debug"])
    assert "  dcp: " in result.stderr and "  deepspeed: " in result.stderr
