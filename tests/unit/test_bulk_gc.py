"""The collector is paused while metadata is parsed and plans are built, and only ``ckpt``'s own
process freezes what was built (a library call must not freeze its caller's objects)."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

from ckptools.core.bulk import gc_paused, without_gc

ROOT = Path(__file__).resolve().parents[2]


def test_paused_within_and_restored_after_without_freezing_a_library_caller() -> None:
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested: still off, and not turned on by the inner block's end
            pass
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]
    assert gc.isenabled()
    # not ckpt's process: nothing frozen (the count may fall: objects an earlier in-process CLI
    # run froze can be freed meanwhile, as in a run of the whole suite; a freeze here would add
    # at least the thousand lists made above)
    assert gc.get_freeze_count() <= frozen
    assert without_gc(gc.isenabled)() is False
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()
    del made


def test_the_ckpt_process_freezes_what_parsing_built() -> None:
    # the entry point declares its process; inspect parses a real DCP .metadata under the pause
    code = (
        "import gc, sys\n"
        "import ckptools.cli\n"
        "try:\n"
        "    ckptools.cli.main(['inspect', sys.argv[1], '--json'])\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        "print('frozen', gc.get_freeze_count(), file=sys.stderr)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "fixtures" / "fsdp2_ws2")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    count = int(proc.stderr.split("frozen ")[-1])
    assert count > 1000, proc.stderr
