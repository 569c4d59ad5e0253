"""ckptools reads what torch wrote, in one process: DCP (every dtype and shape kind),
safetensors directories and torch.save files, bit-exactly against the producer's own values."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

import ckptools
from tests.conftest import Produced
from tests.support.checks import (
    assert_inspect_agrees_with_torch_metadata,
    assert_model_tensors_equal,
    assert_reads_match_reference,
    inspect_json,
)
from tests.support.reference import load_reference


def test_single_process_dcp_every_dtype(produced: Callable[..., Produced]) -> None:
    p = produced("single")
    assert_inspect_agrees_with_torch_metadata(p.path, ["."])
    n = assert_reads_match_reference(p.path, p.ref_path)
    assert n >= 20
    report = inspect_json(p.path)
    dtypes_seen = {t["dtype"] for t in report["tensors"]}
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "bool", "uint64", "complex64"):
        assert name in dtypes_seen
    shapes = {t["fqn"]: t["shape"] for t in report["tensors"]}
    assert shapes["model.scalar_f32"] == [] and shapes["model.empty_0x3"] == [0, 3]
    assert report["model_part"]["prefix"] == "model."


def test_values_are_decoded_only_on_request(produced: Callable[..., Produced]) -> None:
    p = produced("single")
    plain = {o["fqn"]: o for o in inspect_json(p.path)["objects"]}
    assert all("value" not in o for o in plain.values())
    decoded = {o["fqn"]: o.get("value") for o in inspect_json(p.path, "--values")["objects"]}
    assert decoded["extra.epoch"] == 3
    assert decoded["extra.name"] == "single"
    assert decoded["extra.blob"] == {"type": "io.BytesIO", "bytes": len(b"\x00\x01binary\xff")}


def test_sharded_safetensors_directory(produced: Callable[..., Produced]) -> None:
    p = produced("hf_sharded")
    report = inspect_json(p.path)
    assert report["format"] == "safetensors"
    assert len(report["files"]) >= 2
    assert_model_tensors_equal(str(p.path), load_reference(p.ref_path)["model"])


def test_torch_save_full_state_dict(produced: Callable[..., Produced]) -> None:
    p = produced("torch_save")
    report = inspect_json(p.path)
    assert report["format"] == "torch_save"
    assert_model_tensors_equal(str(p.path), load_reference(p.ref_path)["model"])


def test_torch_save_shared_storage_and_views(tmp_path: object) -> None:
    from pathlib import Path

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd = {"a": base, "tied": base, "t": base.t(), "slice": base[1:3, ::2], "bf": base.bfloat16()}
    path = Path(str(tmp_path)) / "model.pt"
    torch.save(sd, path)
    manifest = ckptools.read_manifest(str(path))
    assert manifest.tensors["a"].chunks[0].offset == manifest.tensors["tied"].chunks[0].offset
    for fqn, expected in sd.items():
        assert torch.equal(ckptools.read_tensor(manifest, fqn), expected.contiguous()), fqn


def test_inspect_counts_a_tied_weight_once(tmp_path: Path) -> None:
    """``torch.save`` keeps a tied weight once under two names: inspect's totals count its
    elements and bytes once, as ``model.num_parameters()`` does, and name the alias."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=50, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    totals = ckptools.inspect(str(path)).to_dict()["totals"]
    assert totals["parameters"] == model.num_parameters()
    assert totals["bytes"] == model.num_parameters() * 4
    assert totals["tied_aliases"] == ["lm_head.weight"]
