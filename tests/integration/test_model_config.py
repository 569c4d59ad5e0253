"""The model's ``config.json``: found from a save as from its run directory, refused from
``--config`` when it is no transformers config, and its absence said, naming ``--config``.

DeepSpeed's tag directory is in tests/distributed/test_deepspeed.py.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptools
from ckptools.cli.main import cli
from ckptools.errors import UsageError
from tests.conftest import Produced
from tests.support.producers import hf_config_dict


def test_no_config_is_said_naming_the_flag(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """Without a config.json beside SRC or above it OUT holds the weights only: the result
    says so and names --config; with one, nothing is said."""
    src = tmp_path / "run" / "ckpt"
    shutil.copytree(produced("single").path, src)
    result = ckptools.consolidate(str(src), str(tmp_path / "bare"), quiet=True)
    assert result.config_files == ()
    [note] = [n for n in result.notes if "config.json" in n]
    assert "from_pretrained" in note and "--config" in note
    r = CliRunner().invoke(cli, ["consolidate", str(src), str(tmp_path / "bare2")])
    assert r.exit_code == 0 and "--config" in r.output, r.output
    (tmp_path / "run" / "config.json").write_text(json.dumps(hf_config_dict()))
    result = ckptools.consolidate(str(src), str(tmp_path / "with"), quiet=True)
    assert result.config_files == ("config.json",)
    assert not [n for n in result.notes if "--config" in n]


@pytest.mark.parametrize("as_directory", [False, True])
def test_a_config_without_model_type_is_refused(
    produced: Callable[..., Produced], tmp_path: Path, as_directory: bool
) -> None:
    src = str(produced("single").path)
    given = tmp_path / "cfg"
    given.mkdir()
    (given / "config.json").write_text(json.dumps({"hidden_size": 10, "vocab_size": 37}))
    arg = str(given if as_directory else given / "config.json")
    out = tmp_path / "out"
    with pytest.raises(UsageError, match="model_type"):
        ckptools.consolidate(src, str(out), config=arg, quiet=True)
    r = CliRunner().invoke(cli, ["consolidate", src, str(out), "--config", arg])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and "model_type" in r.output
    assert not out.exists()
    (given / "config.json").write_text(json.dumps(hf_config_dict()))
    result = ckptools.consolidate(src, str(out), config=arg, quiet=True)
    assert result.config_files == ("config.json",)


@pytest.mark.distributed
def test_torchtitan_step_finds_the_run_config(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """torchtitan keeps ``step-N/`` in ``<dump>/checkpoint/``: the config in the dump folder
    is found from ``step-N`` as from the folder holding the steps."""
    p = produced("torchtitan")  # .../checkpoint/step-2
    dump = tmp_path / "outputs"
    shutil.copytree(p.path.parent, dump / "checkpoint")
    config = json.dumps(hf_config_dict())
    (dump / "config.json").write_text(config)
    for src in (dump / "checkpoint", dump / "checkpoint" / "step-2"):
        out = tmp_path / f"out-{src.name}"
        result = ckptools.consolidate(str(src), str(out), quiet=True)
        assert result.config_files == ("config.json",), src
        assert (out / "config.json").read_text() == config
