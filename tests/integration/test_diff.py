"""``ckpt diff`` / ``ckptools.diff`` / ``ckpt verify --against`` against independent truths: the
reference state dicts the producers gathered through torch, written with ``safetensors``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import ckptools
from ckptools.cli.exit_codes import EXIT_DIFFERENCES
from ckptools.cli.main import cli
from ckptools.engine.reader import resolve_chunk
from ckptools.errors import CorruptCheckpointError
from ckptools.io.storage import LocalReader
from ckptools.producers import read_manifest
from ckptools.verbs.diff import BLOCK_BYTES_ENV
from tests.conftest import Produced
from tests.support import producers


def _flat(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for k, v in items:
        if isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
        elif isinstance(v, dict | list | tuple):
            out.update(_flat(v, f"{prefix}{k}."))
    return out


def _safetensors_of_reference(p: Produced, out: Path) -> dict[str, torch.Tensor]:
    sd = {k: v.contiguous().clone() for k, v in _flat(p.reference()["model"]).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"))
    return sd


def _cli(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(cli, args)
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def test_dcp_vs_safetensors_of_the_same_model_is_identical(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    p = produced("single")  # every dtype, 0-dim, zero-size, strided, NaN payloads, -0.0
    sd = _safetensors_of_reference(p, tmp_path / "st")
    report = ckptools.diff(str(p.path), str(tmp_path / "st"))
    assert report.identical, [t.describe() for t in report.differences]
    assert sorted(t.name for t in report.tensors) == sorted(sd)
    assert all(t.status == "equal" for t in report.tensors)
    code, out = _cli(["diff", str(p.path), str(tmp_path / "st"), "--json"])
    assert code == 0 and json.loads(out)["identical"] is True
    code, out = _cli(["verify", str(p.path), "--against", str(tmp_path / "st")])
    assert code == 0 and "identical" in out


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["fsdp2", "fsdp1", "hsdp", "tp_fsdp"])  # tp: dim-1 chunks
def test_sharded_dcp_vs_safetensors_identical(
    produced: Callable[..., Produced], tmp_path: Path, name: str
) -> None:
    p = produced(name)
    _safetensors_of_reference(p, tmp_path / "st")
    report = ckptools.diff(str(p.path), str(tmp_path / "st"))
    assert report.identical, [t.describe() for t in report.differences]
    assert len(report.tensors) == len(p.reference()["model"])


@pytest.mark.parametrize("small_blocks", [False, True])
def test_single_changed_element_is_named(
    produced: Callable[..., Produced],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    small_blocks: bool,
) -> None:
    if small_blocks:
        monkeypatch.setenv(BLOCK_BYTES_ENV, "8")  # one row per slab
    p = produced("single")
    sd = _safetensors_of_reference(p, tmp_path / "a")
    target = "nested.deeper.w"
    changed = {k: v.clone() for k, v in sd.items()}
    changed[target][1, 2] += 0.5
    (tmp_path / "b").mkdir()
    save_file(changed, str(tmp_path / "b" / "model.safetensors"))
    report = ckptools.diff(str(p.path), str(tmp_path / "b"))
    assert not report.identical
    [d] = report.differences
    assert (d.name, d.status, d.mismatched, d.first_index) == (target, "different", 1, (1, 2))
    assert d.value_a == sd[target][1, 2].item() and d.value_b == changed[target][1, 2].item()
    assert d.max_abs == pytest.approx(0.5)
    code, out = _cli(["diff", str(p.path), str(tmp_path / "b")])
    assert code == EXIT_DIFFERENCES and target in out and "[1, 2]" in out
    # Within tolerance it is "close"; the maximum differences are still reported.
    tol = ckptools.diff(str(p.path), str(tmp_path / "b"), atol=0.6)
    assert tol.identical
    [t] = [t for t in tol.tensors if t.name == target]
    assert t.status == "close" and t.max_abs == pytest.approx(0.5)
    report = ckptools.verify(str(p.path), against=str(tmp_path / "b"), quiet=True)
    assert not report.ok and report.findings == ()


@pytest.mark.distributed
def test_flipped_bit_in_a_sharded_chunk_is_named_as_damage(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    """A flipped bit in a DCP item fails its record's CRC-32: diff names the file, tensor and
    rank, as consolidate and verify do (it once reported the element as a difference)."""
    p = produced("fsdp2")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(p.path, ckpt)
    manifest = read_manifest(str(ckpt))
    fqn = "model.model.layers.1.mlp.up_proj.weight"
    tensor = manifest.tensors[fqn]
    chunk = next(c for c in tensor.chunks if c.rank == 1 and c.offsets[0] > 0)
    with LocalReader(str(ckpt)) as reader:
        raw = resolve_chunk(reader, tensor, chunk)
    local = 7  # element index inside the chunk
    producers.flip_bit(ckpt / raw.file, raw.offset + local * 4 + 3, 6)
    with pytest.raises(CorruptCheckpointError, match="CRC-32") as caught:
        ckptools.diff(str(p.path), str(ckpt))
    e = caught.value
    assert (e.path, e.fqn, e.rank) == (f"{ckpt}/{raw.file}", fqn, 1)


_DIFF_IN_A_FRESH_PROCESS = (
    "import json, sys, ckptools\n"
    "r = ckptools.diff(sys.argv[1], sys.argv[2])\n"
    "found = [t.describe() for t in r.differences]\n"
    "print(json.dumps([r.identical, found, 'torch' in sys.modules]))\n"
)


@pytest.mark.parametrize("small_blocks", [False, True])
def test_identical_checkpoints_are_compared_without_importing_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_blocks: bool
) -> None:
    # Importing torch costs ~2 s of CPU, ten times the rest of a small diff: bytes are compared
    # without it, and torch is loaded only to say which elements differ and by how much.
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp

    if small_blocks:
        monkeypatch.setenv(BLOCK_BYTES_ENV, "8")  # one row per slab
    g = torch.Generator().manual_seed(0)
    sd = {
        "layers.0.w": torch.randn(6, 5, generator=g),
        "layers.0.b": torch.randn(5, generator=g).to(torch.bfloat16),
        "steps": torch.tensor(7),
        "empty": torch.zeros(0, 3),
    }
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    (tmp_path / "st").mkdir()
    save_file(sd, str(tmp_path / "st" / "model.safetensors"))
    changed = {k: v.clone() for k, v in sd.items()}
    changed["layers.0.w"][4, 3] += 1.0
    (tmp_path / "changed").mkdir()
    save_file(changed, str(tmp_path / "changed" / "model.safetensors"))

    def run(a: str, b: str) -> Any:
        argv = [
            sys.executable,
            "-c",
            _DIFF_IN_A_FRESH_PROCESS,
            str(tmp_path / a),
            str(tmp_path / b),
        ]
        return json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)

    assert run("dcp", "st") == [True, [], False]
    identical, [difference], torch_loaded = run("dcp", "changed")
    assert not identical and torch_loaded
    assert difference.startswith("layers.0.w: 1 element(s) differ, first at [4, 3]")


def test_missing_unexpected_dtype_and_shape(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    p = produced("single")
    sd = _safetensors_of_reference(p, tmp_path / "a")
    other = dict(sd)
    del other["nested.deeper.w"]
    other["extra.bias"] = torch.zeros(3)
    other["dtypes.float32"] = sd["dtypes.float32"].to(torch.float64)
    other["scalar_f32"] = torch.tensor([3.5])
    (tmp_path / "b").mkdir()
    save_file(other, str(tmp_path / "b" / "model.safetensors"))
    report = ckptools.diff(str(p.path), str(tmp_path / "b"))
    status = {t.name: t.status for t in report.differences}
    assert status == {
        "nested.deeper.w": "missing",
        "extra.bias": "unexpected",
        "dtypes.float32": "dtype",
        "scalar_f32": "shape",
    }
    # With a tolerance, values of different dtypes are compared too (a float64 copy: no change).
    tol = ckptools.diff(str(p.path), str(tmp_path / "b"), atol=0.0)
    [d] = [t for t in tol.tensors if t.name == "dtypes.float32"]
    assert d.status == "dtype" and d.mismatched == 0 and d.max_abs == 0.0
    code, out = _cli(["diff", str(p.path), str(tmp_path / "b"), "--json"])
    assert code == EXIT_DIFFERENCES
    data = json.loads(out)
    assert data["counts"]["missing"] == 1 and data["identical"] is False


def test_nan_payload_and_negative_zero_are_bitwise_differences(tmp_path: Path) -> None:
    a = {"w": torch.tensor([0.0, float("nan"), 1.0])}
    b = {"w": torch.tensor([-0.0, float("nan"), 1.0])}
    for name, sd in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        save_file(sd, str(tmp_path / name / "model.safetensors"))
    report = ckptools.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    [d] = report.differences
    assert d.first_index == (0,) and d.mismatched == 1
    assert ckptools.diff(str(tmp_path / "a"), str(tmp_path / "b"), atol=0.0).identical


def test_bad_tolerance_is_a_usage_error(produced: Callable[..., Produced]) -> None:
    p = str(produced("single").path)
    code, _ = _cli(["diff", p, p, "--atol", "-1"])
    assert code == 2


_ONE_CHANGED_ELEMENT = """
import json, sys
import torch
import torch.distributed.checkpoint as dcp
import ckptools

a, b = sys.argv[1:]
g = torch.Generator().manual_seed(0)
state = {"model": {f"layers.{i}.w": torch.randn(8192, 8192, generator=g) for i in range(4)}}
dcp.save(state, checkpoint_id=a, no_dist=True)
# the same training state but for one element, saved as torch saves it (a flipped bit in the
# file would be damage, which diff reports as verify does)
state["model"]["layers.2.w"].view(torch.int32)[5000, 77] ^= 1 << 8
dcp.save(state, checkpoint_id=b, no_dist=True)
del state
report = ckptools.diff(a, b)
print(json.dumps({
    "bytes": report.bytes_compared,
    "differences": [[d.name, d.mismatched, list(d.first_index)] for d in report.differences],
}))
"""


@pytest.mark.slow
def test_one_changed_element_in_a_1gb_checkpoint(tmp_path: Path) -> None:
    # in a process of its own: the test worker never holds the 1 GiB state, whose peak every
    # process it starts afterwards would report as its own (exec keeps the parent's high-water
    # mark in the child's rusage: test_hostile_decoding measures its commands by it)
    a, b = tmp_path / "a", tmp_path / "b"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run(
        [sys.executable, "-c", _ONE_CHANGED_ELEMENT, str(a), str(b)],
        capture_output=True, text=True, env=env, timeout=600, check=True,
    )  # fmt: skip
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["bytes"] >= 2 * 2**30
    assert found["differences"] == [["layers.2.w", 1, [5000, 77]]]
    assert os.path.getsize(b / "__0_0.distcp") > 2**30


def _gpt2_dcp(root: Path, *, untie_values: bool = False) -> str:
    """A tiny GPT-2 (tied ``lm_head``) saved by ``dcp.save`` from its ``state_dict()``, with its
    ``config.json`` beside it (as ``config.save_pretrained`` writes it)."""
    import torch.distributed.checkpoint as dcp
    import transformers

    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    sd = dict(model.state_dict())
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"] or torch.equal(
        sd["lm_head.weight"], sd["transformer.wte.weight"]
    )
    if untie_values:  # a model whose head was trained apart from its embedding
        sd["lm_head.weight"] = sd["lm_head.weight"].clone()
        sd["lm_head.weight"][3, 1] += 1.0
    src = root / "gpt2"
    dcp.save(sd, checkpoint_id=str(src), no_dist=True)
    cfg.save_pretrained(str(src))
    return str(src)


def test_a_consolidation_that_leaves_out_a_tied_head_is_identical(tmp_path: Path) -> None:
    """``consolidate`` leaves the tied ``lm_head.weight`` out (``from_pretrained`` re-ties it):
    ``diff``, ``verify --against`` and the CLI call the checkpoint and its consolidation
    identical, either way round, and say the head was compared with the embedding."""
    src = _gpt2_dcp(tmp_path)
    out = str(tmp_path / "hf")
    result = ckptools.consolidate(src, out, quiet=True)
    assert result.dropped == (("lm_head.weight", "transformer.wte.weight"),)
    for a, b, missing_in in ((src, out, "B"), (out, src, "A")):
        report = ckptools.diff(a, b)
        assert report.identical, [t.describe() for t in report.differences]
        [head] = [t for t in report.tensors if t.name == "lm_head.weight"]
        assert (head.status, head.tied_to, head.tied_in) == (
            "equal", "transformer.wte.weight", missing_in,
        )  # fmt: skip
        assert any("lm_head.weight: not stored in" in n for n in report.notes)
    assert ckptools.verify(src, against=out, quiet=True).ok
    code, text = _cli(["diff", src, out])
    assert code == 0 and "identical" in text and "lm_head.weight" in text, text
    code, text = _cli(["verify", src, "--against", out])
    assert code == 0, text


def test_a_tied_head_that_differs_from_the_embedding_is_a_difference(tmp_path: Path) -> None:
    """The alias is compared, not assumed: a stored head that is not the embedding differs from
    a directory whose config ties it."""
    src = _gpt2_dcp(tmp_path, untie_values=True)
    out = str(tmp_path / "hf")
    ckptools.consolidate(src, out, quiet=True)  # the config ties: the head is left out
    report = ckptools.diff(src, out)
    [d] = report.differences
    assert (d.name, d.status, d.mismatched, d.first_index) == (
        "lm_head.weight", "different", 1, (3, 1),
    )  # fmt: skip
    assert "tied to B's transformer.wte.weight" in d.describe()
    code, text = _cli(["diff", src, out])
    assert code == EXIT_DIFFERENCES and "tied to B's" in text
