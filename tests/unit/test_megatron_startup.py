"""Start-up of a Megatron MoE consolidate (issue 38, performance: the start-up is part of the
1.25x of ``cp -r`` + ``sync`` at 1 GiB): what a run that finds its conversion in the user's cache
leaves out. Structure, never time: ``importlib.metadata`` (and ``email``, ~60-90 ms; the
conversion cache's key, transformers' version, comes from its ``.dist-info`` name) and the
distributed optimizer's readers (~20-25 ms; only ``--masters``, reshard and load use them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MIXTRAL = REPO / "fixtures" / "megatron" / "mixtral_ep2"

#: run in a fresh ``python -P``: the CLI's consolidate, then the modules named it imported
_RUN = """
import json, sys
from ckptools.cli.main import main
try:
    main(["consolidate", sys.argv[1], sys.argv[2], "--config", sys.argv[3], "-q"])
except SystemExit as e:
    assert not e.code, e.code
print(json.dumps(sorted(m for m in sys.modules if m.startswith(
    ("importlib.metadata", "email", "ckptools.producers.megatron")))))
"""
#: the optimizer's readers: a model-only consolidate has no use for them
_OPTIMIZER = {
    "ckptools.producers.megatron.masters", "ckptools.producers.megatron.optimizer",
    "ckptools.producers.megatron.moe_optimizer", "ckptools.producers.megatron.buckets",
    "ckptools.producers.megatron.training",
}  # fmt: skip


def test_a_megatron_moe_consolidate_imports_no_metadata_and_no_optimizer_reader(
    tmp_path: Path,
) -> None:
    import torch

    config = tmp_path / "config.json"
    config.write_text(torch.load(f"{MIXTRAL}.truth.pt", weights_only=True)["hf_config"])
    env = {**os.environ, "PYTHONPATH": str(REPO), "CKPTOOLS_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-P", "-c", _RUN, str(MIXTRAL), str(tmp_path / "out"), str(config)]
    # the first run derives the conversion with transformers (which imports importlib.metadata)
    # and keeps it in the user's cache; a run that finds it there imports no transformers
    subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    cmd[-2] = str(tmp_path / "again")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    assert (tmp_path / "again" / "model.safetensors").is_file()
    modules = set(json.loads(done.stdout.splitlines()[-1]))
    assert not {m for m in modules if m.startswith(("importlib.metadata", "email"))}
    assert "ckptools.producers.megatron.converted" in modules  # it did read the run
    assert not modules & _OPTIMIZER, sorted(modules & _OPTIMIZER)
