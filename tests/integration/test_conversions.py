"""``ckptools.plan.conversions`` against transformers' own conversion, on real tiny MoE models.

The truth is transformers itself: ``revert_weight_conversion`` (what ``save_pretrained`` writes)
for the on-disk names and values, and the model's own state dict for the in-memory form. The
byte geometry (a box of a stored chunk sharded on any dim) is checked through the real executor
against numpy slicing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptools.core.manifest import Chunk, FileInfo, Manifest, TensorEntry
from ckptools.engine.executor import execute
from ckptools.errors import UnsupportedCheckpointError
from ckptools.plan.conversion_entries import split_entries
from ckptools.plan.conversions import Piece, rules_for
from ckptools.plan.safetensors import plan_consolidation

_COMMON: dict[str, Any] = dict(
    vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts_per_tok=2,
)  # fmt: skip


def _model(arch: str) -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    if arch == "qwen3_moe":
        config = Qwen3MoeConfig(num_experts=3, moe_intermediate_size=8, **_COMMON)
        return Qwen3MoeForCausalLM(config)
    return MixtralForCausalLM(MixtralConfig(num_local_experts=3, **_COMMON))


def _box(t: torch.Tensor, p: Piece) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(p.offsets, p.sizes, strict=True))]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_both_directions_agree_with_transformers(arch: str) -> None:
    from transformers.core_model_loading import revert_weight_conversion

    model = _model(arch)
    memory = model.state_dict()
    disk = revert_weight_conversion(model, dict(memory))
    rules = rules_for(model.config.to_dict())
    assert rules is not None

    to_disk = rules.to_disk({k: tuple(v.shape) for k, v in memory.items()})
    assert sorted(p.disk for p in to_disk.pieces) == sorted(disk)
    for p in to_disk.pieces:
        assert p.disk_shape == tuple(disk[p.disk].shape), p
        assert torch.equal(_box(memory[p.memory], p).reshape(p.disk_shape), disk[p.disk]), p
    assert len(to_disk.rules) >= 2 and all("experts" in r or r == "rename" for r in to_disk.rules)

    to_memory = rules.to_memory({k: tuple(v.shape) for k, v in disk.items()})
    assert dict(to_memory.memory_shapes) == {k: tuple(v.shape) for k, v in memory.items()}
    assert set(to_memory.pieces) == set(to_disk.pieces)


def test_models_without_a_conversion_keep_their_names() -> None:
    assert rules_for(None) is None
    assert rules_for({}) is None
    assert rules_for({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}) is None
    assert rules_for({"model_type": "no-such-model-type"}) is None


def test_an_operation_that_is_not_a_stack_or_join_is_refused_by_name() -> None:
    # inkling_mm_model's experts are Interleave'd: not runs of whole parts
    rules = rules_for({"model_type": "inkling_mm_model"})
    assert rules is not None
    with pytest.raises(UnsupportedCheckpointError, match="Interleave"):
        rules.to_memory({"model.layers.0.mlp.experts.w13_weight": (4, 8, 16)})
    with pytest.raises(UnsupportedCheckpointError, match="Interleave"):
        rules.to_disk({"model.layers.0.mlp.experts.gate_up_proj": (4, 8, 16)})


def test_a_sub_models_operation_that_is_not_a_byte_run_is_refused_by_name() -> None:
    """Qwen3-VL-MoE (a VLM built on ``meta`` to find its rules) transposes its text model's
    experts on load: refused, naming the operation."""
    from transformers import Qwen3VLMoeConfig

    text = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=3,
        moe_intermediate_size=8, rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2]},
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=24, out_hidden_size=16)
    config = Qwen3VLMoeConfig(text_config=text, vision_config=vision).to_dict()
    rules = rules_for({**config, "architectures": ["Qwen3VLMoeForConditionalGeneration"]})
    assert rules is not None
    with pytest.raises(UnsupportedCheckpointError, match="Transpose"):
        rules.to_disk({"model.language_model.layers.0.mlp.experts.gate_up_proj": (3, 16, 16)})


def test_incomplete_experts_are_refused() -> None:
    rules = rules_for({"model_type": "qwen3_moe"})
    assert rules is not None
    shapes = {f"model.layers.0.mlp.experts.{e}.down_proj.weight": (4, 2) for e in (0, 2)}
    with pytest.raises(UnsupportedCheckpointError, match="incomplete"):
        rules.to_memory(shapes)


@pytest.mark.parametrize(
    "boxes",
    [
        [((0, 0, 0), (2, 6, 5)), ((2, 0, 0), (1, 6, 5))],  # FSDP2 rows on the experts
        [((0, 0, 0), (3, 4, 5)), ((0, 4, 0), (3, 2, 5))],  # split inside the joined dim
        [((0, 0, 0), (3, 6, 2)), ((0, 0, 2), (3, 6, 3))],  # split on the last dim (strided)
        [((0, 0, 0), (1, 6, 5)), ((1, 0, 0), (2, 1, 5)), ((1, 1, 0), (2, 5, 5))],
    ],
)
def test_split_boxes_of_any_chunking_copy_the_right_bytes(
    tmp_path: Path, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> None:
    """A fused [3 experts, 2x3, 5] tensor stored as ``boxes`` (hand-made chunking, real
    executor): every per-expert half equals numpy's slice of the fused tensor."""
    fused = np.arange(3 * 6 * 5, dtype=np.float32).reshape(3, 6, 5)
    chunks, pos = [], 0
    with open(tmp_path / "data", "wb") as f:
        for offsets, sizes in boxes:
            part = np.ascontiguousarray(
                fused[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]
            )
            f.write(part.tobytes())
            chunks.append(Chunk(offsets, sizes, "data", pos, part.nbytes))
            pos += part.nbytes
    name = "model.layers.0.mlp.experts.gate_up_proj"
    entry = TensorEntry(name, "float32", (3, 6, 5), tuple(chunks))
    manifest = Manifest(str(tmp_path), "safetensors", "hf", {name: entry}, {},
                        {"data": FileInfo("data", pos)})  # fmt: skip
    rules = rules_for({"model_type": "qwen3_moe"})
    assert rules is not None
    keymap = rules.to_disk({name: (3, 6, 5)})
    derived, names, unchecked = split_entries(manifest, {name: name}, keymap, lambda e, c: c)
    assert len(names) == 6 and not unchecked
    plan = plan_consolidation(derived, names, max_shard_size=10**9)
    out = tmp_path / "out"
    os.mkdir(out)
    execute(plan, derived, str(out), quiet=True)
    from safetensors.numpy import load_file

    got = load_file(str(out / "model.safetensors"))
    for e in range(3):
        for h, half in enumerate(("gate_proj", "up_proj")):
            key = f"model.layers.0.mlp.experts.{e}.{half}.weight"
            np.testing.assert_array_equal(got[key], fused[e, 3 * h : 3 * h + 3])


def test_without_transformers_names_stay_as_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert rules_for({"model_type": "qwen3_moe"}) is None


def _dcp_of_fused_model(tmp_path: Path) -> tuple[Path, Path, Any]:
    """A one-process ``dcp.save`` of a Qwen3-MoE state dict (fused experts), its config beside."""
    import torch.distributed.checkpoint as dcp

    model = _model("qwen3_moe")
    src = tmp_path / "dcp"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(src))
    hf = tmp_path / "hf"
    model.save_pretrained(str(hf))
    return src, hf, model


def test_a_damaged_record_split_over_experts_is_caught(tmp_path: Path) -> None:
    """Each expert's gate and up halves are cut from one stored record; a flipped byte in it
    fails the record's CRC-32 although no output tensor copies the record whole."""
    from ckptools import consolidate, read_manifest
    from ckptools.engine.reader import resolve_chunk
    from ckptools.errors import CorruptCheckpointError
    from ckptools.io.storage import open_reader

    src, hf, _ = _dcp_of_fused_model(tmp_path)
    consolidate(str(src), str(tmp_path / "good"), config=str(hf), quiet=True)
    fqn = "model.model.layers.1.mlp.experts.gate_up_proj"
    entry = read_manifest(str(src)).tensors[fqn]
    with open_reader(str(src)) as reader:
        raw = resolve_chunk(reader, entry, entry.chunks[0])
    assert raw.crc32 is not None
    with open(src / raw.file, "r+b") as f:
        f.seek(raw.offset + raw.length - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CorruptCheckpointError, match=f"CRC-32.*{fqn}|{fqn}.*CRC-32"):
        consolidate(str(src), str(tmp_path / "bad"), config=str(hf), quiet=True)
    assert not (tmp_path / "bad").exists()
    # a dry run plans without reading tensor bytes
    plan = consolidate(str(src), str(tmp_path / "bad"), config=str(hf), dry_run=True)
    assert plan.tensors == len(_tensors_of(hf))


def _tensors_of(directory: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return list(f.keys())


def _fused_model(arch: str) -> Any:
    """A tiny real model whose files hold a tensor transformers ``Chunk`` s on load (Dinov2's
    SwiGLU ``weights_in``, HRM-Text's ``gate_up_proj`` and ``gqkv_proj``) or whose files hold
    parts it ``Concatenate`` s (OLMo-Hybrid's q/k/v ``conv1d``), or whose rules transformers
    scopes to a sub-model (Dinov2ForImageClassification's ``dinov2``, Qwen3.5-MoE's text model)."""
    import transformers

    torch.manual_seed(0)
    if arch.startswith("Dinov2"):
        dinov2 = transformers.Dinov2Config(hidden_size=16, num_hidden_layers=2, num_labels=3,
            num_attention_heads=2, image_size=28, patch_size=14, use_swiglu_ffn=True)  # fmt: skip
        return getattr(transformers, arch)(dinov2)
    if arch == "qwen3_5_moe":  # a VLM whose text model's experts are fused: a scoped sub-model
        text = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=3,
            moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts_per_tok=2,
        )  # fmt: skip
        vision = dict(
            depth=1, hidden_size=16, num_heads=2, intermediate_size=24, out_hidden_size=16
        )
        return transformers.Qwen3_5MoeForConditionalGeneration(
            transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
        )
    extra = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": None}
    config = transformers.AutoConfig.for_model(
        arch, vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, **(extra if arch == "olmo_hybrid" else {}),
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config)


def _run(model: Any) -> torch.Tensor:
    with torch.no_grad():
        if type(model).__name__.startswith("Dinov2"):
            torch.manual_seed(1)
            out = model(torch.randn(1, 3, 28, 28))
            return out.logits if hasattr(out, "logits") else out.last_hidden_state  # type: ignore[no-any-return]
        return model(torch.arange(12).reshape(2, 6) % 32, use_cache=False).logits  # type: ignore[no-any-return]


# the kind of rule each uses; the last two only through a sub-model's scoped mapping
_FUSED = {"Dinov2Model": "chunk", "hrm_text": "chunk", "olmo_hybrid": "join",
          "Dinov2ForImageClassification": "chunk", "qwen3_5_moe": "stack"}  # fmt: skip


@pytest.mark.parametrize("arch", _FUSED)
def test_chunk_and_concatenate_rules_agree_with_transformers(arch: str) -> None:
    """Both directions of ``Chunk``-only and ``Concatenate``-only rules, and of rules that
    transformers applies to a sub-model only (scoped to its prefix): the names, shapes and
    values ``revert_weight_conversion`` gives, and back to the model's state dict."""
    from transformers.core_model_loading import revert_weight_conversion

    model = _fused_model(arch)
    memory = model.state_dict()
    disk = revert_weight_conversion(model, dict(memory))
    rules = rules_for({**model.config.to_dict(), "architectures": [type(model).__name__]})
    assert rules is not None
    to_disk = rules.to_disk({k: tuple(v.shape) for k, v in memory.items()})
    assert sorted({p.disk for p in to_disk.pieces}) == sorted(disk)
    assert {f.kind for f in rules.fusions} == {_FUSED[arch]}
    assert ("scoped to language_model" in rules.mapping) == (arch == "qwen3_5_moe")
    for p in to_disk.pieces:
        assert p.disk_shape == tuple(disk[p.disk].shape), p
        if p.fused_on_disk:  # the in-memory tensor is a box of the file tensor
            assert torch.equal(_box(disk[p.disk], p), memory[p.memory]), p
        else:
            assert torch.equal(_box(memory[p.memory], p).reshape(p.disk_shape), disk[p.disk]), p
    assert any(p.fused_on_disk for p in to_disk.pieces) == (_FUSED[arch] == "chunk")
    to_memory = rules.to_memory({k: tuple(v.shape) for k, v in disk.items()})
    assert dict(to_memory.memory_shapes) == {k: tuple(v.shape) for k, v in memory.items()}
    assert set(to_memory.pieces) == set(to_disk.pieces)


@pytest.mark.parametrize("arch", _FUSED)
def test_chunk_and_concatenate_models_consolidate_and_shard(tmp_path: Path, arch: str) -> None:
    """A DCP of the in-memory state consolidates to exactly ``save_pretrained``'s tensors (and
    ``from_pretrained`` of it runs the same); ``diff`` calls them identical; ``shard`` of the
    published directory gives a DCP that loads back into the model's own state dict."""
    import torch.distributed.checkpoint as dcp

    import ckptools

    model = _fused_model(arch)
    src, hf = tmp_path / "dcp", tmp_path / "hf"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(src))
    model.save_pretrained(str(hf))
    out = tmp_path / "out"
    ckptools.consolidate(str(src), str(out), config=str(hf), quiet=True)
    want = _read(hf)
    got = _read(out)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert v.dtype == got[k].dtype and torch.equal(
            v.view(torch.uint8), got[k].view(torch.uint8)
        )
    assert torch.equal(_run(type(model).from_pretrained(str(out))), _run(model))
    report = ckptools.diff(str(src), str(hf))
    assert report.identical and any(
        f"transformers {rules_for_name(model)}" in n for n in report.notes
    )

    sharded = tmp_path / "sharded"
    ckptools.shard(str(hf), str(sharded), world_size=2, quiet=True)
    fresh = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load({"model": fresh}, checkpoint_id=str(sharded))
    for k, v in model.state_dict().items():
        assert torch.equal(fresh[k], v), k


def rules_for_name(model: Any) -> str:
    rules = rules_for({**model.config.to_dict(), "architectures": [type(model).__name__]})
    assert rules is not None
    return rules.model_type


def _read(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def test_save_pretrained_from_training_refuses_a_join_by_name(tmp_path: Path) -> None:
    """``ckptools.save_pretrained`` writes boxes of one stored tensor per file tensor; HRM-Text's
    ``gqkv_proj`` is joined from four in-memory tensors: refused by name (nothing written), and
    ``keep_in_memory_names`` writes the in-memory tensors."""
    import ckptools

    model = _fused_model("hrm_text")
    with pytest.raises(UnsupportedCheckpointError, match=r"gqkv_proj.*joined from.*q_proj"):
        ckptools.save_pretrained(model, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    ckptools.save_pretrained(model, str(tmp_path / "kept"), keep_in_memory_names=True)
    got = _read(tmp_path / "kept")
    assert sorted(got) == sorted(model.state_dict())


@pytest.mark.parametrize(
    "odd",
    [
        {"num_hidden_layers": 10**9},  # too many modules to build: not built
        {"hidden_size": "sixteen"},  # does not build
        {"architectures": ["AutoModel", "__class__", "os", "Dinov2Model"]},  # not model classes
    ],
)
def test_a_config_that_does_not_build_falls_back_to_the_roots_rules(odd: dict[str, Any]) -> None:
    """A hostile or odd config.json never runs anything but transformers' own model classes,
    and a model that does not build on ``meta`` is looked up by its root's names alone."""
    config = {"architectures": ["Dinov2Model"], "model_type": "dinov2", "use_swiglu_ffn": True}
    rules = rules_for({**config, **odd})
    built = "architectures" in odd  # names that are not model classes are skipped, then built
    assert rules is not None and rules.model_type == ("dinov2" if built else "Dinov2Model")
    assert {f.kind for f in rules.fusions} == {"chunk"}
