"""ckptools reads its ``CKPTOOLS_*`` overrides when called, never when imported.

The test suite's fork server imports ckptools once and forks every rank from it
(tests/support/dist.py, ``_SERVER_PRELOAD``): a setting read at import would be the server's, not
the run's. And a library whose behaviour depends on when it was first imported surprises its users
the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support import zygote

REPO = str(Path(__file__).resolve().parents[2])

#: run in a fresh interpreter: import every module of ckptools while ``os.environ`` records the
#: names that code of ckptools looks up (third-party modules imported along the way, tqdm's and
#: fsspec's, read the whole environment: not ckptools' doing), then print them
_IMPORT_ALL = """
import json, os, pkgutil, importlib, sys

read = []

class Recording(type(os.environ)):
    def __getitem__(self, key):
        frame = sys._getframe(1)
        while frame.f_globals.get("__name__") in ("os", "collections.abc"):
            frame = frame.f_back
        if frame.f_globals.get("__name__", "").startswith("ckptools"):
            read.append(key)
        return super().__getitem__(key)

os.environ.__class__ = Recording
import ckptools
names = [m.name for m in pkgutil.walk_packages(ckptools.__path__, "ckptools.")]
for name in names:
    if not name.endswith("__main__"):
        importlib.import_module(name)
print(json.dumps({"modules": len(names), "read": sorted(set(read))}))
"""


def test_no_ckptools_setting_is_read_at_import() -> None:
    # forked from the zygote: torch and the other libraries it preloads are imported already
    # (what they read is not ckptools' doing), ckptools is imported afresh by the child
    argv = [sys.executable, "-c", _IMPORT_ALL]
    run = zygote.run(argv, env=dict(os.environ), cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["modules"] > 100  # the walk reached the whole package
    assert report["read"] == []


def test_the_recording_sees_a_setting_read_at_import(tmp_path: Path) -> None:
    """The check above would catch one: a module that reads a setting at import is reported."""
    pkg = tmp_path / "ckptools_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import os\nLIMIT = os.environ.get('CKPTOOLS_PROBE', '1')\n")
    code = _IMPORT_ALL.replace("import ckptools\n", "import ckptools_probe as ckptools\n")
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["read"] == ["CKPTOOLS_PROBE"]
