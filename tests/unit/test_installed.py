"""Start-up of a converted consolidate (issue 38, performance): the installed transformers'
version, which keys the conversion cache, is read from its ``.dist-info`` directory's name, so
a Megatron MoE consolidate that finds its conversion in the user's cache never imports ``importlib.metadata`` (and ``email``: ~60-90 ms)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from ckptools.io import installed

REPO = Path(__file__).resolve().parents[2]
MIXTRAL = REPO / "fixtures" / "megatron" / "mixtral_ep2"


@pytest.mark.parametrize(
    ("dist", "module"),
    [("transformers", None), ("torch", None), ("huggingface-hub", "huggingface_hub"),
     ("typing-extensions", "typing_extensions")],  # the last: one module, asked of metadata
)  # fmt: skip
def test_version_is_what_importlib_metadata_says(dist: str, module: str | None) -> None:
    installed.version.cache_clear()
    assert installed.version(dist, module) == metadata.version(dist)


def test_a_missing_distribution_has_no_version() -> None:
    assert installed.version("ckptools-no-such-distribution") is None


_RUN = """
import json, sys
from ckptools.cli.main import main
try:
    main(["consolidate", sys.argv[1], sys.argv[2], "--config", sys.argv[3], "-q"])
except SystemExit as e:
    assert not e.code, e.code
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("importlib.metadata", "email")))))
"""


def test_a_megatron_moe_consolidate_does_not_import_importlib_metadata(tmp_path: Path) -> None:
    import torch

    config = tmp_path / "config.json"
    config.write_text(torch.load(f"{MIXTRAL}.truth.pt", weights_only=True)["hf_config"])
    env = {**os.environ, "PYTHONPATH": str(REPO), "CKPTOOLS_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-P", "-c", _RUN, str(MIXTRAL), str(tmp_path / "out"), str(config)]
    # the first run derives the conversion with transformers (which imports it) and keeps it in
    # the user's cache; a run that finds it there imports no transformers
    subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    cmd[-2] = str(tmp_path / "again")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    assert (tmp_path / "again" / "model.safetensors").is_file()
    assert json.loads(done.stdout.splitlines()[-1]) == []
