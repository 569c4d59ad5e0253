"""The rules about an output directory OUT (ckptools/io/out_rules.py), the same for every writer,
on real producers' checkpoints: OUT never lies inside its source (DCP, DeepSpeed, Hugging Face
directory), ``--overwrite`` replaces only an earlier ckptools output of the same kind, and an
OUT that cannot be a directory here is refused in one line, never with a traceback.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptools
from ckptools.cli.main import cli
from ckptools.errors import UsageError
from tests.conftest import Produced

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _refused(args: list[str]) -> str:
    """The CLI's one line for a usage error (exit 2), no traceback."""
    result = CliRunner().invoke(cli, args)
    text = result.output.strip()
    assert result.exit_code == 2, (result.exit_code, text, result.exception)
    assert text.startswith("error: ") and "\n" not in text, text
    assert "Traceback" not in text
    return text


def _ok(args: list[str]) -> None:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output


def _zero_run(cached_output: Callable[..., Path], tmp_path: Path) -> Path:
    from tests.support import deepspeed_producers as ds

    if not ds.deepspeed_available():
        pytest.skip("needs deepspeed")
    root = cached_output(
        "load-zero2-fp32",
        [Path(ds.__file__)],
        lambda d: ds.produce_zero(str(d), 2, [(2, "fp32")]),
    )
    return Path(shutil.copytree(ds.case_dir(str(root), 2, "fp32"), tmp_path / "ds_run"))


# --------------------------------------------------------------------------------------------------
# OUT inside SRC: refused for every verb, new or existing
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("existing", [False, True])
@pytest.mark.parametrize("source", ["dcp", "deepspeed", "hf"])
def test_consolidate_refuses_an_out_inside_its_source(
    cached_output: Callable[..., Path], tmp_path: Path, source: str, existing: bool
) -> None:
    if source == "deepspeed":
        src = _zero_run(cached_output, tmp_path)
    else:
        fixture = {"dcp": "dcp_single", "hf": "hf_sharded"}[source]
        src = Path(shutil.copytree(FIXTURES / fixture, tmp_path / fixture))
    args = ["consolidate", str(src), str(src / "hf"), "--weights-only"]
    if existing:  # an earlier consolidation's output, put there by hand: part of SRC now
        _ok(
            [
                "consolidate",
                str(FIXTURES / "dcp_single"),
                str(tmp_path / "elsewhere"),
                "--weights-only",
            ]
        )
        shutil.copytree(tmp_path / "elsewhere", src / "hf")
        args.append("--overwrite")
    before = _digest(src)
    text = _refused(args)
    assert f"{src / 'hf'}: lies inside the source checkpoint" in text
    assert "write the output somewhere else" in text
    assert _digest(src) == before
    with pytest.raises(UsageError, match="lies inside the source checkpoint"):
        ckptools.consolidate(
            str(src), str(src / "hf"), overwrite=existing, quiet=True, weights_only=True
        )
    assert _digest(src) == before


def test_callback_output_stays_out_of_later_conversions(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """The Trainer callback's documented checkpoint-N/hf/ still works (it consolidates the
    model's DCP directory); a later reshard of checkpoint-N does not carry hf/ along, and the
    CLI may not write there itself."""
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerControl, TrainerState

    from ckptools.integrations.transformers import CkptoolsCallback
    from tests.support.producers import _training_args_pickle, hf_config_dict

    run = tmp_path / "run"
    checkpoint = run / "checkpoint-2"
    shutil.copytree(produced("trainer").path, checkpoint)
    cfg = {k: v for k, v in hf_config_dict().items() if k not in ("architectures", "torch_dtype")}
    model: Any = LlamaForCausalLM(LlamaConfig(**cfg))
    callback = CkptoolsCallback("hf")
    args, state = _training_args_pickle(str(run)), TrainerState(global_step=2)
    callback.on_save(args, state, TrainerControl(), model=model)
    callback.on_save(args, state, TrainerControl(), model=model)  # the same step saved again
    assert (checkpoint / "hf" / "config.json").is_file()
    written = sorted(os.listdir(checkpoint / "hf"))
    assert any(n.endswith(".safetensors") for n in written)

    _ok(["reshard", str(checkpoint), str(tmp_path / "resharded"), "--world-size", "1"])
    carried = [
        str(p.relative_to(tmp_path / "resharded")) for p in (tmp_path / "resharded").rglob("*")
    ]
    assert not any(p == "hf" or p.startswith("hf/") for p in carried), carried
    _ok(["consolidate", str(checkpoint), str(tmp_path / "again"), "--weights-only"])
    assert os.listdir(tmp_path / "again") == ["model.safetensors"]  # nothing of hf/ copied

    before = _digest(checkpoint)
    text = _refused(
        ["consolidate", str(checkpoint), str(checkpoint / "hf"), "--overwrite", "--weights-only"]
    )
    assert "lies inside the source checkpoint" in text
    assert _digest(checkpoint) == before


# --------------------------------------------------------------------------------------------------
# --overwrite replaces an earlier output of the same kind, or an empty directory, nothing else
# --------------------------------------------------------------------------------------------------


def _user_dir(tmp_path: Path) -> Path:
    """A directory of the user's: notes and a training checkpoint."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("what I tried")
    shutil.copytree(FIXTURES / "dcp_single", mine / "step-1")
    return mine


@pytest.mark.parametrize("verb", ["consolidate", "reshard", "shard"])
def test_overwrite_refuses_a_directory_ckptools_did_not_write(tmp_path: Path, verb: str) -> None:
    mine = _user_dir(tmp_path)
    before = _digest(mine)
    src = FIXTURES / ("hf_sharded" if verb == "shard" else "dcp_single")
    extra = [] if verb == "consolidate" else ["--world-size", "2"]
    text = _refused([verb, str(src), str(mine), "--overwrite", *extra])
    assert text.startswith(f"error: {mine}: --overwrite would delete notes.txt, which ckptools")
    assert "remove it yourself or choose another OUT" in text
    assert _digest(mine) == before
    # the dry run says so too, without stopping the plan
    result = CliRunner().invoke(
        cli, [verb, str(src), str(mine), "--overwrite", "--dry-run", *extra]
    )
    assert result.exit_code == 0 and "would delete notes.txt" in result.output
    assert _digest(mine) == before


def test_overwrite_replaces_an_earlier_output_of_the_same_kind(tmp_path: Path) -> None:
    src = str(FIXTURES / "dcp_single")
    hf, dcp, empty = tmp_path / "hf", tmp_path / "dcp", tmp_path / "empty"
    empty.mkdir()
    _ok(["consolidate", src, str(empty), "--overwrite", "--weights-only"])  # an empty directory
    _ok(["consolidate", src, str(hf), "--weights-only"])
    _ok(["consolidate", src, str(hf), "--overwrite", "--weights-only"])
    _ok(["reshard", src, str(dcp), "--world-size", "2"])
    _ok(["reshard", src, str(dcp), "--world-size", "3", "--overwrite"])
    assert sorted(os.listdir(dcp)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    # another kind's output is not this writer's to replace
    assert "would delete .metadata" in _refused(
        ["consolidate", src, str(dcp), "--overwrite", "--weights-only"]
    )
    text = _refused(["reshard", src, str(hf), "--world-size", "2", "--overwrite"])
    assert "would delete model.safetensors" in text
    # a file is nobody's output
    (tmp_path / "model.txt").write_text("mine")
    text = _refused(
        ["consolidate", src, str(tmp_path / "model.txt"), "--overwrite", "--weights-only"]
    )
    assert "--overwrite would delete this file, which ckptools did not write" in text


def test_training_manager_replaces_its_own_step_never_a_directory_of_other_files(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(3, 2)
    root = tmp_path / "run"
    with ckptools.CheckpointManager(root) as mgr:
        mgr.save(1, model)
        mgr.save(1, model)  # the same step saved again (a resumed run): replaced
        assert mgr.steps() == [1]
        (root / "step-2").mkdir()
        (root / "step-2" / "notes.txt").write_text("mine")
        with pytest.raises(UsageError, match=r"would delete notes\.txt"):
            mgr.save(2, model)
        assert (root / "step-2" / "notes.txt").read_text() == "mine"
        assert mgr.steps() == [1]


def test_training_manager_root_is_not_a_checkpoint_or_another_producers_run(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    # its step-N saves went into the DCP or beside the Trainer's checkpoint-N, quietly
    model = torch.nn.Linear(3, 2)
    dcp_dir = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "dcp_single", dcp_dir)
    trainer_out = tmp_path / "trainer_out"
    shutil.copytree(produced("trainer", world_size=2).path, trainer_out / "checkpoint-2")
    for root, says in (
        (dcp_dir, "is a DCP checkpoint itself"),
        (trainer_out, "holds 1 trainer save(s) (checkpoint-2, ...)"),
    ):
        before = _digest(root)
        with pytest.raises(UsageError, match=re.escape(f"{root}: {says}; a CheckpointManager")):
            ckptools.CheckpointManager(root)
        assert _digest(root) == before
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "events.out").write_text("a run's other files are fine")
    with ckptools.CheckpointManager(tmp_path / "logs") as mgr:
        mgr.save(1, model)
        assert mgr.steps() == [1]


# --------------------------------------------------------------------------------------------------
# an OUT that cannot be a directory here: one line, exit 2
# --------------------------------------------------------------------------------------------------


def test_unusable_out_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = str(FIXTURES / "dcp_single")
    busy = tmp_path / "busy"
    busy.mkdir()
    monkeypatch.chdir(busy)
    assert "OUT is an empty path" in _refused(["consolidate", src, "", "--weights-only"])
    assert "OUT is an empty path" in _refused(["reshard", src, "", "--world-size", "2"])
    text = _refused(["consolidate", src, ".", "--overwrite", "--weights-only"])
    assert text.startswith("error: .: is the current directory")
    text = _refused(["reshard", src, "..", "--overwrite", "--world-size", "2"])
    assert text.startswith("error: ..: holds the current directory")
    (tmp_path / "somefile.txt").write_text("mine")
    below = str(tmp_path / "somefile.txt" / "out")
    text = _refused(["consolidate", src, below, "--weights-only"])
    assert f"{tmp_path / 'somefile.txt'} is not a directory" in text
    assert "File exists" not in text
    for proc in ("/proc/out", "/proc/self/nothing/out"):
        text = _refused(["consolidate", src, proc, "--weights-only"])
        assert "cannot create" in text and "choose another OUT" in text
    assert os.listdir(busy) == []


def test_save_onto_a_file_is_one_line_not_every_ranks_traceback(tmp_path: Path) -> None:
    # ckptools.save writes in place (no staged OUT); torch's writers raised a CheckpointException
    # (not even an Exception) holding each rank's traceback
    import torch

    import ckptools
    from ckptools.errors import UsageError

    model = torch.nn.Linear(4, 2)
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    for path, says in (
        (afile, "is a file, not a checkpoint directory"),
        (afile / "ckpt", f"lies below the file {afile}"),
        ("", "the path is empty"),
    ):
        with pytest.raises(UsageError, match=says):
            ckptools.save(str(path), model)
    assert afile.read_text() == "mine"
    ckptools.save(str(tmp_path / "ckpt"), model)  # a new directory is still fine
    assert (tmp_path / "ckpt" / ".metadata").is_file()
