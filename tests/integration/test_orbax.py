"""Orbax (JAX) checkpoints: ``inspect`` lists their arrays, every other verb refuses by name.

On real files written by orbax-checkpoint 0.12.8 (``fixtures/orbax/generate.py``): a MaxText-like
``CheckpointManager`` run (OCDBT) and a ``use_ocdbt=False`` save. Before, ``inspect`` said only
that no layout recognised the directory, and nothing said it was Orbax's.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptools
from ckptools.cli.main import cli
from ckptools.errors import UnsupportedCheckpointError

ORBAX = Path(__file__).resolve().parents[2] / "fixtures" / "orbax"
RUN = ORBAX / "maxtext_run"
ZARR = ORBAX / "standard_zarr"
REFUSAL = "an Orbax (JAX) checkpoint: ckptools reads PyTorch checkpoints"
#: what generate.py saved: path -> (shape, dtype)
PARAMS = {
    "params.decoder.decoder_norm.scale": ([16], "float32"),
    "params.decoder.layers_0.mlp.wi_0.kernel": ([16, 24], "bfloat16"),
    "params.decoder.layers_0.mlp.wo.kernel": ([24, 16], "bfloat16"),
    "params.decoder.layers_0.pre_self_attention_norm.scale": ([16], "float32"),
    "params.decoder.layers_0.self_attention.query.kernel": ([16, 2, 8], "bfloat16"),
    "params.token_embedder.embedding": ([40, 16], "bfloat16"),
}
PATHS = [RUN, RUN / "1", RUN / "2" / "items", ZARR]


def test_the_fixtures_are_what_orbax_wrote() -> None:
    listed = {}
    for line in (ORBAX / "SHA256SUMS").read_text().splitlines():
        digest, _, rel = line.partition("  ")
        listed[rel.removeprefix("./")] = digest
    on_disk = {
        str(p.relative_to(ORBAX))
        for p in ORBAX.rglob("*")
        if p.is_file() and p.name not in ("SHA256SUMS", "README.md", "generate.py")
    }
    assert on_disk == set(listed)
    for rel, digest in listed.items():
        assert hashlib.sha256((ORBAX / rel).read_bytes()).hexdigest() == digest, rel
    assert sum((ORBAX / rel).stat().st_size for rel in listed) < 1 << 20


def _inspect(path: Path) -> dict:
    result = CliRunner().invoke(cli, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    report: dict = json.loads(result.output)
    return report


def test_inspect_lists_a_maxtext_runs_newest_step() -> None:
    report = _inspect(RUN)
    assert (report["format"], report["layout"], report["tensors"]) == ("orbax", "orbax", [])
    assert any(REFUSAL in n for n in report["notes"])
    assert any("using 2, the newest complete of 2" in n for n in report["notes"])
    facts = report["orbax"]
    assert facts["step"] == 2
    [item] = facts["items"]
    assert item["item"] == "items" and "OCDBT" in item["storage"]
    arrays = {a["path"]: a for a in item["arrays"]}
    assert len(arrays) == 3 * len(PARAMS) + 2  # params, mu, nu; count and step
    for path, (shape, _) in PARAMS.items():
        for prefix in ("", "opt_state.mu.", "opt_state.nu."):
            name = prefix + path.removeprefix("params.") if prefix else path
            assert arrays[name]["shape"] == shape, name
            assert arrays[name]["dtype"] is None  # in the OCDBT store, not in JSON
    assert arrays["step"]["shape"] == [] and arrays["opt_state.count"]["shape"] == []


def test_inspect_lists_dtypes_where_orbax_wrote_them_as_json() -> None:
    report = _inspect(ZARR)
    [item] = report["orbax"]["items"]
    got = {a["path"]: (a["shape"], a["dtype"]) for a in item["arrays"]}
    assert got == PARAMS
    text = CliRunner().invoke(cli, ["inspect", str(ZARR)])
    assert text.exit_code == 0, text.output
    assert "params.decoder.layers_0.mlp.wi_0.kernel" in text.output
    assert "bfloat16" in text.output and "[16, 2, 8]" in text.output
    assert "Traceback" not in text.output
    assert "model part" not in text.output  # no PyTorch model part of ours to describe


@pytest.mark.parametrize("path", PATHS, ids=lambda p: str(p.relative_to(ORBAX)))
def test_every_other_verb_refuses_it_in_one_line(path: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    for args in (
        ["consolidate", str(path), str(out)],
        ["consolidate", str(path), str(out), "--weights-only"],
        ["reshard", str(path), str(out), "--world-size", "2"],
        ["verify", str(path)],
        ["diff", str(path), str(ORBAX.parent / "dcp_single")],
        ["inspect", str(path), "--format", "dcp"],
    ):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code != 0, (args, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.output)
        if "--format" not in args:
            assert REFUSAL in lines[0], (args, result.output)
    assert os.listdir(tmp_path) == []


def test_ckptools_load_refuses_it_by_name() -> None:
    import torch

    with pytest.raises(UnsupportedCheckpointError, match="Orbax"):
        ckptools.load(str(RUN), torch.nn.Linear(2, 2))
