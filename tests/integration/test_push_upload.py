"""Pushing a real consolidated model with the real ``huggingface_hub`` client to the recording
server (``tests/support/hub_server.py``): what arrives is byte for byte the directory, loads with
``transformers`` as the reference state dict torch gathered itself, and comes with a model card
whose checksums match an independent SHA-256 of the files. Also: the LFS path, resuming after a
failure, branches, pull requests, existing repositories, the multi-commit path for large
directories, ``ckpt consolidate --push-to-hub`` and the Trainer callback's push.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner

import ckptools
from ckptools.cli.exit_codes import EXIT_USAGE
from ckptools.cli.main import cli
from ckptools.errors import HubError, UsageError
from ckptools.hub.checks import LARGE_FOLDER_BYTES_ENV
from tests.conftest import Produced
from tests.support.hub_server import TEST_TOKEN as TOKEN
from tests.support.hub_server import USER, HubServer
from tests.support.producers import hf_config_dict

# The client's LFS upload hands httpx a file object, which httpx2 deprecates; not ours to fix.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
    pytest.mark.usefixtures("no_saved_token"),
]
REPO = "me/tiny-llama"
_STEP = 7


@pytest.fixture
def lfs_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    """Files of 1 KB and more go through LFS, which the client uses once Xet is off."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    with HubServer(token=TOKEN, lfs_min_bytes=1024) as server:
        yield server


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, produced: Callable[..., Produced]) -> Path:
    """``run/step-7/`` (an FSDP2 checkpoint of 2 ranks) with ``run/config.json`` beside it."""
    p = produced("fsdp2", world_size=2, optimizer=False)
    root = tmp_path_factory.mktemp("push-run")
    shutil.copytree(p.path, root / "run" / f"step-{_STEP}")
    shutil.copy(p.ref_path, root / "reference.pt")
    (root / "run" / "config.json").write_text(json.dumps(hf_config_dict()))
    return root


@pytest.fixture(scope="module")
def model(run: Path) -> Path:
    """The consolidated model: several shards, an index and config.json."""
    out = run / "hf"
    result = ckptools.consolidate(
        str(run / "run" / f"step-{_STEP}"), str(out), max_shard_size="4KB", quiet=True
    )
    assert len(result.plan.files) > 2 and result.plan.index is not None
    return out


def _reference(run: Path) -> dict[str, torch.Tensor]:
    ref: dict[str, Any] = torch.load(run / "reference.pt", weights_only=True)
    return dict(ref["model"])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _front_matter(card: str) -> dict[str, Any]:
    assert card.startswith("---\n")
    meta: dict[str, Any] = yaml.safe_load(card.split("\n---\n", 1)[0][4:])
    return meta


def _local_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_push_arrives_whole_loads_as_the_reference_and_is_described(
    run: Path, model: Path, hub: HubServer, tmp_path: Path
) -> None:
    from transformers import LlamaForCausalLM

    source = str(run / "run" / f"step-{_STEP}")
    result = ckptools.push_to_hub(
        str(model), REPO, private=True, source=source, endpoint=hub.url, token=TOKEN, quiet=True
    )

    # what the client sent, in order, and what it asked for
    assert hub.routes() == ["create", "validate_yaml", "preupload", "commit"]
    create = hub.to("create")[0].json()
    assert (create["organization"], create["name"], create["visibility"]) == (
        "me",
        "tiny-llama",
        "private",
    )
    assert hub.repos[REPO].private
    local = _local_files(model)
    sizes = {f["path"]: f["size"] for f in hub.to("preupload")[0].json()["files"]}
    assert sizes == {
        **{n: len(b) for n, b in local.items()},
        "README.md": len(result.card_text or ""),
    }
    (commit,) = hub.commits
    assert commit.summary == f"Upload model with ckptools from run/step-{_STEP} (step {_STEP})"
    assert commit.ref == "main" and sorted(commit.added) == sorted([*local, "README.md"])

    # what the repository holds: the directory byte for byte, plus the card
    arrived = hub.files_at(REPO)
    assert {n: arrived[n] for n in local} == local
    assert arrived["README.md"].decode() == result.card_text
    assert result.commit_url == f"{hub.url}/{REPO}/commit/{commit.oid}"
    assert result.created_repo and result.method == "single_commit"

    # the model card: metadata and provenance, checksums an independent sha256 agrees with
    meta = _front_matter(arrived["README.md"].decode())
    assert meta["library_name"] == "transformers"
    assert meta["tags"] == ["ckptools", "safetensors", "llama"]
    prov = meta["ckptools"]
    assert prov["source"] == f"run/step-{_STEP}" and prov["step"] == _STEP
    assert prov["world_size"] == 2 and prov["source_layout"] == "dcp"
    assert prov["dtype"] == "float32"
    reference = _reference(run)
    assert prov["parameters"] == sum(t.numel() for t in reference.values())
    assert prov["checksums"]["algorithm"] == "sha256"
    assert prov["checksums"]["files"] == {
        n: hashlib.sha256(b).hexdigest() for n, b in local.items()
    }
    body = arrived["README.md"].decode()
    assert f'LlamaForCausalLM.from_pretrained("{REPO}")' in body

    # what was uploaded is the model: transformers loads it as the reference, bit for bit
    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    for name, data in arrived.items():
        (downloaded / name).write_bytes(data)
    loaded = LlamaForCausalLM.from_pretrained(str(downloaded), dtype=torch.float32).state_dict()
    assert sorted(loaded) == sorted(reference)
    assert [k for k in reference if not torch.equal(_bits(loaded[k]), _bits(reference[k]))] == []

    # the directory itself is untouched
    assert _local_files(model) == local


def test_lfs_upload_sends_each_object_once_with_its_sha256(model: Path, lfs_hub: HubServer) -> None:
    result = ckptools.push_to_hub(str(model), REPO, endpoint=lfs_hub.url, token=TOKEN, quiet=True)
    local = _local_files(model)
    big = {n: b for n, b in local.items() if len(b) >= 1024}
    assert len(big) >= 2
    (batch,) = lfs_hub.to("lfs_batch")
    objects = {(o["oid"], o["size"]) for o in batch.json()["objects"]}
    card = (result.card_text or "").encode()
    expected = {(hashlib.sha256(b).hexdigest(), len(b)) for b in big.values()}
    if len(card) >= 1024:
        expected.add((hashlib.sha256(card).hexdigest(), len(card)))
    assert objects == expected
    assert sorted(r.params["oid"] for r in lfs_hub.to("lfs_upload")) == sorted(
        o for o, _ in objects
    )
    (commit,) = lfs_hub.commits
    assert {n for n, f in commit.added.items() if f.lfs} >= set(big)
    assert {n: lfs_hub.files_at(REPO)[n] for n in local} == local


def test_rerun_after_a_failed_commit_resumes_without_resending(
    model: Path, lfs_hub: HubServer
) -> None:
    lfs_hub.fail("commit", 500, "storage hiccup")
    with pytest.raises(HubError, match="try again later"):
        ckptools.push_to_hub(str(model), REPO, endpoint=lfs_hub.url, token=TOKEN, quiet=True)
    uploaded = len(lfs_hub.to("lfs_upload"))
    assert uploaded >= 2 and lfs_hub.commits == []

    start = len(lfs_hub.requests)
    result = ckptools.push_to_hub(str(model), REPO, endpoint=lfs_hub.url, token=TOKEN, quiet=True)
    again = lfs_hub.requests[start:]
    assert [r.route for r in again if r.route == "lfs_upload"] == []  # the Hub had them all
    assert not result.created_repo and len(lfs_hub.commits) == 1
    assert {n: lfs_hub.files_at(REPO)[n] for n in _local_files(model)} == _local_files(model)

    # unchanged: nothing to commit; the result points at the commit that holds the model
    start = len(lfs_hub.requests)
    result = ckptools.push_to_hub(str(model), REPO, endpoint=lfs_hub.url, token=TOKEN, quiet=True)
    assert "commit" not in [r.route for r in lfs_hub.requests[start:]]
    assert len(lfs_hub.commits) == 1 and result.commit_oid == lfs_hub.commits[0].oid


def test_branch_is_created_and_main_left_alone(model: Path, hub: HubServer) -> None:
    hub.add_repo(REPO)
    main_before = hub.files_at(REPO)
    result = ckptools.push_to_hub(
        str(model), REPO, revision="step-7", endpoint=hub.url, token=TOKEN, quiet=True
    )
    assert hub.routes() == ["create", "repo_info", "branch", "validate_yaml", "preupload", "commit"]
    assert hub.commits[0].ref == "step-7" and not result.created_repo
    assert hub.files_at(REPO) == main_before
    assert "model.safetensors.index.json" in hub.files_at(REPO, "step-7")


def test_create_pr_commits_to_a_pull_request(model: Path, hub: HubServer) -> None:
    hub.add_repo(REPO)
    result = ckptools.push_to_hub(
        str(model), REPO, create_pr=True, endpoint=hub.url, token=TOKEN, quiet=True
    )
    (commit,) = hub.commits
    assert commit.ref == "refs/pr/1" and hub.to("commit")[0].query["create_pr"] == ["1"]
    assert result.pr_url == f"{hub.url}/{REPO}/discussions/1"
    assert sorted(hub.files_at(REPO)) == [".gitattributes"]


def test_private_push_refuses_an_existing_public_repo(model: Path, hub: HubServer) -> None:
    hub.add_repo(REPO, private=False)
    with pytest.raises(UsageError, match="already exists and is public"):
        ckptools.push_to_hub(
            str(model), REPO, private=True, endpoint=hub.url, token=TOKEN, quiet=True
        )
    assert "commit" not in hub.routes() and "preupload" not in hub.routes()
    hub.repos[REPO].private = True
    result = ckptools.push_to_hub(
        str(model), REPO, private=True, endpoint=hub.url, token=TOKEN, quiet=True
    )
    assert result.created_repo is False and len(hub.commits) == 1


def test_repo_without_namespace_goes_to_the_token_owner(model: Path, hub: HubServer) -> None:
    result = ckptools.push_to_hub(
        str(model), "tiny-llama", endpoint=hub.url, token=TOKEN, quiet=True
    )
    assert result.repo_id == f"{USER}/tiny-llama"
    assert hub.commits[0].repo_id == f"{USER}/tiny-llama"


def test_large_directory_commits_weights_first_and_the_index_last(
    model: Path, hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LARGE_FOLDER_BYTES_ENV, "1")
    result = ckptools.push_to_hub(str(model), REPO, endpoint=hub.url, token=TOKEN, quiet=True)
    assert result.method == "multi_commit"
    shards = {n for n in os.listdir(model) if n.endswith(".safetensors")}
    *weights, last = hub.commits
    assert weights and set().union(*(c.added for c in weights)) == shards
    assert sorted(last.added) == ["README.md", "config.json", "model.safetensors.index.json"]
    assert result.commit_oid == last.oid
    assert {n: hub.files_at(REPO)[n] for n in os.listdir(model)} == _local_files(model)


def test_cli_push_prints_the_commit_url_and_json(model: Path, hub: HubServer) -> None:
    args = ["push", str(model), REPO, "--endpoint", hub.url, "--token", TOKEN, "-q"]
    result = CliRunner().invoke(cli, [*args, "--commit-message", "from the cli"])
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith(f"commit: {hub.url}/{REPO}/commit/{hub.commits[0].oid}")
    assert hub.commits[0].summary == "from the cli"

    result = CliRunner().invoke(cli, [*args, "--json"])
    data = json.loads(result.output)
    assert data["commit_url"].startswith(f"{hub.url}/{REPO}/commit/")
    assert {f["name"] for f in data["files"]} == {*os.listdir(model), "README.md"}


def test_consolidate_push_to_hub(
    run: Path, hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants as constants

    # The client's own defaults (HF_ENDPOINT, read at import, and HF_TOKEN) reach the push.
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    src = str(run / "run" / f"step-{_STEP}")
    out = str(run / "hf-pushed")
    result = CliRunner().invoke(
        cli,
        ["consolidate", src, out, "--max-shard-size", "4KB", "-q", "--json", "--push-to-hub", REPO],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["push"]["commit_url"] == f"{hub.url}/{REPO}/commit/{hub.commits[0].oid}"
    assert data["push"]["provenance"]["source"] == f"run/step-{_STEP}"
    arrived = hub.files_at(REPO)
    assert {n: arrived[n] for n in os.listdir(out)} == _local_files(Path(out))


def test_consolidate_push_refuses_a_shard_size_over_the_limit_first(
    run: Path, hub: HubServer
) -> None:
    out = run / "never"
    src = f"{run}/run/step-{_STEP}"
    args = ["consolidate", src, str(out), "--max-shard-size", "60GB", "--push-to-hub", REPO]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == EXIT_USAGE and "--max-shard-size 5GB" in result.output
    assert not out.exists() and hub.requests == []


def test_trainer_callback_pushes_each_consolidated_checkpoint(
    tmp_path: Path, produced: Callable[..., Produced], hub: HubServer
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerControl, TrainerState

    from ckptools.integrations.transformers import CkptoolsCallback
    from tests.support.producers import _training_args_pickle

    p = produced("trainer")
    shutil.copytree(p.path, tmp_path / "checkpoint-2")
    cfg = {k: v for k, v in hf_config_dict().items() if k not in ("architectures", "torch_dtype")}
    callback = CkptoolsCallback(
        "hf", push_to_hub=REPO, hub_private=True, hub_endpoint=hub.url, hub_token=TOKEN
    )
    callback.on_save(
        _training_args_pickle(str(tmp_path)),
        TrainerState(global_step=2),
        TrainerControl(),
        model=LlamaForCausalLM(LlamaConfig(**cfg)),
    )
    pushed = callback.wait_for_push()
    assert (
        pushed is not None and pushed.commit_url == f"{hub.url}/{REPO}/commit/{hub.commits[0].oid}"
    )
    out = tmp_path / "checkpoint-2" / "hf"
    assert {n: hub.files_at(REPO)[n] for n in os.listdir(out)} == _local_files(out)
    assert hub.repos[REPO].private
    prov = _front_matter(hub.files_at(REPO)["README.md"].decode())["ckptools"]
    assert prov["step"] == 2 and prov["source_layout"] == "trainer"

    # a failed push is kept for wait_for_push, not raised into training
    hub.fail("preupload", 403, "read-only token")
    callback.on_save(
        _training_args_pickle(str(tmp_path)), TrainerState(global_step=2), TrainerControl()
    )
    with pytest.raises(HubError, match="no write access"):
        callback.wait_for_push()
    assert len(hub.commits) == 1
