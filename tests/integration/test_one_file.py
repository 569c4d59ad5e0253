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


@pytest.mark.parametrize(
    ("directory", "name", "held"),
    [
        ("verl/fsdp2_ws2", "model_world_size_2_rank_0.pt", "DTensor"),
        ("verl/fsdp2_ws2", "optim_world_size_2_rank_1.pt", "DTensor"),
        ("verl/fsdp1_ws2", "model_world_size_2_rank_1.pt", "ShardedTensor"),
    ],
)
def test_a_rank_file_read_as_torch_save_names_its_directory(
    tmp_path: Path, directory: str, name: str, held: str
) -> None:
    # --format torch_save reads the one file as a whole model: its pickle holds one rank's
    # DTensor / ShardedTensor pieces, which only the directory of every rank's files places
    src, out = FIXTURES / directory / name, tmp_path / "out"
    r = CliRunner().invoke(cli, ["consolidate", "--format", "torch_save", str(src), str(out)])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    [line] = r.output.strip().splitlines()
    assert f"holds {held} pieces, one rank's part" in line, line
    assert f"point at {src.parent}, the directory that holds every rank's files" in line, line
    assert not out.exists()
    ckptools.consolidate(str(src.parent), str(out), quiet=True)  # as it says


def test_a_rank_file_copied_out_alone_names_the_files_it_lacks(tmp_path: Path) -> None:
    # pointing at the directory it was copied to would read it as something else (or fail)
    lone = tmp_path / "lone"
    lone.mkdir()
    src = lone / "model_world_size_2_rank_0.pt"
    src.write_bytes((FIXTURES / "verl" / "fsdp2_ws2" / src.name).read_bytes())
    for args in (["inspect", str(src)], ["inspect", "--format", "torch_save", str(src)]):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        [line] = r.output.strip().splitlines()
        assert f"{lone} lacks model_world_size_2_rank_1.pt" in line, line


@pytest.mark.parametrize(("directory", "name", "family"), PARTS[:4])
def test_a_part_forced_to_its_familys_format_names_its_directory(
    tmp_path: Path, directory: str, name: str, family: str
) -> None:
    # `--format verl` on a verl rank file: the family is right, the path is not
    src, out = FIXTURES / directory / name, tmp_path / "out"
    r = CliRunner().invoke(cli, ["consolidate", "--format", family, str(src), str(out)])
    assert r.exit_code != 0 and "Traceback" not in r.output, r.output
    [line] = r.output.strip().splitlines()
    assert line.endswith(f"it is one file of the checkpoint at {src.parent}: point at it"), line
    assert not out.exists()
