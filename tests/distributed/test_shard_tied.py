"""``ckpt shard`` of a model that ties its output embedding, loaded by a real FSDP2 job.

``save_pretrained`` of a tied model (GPT-2; a Llama with ``tie_word_embeddings: true``) leaves
``lm_head.weight`` out of the safetensors, but the FSDP2 model's ``get_model_state_dict`` has it:
``dcp.load({"model": get_model_state_dict(model)})`` of the shard must find it. The truth is the
model ``save_pretrained`` was called on; the ranks load into a model of another seed and rank 0
returns the full state, compared bit-exactly, the head included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from ckptools.cli.main import cli
from tests.support.dist import run_ranks

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _config(arch: str) -> Any:
    import transformers

    if arch == "gpt2":  # ties by default: its config.json need not say so
        return transformers.GPT2Config(
            n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=16, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True,
    )  # fmt: skip


def _load_sharded(rank: int, world_size: int, hf_dir: str, dcp_dir: str) -> Any:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1 + rank)
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_config(config)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_model_state_dict(model, state["model"])
    full = get_model_state_dict(model, options=_FULL)
    return {k: v.clone() for k, v in full.items()} if rank == 0 else None


@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_shard_of_a_tied_model_loads_in_fsdp2_with_its_head(tmp_path: Path, arch: str) -> None:
    import transformers
    from safetensors import safe_open

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(arch))
    hf_dir, out = tmp_path / "hf", tmp_path / "dcp"
    model.save_pretrained(str(hf_dir))
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # the producer leaves the tied head out
    truth = {k: v.detach().clone() for k, v in model.state_dict().items()}

    r = CliRunner().invoke(cli, ["shard", str(hf_dir), str(out), "--world-size", "2"])
    assert r.exit_code == 0, r.output
    assert "lm_head.weight" in r.output and "tie" in r.output, r.output  # the note
    loaded = run_ranks(_load_sharded, 2, str(hf_dir), str(out), timeout=300)[0]
    assert sorted(loaded) == sorted(truth)
    for k, v in truth.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
