"""``push_to_hub`` against the real Hugging Face Hub: runs only with ``HF_TOKEN`` set (``-m hub``;
``tests/conftest.py`` skips it otherwise). Pushes a tiny model to a new private repository of the
token's user, checks what the Hub holds, and deletes the repository afterwards.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import ckptools


@pytest.fixture
def repo_id() -> Iterator[str]:
    from huggingface_hub import HfApi

    api = HfApi()
    user = api.whoami()["name"]
    name = f"{user}/ckptools-push-test-{uuid.uuid4().hex[:10]}"
    try:
        yield name
    finally:
        api.delete_repo(name, missing_ok=True)


@pytest.mark.hub
def test_push_to_the_live_hub(tmp_path: Path, repo_id: str) -> None:
    from huggingface_hub import HfApi, hf_hub_download
    from safetensors.numpy import save_file

    model = tmp_path / "model"
    model.mkdir()
    rng = np.random.default_rng(0)
    save_file(
        {"model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32)},
        str(model / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))

    result = ckptools.push_to_hub(str(model), repo_id, private=True, quiet=True)
    assert result.created_repo and result.commit_url and repo_id in result.commit_url

    api = HfApi()
    assert api.repo_info(repo_id).private is True
    assert sorted(api.list_repo_files(repo_id)) == [
        ".gitattributes",
        "README.md",
        "config.json",
        "model.safetensors",
    ]
    for name in ("model.safetensors", "config.json"):
        got = Path(hf_hub_download(repo_id, name, cache_dir=str(tmp_path / "cache")))
        assert got.read_bytes() == (model / name).read_bytes()
    card = Path(hf_hub_download(repo_id, "README.md", cache_dir=str(tmp_path / "cache")))
    text = card.read_text()
    assert "library_name: transformers" in text
    digest = hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()
    assert digest in text

    again = ckptools.push_to_hub(str(model), repo_id, private=True, quiet=True)
    assert again.created_repo is False and again.commit_oid == result.commit_oid
