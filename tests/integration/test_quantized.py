"""Issue 39, item 3: FP8-quantized model directories written by their producers
(fixtures/quantized/: llmcompressor 0.14's FP8_BLOCK, DeepSeek-V3's fp8 blocks; torchao 0.18's
Float8 weight-only save, live) dequantized by ``consolidate --dtype`` bit for bit as each
library reads them, copied as stored without ``--dtype``, shown by ``inspect``, refused by
name when not understood."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from ckptools.cli.main import cli

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures" / "quantized"
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _consolidate(src: Path, out: Path, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(cli, ["consolidate", str(src), str(out), "--quiet", *args])
    return r.exit_code, r.output


def _assert_bits_equal(out: Path, expected: Path, dtype: torch.dtype) -> None:
    got, want = load_file(str(out / "model.safetensors")), load_file(str(expected))
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for name, t in got.items():
        assert t.dtype == dtype, name
        w = want[name].to(dtype)
        assert torch.equal(t.view(_BITS[dtype]), w.view(_BITS[dtype])), name


@pytest.mark.parametrize("fixture", ["ct_fp8_block", "deepseek_fp8"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_consolidate_dtype_dequantizes_as_the_library_reads(
    fixture: str, dtype: str, tmp_path: Path
) -> None:
    out = tmp_path / "hf"
    code, output = _consolidate(FIXTURES / fixture, out, "--dtype", dtype)
    assert code == 0, output
    _assert_bits_equal(out, FIXTURES / f"{fixture}.expected.{dtype}.safetensors",
                       getattr(torch, dtype))  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config.get("dtype", config.get("torch_dtype")) == dtype
    source = json.loads((FIXTURES / fixture / "config.json").read_text())
    del source["quantization_config"]
    assert {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")} == {
        k: v for k, v in source.items() if k not in ("dtype", "torch_dtype")
    }


@pytest.mark.parametrize("fixture", ["ct_fp8_block", "deepseek_fp8"])
def test_dequantizing_a_few_rows_at_a_time_gives_the_same_bits(
    fixture: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table indices are made a few rows at a time (a cache-sized scratch per thread):
    one row at a time, blocks of rows split many times over, the library's bits still."""
    from ckptools.producers.compressed import dequantize

    monkeypatch.setattr(dequantize, "_INDEX_ELEMENTS", 1)
    out = tmp_path / "hf"
    code, output = _consolidate(FIXTURES / fixture, out, "--dtype", "bfloat16")
    assert code == 0, output
    expected = FIXTURES / f"{fixture}.expected.bfloat16.safetensors"
    _assert_bits_equal(out, expected, torch.bfloat16)


def test_the_dequantized_model_loads_and_diff_does_not_call_it_the_source(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    assert _consolidate(FIXTURES / "ct_fp8_block", out, "--dtype", "bfloat16")[0] == 0
    model = AutoModelForCausalLM.from_pretrained(str(out))
    want = load_file(str(FIXTURES / "ct_fp8_block.expected.bfloat16.safetensors"))
    for name, p in model.state_dict().items():
        assert torch.equal(p, want[name]), name
    r = CliRunner().invoke(cli, ["diff", str(FIXTURES / "ct_fp8_block"), str(out)])
    assert (
        r.exit_code != 0
        and "DIFFERENT" in r.output
        and "dtype float8_e4m3fn vs bfloat16" in r.output
    )
    # the way to the comparison that means something: A's plain model
    assert "A: 7 weight(s) stored quantized, with their scales: compared as stored" in r.output
    assert f"`ckpt consolidate {FIXTURES / 'ct_fp8_block'} OUT --dtype bfloat16`" in r.output


def test_a_plain_copy_keeps_the_quantized_form(tmp_path: Path) -> None:
    src = FIXTURES / "ct_fp8_block"
    out = tmp_path / "hf"
    code, output = _consolidate(src, out)
    assert code == 0, output
    assert "7 weight(s) kept quantized as stored (compressed-tensors" in output, output
    assert "--dtype bfloat16 or float32 writes the plain model" in output
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    with (
        safe_open(str(src / "model.safetensors"), "pt") as a,
        safe_open(str(out / "model.safetensors"), "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():  # noqa: SIM118 (safe_open has no __iter__)
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_inspect_names_scheme_block_and_quantized_tensors() -> None:
    r = CliRunner().invoke(cli, ["inspect", str(FIXTURES / "deepseek_fp8")])
    assert r.exit_code == 0, r.output
    assert (
        "quantized: DeepSeek-V3 / FineGrainedFP8 (fp8 e4m3 blocks), block 128x128: 7 " in r.output
    )
    assert "model.layers.0.mlp.down_proj.weight" in r.output
    r = CliRunner().invoke(cli, ["inspect", str(FIXTURES / "ct_fp8_block"), "--json"])
    q = json.loads(r.output)["quantized"]
    assert q["producer"] == "compressed-tensors" and q["block"] == [128, 128]
    assert q["refused"] is None
    assert {w["scale"] for w in q["weights"]} == {
        f"model.layers.0.{m}.weight_scale"
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    }  # fmt: skip


def _edited(tmp_path: Path, edit: Callable[[dict], None]) -> Path:
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "ct_fp8_block", src)
    config = json.loads((src / "config.json").read_text())
    edit(config["quantization_config"])
    (src / "config.json").write_text(json.dumps(config))
    return src


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (
            lambda qc: qc["config_groups"]["group_0"]["weights"].update(type="int", num_bits=4),
            "compressed-tensors weights of type 'int', 4 bits",
        ),
        (lambda qc: qc.update(quant_method="awq"), "quantization 'awq'"),
        (
            lambda qc: qc["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"),
            "compressed-tensors format 'nvfp4-pack-quantized'",
        ),
    ],
)
def test_a_form_not_understood_is_refused_by_name(
    tmp_path: Path, edit: Callable[[dict], None], named: str
) -> None:
    src = _edited(tmp_path, edit)
    out = tmp_path / "hf"
    code, output = _consolidate(src, out, "--dtype", "bfloat16")
    assert code == 1 and named in output and "without --dtype" in output, output
    assert len(output.strip().splitlines()) == 1
    assert not out.exists()
    assert _consolidate(src, out)[0] == 0  # copied as stored


@pytest.fixture(scope="module")
def torchao_model(
    cached_output: Callable[[str, Sequence[Path], Callable[[Path], None]], Path],
) -> Path:
    pytest.importorskip("torchao")
    script = REPO / "tests" / "support" / "torchao_producers.py"

    def build(directory: Path) -> None:
        subprocess.run([sys.executable, "-m", "tests.support.torchao_producers", str(directory)],
                       check=True, cwd=REPO, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip

    return cached_output("torchao_float8_weight_only", [script], build)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_torchao_float8_safetensors_dequantized_as_torchao_reads(
    torchao_model: Path, dtype: str, tmp_path: Path
) -> None:
    out = tmp_path / "hf"
    code, output = _consolidate(torchao_model / "quant", out, "--dtype", dtype)
    assert code == 0, output
    _assert_bits_equal(out, torchao_model / f"expected.{dtype}.safetensors", getattr(torch, dtype))
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    r = CliRunner().invoke(cli, ["inspect", str(torchao_model / "quant"), "--json"])
    q = json.loads(r.output)["quantized"]
    assert q["producer"] == "torchao" and q["scheme"] == "Float8Tensor (per row)"
    assert len(q["weights"]) == 7 and q["weights"][0]["data"].endswith("._weight_qdata")


@pytest.mark.parametrize("fixture", ["ct_fp8_block", "deepseek_fp8"])
def test_shard_and_load_pretrained_refuse_float8_weights_without_their_scales(
    fixture: str, tmp_path: Path
) -> None:
    """An FSDP2 job's model holds plain tensors: sharding a quantized model, or loading it
    into a plain model (even with strict=False, which ignores the scales as extra keys), would
    give it each float8 weight without its scale. Both stop in one line naming the way."""
    import ckptools
    from ckptools.errors import UsageError

    src = FIXTURES / fixture
    out = tmp_path / "dcp"
    r = CliRunner().invoke(cli, ["shard", str(src), str(out), "--world-size", "2"])
    assert r.exit_code == 2, r.output
    assert "--dtype bfloat16" in r.output and "quantized" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not out.exists()

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for strict in (True, False):
        with pytest.raises(UsageError, match=r"stored as float8_e4m3fn .*--dtype bfloat16"):
            ckptools.load_pretrained(model, src, strict=strict)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
