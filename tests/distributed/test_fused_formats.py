"""transformers' ``Chunk``-only and ``Concatenate``-only conversions both ways, under FSDP2.

HRM-Text keeps ``gate_proj``/``up_proj`` and ``gate``/``q``/``k``/``v`` as separate parameters
in memory but writes each group as one fused tensor (``Chunk`` on load); OLMo-Hybrid fuses its
q/k/v ``conv1d`` in memory and writes the parts (``Concatenate`` on load): at world size 2
FSDP2's dim-0 rows of the fused [48, 1, 4] tensor end inside the k part (16 rows each). Each
case trains one step, saves the DCP and has rank 0 write the model's own ``save_pretrained``
directory (the truth); ``consolidate`` must write exactly its tensors (and ``from_pretrained``
of it the same logits), ``diff`` call them identical, and ``shard`` of the directory give a DCP
the FSDP2 model loads bit-exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

import ckptools
from tests.distributed.test_moe_formats import _assert_same, _tensors
from tests.support.dist import run_ranks

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_TOKENS = torch.arange(16).reshape(2, 8) % 31


def _model(arch: str, seed: int) -> Any:
    import transformers

    extra = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": None}
    config = transformers.AutoConfig.for_model(
        arch, vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, tie_word_embeddings=False,
        **(extra if arch == "olmo_hybrid" else {}),
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def _fsdp2(model: Any, world_size: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return model


def _train_save(rank: int, world_size: int, arch: str, dcp_dir: str, hf_dir: str) -> None:
    model = _fsdp2(_model(arch, seed=0), world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(_TOKENS, labels=_TOKENS, use_cache=False).loss.backward()
    opt.step()
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=dcp_dir)
    full = get_model_state_dict(model, options=_FULL)
    if rank == 0:
        plain = _model(arch, seed=1)
        plain.load_state_dict(full)
        plain.save_pretrained(hf_dir)
    dist.barrier()


def _load_sharded(rank: int, world_size: int, arch: str, dcp_dir: str) -> dict[str, Any] | None:
    model = _fsdp2(_model(arch, seed=2), world_size)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_model_state_dict(model, state["model"])
    full = get_model_state_dict(model, options=_FULL)
    return {k: v.clone() for k, v in full.items()} if rank == 0 else None


def _logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path))
    with torch.no_grad():
        return model(_TOKENS, use_cache=False).logits  # type: ignore[no-any-return]


@pytest.mark.distributed
@pytest.mark.slow  # two spawns of 3 ranks, transformers in every rank
@pytest.mark.parametrize(("arch", "world_size"), [("hrm_text", 3), ("olmo_hybrid", 2)])
def test_fsdp2_chunk_and_concatenate_models_both_ways(
    tmp_path: Path, arch: str, world_size: int
) -> None:
    dcp_dir, hf_dir = tmp_path / "dcp", tmp_path / "hf"
    run_ranks(_train_save, world_size, arch, str(dcp_dir), str(hf_dir), timeout=300)
    truth = _tensors(hf_dir)
    fused = "gqkv_proj" if arch == "hrm_text" else "q_conv1d"
    assert any(fused in k for k in truth)  # save_pretrained's own form differs from memory
    if arch == "olmo_hybrid":  # the DCP's rows of the fused conv1d cross the parts' boundary
        rows = [c.sizes[0] for c in ckptools.read_manifest(str(dcp_dir)).tensors[
            "model.model.layers.0.linear_attn.conv1d.weight"].chunks]  # fmt: skip
        assert rows == [24, 24]

    out = tmp_path / "consolidated"
    ckptools.consolidate(str(dcp_dir), str(out), config=str(hf_dir), quiet=True)
    _assert_same(_tensors(out), truth)
    assert torch.equal(_logits(out), _logits(hf_dir))
    report = ckptools.diff(str(dcp_dir), str(hf_dir))
    assert report.identical, [t.describe() for t in report.differences]

    in_memory = tmp_path / "in_memory"
    ckptools.consolidate(
        str(dcp_dir), str(in_memory), config=str(hf_dir), keep_in_memory_names=True, quiet=True
    )
    sharded = tmp_path / "sharded"
    ckptools.shard(str(hf_dir), str(sharded), world_size=world_size, quiet=True)
    loaded = run_ranks(_load_sharded, world_size, arch, str(sharded), timeout=300)[0]
    _assert_same(loaded, _tensors(in_memory))
