"""The CLI surface: help, exit codes, and that --help never imports torch."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptools.cli.main import cli


def test_help_lists_commands() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    assert "inspect" in result.output


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from ckptools.cli.main import cli\n"
        "try:\n"
        "    cli.main(args=['inspect', '--help'], prog_name='ckpt')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("NO-TORCH")


def test_missing_path_is_one_line_exit_1(tmp_path: object) -> None:
    result = CliRunner().invoke(cli, ["inspect", "/nonexistent/ckpt"])
    assert result.exit_code == 1
    assert result.output.strip() == "error: /nonexistent/ckpt: no such file or directory"


def test_unknown_directory_lists_each_layouts_reason(tmp_path: object) -> None:
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path)])
    assert result.exit_code == 1
    for name in ("dcp", "safetensors", "torch_save", "accelerate", "trainer", "lightning"):
        assert f"  {name}: " in result.output
    assert "Traceback" not in result.output


def test_disk_full_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "/data/out/model.safetensors")

    monkeypatch.setattr("ckptools.inspection.inspect", full)
    result = CliRunner().invoke(cli, ["inspect", "x"])
    assert result.exit_code == 1
    assert result.output.strip() == (
        "error: /data/out/model.safetensors: No space left on device; nothing was written"
    )


def test_output_under_a_file_is_one_line(tmp_path: Path) -> None:
    # OUT's parent is a regular file: the environment's problem, not a bug (no traceback).
    (tmp_path / "file").write_bytes(b"")
    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "fsdp2_ws2"
    result = CliRunner().invoke(cli, ["consolidate", str(fixture), str(tmp_path / "file" / "out")])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert result.output.strip().endswith("nothing was written")
    assert str(tmp_path / "file") in result.output
