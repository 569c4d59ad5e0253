"""Megatron's distributed-optimizer state read from real Megatron-core saves, against the truth
the saving job held.

The fixtures under ``fixtures/megatron/`` are written by Megatron-core 0.19.2 itself (its
``save_checkpoint``, on gloo/CPU, see ``fixtures/megatron/generate.py``); each ``<case>.truth.pt``
holds what the job's DistributedOptimizer held when it saved, gathered with torch collectives:
the fp32 masters and Adam moments per parameter (TP-gathered, per layer) and every buffer's
parameter ranges. ckptools derives the ranges from the saved bucket sizes alone and reads the
state as byte runs; both must equal the truth bit-exactly.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptools.core.manifest import TensorEntry
from ckptools.producers import read_manifest
from ckptools.producers.megatron import masters as megatron_masters
from ckptools.producers.megatron import optimizer as mo

FIXTURES = Path(
    os.environ.get("CKPTOOLS_MEGATRON_FIXTURES")
    or Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
)
CASES = ("tp2_pp1", "tp1_pp2", "tp2_pp2_bf16", "dp2", "dp2_fully_reshardable", "qwen2_tp2")
#: the checkpoint's stacked names of the local layer spec's modules (its norms are saved under
#: the fused linear layers' names)
LAYER_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
TRUTH_SECTIONS = {"param": "masters", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def _case(name: str) -> tuple[Path, dict[str, Any]]:
    path = FIXTURES / name
    if not path.is_dir():
        pytest.skip(f"no Megatron fixture {path} (fixtures/megatron/generate.py writes it)")
    return path, torch.load(FIXTURES / f"{name}.truth.pt", weights_only=False)


def _stored(name: str) -> tuple[str, int | None]:
    """A truth name (``decoder.layers.3.input_layernorm.weight``) as the checkpoint's FQN and
    layer."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"] and parts[2].isdigit():
        rest = ".".join(parts[3:])
        return "decoder.layers." + LAYER_NAMES.get(rest, rest), int(parts[2])
    return name, None


def _read(root: Path, entry: TensorEntry) -> np.ndarray:
    """An entry's value from its raw chunks, with numpy (no ckptools reader)."""
    out = np.full(entry.shape, np.nan, dtype=np.float32)
    for c in entry.chunks:
        with open(root / c.file, "rb") as f:
            f.seek(c.offset)
            blob = f.read(c.length)
        if c.encoding == "raw":
            data = np.frombuffer(blob, dtype=np.float32).reshape(c.sizes)
        else:  # a DCP item: torch.save of the chunk, read by torch itself
            data = torch.load(io.BytesIO(blob), weights_only=True).numpy()
        out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))] = data
    return out


@pytest.mark.parametrize("name", CASES)
def test_the_state_read_from_the_buckets_is_what_the_optimizer_held(name: str) -> None:
    path, truth = _case(name)
    manifest = read_manifest(str(path))
    opt = megatron_masters.read_optimizer(manifest)
    assert opt is not None
    assert opt.sharding == truth["distrib_optim_sharding_type"]
    root = Path(manifest.data_dir())
    for kind, section in TRUTH_SECTIONS.items():
        values = {fqn: _read(root, e) for fqn, e in opt.state[kind].items()}
        assert len(truth[section]) >= len(values) > 0
        for truth_name, want in truth[section].items():
            fqn, layer = _stored(truth_name)
            got = values[fqn] if layer is None else values[fqn][layer]
            want = want.to(torch.float32).numpy()
            assert got.shape == want.shape, (kind, truth_name)
            assert got.tobytes() == want.tobytes(), (kind, truth_name)
    assert opt.step == truth["optimizer_step"]
    assert [g["weight_decay"] for g in opt.param_groups] == [
        g["weight_decay"] for g in truth["param_groups"]
    ]


@pytest.mark.parametrize("name", [c for c in CASES if "fully" not in c])
def test_the_derived_ranges_are_the_buffers_megatron_built(name: str) -> None:
    """Every rank's buffer ranges (recorded by the job) equal the ranges derived from the saved
    ``per_bucket_numel`` alone."""
    path, truth = _case(name)
    manifest = read_manifest(str(path))
    model = [
        mo.ModelTensor(f, e.shape, tuple({(c.offsets, c.sizes) for c in e.chunks}))
        for f, e in manifest.tensors.items()
        if not f.startswith("optimizer.")
    ]
    tp, pp = truth["tp"], truth["pp"]
    layers = manifest.details["megatron"]["num_layers"]
    staged = mo.stage_params(model, tp=tp, pp=pp, num_layers=layers, tied=not _untied(manifest))
    for rank in truth["ranks"]:
        (buffer,) = rank["buffers"]
        (unpadded,) = rank["per_bucket_numel_unpadded"][0].values()
        (padded,) = rank["per_bucket_numel"][0].values()
        group = rank["tp"] + tp * rank["pp"]
        ranges = mo.place_params(staged[group], unpadded, padded, truth["dp"])
        starts = [b["offset"] for b in buffer["buckets"]]
        got = [(r.param.fqn, r.start + starts[r.bucket], r.bucket) for r in ranges]
        want = [(_stored(n)[0], s, b) for n, s, _, b in buffer["params"]]
        assert got == want


def _untied(manifest: Any) -> bool:
    return manifest.details["megatron"]["untie_embeddings_and_output_weights"] is not False


@pytest.mark.parametrize("name", ["tp2_pp2_bf16", "dp2", "dp2_fully_reshardable", "qwen2_tp2"])
def test_consolidate_masters_writes_the_fp32_masters_under_hf_names(
    name: str, tmp_path: Path
) -> None:
    """``consolidate --masters``: the HF model holds the optimizer's fp32 masters (a bf16 run's
    weights are their rounding), bit for bit, and transformers loads it."""
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from ckptools.cli.main import cli
    from tests.support.megatron_truth import hf_truth

    path, truth = _case(name)
    config = tmp_path / "hf"
    config.mkdir()
    cfg = truth["hf_config"]
    (config / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    out = tmp_path / "out"
    args = ["consolidate", str(path), str(out), "--masters", "--config", str(config), "-q"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    got = load_file(str(out / "model.safetensors"))
    want = hf_truth(truth, "masters")
    assert set(got) == set(want)
    for n, t in want.items():
        assert got[n].dtype == torch.float32 and torch.equal(got[n], t), n
    if "bfloat16" in str(truth["params_dtype"]):  # the stored weights are not the masters
        plain = tmp_path / "plain"
        args = ["consolidate", str(path), str(plain), "--config", str(config), "-q"]
        assert CliRunner().invoke(cli, args).exit_code == 0
        stored = load_file(str(plain / "model.safetensors"))
        assert all(stored[n].dtype != torch.float32 for n in want)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert torch.equal(model.model.embed_tokens.weight, want["model.embed_tokens.weight"])


def test_masters_of_a_checkpoint_without_a_distributed_optimizer_is_refused(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ckptools.cli.main import cli

    src = FIXTURES.parent / "dcp_single"
    result = CliRunner().invoke(cli, ["consolidate", str(src), str(tmp_path / "o"), "--masters"])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and "--masters" in line and "drop --masters" in line, line


@pytest.mark.parametrize("option", [["--adapter"], ["--merge-lora"], ["--select", "model."]])
def test_masters_with_a_lora_or_selection_option_is_refused_in_the_producers_words(
    tmp_path: Path, option: list[str]
) -> None:
    """The refusal names what ``--masters`` exports as the producer's package declares it
    (``MASTERS_MODEL``), before anything is read or written."""
    from click.testing import CliRunner

    from ckptools.cli.main import cli

    out = tmp_path / "o"
    args = ["consolidate", str(FIXTURES / "tp2_pp1"), str(out), "--masters", *option]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert result.output == (
        "error: --masters exports a Megatron model: drop --adapter, --merge-lora and --select\n"
    )
    assert not out.exists()


def test_buckets_that_do_not_add_up_are_refused_in_one_line(tmp_path: Path) -> None:
    """A save whose saved bucket sizes were altered (what a layout change in a future Megatron
    would look like) is refused before anything is written, naming the way forward."""
    from click.testing import CliRunner

    from ckptools.cli.main import cli

    path, truth = _case("dp2")
    (numels,) = truth["ranks"][0]["per_bucket_numel_unpadded"][0].values()
    n = numels[0]
    manifest = read_manifest(str(path))
    entry = next(
        e for f, e in manifest.objects.items() if "per_bucket_numel_unpadded" in f and e.file
    )
    work = tmp_path / "dp2"
    shutil.copytree(path, work)
    data_dir = Path(manifest.data_dir()).relative_to(path)
    target = work / data_dir / entry.file
    blob = bytearray(target.read_bytes())
    # the pickled bucket size (BININT2 or BININT) one alignment gap smaller: no longer adds up
    code, fmt = (b"M", "<H") if n < 2**16 else (b"J", "<i")
    record = blob[entry.offset : entry.offset + entry.length]
    at = record.find(code + struct.pack(fmt, n))
    assert at >= 0
    fixed = code + struct.pack(fmt, n - 64)
    blob[entry.offset + at : entry.offset + at + len(fixed)] = fixed
    target.write_bytes(bytes(blob))
    result = CliRunner().invoke(
        cli, ["reshard", str(work), str(tmp_path / "o"), "--world-size", "2"]
    )
    assert result.exit_code == 1, result.output
    line = result.output.strip()
    assert "\n" not in line and "do not add up" in line and "--drop-optimizer" in line, line
    assert not (tmp_path / "o").exists()
