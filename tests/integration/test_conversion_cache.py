"""transformers' conversion rules derived once per model and kept in the user's cache.

Truth: the rules derived afresh from the installed transformers
(:func:`ckptools.plan.conversions.rules_for`) on files a Qwen3-MoE's own ``save_pretrained``
wrote, and ``ckpt consolidate`` of a DCP that torch's ``dcp.save`` wrote: the second run reads
the cache (imports no transformers) and writes the same bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptools.io import user_cache
from ckptools.plan import conversion_cache
from ckptools.plan.conversion_cache import keymap_for
from ckptools.plan.conversions import rules_for

ROOT = Path(__file__).resolve().parents[2]


def _qwen3_moe(experts: int = 4) -> Any:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts_per_tok=2,
        num_experts=experts, moe_intermediate_size=8, tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(config)


def _published(root: Path, experts: int = 4) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """config.json and the tensors' shapes of a Qwen3-MoE as its ``save_pretrained`` writes it."""
    from ckptools.producers.hf.safetensors import read_safetensors

    out = root / f"qwen3-moe-{experts}"
    _qwen3_moe(experts).save_pretrained(str(out))
    config = json.loads((out / "config.json").read_text())
    return config, {k: e.shape for k, e in read_safetensors(str(out)).tensors.items()}


def _entries(cache: Path) -> list[Path]:
    return sorted(cache.rglob("*.json"))


def test_derived_once_then_read_back_damage_derived_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("CKPTOOLS_CACHE_DIR", str(cache))
    config, shapes = _published(tmp_path)
    truth = rules_for(config).to_memory(shapes)  # type: ignore[union-attr]
    assert truth.converted

    capsys.readouterr()
    first = keymap_for(config, shapes, "memory")
    assert first == truth
    said = capsys.readouterr().err
    assert "reading transformers" in said and "Qwen3MoeForCausalLM" in said and str(cache) in said
    (entry,) = _entries(cache)
    assert entry.parent.name == "Qwen3MoeForCausalLM"
    assert entry.parent.parent.name == conversion_cache._version()

    def underived(*a: Any) -> Any:
        raise AssertionError("derived again although cached")

    with monkeypatch.context() as m:
        m.setattr(conversion_cache, "rules_for", underived)
        assert keymap_for(config, shapes, "memory") == truth
        assert keymap_for(config, shapes, "memory", quiet=True) == truth
    assert capsys.readouterr().err == ""  # no status line when read from the cache

    # the other direction, and another model (8 experts), are entries of their own
    assert keymap_for(config, dict(truth.memory_shapes), "disk") == rules_for(config).to_disk(  # type: ignore[union-attr]
        dict(truth.memory_shapes)
    )
    config8, shapes8 = _published(tmp_path, experts=8)
    assert keymap_for(config8, shapes8, "memory") == rules_for(config8).to_memory(shapes8)  # type: ignore[union-attr]
    assert len(_entries(cache)) == 3

    good = entry.read_bytes()
    damaged = [
        b"", b"{", good[: len(good) // 2], b"[]",
        good.replace(b'"format": 1', b'"format": 99'),
        good.replace(b'"pieces": [[', b'"pieces": [[7, '),
        good.replace(b'gate_up_proj"', b'gate_up_projX"', 1),  # parses, but not what was kept
        good.replace(b", 0, ", b", 1, ", 1),
    ]  # fmt: skip
    assert all(bad != good for bad in damaged)
    for bad in damaged:
        entry.write_bytes(bad)
        assert keymap_for(config, shapes, "memory", quiet=True) == truth, bad[:20]
        assert entry.read_bytes() == good  # rewritten whole
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".tmp-")]


def test_cache_that_cannot_be_written_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, shapes = _published(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("CKPTOOLS_CACHE_DIR", str(blocker))
    assert keymap_for(config, shapes, "memory", quiet=True) == rules_for(config).to_memory(shapes)  # type: ignore[union-attr]


def test_cache_dir_override_then_xdg_then_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CKPTOOLS_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert user_cache.cache_dir() == str(tmp_path / "home" / ".cache" / "ckptools")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec: absolute only
    assert user_cache.cache_dir() == str(tmp_path / "home" / ".cache" / "ckptools")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache.cache_dir() == str(tmp_path / "xdg" / "ckptools")
    monkeypatch.setenv("CKPTOOLS_CACHE_DIR", str(tmp_path / "mine"))
    assert user_cache.cache_dir() == str(tmp_path / "mine")


_CONSOLIDATE = """
import sys
from click.testing import CliRunner
from ckptools.cli.main import cli
run = CliRunner().invoke(cli, ["consolidate", sys.argv[1], sys.argv[2]])
sys.stderr.write(run.output)
print("transformers" in sys.modules, run.exit_code)
"""


def test_second_consolidate_reads_the_cache_and_imports_no_transformers(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = _qwen3_moe()
    src = tmp_path / "dcp"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(src))  # one process: no group
    model.config.save_pretrained(str(src))
    env = {**os.environ, "CKPTOOLS_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", _CONSOLIDATE, str(src)]
    kw: dict[str, Any] = {"cwd": ROOT, "env": env, "capture_output": True, "text": True}
    runs = [subprocess.run([*argv, str(tmp_path / o)], check=True, **kw) for o in ("hf1", "hf2")]
    assert runs[0].stdout.split() == ["True", "0"]
    assert runs[1].stdout.split() == ["False", "0"]
    assert "reading transformers" in runs[0].stderr
    assert "reading transformers" not in runs[1].stderr
    for name in os.listdir(tmp_path / "hf1"):
        assert (tmp_path / "hf1" / name).read_bytes() == (tmp_path / "hf2" / name).read_bytes()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf2" / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in f.keys()  # noqa: SIM118
