"""PEFT LoRA checkpoints: the adapter exported and the adapter merged, against peft itself.

A tiny Llama (built from a config, nothing downloaded) wrapped by peft's ``get_peft_model``
(LoRA on q_proj and v_proj) trains one AdamW step under FSDP2 at world size 2 and is saved with
``dcp.save`` from ``get_state_dict``. Rank 0 loads the full trained state into a plain peft model
and writes the truths with peft's own code: ``save_pretrained`` (the adapter) and
``merge_and_unload`` + ``save_pretrained`` (the merged model). Then ``consolidate --adapter``
must equal peft's adapter bit-exactly (names too) with the same ``adapter_config.json``, and load
with ``PeftModel.from_pretrained`` to the same logits; ``--merge-lora`` must equal the merged
model within 1e-6 and load with ``from_pretrained`` to the same logits; without alpha both are
refused with a one-line error naming ``--lora-alpha``; ``inspect`` names the adapter.
"""

from __future__ import annotations

import importlib
import importlib.util
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
    get_state_dict,
)

import ckptools
from ckptools.cli.main import cli
from ckptools.errors import UsageError
from tests.support.dist import run_ranks

# find_spec, not importorskip: every pytest-xdist worker collects this module, and importing peft
# here cost each of them 2.5 s of CPU; the tests import it where they use it
if importlib.util.find_spec("peft") is None:
    pytest.skip("needs peft", allow_module_level=True)

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_TOKENS = torch.arange(16).reshape(2, 8) % 61
_ALPHA = 16.0


def _base(seed: int, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype)


def _peft(seed: int, rslora: bool, dtype: torch.dtype = torch.float32) -> Any:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, lora_alpha=_ALPHA, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
        use_rslora=rslora,
    )  # fmt: skip
    return get_peft_model(_base(seed, dtype), config)


def _accelerate_save(rank: int, world_size: int, model: Any, opt: Any, out: str) -> None:
    """accelerate's own ``save_fsdp_model`` / ``save_fsdp_optimizer`` with SHARDED_STATE_DICT,
    the functions ``Accelerator.save_state`` calls (``pytorch_model_fsdp_0/``, ``optimizer_0/``).
    accelerate enables FSDP only on accelerators: the Accelerator is a CPU one, the model wrapped
    with ``fully_shard`` as its FSDP2 path does (as tests/support/producers.py does)."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
        FSDP_STATE_DICT_TYPE="SHARDED_STATE_DICT", FSDP_VERSION="2",
    )  # fmt: skip
    from accelerate import Accelerator
    from accelerate.utils import (
        FullyShardedDataParallelPlugin,
        save_fsdp_model,
        save_fsdp_optimizer,
    )

    accelerator = Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin()
    save_fsdp_model(plugin, accelerator, model, out)
    save_fsdp_optimizer(plugin, accelerator, opt, model, out)


def _train_save(
    rank: int, world_size: int, root: str, rslora: bool, dtype_name: str, producer: str
) -> None:
    """Every rank: one AdamW step of the FSDP2-wrapped peft model, saved with ``dcp.save`` of
    model and optimizer (or accelerate's save functions) into ``root/src``; rank 0 then writes
    peft's own adapter and merged model from the full state."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dtype = getattr(torch, dtype_name)
    model = _peft(0, rslora, dtype)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(_TOKENS, labels=_TOKENS).loss.backward()
    opt.step()
    if producer == "accelerate":
        _accelerate_save(rank, world_size, model, opt, os.path.join(root, "src"))
    else:
        ckptools.save_pretrained(
            model, os.path.join(root, "sp_adapter"), adapter=True, lora_alpha=_ALPHA
        )
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, "src"))
    full = get_model_state_dict(model, options=_FULL)
    if rank == 0:
        plain = _peft(1, rslora, dtype)
        plain.load_state_dict(full)
        plain.save_pretrained(os.path.join(root, "peft_adapter"))
        config = plain.base_model.model.config
        config.architectures = ["LlamaForCausalLM"]  # as the model's save_pretrained sets it
        config.save_pretrained(os.path.join(root, "base_config"))
        plain.merge_and_unload().save_pretrained(os.path.join(root, "peft_merged"))
    dist.barrier()


def _tensors(directory: Path, name: str) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / name), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _merged_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(_tensors(directory, name))
    return out


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(_TOKENS).logits.float()  # type: ignore[no-any-return]


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    # peft writes target_modules from a set: its order follows the string hash of the process
    return {**config, "target_modules": sorted(config["target_modules"])}


@pytest.fixture(
    scope="module",
    params=[("dcp", False, "float32"), ("dcp", True, "bfloat16"), ("accelerate", False, "float32")],
    ids=["dcp-lora-fp32", "dcp-rslora-bf16", "accelerate-lora-fp32"],
)
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    producer, rslora, dtype_name = request.param
    root = tmp_path_factory.mktemp("lora")
    run_ranks(_train_save, 2, str(root), rslora, dtype_name, producer, timeout=300)
    return root, rslora, getattr(torch, dtype_name)


@pytest.mark.distributed
@pytest.mark.slow  # ~30-60 s per case on 2 shared cores: a spawn with transformers and peft
def test_adapter_export_equals_peft_save_pretrained(trained: Any) -> None:
    from peft import PeftModel

    root, rslora, dtype = trained
    out = root / "ours_adapter"
    result = ckptools.consolidate(
        str(root / "src"), str(out), adapter=True, lora_alpha=_ALPHA,
        config=str(root / "base_config"), quiet=True, overwrite=True,
    )  # fmt: skip
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    truth = _tensors(root / "peft_adapter", "adapter_model.safetensors")
    got = _tensors(out, "adapter_model.safetensors")
    assert sorted(got) == sorted(truth) and len(truth) == 2 * 2 * 2  # 2 layers x q,v x A,B
    for k, v in truth.items():
        assert got[k].dtype == v.dtype and torch.equal(
            got[k].view(torch.uint8), v.view(torch.uint8)
        ), k
    assert any(torch.count_nonzero(v) for k, v in truth.items() if "lora_B" in k)  # trained
    # the adapter's bytes only: the base weights are never part of the plan
    assert result.plan.total_size == sum(v.numel() * v.element_size() for v in truth.values())
    ours_cfg = json.loads((out / "adapter_config.json").read_text())
    peft_cfg = json.loads((root / "peft_adapter" / "adapter_config.json").read_text())
    if not rslora:
        assert _comparable(ours_cfg) == _comparable(peft_cfg)
    else:  # peft's own config says use_rslora; ours learns it from --adapter-config only
        assert ours_cfg["use_rslora"] is False and peft_cfg["use_rslora"] is True
        given = ckptools.consolidate(
            str(root / "src"), str(out), adapter=True, quiet=True, overwrite=True,
            adapter_config=str(root / "peft_adapter" / "adapter_config.json"),
        )  # fmt: skip
        assert given.tensors == 8
        ours_cfg = json.loads((out / "adapter_config.json").read_text())
        assert _comparable(ours_cfg) == _comparable(peft_cfg)
    if (root / "sp_adapter").exists():  # ckptools.save_pretrained from the FSDP2 shards
        sp = _tensors(root / "sp_adapter", "adapter_model.safetensors")
        assert sorted(sp) == sorted(truth)
        assert all(
            torch.equal(sp[k].view(torch.uint8), v.view(torch.uint8)) for k, v in truth.items()
        )
        sp_cfg = json.loads((root / "sp_adapter" / "adapter_config.json").read_text())
        assert sorted(os.listdir(root / "sp_adapter")) == sorted(os.listdir(out))
        if not rslora:  # task_type comes from config.json's architectures, which a model
            # built from a config (never from_pretrained) does not have: null then
            assert sp_cfg.pop("task_type") is None and peft_cfg.pop("task_type") == "CAUSAL_LM"
            assert _comparable(sp_cfg) == _comparable(peft_cfg)
            peft_cfg["task_type"] = "CAUSAL_LM"
    loaded = PeftModel.from_pretrained(_base(0, dtype), str(out))  # frozen base: seed 0 init
    want = PeftModel.from_pretrained(_base(0, dtype), str(root / "peft_adapter"))
    assert torch.equal(_logits(loaded), _logits(want))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("path", ["while_written", "in_place"])
def test_merge_lora_equals_merge_and_unload(
    trained: Any, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Each target weight merged as the executor writes it, in row blocks (a 384-byte buffer:
    3 fp32 rows of 16 columns, 16 = 5*3 + 1; 6 bf16 ones), or, where it cannot (ranks sharing
    the copy, a cast), copied and then merged in place (blocks of 3 rows too)."""
    from transformers import AutoModelForCausalLM

    from ckptools.views import lora

    consolidate_module = importlib.import_module("ckptools.verbs.consolidate")  # not the function

    monkeypatch.setattr(lora, "MERGE_BLOCK_ELEMENTS", 3 * 16)
    if path == "in_place":
        monkeypatch.setattr(consolidate_module, "in_row_blocks", lambda plan, block: False)
    rewrites: list[int] = []
    merge_into = lora.merge_into
    monkeypatch.setattr(lora, "merge_into", lambda *a: rewrites.append(len(a[2])) or merge_into(*a))

    root, rslora, _ = trained
    out = root / f"ours_merged_{path}"
    cfg = root / "peft_adapter" / "adapter_config.json"
    options: dict[str, Any] = {"adapter_config": str(cfg)} if rslora else {"lora_alpha": _ALPHA}
    ckptools.consolidate(
        str(root / "src"), str(out), merge_lora=True, config=str(root / "base_config"),
        quiet=True, overwrite=True, workers=1, memory_budget=384, **options,
    )  # fmt: skip
    # each target weight written once, merged, or copied then rewritten
    assert (sum(rewrites) == 0) == (path == "while_written"), rewrites
    truth, got = _merged_tensors(root / "peft_merged"), _merged_tensors(out)
    assert sorted(got) == sorted(truth)
    assert not any("lora" in k or "base_layer" in k or k.startswith("base_model") for k in got)
    changed = 0
    for k, v in truth.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6, msg=k)
        changed += ".q_proj." in k or ".v_proj." in k
    assert changed == 4
    # a merge that forgot the adapter would equal the frozen base: it must not
    base = _base(0, truth["lm_head.weight"].dtype).state_dict()
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])  # fmt: skip
    ours = AutoModelForCausalLM.from_pretrained(str(out))
    want = AutoModelForCausalLM.from_pretrained(str(root / "peft_merged"))
    torch.testing.assert_close(_logits(ours), _logits(want), rtol=0, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
def test_missing_alpha_refused_and_inspect_names_the_adapter(trained: Any) -> None:
    root, _, _ = trained
    for flag in ("adapter", "merge_lora"):
        with pytest.raises(UsageError, match="--lora-alpha"):
            ckptools.consolidate(str(root / "src"), str(root / f"no_{flag}"), quiet=True,
                                 **{flag: True})  # fmt: skip
        assert not (root / f"no_{flag}").exists()
    r = CliRunner().invoke(cli, ["consolidate", str(root / "src"), str(root / "x"), "--merge-lora"])
    assert r.exit_code == 2 and "--lora-alpha" in r.output and "Traceback" not in r.output
    peft_info = ckptools.inspect(str(root / "src")).to_dict()["peft"]
    adapter = peft_info["adapters"]["default"]
    assert adapter["target_modules"] == ["q_proj", "v_proj"] and adapter["ranks"] == [4]
    assert adapter["modules"] == 4
    trained_names = peft_info["with_optimizer_state"]
    assert len(trained_names) == 8 and all(".lora_" in n for n in trained_names)
    # embeddings, lm_head, final norm + 9 per layer (base q and v among them) are frozen
    assert peft_info["frozen_parameters"] == 3 + 2 * 9 and peft_info["trainable_parameters"] == 8
    r = CliRunner().invoke(cli, ["inspect", str(root / "src")])
    assert "LoRA adapter 'default': 4 modules, target modules q_proj, v_proj, rank 4" in r.output


def _consolidate_on_ranks(rank: int, world_size: int, src: str, out: str, config: str) -> list[str]:
    """Every rank: ``ckptools.consolidate`` inside the process group (the torchrun mode): the
    ranks copy shares of the bytes, rank 0 merges and commits."""
    r = ckptools.consolidate(
        src, out, merge_lora=True, lora_alpha=_ALPHA, config=config, quiet=True
    )
    return list(r.notes)


@pytest.mark.distributed
@pytest.mark.slow
def test_merge_lora_by_two_ranks_and_adapter_from_the_cli(trained: Any) -> None:
    root, rslora, _ = trained
    if rslora:
        pytest.skip("one producer is enough for the torchrun path")
    out = root / "ranks_merged"
    notes = run_ranks(
        _consolidate_on_ranks, 2, str(root / "src"), str(out), str(root / "base_config")
    )
    assert "written by 2 ranks" in notes[0]
    truth, got = _merged_tensors(root / "peft_merged"), _merged_tensors(out)
    assert sorted(got) == sorted(truth)
    for k, v in truth.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6, msg=k)
    cli_out = root / "cli_adapter"
    r = CliRunner().invoke(
        cli, ["consolidate", str(root / "src"), str(cli_out), "--adapter", "--lora-alpha", "16",
              "--config", str(root / "base_config"), "--quiet"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    want = _tensors(root / "peft_adapter", "adapter_model.safetensors")
    got = _tensors(cli_out, "adapter_model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.distributed
def test_plain_consolidate_of_a_peft_model_is_refused_naming_the_ways(trained: Any) -> None:
    """Without --merge-lora or --adapter the output would hold peft's names
    (``base_model.model.*``, ``lora_A/B``), which ``from_pretrained`` loads as missing and
    unexpected keys: refused in one line naming both flags and the ``--select`` that keeps the
    raw names, which then works."""
    import re

    root, _, _ = trained
    src, out = str(root / "src"), root / "plain"
    with pytest.raises(UsageError, match="--merge-lora") as caught:
        ckptools.consolidate(src, str(out), config=str(root / "base_config"), quiet=True)
    assert "--adapter" in str(caught.value) and not out.exists()
    r = CliRunner().invoke(cli, ["consolidate", src, str(out), "--config",
                                 str(root / "base_config")])  # fmt: skip
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert "--merge-lora" in r.output and "--adapter" in r.output and not out.exists()
    select = re.search(r"--select (\S+) keeps", r.output)
    assert select is not None, r.output
    r = CliRunner().invoke(cli, ["consolidate", src, str(out), "--quiet",
                                 "--select", select.group(1).strip("'")])  # fmt: skip
    assert r.exit_code == 0, r.output
    names = set()
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names.update(st.keys())
    assert any(".lora_A.default." in n for n in names)
    assert all(n.startswith("base_model.model.") for n in names if ".lora_" in n)


def _save_pretrained_without_a_way(rank: int, world_size: int, root: str) -> list[str]:
    """Every rank: the FSDP2-wrapped peft model given to ``ckptools.save_pretrained`` plainly,
    then with a LoRA argument but no ``adapter``; each call's error, as this rank saw it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _peft(0, False)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    seen = []
    for kwargs in ({}, {"lora_alpha": _ALPHA}):
        with pytest.raises(UsageError) as caught:
            ckptools.save_pretrained(model, os.path.join(root, "out"), **kwargs)
        seen.append(str(caught.value))
    return seen


@pytest.mark.distributed
def test_save_pretrained_of_a_peft_model_names_its_arguments(tmp_path: Path) -> None:
    """``save_pretrained`` shares consolidate's planning, but takes arguments, not flags, and
    has no merge_lora or select: its refusal of a PEFT model names what it does take, on every
    rank, and writes nothing."""
    errors = run_ranks(_save_pretrained_without_a_way, 2, str(tmp_path), timeout=300)
    for plain, alpha_only in errors:
        assert "PEFT-wrapped model" in plain and "adapter=True" in plain, plain
        assert "merge_and_unload()" in plain and "merge_lora=True" in plain, plain
        assert "--" not in plain and "\n" not in plain, plain
        assert "adapter=True" in alpha_only and "--" not in alpha_only, alpha_only
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out")]
