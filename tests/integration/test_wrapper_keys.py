"""Wrapper segments are wrappers: a model's own submodule named ``module`` survives consolidate.

transformers' LeViT keeps each residual block's layer in ``LevitResidualLayer.module``
(``levit.encoder.stages.0.layers.0.module.projection.linear.weight``), as many custom models do;
DDP puts its own ``module.`` in front of every name. A real tiny LeViT is saved plain (through
``ckptools.save``), under a real DDP (gloo, one rank), under ``torch.compile`` and both; every
consolidation must carry the model's own ``state_dict`` names and bytes, and load with
``from_pretrained`` with no missing or unexpected key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import ckptools  # noqa: E402

VARIANTS = (
    "plain_dcp",
    "ddp_dcp",
    "ddp_torch_save",
    "compile_torch_save",
    "compile_ddp_torch_save",
)


def _levit() -> tuple[Any, Any]:
    """A LeViT of ~33k parameters: builds in well under a second."""
    config = transformers.LevitConfig(
        image_size=32, patch_size=16, hidden_sizes=[16, 24, 32], num_attention_heads=[1, 2, 2],
        depths=[1, 1, 1], key_dim=[8, 8, 8], attention_ratio=[2, 2, 2], mlp_ratio=[2, 2, 2],
        down_ops=[["Subsample", 8, 2, 4, 2, 2], ["Subsample", 8, 3, 4, 2, 2]],
        num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LevitForImageClassification(config).eval()
    with torch.no_grad():  # running statistics that are not the defaults, so bytes can differ
        for name, buf in model.named_buffers():
            if name.endswith(("running_mean", "running_var")):
                buf.uniform_(0.5, 1.5)
    return config, model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, str], str]:
    """The model, each variant's checkpoint, and a directory holding its config.json."""
    root = tmp_path_factory.mktemp("levit")
    config, model = _levit()
    config_dir = root / "config"
    config.save_pretrained(config_dir)
    paths = {v: str(root / v) for v in VARIANTS}
    ckptools.save(paths["plain_dcp"], model)
    dist.init_process_group(
        "gloo", init_method=f"file://{root / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        ddp = DistributedDataParallel(model)
        assert all(k.startswith("module.") for k in ddp.state_dict())
        dcp.save({"model": ddp.state_dict()}, checkpoint_id=paths["ddp_dcp"])
        torch.save(ddp.state_dict(), paths["ddp_torch_save"])
        compiled_ddp = torch.compile(ddp).state_dict()  # "_orig_mod.module.levit..."
        torch.save(compiled_ddp, paths["compile_ddp_torch_save"])
    finally:
        dist.destroy_process_group()
    compiled = torch.compile(model).state_dict()  # "_orig_mod.levit..."
    assert all(k.startswith("_orig_mod.") for k in compiled)
    torch.save(compiled, paths["compile_torch_save"])
    return model, paths, str(config_dir)


def _same_bytes(a: Any, b: Any) -> bool:
    return bool(
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _read_dir(path: Path) -> dict[str, Any]:
    manifest = ckptools.read_manifest(str(path))
    return {fqn: ckptools.read_tensor(manifest, fqn) for fqn in manifest.tensors}


def test_the_model_has_submodules_named_module(saved: tuple[Any, dict[str, str], str]) -> None:
    model, _, _ = saved
    own = [k for k in model.state_dict() if ".module." in k]
    assert own and "levit.encoder.stages.0.layers.0.module.attention_biases" in own


@pytest.mark.parametrize("variant", VARIANTS)
def test_consolidate_keeps_the_models_own_names(
    saved: tuple[Any, dict[str, str], str], variant: str, tmp_path: Path
) -> None:
    model, paths, config_dir = saved
    expected = model.state_dict()
    out = tmp_path / "hf"
    ckptools.consolidate(paths[variant], str(out), config=config_dir, quiet=True)
    got = _read_dir(out)
    assert sorted(got) == sorted(expected)
    assert [k for k in expected if not _same_bytes(got[k], expected[k])] == []
    assert ckptools.diff(paths[variant], str(out)).identical

    loaded, info = transformers.LevitForImageClassification.from_pretrained(
        str(out), output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    reloaded = loaded.state_dict()
    assert [k for k in expected if not _same_bytes(reloaded[k], expected[k])] == []


def test_select_of_a_ddp_model_removes_only_ddps_module(
    saved: tuple[Any, dict[str, str], str], tmp_path: Path
) -> None:
    model, paths, config_dir = saved
    out = tmp_path / "hf"
    ckptools.consolidate(paths["ddp_dcp"], str(out), select="model", config=config_dir, quiet=True)
    assert sorted(_read_dir(out)) == sorted(model.state_dict())


def test_ckpt_consolidate_cli_names(saved: tuple[Any, dict[str, str], str], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ckptools.cli.main import cli

    model, paths, config_dir = saved
    out = tmp_path / "hf"
    args = ["consolidate", paths["ddp_dcp"], str(out), "--config", config_dir, "--json", "-q"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert sorted(_read_dir(out)) == sorted(model.state_dict())
