"""A file that holds an optimizer's ``state_dict()`` alone is never taken for a model.

``torch.save(optimizer.state_dict())`` (a Trainer's ``optimizer.pt``, verl's
``optim_world_size_W_rank_r.pt``) holds tensors under ``state.<id>.exp_avg``...; exported as
the model they would make a ``model.safetensors`` of optimizer moments. Every verb that needs a
model refuses in one line saying what the file is, and ``inspect`` says it too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptools
from ckptools.cli.main import cli
from ckptools.errors import UsageError

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
WHAT = "this is an optimizer state dict"


def _optimizer_file(tmp_path: Path) -> Path:
    """What torch itself writes for ``torch.save(optimizer.state_dict())`` after one step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    path = tmp_path / "optimizer.pt"
    torch.save(optimizer.state_dict(), path)
    return path


@pytest.mark.parametrize(
    "verb",
    [
        ["consolidate", "{src}", "{out}"],
        ["reshard", "{src}", "{out}", "--world-size", "2"],
        ["shard", "{src}", "{out}", "--world-size", "2"],
    ],
    ids=lambda v: v[0],
)
def test_an_optimizer_alone_is_refused_in_one_line(tmp_path: Path, verb: list[str]) -> None:
    src, out = _optimizer_file(tmp_path), tmp_path / "out"
    r = CliRunner().invoke(cli, [a.format(src=src, out=out) for a in verb])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    [line] = r.output.strip().splitlines()
    assert f"{src}: {WHAT}" in line and "not a model; point at the model's file" in line, line
    assert not out.exists()


def test_the_library_refuses_and_inspect_says_what_it_is(tmp_path: Path) -> None:
    src = _optimizer_file(tmp_path)
    with pytest.raises(UsageError, match=WHAT):
        ckptools.consolidate(str(src), str(tmp_path / "out"), quiet=True)
    report = ckptools.inspect(str(src)).to_dict()
    assert report["model_part"]["tensors"] == 0
    assert report["model_part"]["excluded"] == ["state"]
    assert any(WHAT in n for n in report["notes"]), report["notes"]
    # its tensors are all still there for whoever asks for them by name
    assert len(report["optimizers"]) == 1 and report["optimizers"][0]["entries"] == 4
    selected = ckptools.inspect(str(src), key="state").to_dict()["model_part"]
    assert selected["tensors"] == len(report["tensors"])


def test_verl_optimizer_rank_file_read_with_format_is_refused(tmp_path: Path) -> None:
    # FSDP1's per-rank optimizer state holds plain tensors: read as a torch.save file it parsed
    src = FIXTURES / "verl" / "fsdp1_ws2" / "optim_world_size_2_rank_0.pt"
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["consolidate", "--format", "torch_save", str(src), str(out)])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert WHAT in r.output and not out.exists()


def test_a_model_beside_its_optimizer_is_still_the_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    src = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, src)
    ckptools.consolidate(str(src), str(tmp_path / "out"), quiet=True, weights_only=True)
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert got.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(got[k], v)
