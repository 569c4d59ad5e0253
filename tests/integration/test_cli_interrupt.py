"""Ctrl-C on the real ``ckpt`` process (``python -m ckptools``, SIGINT): at any moment one line
saying how to go on, exit code 130, never a traceback, a logger prefix or click's "Aborted!".

Each moment is found from the process itself rather than guessed with a delay: ``-X importtime``
reports every import as it completes, so the signal lands while click loads (before any command
runs), while torch loads inside the command's body, or, for a resumable conversion, right after
its first output file is journaled (the staging directory is then kept, and re-running the same
command finishes the job, as the line says).
"""

from __future__ import annotations

import filecmp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import ckptools
from ckptools.io import resume
from tests.conftest import Produced
from tests.support.producers import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
#: big enough that a cast copy with a 64 KB memory budget takes seconds, not milliseconds
CONFIG = ModelConfig(vocab=8192, hidden=256, n_heads=8, n_kv_heads=2, head_dim=32,
                     intermediate=1001, n_layers=4)  # fmt: skip
INTERRUPTED = 130


def _start(
    args: list[str], env: dict[str, str] | None = None, importtime: bool = True
) -> subprocess.Popen[str]:
    """``python -m ckptools ARGS``; ``importtime``: its stderr reports each import (read it
    as it comes: the pipe would fill and stop the process)."""
    return subprocess.Popen(
        [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "ckptools", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _interrupt_after_import(proc: subprocess.Popen[str], module: str) -> list[str]:
    """Send SIGINT once ``module`` finished importing; the process's own stderr lines after."""
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("import time:") and line.split("|")[-1].strip() == module:
            proc.send_signal(signal.SIGINT)
            break
    else:
        pytest.fail(f"{module} never imported")
    rest = proc.stderr.read()
    proc.wait(timeout=60)
    return [ln for ln in rest.splitlines() if not ln.startswith("import time:")]


@pytest.mark.parametrize(
    ("module", "command"),
    [
        ("click.core", ["--help"]),  # the entry point's imports, before any command runs
        ("ckptools.verbs.consolidate", ["consolidate", "{src}", "{out}"]),  # in the command
    ],
)
def test_ctrl_c_while_importing_is_one_line_and_130(
    module: str, command: list[str], produced: Callable[..., Produced], tmp_path: Path
) -> None:
    src = produced("fsdp2", world_size=2)
    args = [a.format(src=src.path, out=tmp_path / "out") for a in command]
    proc = _start(args)
    lines = _interrupt_after_import(proc, module)
    assert proc.returncode == INTERRUPTED, lines
    assert lines == ["interrupted; nothing was committed: run the same command again"]
    assert not (tmp_path / "out").exists()


def test_ctrl_c_mid_write_says_where_the_files_are_kept_and_a_rerun_resumes(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    src = produced("fsdp2", world_size=2, optimizer=True, cfg=CONFIG)
    out = tmp_path / "hf"
    args = [str(src.path), str(out), "--max-shard-size", "3MB", "--dtype", "bfloat16",
            "--workers", "1"]  # fmt: skip
    proc = _start(
        ["consolidate", *args, "--weights-only"],
        env={"CKPTOOLS_MEMORY_BUDGET": "64KB"},
        importtime=False,
    )
    journal = f"{out.name}.tmp-*/{resume.JOURNAL_PREFIX}*.json"
    while proc.poll() is None and not any(tmp_path.glob(journal)):
        time.sleep(0.002)
    assert proc.poll() is None, "finished before its first file was journaled"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    lines = err.splitlines()
    assert proc.returncode == INTERRUPTED, err
    (kept,) = tmp_path.glob(f"{out.name}.tmp-*")
    assert lines == [
        f"interrupted; the files written so far are kept in {kept}: run the same command "
        "again to resume (or delete it)"
    ]
    again = subprocess.run(
        [sys.executable, "-m", "ckptools", "consolidate", *args, "--weights-only"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "resumed:" in again.stdout
    assert not kept.exists()
    clean = tmp_path / "clean"
    ckptools.consolidate(str(src.path), str(clean), max_shard_size="3MB", dtype="bfloat16",
                         quiet=True, weights_only=True)  # fmt: skip
    names = sorted(os.listdir(clean))
    assert sorted(os.listdir(out)) == names
    assert all(filecmp.cmp(clean / n, out / n, shallow=False) for n in names)
