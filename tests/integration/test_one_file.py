"""A user points at one file of a multi-file checkpoint instead of its directory: every verb
answers in one line naming the directory to point at, and writes nothing.

The checkpoints are the checked-in fixtures, written by the producers themselves (FSDP2's
``dcp.save``, verl's ``FSDPCheckpointManager``, transformers' sharded ``save_pretrained``);
DeepSpeed's ZeRO-3 rank file is in tests/distributed/test_deepspeed.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptools
from ckptools.cli.main import cli
from ckptools.errors import UsageError

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"

PARTS = [
    ("fsdp2_ws2", "__0_0.distcp", "dcp"),
    ("fsdp2_ws2", ".metadata", "dcp"),
    ("verl/fsdp1_ws2", "model_world_size_2_rank_0.pt", "verl"),
    ("verl/fsdp2_ws2", "optim_world_size_2_rank_1.pt", "verl"),
    ("hf_sharded", "model-00001-of-00002.safetensors", "safetensors"),
]
VERBS = [
    ["consolidate", "{src}", "{out}"],
    ["reshard", "{src}", "{out}", "--world-size", "2"],
    ["inspect", "{src}"],
    ["verify", "{src}"],
]


@pytest.mark.parametrize(("directory", "name", "family"), PARTS)
@pytest.mark.parametrize("verb", VERBS, ids=lambda v: v[0])
def test_one_file_of_a_checkpoint_names_its_directory(
    tmp_path: Path, directory: str, name: str, family: str, verb: list[str]
) -> None:
    src, out = FIXTURES / directory / name, tmp_path / "out"
    args = [a.format(src=src, out=out) for a in verb]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    [line] = r.output.strip().splitlines()
    want = f"one file of the {family} checkpoint at {src.parent}; point at {src.parent}"
    assert want in line, line
    assert not out.exists()
    # the directory it names is what the verb reads
    ckptools.inspect(str(src.parent))


def test_the_library_says_the_same_and_format_still_reads_the_file(tmp_path: Path) -> None:
    src = FIXTURES / "hf_sharded" / "model-00001-of-00002.safetensors"
    with pytest.raises(UsageError, match="point at"):
        ckptools.consolidate(str(src), str(tmp_path / "out"), quiet=True)
    # asked for by name, one file is read as what it is
    assert ckptools.inspect(str(src), format="safetensors").to_dict()["tensors"]
