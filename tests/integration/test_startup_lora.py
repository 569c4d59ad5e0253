"""Start-up of ``consolidate --adapter`` (issue seam 17): a LoRA adapter is written without
importing peft (and with it torch and transformers) once peft's ``LoraConfig`` defaults are in
the user's cache, with the same ``adapter_config.json`` as peft's own ``save_pretrained``.

Structure, not time: which modules a fresh process imports (tests/unit/test_startup_imports.py).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.integration import test_diff_lora_seams as seams
from tests.unit.test_startup_imports import heavy_imports

_Cached = Callable[[str, Sequence[Path], Callable[[Path], None]], Path]


@pytest.fixture(scope="module")
def peft_dcp(cached_output: _Cached) -> Path:
    """test_diff_lora_seams' producer (shared with it): a peft-wrapped tiny Llama saved with
    ``dcp.save``, its config.json beside it, and peft's own adapter directory."""
    if importlib.util.find_spec("peft") is None:
        pytest.skip("needs peft")
    return cached_output("peft-llama-dcp", [Path(seams.__file__)], seams._peft_dcp)


def _config(path: Path) -> dict[str, Any]:
    config = json.loads(path.read_text())
    # peft writes target_modules from a set: its order follows the process's string hash
    return {**config, "target_modules": sorted(config["target_modules"])}


def test_an_adapter_is_written_without_peft_once_its_defaults_are_kept(
    peft_dcp: Path, tmp_path: Path
) -> None:
    src, truth = str(peft_dcp / "src"), peft_dcp / "peft_adapter" / "adapter_config.json"
    args = ["--adapter", "--lora-alpha", "16", "-q"]
    # a fresh cache: peft asked once for its defaults (and the config beside it checked)
    first = heavy_imports(tmp_path, "consolidate", src, str(tmp_path / "a"), *args)
    assert "peft" in first
    again = heavy_imports(tmp_path, "consolidate", src, str(tmp_path / "b"), *args)
    assert again == set()  # the next run, e.g. the next checkpoint of the same training run
    for out in ("a", "b"):
        assert _config(tmp_path / out / "adapter_config.json") == _config(truth)
    assert (tmp_path / "a" / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "b" / "adapter_model.safetensors"
    ).read_bytes()


def test_a_peft_upgrade_is_noticed(
    peft_dcp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptools.io import user_cache
    from ckptools.views import peft_defaults

    monkeypatch.setenv(user_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    asked: list[int] = []
    real = peft_defaults._derive_peft_defaults
    monkeypatch.setattr(peft_defaults, "_derive_peft_defaults", lambda: asked.append(1) or real())
    kept = peft_defaults._peft_defaults()
    assert (
        kept is not None
        and asked == [1]
        and peft_defaults._peft_defaults() == kept
        and asked == [1]
    )
    monkeypatch.setattr(
        peft_defaults, "_PEFT_SOURCES", (*peft_defaults._PEFT_SOURCES, "__init__.py")
    )
    assert peft_defaults._peft_defaults() == kept and asked == [1, 1]  # other sources: asked again
    from importlib import metadata

    version = metadata.version
    monkeypatch.setattr(
        metadata, "version", lambda name: "99.0" if name == "peft" else version(name)
    )
    assert peft_defaults._peft_defaults() == kept and asked == [
        1,
        1,
        1,
    ]  # another version: asked again
