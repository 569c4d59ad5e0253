"""FSDP1 LOCAL_STATE_DICT: flat-parameter shards, refused by every verb in one line naming it.

Written by torch's own FSDP1 on two gloo ranks (:mod:`tests.support.fsdp1_local_producers`),
``use_orig_params`` both ways, saved per rank with ``torch.save`` and through ``dcp.save``.
No parameter name or shape is stored, so nothing may be written from them: before this,
``consolidate`` and ``reshard`` exited 0 with a "model" of ``_flat_param`` tensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptools
from ckptools.cli.main import cli
from ckptools.errors import UnsupportedCheckpointError
from tests.support import fsdp1_local_producers as local

pytestmark = pytest.mark.distributed

REFUSAL = (
    "flat-parameter shards of FSDP1 LOCAL_STATE_DICT: no parameter names or shapes are "
    "stored; save with SHARDED_STATE_DICT"
)
CASES = [orig_how for orig_how, _ in local.saves("")]


@pytest.fixture(scope="module")
def saves(cached_output: Callable[..., Path]) -> dict[str, str]:
    root = cached_output(
        "fsdp1-local-state-dict", [Path(local.__file__)], local.produce_local_state_dict
    )
    return dict(local.saves(root))


def _refused(args: list[str]) -> str:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, (args, result.output)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and REFUSAL in lines[0], (args, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    return lines[0]


@pytest.mark.parametrize("case", CASES)
def test_every_verb_refuses_it_by_name_and_writes_nothing(
    saves: dict[str, str], tmp_path: Path, case: str
) -> None:
    src = saves[case]
    out = tmp_path / "out"
    _refused(["consolidate", src, str(out)])
    _refused(["consolidate", src, str(out), "--weights-only", "--dry-run"])
    _refused(["reshard", src, str(out), "--world-size", "2"])
    _refused(["verify", src])
    _refused(["diff", src, src])
    _refused(["inspect", src])
    result = CliRunner().invoke(cli, ["inspect", src, "--json"])
    assert result.exit_code == 1
    assert REFUSAL in json.loads(result.output)["error"]
    assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("torch_save")])
def test_one_rank_file_is_refused_alike(saves: dict[str, str], case: str) -> None:
    line = _refused(["inspect", os.path.join(saves[case], "rank1.pt")])
    assert "rank1.pt" in line


@pytest.mark.parametrize("case", CASES)
def test_ckptools_load_refuses_it_by_name(saves: dict[str, str], case: str) -> None:
    """Not ``dcp.load``'s missing-key error, nor a model of flat parameters loaded."""
    from tests.support.producers import DEFAULT_CONFIG, TinyLlama

    with pytest.raises(UnsupportedCheckpointError, match=REFUSAL):
        ckptools.load(saves[case], TinyLlama(DEFAULT_CONFIG))
