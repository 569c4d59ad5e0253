"""Every writer of a staged output runs the one output protocol (ckptools.outputs.protocol).

Truth: the writers' own source, read as text is read by the architecture test. A writer that
stages, discards or commits by itself carries a private copy of the protocol again (the four
copies issue 37 removed), which drifts: the Ctrl-C rule, the spool clean-up, the journal order.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ckptools"
WRITERS = [
    "verbs/consolidate.py", "verbs/dcp_output.py", "training/pretrained.py", "training/manager.py",
]  # fmt: skip
# io.staging's steps, the resume journal and the collective's prepare-or-discard, which only
# the protocol calls (the OUT rules, io.out_rules.check_out, a verb may also apply before it
# plans: a dry run reports them)
PROTOCOL_STEPS = {
    "commit", "discard", "make_tmp_dir", "resumable_staging", "upload_dir", "make_spool_dir",
    "remove_spool_dir", "fsync_dir", "staged", "Journal",
}  # fmt: skip


def _steps_called(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module in {"ckptools.io.staging", "ckptools.io.spool", "ckptools.io.resume"}
        for alias in node.names
    }
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} & imported
    # staging.commit(...), spool.make_spool_dir(...), ranks.staged(...): a step called through
    # a module or a Ranks
    attrs = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id in {"staging", "spool", "ranks"}
    }
    return (names | attrs) & PROTOCOL_STEPS


@pytest.mark.parametrize("writer", WRITERS)
def test_writer_has_no_private_copy_of_the_output_protocol(writer: str) -> None:
    called = _steps_called(PACKAGE / writer)
    assert not called, f"{writer} calls {sorted(called)}: run ckptools.outputs.protocol instead"


def test_the_protocol_holds_the_steps() -> None:
    assert _steps_called(PACKAGE / "outputs/protocol.py") >= {"commit", "discard", "staged"}
