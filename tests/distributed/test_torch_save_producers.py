"""The torch.save checkpoints FSDP and DDP users have: read, inspected, verified, consolidated.

Each checkpoint is written by its real producer on gloo ranks (world size 2): torch FSDP1's
tutorial pattern (FULL_STATE_DICT, rank0_only, ``use_orig_params`` both ways), accelerate's own
save functions with ``FULL_STATE_DICT``, and a DDP script with two param groups. ckptools reads
each from the outer directory the producer wrote; the consolidated model equals, bit for bit, the
full state dict torch gathered itself, ``transformers`` loads it, and no input byte changes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import ckptools
from ckptools.cli.main import cli
from tests.conftest import Produced
from tests.support.producers import flip_bit, iter_files
from tests.support.reference import tensor_bytes

pytestmark = pytest.mark.distributed

CASES: list[tuple[str, dict[str, Any], str, str, str]] = [
    # producer, options, layout, model prefix, the file holding the model
    ("fsdp1_full", {"use_orig_params": True}, "torch_save", "model_state_dict.", "checkpoint.pth"),
    ("fsdp1_full", {"use_orig_params": False}, "torch_save", "model_state_dict.", "checkpoint.pth"),
    ("accelerate_full", {}, "accelerate", "", "pytorch_model_fsdp.bin"),
    ("ddp", {}, "torch_save", "model.", "checkpoint.pt"),
    ("ddp", {"param_names": True}, "torch_save", "model.", "checkpoint.pt"),
]
IDS = [f"{c[0]}-{'-'.join(f'{k}={v}' for k, v in c[1].items())}" for c in CASES]


def _hashes(root: Path) -> dict[str, str]:
    return {rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in iter_files(root)}


def _output(out: Path) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    return got


def _inspect(path: Path, *args: str) -> dict[str, Any]:
    result = CliRunner().invoke(cli, ["inspect", str(path), "--json", *args])
    assert result.exit_code == 0, result.output
    report: dict[str, Any] = json.loads(result.output)
    return report


@pytest.mark.parametrize(("name", "opts", "layout", "prefix", "model_file"), CASES, ids=IDS)
def test_consolidates_bit_exactly_from_the_outer_directory(
    produced: Callable[..., Produced],
    tmp_path: Path,
    name: str,
    opts: dict[str, Any],
    layout: str,
    prefix: str,
    model_file: str,
) -> None:
    p = produced(name, **opts)
    before = _hashes(p.path)
    reference = p.reference()["model"]

    report = _inspect(p.path)
    assert report["layout"] == layout
    assert report["model_part"]["prefix"] == prefix
    assert report["model_part"]["tensors"] == len(reference)
    assert report["model_part"]["elements"] == sum(t.numel() for t in reference.values())
    assert report["sources"][0]["file"] == model_file
    assert report["sources"][0]["role"] == "model"

    out = tmp_path / "hf"
    result = ckptools.consolidate(str(p.path), str(out), quiet=True)
    got = _output(out)
    assert set(got) == set(reference)
    for fqn, expected in reference.items():
        assert got[fqn].dtype == expected.dtype and got[fqn].shape == expected.shape, fqn
        assert torch.equal(tensor_bytes(got[fqn]), tensor_bytes(expected)), fqn
    assert "config.json" in result.config_files
    assert result.skipped_objects > 0  # the optimizer's param_groups, step/epoch: not exported

    assert ckptools.verify(str(p.path)).ok
    assert not ckptools.diff(str(p.path), str(out)).differences
    assert _hashes(p.path) == before


def test_fsdp1_tutorial_file_and_its_flat_shard_optimizer(
    produced: Callable[..., Produced],
) -> None:
    p = produced("fsdp1_full", use_orig_params=False)
    report = _inspect(p.path)
    assert report["step"] == 2
    [opt] = report["optimizers"]
    model = report["model_part"]
    # rank 0's own optimizer: one integer-keyed entry per FlatParameter (2 blocks + the root)
    # holding rank 0's half of the elements; the numbers show it is not a full optimizer.
    assert opt["key"] == "optimizer_state_dict" and opt["keyed"] == "integer"
    assert opt["entries"] == 3 and opt["params"] == 3 and opt["param_groups"] == 1
    assert 0 < opt["elements"]["exp_avg"] <= (model["elements"] + 3 * 2) // 2
    assert not opt["param_names"]
    # and inspect says so, as reshard does (issue 25, item 17)
    [note] = [n for n in report["notes"] if "FSDP1 flat-parameter shard" in n]
    assert note.startswith("optimizer state 'optimizer_state_dict' holds 3 flat entries / ")
    assert f"{model['tensors']} parameters / {model['elements']:,} elements" in note
    assert "--drop-optimizer" in note


def test_fsdp1_use_orig_params_file_reads_from_the_file_too(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    p = produced("fsdp1_full", use_orig_params=True)
    file = p.path / "checkpoint.pth"
    report = _inspect(file)
    assert report["layout"] == "torch_save" and report["step"] == 2
    assert report["optimizers"][0]["keyed"] == "integer"
    assert report["optimizers"][0]["params"] == len(p.reference()["model"])
    out = tmp_path / "hf"
    ckptools.consolidate(str(file), str(out), quiet=True)
    assert set(_output(out)) == set(p.reference()["model"])


def test_accelerate_full_state_dict_optimizer_is_fqn_keyed(
    produced: Callable[..., Produced],
) -> None:
    p = produced("accelerate_full")
    report = _inspect(p.path)
    roles = {s["file"]: (s["role"], s["under"]) for s in report["sources"]}
    assert roles == {
        "pytorch_model_fsdp.bin": ("model", ""),
        "optimizer.bin": ("optimizer", "optimizer"),
    }
    [opt] = report["optimizers"]
    reference = p.reference()
    assert opt["key"] == "optimizer" and opt["keyed"] == "fqn"
    assert opt["entries"] == len(reference["optim"]["state"]) == len(reference["model"])
    assert opt["elements"]["exp_avg"] == report["model_part"]["elements"]
    manifest = ckptools.read_manifest(str(p.path))
    for fqn, state in reference["optim"]["state"].items():
        got = ckptools.read_tensor(manifest, f"optimizer.state.{fqn}.exp_avg")
        assert torch.equal(tensor_bytes(got), tensor_bytes(state["exp_avg"])), fqn


@pytest.mark.parametrize("param_names", [False, True])
def test_ddp_two_param_groups(produced: Callable[..., Produced], param_names: bool) -> None:
    p = produced("ddp", param_names=True) if param_names else produced("ddp")
    report = _inspect(p.path)
    [opt] = report["optimizers"]
    assert opt["key"] == "optimizer" and opt["keyed"] == "integer"
    assert opt["param_groups"] == 2 and opt["params"] == len(p.reference()["model"])
    assert opt["param_names"] is param_names
    assert "weight_decay" in opt["hyperparameters"]
    # DDP's module. prefix is the wrapper's, not the model's
    assert all(not n.startswith("module.") for n in _output_names(p.path))


def _output_names(path: Path) -> list[str]:
    manifest = ckptools.read_manifest(str(path))
    from ckptools.verbs.consolidate import select_tensors

    return list(select_tensors(manifest))


def test_transformers_loads_the_consolidated_fsdp1_checkpoint(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    p = produced("fsdp1_full", use_orig_params=True)
    out = tmp_path / "hf"
    ckptools.consolidate(str(p.path), str(out), quiet=True)
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    for fqn, expected in p.reference()["model"].items():
        assert torch.equal(tensor_bytes(loaded[fqn]), tensor_bytes(expected)), fqn


def test_key_option_names_the_container(produced: Callable[..., Produced], tmp_path: Path) -> None:
    p = produced("ddp")
    report = _inspect(p.path, "--key", "optimizer")
    assert report["model_part"]["prefix"] == "optimizer."
    runner = CliRunner()
    bad = runner.invoke(cli, ["inspect", str(p.path), "--key", "nope"])
    assert bad.exit_code == 2 and "top-level keys with tensors: model, optimizer" in bad.output
    out = tmp_path / "hf"
    ok = runner.invoke(cli, ["consolidate", str(p.path), str(out), "--key", "model", "--quiet"])
    assert ok.exit_code == 0, ok.output
    assert set(_output(out)) == set(p.reference()["model"])
    both = runner.invoke(
        cli, ["consolidate", str(p.path), str(tmp_path / "x"), "--key", "a", "--select", "b"]
    )
    assert both.exit_code == 2 and "--key and --select" in both.output


def test_verify_finds_a_flipped_bit_and_names_the_tensor(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    import shutil

    p = produced("fsdp1_full", use_orig_params=False)
    copy = tmp_path / "ckpt"
    shutil.copytree(p.path, copy)
    manifest = ckptools.read_manifest(str(copy))
    fqn = "model_state_dict.model.layers.1.mlp.down_proj.weight"
    chunk = manifest.tensors[fqn].chunks[0]
    flip_bit(copy / chunk.file, chunk.offset + 5, 3)
    report = ckptools.verify(str(copy))
    assert not report.ok
    [finding] = [f for f in report.findings if f.kind == "crc"]
    assert finding.fqn == fqn and "checkpoint.pth" in finding.message
