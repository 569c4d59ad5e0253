"""The small files beside a checkpoint's data (a ``config.json``, an index, a Megatron
``metadata.json`` or tracker, a checksum manifest) are read with a bound: one too large is
refused in one line naming it before a byte of it is read, and one nested deeper than Python's
JSON parser recurses is refused in one line too (it raised ``RecursionError`` before).

Each case starts from a real checkpoint (the checked-in ``dcp.save``, Megatron-core and
``save_pretrained`` fixtures) and grows one file into a sparse file larger than the bound, so
the test stays fast: a reader that read it whole would still read 80 MiB and then fail the
message checks.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptools.cli.main import cli
from ckptools.io import storage

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
#: past :data:`ckptools.io.storage.SMALL_FILE_LIMIT` (64 MiB), sparse
HUGE = 80 << 20


def _grown(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


def _one_line(args: list[str], named: str, code: int) -> str:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == code, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    assert named in result.output and "Traceback" not in result.output, result.output
    return result.output


def test_a_huge_config_beside_a_dcp_is_refused_before_it_is_read(tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "dcp_single", src)
    _grown(src / "config.json", HUGE)
    out = tmp_path / "hf"
    said = _one_line(["consolidate", str(src), str(out)], "config.json", 2)
    assert f"{HUGE:,} bytes, more than ckptools reads of a model config" in said
    assert not out.exists() and not list(tmp_path.glob("hf.tmp-*"))


def test_a_config_nested_too_deep_is_one_line(tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "dcp_single", src)
    (src / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    said = _one_line(["consolidate", str(src), str(tmp_path / "hf")], "config.json", 2)
    assert "nested too deep" in said


@pytest.mark.parametrize("nested", [False, True])
def test_a_hostile_safetensors_index_is_one_line(tmp_path: Path, nested: bool) -> None:
    src = tmp_path / "hf"
    shutil.copytree(FIXTURES / "hf_sharded", src)
    index = src / "model.safetensors.index.json"
    if nested:
        index.write_text('{"weight_map":' + "[" * 200_000 + "]" * 200_000 + "}")
    else:
        _grown(index, HUGE)
    said = _one_line(["inspect", str(src)], "model.safetensors.index.json", 1)
    assert ("maximum recursion depth" if nested else "more than ckptools reads") in said
    verified = CliRunner().invoke(cli, ["verify", str(src)])  # a report: the problem found
    assert verified.exit_code == 3 and "[metadata]" in verified.output, verified.output
    assert "model.safetensors.index.json" in verified.output
    assert "Traceback" not in verified.output


@pytest.mark.parametrize(
    ("name", "size"),
    [
        ("latest_checkpointed_iteration.txt", storage.TRACKER_LIMIT + 1),
        ("iter_0000010/metadata.json", HUGE),
    ],
)
def test_a_huge_megatron_record_is_refused_before_it_is_read(
    tmp_path: Path, name: str, size: int
) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "megatron" / "tp2_pp1", run)
    _grown(run / name, size)
    said = _one_line(["inspect", str(run)], name.rsplit("/", 1)[-1], 1)
    assert f"{size:,} bytes, more than ckptools reads" in said


def test_a_huge_checksum_manifest_is_refused_before_it_is_read(tmp_path: Path) -> None:
    from ckptools.verify.checksums import CHECKSUM_FILE, CHECKSUMS_LIMIT

    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "dcp_single", src)
    assert CliRunner().invoke(cli, ["checksum", str(src)]).exit_code == 0
    _grown(src / CHECKSUM_FILE, CHECKSUMS_LIMIT + 1)  # sparse: nothing is written
    result = CliRunner().invoke(cli, ["verify", str(src)])
    assert result.exit_code != 0 and CHECKSUM_FILE in result.output, result.output
    assert f"{CHECKSUMS_LIMIT + 1:,} bytes" in result.output and "Traceback" not in result.output
    assert os.path.getsize(src / CHECKSUM_FILE) == CHECKSUMS_LIMIT + 1
