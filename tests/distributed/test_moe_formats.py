"""transformers' on-disk formats both ways, on real MoE models (Qwen3-MoE, Mixtral) under FSDP2.

transformers 5 holds each MoE layer's experts fused in memory and writes them per expert; an FSDP2
DCP holds the fused form. Each case trains one step at world size 2 or 3, saves the DCP, and has
rank 0 write the model's own ``save_pretrained`` directory (the truth), and every rank
``ckptools.save_pretrained`` from its shards (equal to the truth). Then: ``consolidate``
writes exactly ``save_pretrained``'s tensors (names, dtypes, bytes) and ``from_pretrained`` of it
gives the same logits; ``--keep-in-memory-names`` writes the fused form; ``diff`` calls the DCP
and the directory identical in either form and names the mapping; ``shard`` of the
per-expert directory gives a DCP that an FSDP2 job of the model loads bit-exactly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

import ckptools
from ckptools.cli.main import cli
from ckptools.plan.conversions import rules_for
from tests.support.dist import run_ranks

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_TOKENS = torch.arange(16).reshape(2, 8) % 61


def _model(arch: str, seed: int) -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common: dict[str, Any] = dict(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts_per_tok=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    if arch == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=4, moe_intermediate_size=8, **common))
    return MixtralForCausalLM(MixtralConfig(num_local_experts=4, **common))


def _fsdp2(model: Any, world_size: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train_save(
    rank: int, world_size: int, arch: str, dcp_dir: str, hf_dir: str, ours: str
) -> None:
    """Every rank: one AdamW step of the FSDP2 model, ``dcp.save``, ``ckptools.save_pretrained``
    into ``ours``; rank 0 then writes the trained weights with the model's own
    ``save_pretrained`` into ``hf_dir``."""
    model = _fsdp2(_model(arch, seed=0), world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(_TOKENS, labels=_TOKENS).loss.backward()
    opt.step()
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=dcp_dir)
    ckptools.save_pretrained(model, ours)
    full = get_model_state_dict(model, options=_FULL)
    if rank == 0:
        plain = _model(arch, seed=1)
        plain.load_state_dict(full)
        plain.save_pretrained(hf_dir)
    dist.barrier()


def _load_sharded(rank: int, world_size: int, arch: str, dcp_dir: str) -> dict[str, Any] | None:
    """Every rank: a fresh FSDP2 model loads ``dcp_dir`` with torch's own ``dcp.load``; rank 0
    returns the full state dict."""
    model = _fsdp2(_model(arch, seed=2), world_size)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_model_state_dict(model, state["model"])
    full = get_model_state_dict(model, options=_FULL)
    return {k: v.clone() for k, v in full.items()} if rank == 0 else None


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(str(directory / name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


def _logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path))
    with torch.no_grad():
        return model(_TOKENS).logits  # type: ignore[no-any-return]


@pytest.mark.distributed
@pytest.mark.slow  # ~45-85 s each on 2 shared cores: two spawns, transformers in every rank
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fsdp2_moe_dcp_consolidates_to_save_pretrained_and_shards_back(
    tmp_path: Path, arch: str, world_size: int
) -> None:
    dcp_dir, hf_dir = tmp_path / "dcp", tmp_path / "hf"
    ours = tmp_path / "ours"
    run_ranks(_train_save, world_size, arch, str(dcp_dir), str(hf_dir), str(ours), timeout=300)
    truth = _tensors(hf_dir)
    _assert_same(_tensors(ours), truth)  # ckptools.save_pretrained from the shards
    experts = 4 * 2 * 3  # 4 experts x 2 layers x (gate, up, down)
    assert sum(".experts." in k for k in truth) == experts  # save_pretrained's own per-expert form

    out = tmp_path / "consolidated"
    result = ckptools.consolidate(str(dcp_dir), str(out), config=str(hf_dir), quiet=True)
    _assert_same(_tensors(out), truth)
    assert any("on-disk format of transformers" in n for n in result.to_dict()["notes"])
    assert torch.equal(_logits(out), _logits(hf_dir))

    fused = tmp_path / "fused"
    ckptools.consolidate(
        str(dcp_dir), str(fused), config=str(hf_dir), keep_in_memory_names=True, quiet=True
    )
    in_memory = _tensors(fused)
    assert sum(".experts." in k for k in in_memory) == 2 * 2  # gate_up_proj, down_proj per layer
    keymap = rules_for({"model_type": arch}).to_disk(  # type: ignore[union-attr]
        {k: tuple(v.shape) for k, v in in_memory.items()}
    )
    assert sorted(p.disk for p in keymap.pieces) == sorted(truth)

    for kept in (False, True):
        report = ckptools.diff(str(dcp_dir), str(hf_dir), keep_in_memory_names=kept)
        assert report.identical, [t.describe() for t in report.differences]
        assert len(report.tensors) == len(in_memory if kept else truth)
        assert any(f"transformers {arch}" in n for n in report.notes)
    assert ckptools.diff(str(fused), str(out)).identical
    other = tmp_path / "other"
    _model(arch, seed=5).save_pretrained(str(other))
    differs = ckptools.diff(str(dcp_dir), str(other)).differences
    assert {t.name for t in differs} >= {k for k in truth if ".experts.0." in k}
    runner = CliRunner().invoke(cli, ["diff", str(dcp_dir), str(hf_dir), "--json"])
    assert runner.exit_code == 0, runner.output

    sharded = tmp_path / "sharded"
    ckptools.shard(str(hf_dir), str(sharded), world_size=world_size, quiet=True)
    loaded = run_ranks(_load_sharded, world_size, arch, str(sharded), timeout=300)[0]
    _assert_same(loaded, in_memory)


def test_shard_cli_takes_the_config_of_a_bare_file_or_keeps_stored_names(tmp_path: Path) -> None:
    """``ckpt shard FILE --config PATH`` fuses the experts (the config is not beside a bare
    file's directory here); ``--keep-stored-names`` keeps the per-expert tensors."""
    hf = tmp_path / "hf"
    _model("qwen3_moe", seed=0).save_pretrained(str(hf))
    bare = tmp_path / "bare"
    bare.mkdir()
    os.replace(hf / "model.safetensors", bare / "model.safetensors")
    stored = len(_tensors(bare))
    runner = CliRunner()

    def shard(*args: str) -> dict[str, Any]:
        out = str(tmp_path / f"out{len(os.listdir(tmp_path))}")
        argv = ["shard", str(bare / "model.safetensors"), out, "--world-size", "2", "--json"]
        result = runner.invoke(cli, [*argv, *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)  # type: ignore[no-any-return]

    fused = shard("--config", str(hf / "config.json"))
    assert fused["parts"][""]["tensors"] == stored - 4 * 2 * 3 + 2 * 2
    assert any("in-memory layout of transformers qwen3_moe" in n for n in fused["notes"])
    kept = shard("--config", str(hf / "config.json"), "--keep-stored-names")
    assert kept["parts"][""]["tensors"] == stored
    assert shard()["parts"][""]["tensors"] == stored  # no config: names as stored
