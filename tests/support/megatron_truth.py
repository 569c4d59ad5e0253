"""Megatron's ground truth (``fixtures/megatron/<case>.truth.pt``) under the Hugging Face model's
names, mapped here from the documented layout (per query group: its q heads, then k, then v;
fc1: gate rows then up rows; the padded vocabulary cut), independently of ckptools."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner, Result

from ckptools.cli.main import cli

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"


def truth(case: str, where: Path = FIXTURES) -> dict[str, Any]:
    """The ground truth of the fixture ``case`` (``<case>.truth.pt`` in ``where``)."""
    out: dict[str, Any] = torch.load(where / f"{case}.truth.pt", weights_only=True)
    return out


def invoke(*args: str) -> Result:
    """``ckpt ARGS`` in this process (an exception propagates: a traceback is a failure)."""
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def ok(*args: str) -> dict[str, Any]:
    """``ckpt ARGS --json`` (quiet where the verb writes), which must exit 0: its JSON."""
    quiet = ("-q",) if args[0] not in ("inspect", "list") else ()
    result = invoke(*args, "--json", *quiet)
    assert result.exit_code == 0, result.output
    out: dict[str, Any] = json.loads(result.output)
    return out


def config_file(tmp_path: Path, case: str) -> Path:
    """The HF ``config.json`` the truth of ``case`` records, written under ``tmp_path``."""
    path = tmp_path / f"{case}-config.json"
    path.write_text(truth(case)["hf_config"])
    return path


def hf_truth(truth: dict[str, Any], section: str) -> dict[str, Any]:
    """The truth's per-layer Megatron tensors under the HF model's names."""
    cfg = truth["hf_config"]
    cfg = json.loads(cfg) if isinstance(cfg, str) else cfg
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    vocab, q = cfg["vocab_size"], heads // groups
    out: dict[str, Any] = {}
    for name, t in truth[section].items():
        t = t.float()
        parts = name.split(".")
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t[:vocab]
        elif name == "output_layer.weight":
            out["lm_head.weight"] = t[:vocab]
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
        else:
            i, rest = parts[2], ".".join(parts[3:])
            pre = f"model.layers.{i}."
            if rest == "input_layernorm.weight":
                out[pre + rest] = t
            elif rest == "pre_mlp_layernorm.weight":
                out[pre + "post_attention_layernorm.weight"] = t
            elif rest.startswith("self_attention.linear_qkv."):
                kind = rest.rsplit(".", 1)[1]
                g = t.reshape(groups, q + 2, d, *t.shape[1:])
                out[pre + f"self_attn.q_proj.{kind}"] = g[:, :q].reshape(heads * d, *t.shape[1:])
                out[pre + f"self_attn.k_proj.{kind}"] = g[:, q].reshape(groups * d, *t.shape[1:])
                out[pre + f"self_attn.v_proj.{kind}"] = g[:, q + 1].reshape(
                    groups * d, *t.shape[1:]
                )
            elif rest == "self_attention.linear_proj.weight":
                out[pre + "self_attn.o_proj.weight"] = t
            elif rest == "mlp.linear_fc1.weight":
                half = t.shape[0] // 2
                out[pre + "mlp.gate_proj.weight"] = t[:half]
                out[pre + "mlp.up_proj.weight"] = t[half:]
            elif rest == "mlp.linear_fc2.weight":
                out[pre + "mlp.down_proj.weight"] = t
            else:
                raise AssertionError(f"no HF name for {name}")
    return {k: v.contiguous() for k, v in out.items()}


def hf_members(megatron: str) -> set[str]:
    """The HF parameters a Megatron parameter (a truth group member) becomes."""
    parts = megatron.split(".")
    table = {
        "embedding.word_embeddings.weight": ["model.embed_tokens.weight"],
        "output_layer.weight": ["lm_head.weight"],
        "decoder.final_layernorm.weight": ["model.norm.weight"],
    }
    if megatron in table:
        return set(table[megatron])
    i, rest = parts[2], ".".join(parts[3:])
    pre = f"model.layers.{i}."
    per = {
        "input_layernorm.weight": ["input_layernorm.weight"],
        "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
        "self_attention.linear_qkv.weight": [f"self_attn.{x}_proj.weight" for x in "qkv"],
        "self_attention.linear_qkv.bias": [f"self_attn.{x}_proj.bias" for x in "qkv"],
        "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
        "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
    }
    return {pre + x for x in per[rest]}
