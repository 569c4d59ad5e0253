"""``ckpt verify / diff / checksum``: surface, exit codes, tunables and their env overrides."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from click.testing import CliRunner

import ckptools
from ckptools.cli.exit_codes import EXIT_DIFFERENCES
from ckptools.cli.main import cli
from ckptools.errors import UsageError
from ckptools.io import tunables
from ckptools.verify import scan as scan_module

# ``ckptools.diff`` is also the public function; take the module.
diff_module = importlib.import_module("ckptools.verbs.diff")


def test_commands_are_registered() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for name in ("verify", "diff", "checksum"):
        assert name in result.output


@pytest.mark.parametrize("command", ["verify", "diff", "checksum"])
def test_help_does_not_import_torch(command: str) -> None:
    code = (
        "import sys\n"
        "from ckptools.cli.main import cli\n"
        "try:\n"
        f"    cli.main(args=[{command!r}, '--help'], prog_name='ckpt')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("NO-TORCH")


def test_exit_code_constant() -> None:
    assert EXIT_DIFFERENCES == 3


def test_missing_path_is_an_error_not_a_finding() -> None:
    for args in (["verify", "/nonexistent/x"], ["diff", "/nonexistent/x", "/nonexistent/y"]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 1, result.output
        assert result.output.startswith("error: /nonexistent/x")


def test_quick_with_check_finite_is_a_usage_error(tmp_path: object) -> None:
    result = CliRunner().invoke(cli, ["verify", str(tmp_path), "--quick", "--check-finite"])
    assert result.exit_code == 2
    assert "quick" in result.output


def test_workers_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    # verify and checksum take their threads from the one tunable every command shares.
    monkeypatch.delenv(tunables.WORKERS_ENV, raising=False)
    assert tunables.workers(None) == tunables.DEFAULT_WORKERS
    monkeypatch.setenv(tunables.WORKERS_ENV, "3")
    assert tunables.workers(None) == 3
    assert tunables.workers(2) == 2
    monkeypatch.setenv(tunables.WORKERS_ENV, "zero")
    with pytest.raises(UsageError, match="CKPTOOLS_WORKERS"):
        tunables.workers(None)
    with pytest.raises(UsageError):
        tunables.workers(0)
    with pytest.raises(UsageError, match="CKPTOOLS_WORKERS"):
        ckptools.verify(".", workers=None)  # resolved before the checkpoint is read


def test_block_bytes_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(scan_module.BLOCK_BYTES_ENV, raising=False)
    assert scan_module.resolve_block_bytes() == scan_module.DEFAULT_BLOCK_BYTES
    monkeypatch.setenv(scan_module.BLOCK_BYTES_ENV, "1000")
    assert scan_module.resolve_block_bytes() == 960  # whole 64-byte units
    monkeypatch.setenv(scan_module.BLOCK_BYTES_ENV, "-5")
    with pytest.raises(UsageError):
        scan_module.resolve_block_bytes()
    monkeypatch.delenv(diff_module.BLOCK_BYTES_ENV, raising=False)
    assert diff_module.resolve_block_bytes() == diff_module.DEFAULT_BLOCK_BYTES
    monkeypatch.setenv(diff_module.BLOCK_BYTES_ENV, "4096")
    assert diff_module.resolve_block_bytes() == 4096
