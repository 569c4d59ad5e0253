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
    """Without a config.json beside SRC or above it, --weights-only writes the weights only:
    the result says so (from_pretrained cannot load it); with one, nothing is said. (Without
    --weights-only it is refused: tests/integration/test_config_rule.py.)"""
    src = tmp_path / "run" / "ckpt"
    shutil.copytree(produced("fsdp2", world_size=2).path, src)
    result = ckptools.consolidate(str(src), str(tmp_path / "bare"), weights_only=True, quiet=True)
    assert result.config_files == ()
    [note] = [n for n in result.notes if "config.json" in n]
    assert "from_pretrained" in note and "weights only" in note
    r = CliRunner().invoke(
        cli, ["consolidate", str(src), str(tmp_path / "bare2"), "--weights-only"]
    )
    assert r.exit_code == 0 and "weights only" in r.output, r.output
    (tmp_path / "run" / "config.json").write_text(json.dumps(hf_config_dict()))
    result = ckptools.consolidate(str(src), str(tmp_path / "with"), quiet=True)
    assert result.config_files == ("config.json",)
    assert not [n for n in result.notes if "--config" in n or "weights only" in n]


@pytest.mark.parametrize("as_directory", [False, True])
def test_a_config_without_model_type_is_refused(
    produced: Callable[..., Produced], tmp_path: Path, as_directory: bool
) -> None:
    src = str(produced("fsdp2", world_size=2).path)
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
    is found from ``step-N`` as from the folder holding the steps. (An HF Llama config does
    not fit torchtitan's own names, ``layers.0.attention.wq.weight``: found, it is named in the
    refusal and, with ``weights_only``, in a note, and not copied.)"""
    p = produced("torchtitan")  # .../checkpoint/step-2
    dump = tmp_path / "outputs"
    shutil.copytree(p.path.parent, dump / "checkpoint")
    config = json.dumps(hf_config_dict())
    (dump / "config.json").write_text(config)
    for src in (dump / "checkpoint", dump / "checkpoint" / "step-2"):
        out = tmp_path / f"out-{src.name}"
        with pytest.raises(UsageError, match="--weights-only"):  # no config fits: refused
            ckptools.consolidate(str(src), str(out), quiet=True)
        assert not out.exists()
        result = ckptools.consolidate(str(src), str(out), weights_only=True, quiet=True)
        assert result.config_files == (), src
        [note] = [n for n in result.notes if "does not fit" in n]
        assert note.startswith(f"{dump / 'config.json'} (found for {src})"), note
        assert not (out / "config.json").exists()


VERL = Path(__file__).resolve().parents[2] / "fixtures" / "verl"


@pytest.mark.parametrize("kept", ["huggingface", "run"])
def test_verl_global_step_finds_the_config(tmp_path: Path, kept: str) -> None:
    """verl saves ``<run>/global_step_N/actor/`` with the model's config in its
    ``huggingface/``; with that folder left out, a config kept in the run directory is found
    from ``actor/`` as from ``global_step_N/`` and the run directory."""
    run = tmp_path / "checkpoints"
    actor = run / "global_step_2" / "actor"
    shutil.copytree(VERL / "fsdp2_ws2", actor)
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    config = (actor / "huggingface" / "config.json").read_text()
    if kept == "run":
        shutil.rmtree(actor / "huggingface")
        (run / "config.json").write_text(config)
    for src in (run, run / "global_step_2", actor):
        out = tmp_path / f"out-{src.name}"
        result = ckptools.consolidate(str(src), str(out), quiet=True)
        assert result.config_files == ("config.json",), src
        assert (out / "config.json").read_text() == config


@pytest.mark.distributed
def test_trainer_checkpoint_finds_the_output_dir_config(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """A Trainer with FSDP's sharded state dict writes no config.json into ``checkpoint-N/``;
    ``trainer.save_model()`` puts it in ``output_dir``: found from the output dir, from
    ``checkpoint-N/`` and from the DCP folder inside it."""
    p = produced("trainer")
    output_dir = tmp_path / "output"
    shutil.copytree(p.path, output_dir / "checkpoint-2")
    assert not (output_dir / "checkpoint-2" / "config.json").exists()
    config = json.dumps(hf_config_dict())
    (output_dir / "config.json").write_text(config)
    dcp_dir = output_dir / "checkpoint-2" / "pytorch_model_fsdp_0"
    for src in (output_dir, output_dir / "checkpoint-2", dcp_dir):
        out = tmp_path / f"out-{src.name}"
        result = ckptools.consolidate(str(src), str(out), quiet=True)
        assert result.config_files == ("config.json",), src
        assert (out / "config.json").read_text() == config
