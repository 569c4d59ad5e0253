"""A long list of output files is shown as its first names and a count, not one line of 191."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from ckptools.cli.main import cli
from ckptools.cli.render import shortlist


def test_shortlist_keeps_the_first_names_and_counts_the_rest() -> None:
    assert shortlist(["a", "b"]) == "a, b"
    assert shortlist([f"f{i}" for i in range(6)]) == "f0, f1, f2, f3, f4, f5"
    assert shortlist([f"f{i}" for i in range(9)], keep=2) == "f0, f1 and 7 more"


def test_consolidate_names_six_shards_and_counts_the_others(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    src = tmp_path / "model"
    src.mkdir()
    save_file({f"layer{i}.weight": torch.ones(16) for i in range(10)}, src / "model.safetensors")
    out = tmp_path / "hf"
    # 64 bytes a shard: one tensor each, ten shards
    args = ["consolidate", str(src), str(out), "--dry-run", "--max-shard-size", "64B"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.output.splitlines() if x.startswith("  would write: ")]
    names = line.removeprefix("  would write: ").split(" + ")[0]
    shown, more = names.split(" and ")
    assert len(shown.split(", ")) == 6 and more.endswith(" more")
    assert more == "4 more"
    assert shown.startswith("model-00001-of-00010.safetensors, model-00002-of-00010")
