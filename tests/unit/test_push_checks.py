"""``ckpt push`` / ``ckptools.push_to_hub``: the checks made before any request, the CLI surface,
and every Hub failure as a one-line error — with the real ``huggingface_hub`` client talking to
the recording server of ``tests/support/hub_server.py``.

Model directories here are written with ``safetensors.numpy`` (no torch); the integration tests
push a real consolidated model.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import ckptools
from ckptools.cli.exit_codes import EXIT_ERROR, EXIT_USAGE
from ckptools.cli.main import cli
from ckptools.errors import (
    CheckpointNotFoundError,
    HubAuthError,
    HubConflictError,
    HubConnectionError,
    HubError,
    HubFileTooLargeError,
    HubNotFoundError,
    IncompleteCheckpointError,
    UsageError,
)
from ckptools.hub.card import step_of
from ckptools.hub.checks import MAX_FILE_BYTES_ENV, resolve_max_file_bytes
from tests.support.hub_server import TEST_TOKEN as TOKEN
from tests.support.hub_server import HubServer

pytestmark = pytest.mark.usefixtures("no_saved_token")
REPO = "me/tiny"


def write_model(directory: Path, shards: int = 2) -> Path:
    """A small Llama-named model directory: ``shards`` safetensors files (+ index when > 1)."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(2 * shards)]
    weight_map: dict[str, str] = {}
    per = len(names) // shards
    for s in range(shards):
        fname = (
            "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        )
        part = {
            n: rng.standard_normal((8, 16)).astype(np.float32)
            for n in names[s * per : (s + 1) * per]
        }
        save_file(part, str(directory / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    if shards > 1:
        index = {"metadata": {"total_size": 4 * 8 * 16 * len(names)}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    return directory


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


# --------------------------------------------------------------------------------------------------
# Surface
# --------------------------------------------------------------------------------------------------


def test_push_is_registered_and_exported() -> None:
    code, out = invoke("--help")
    assert code == 0 and "push" in out
    assert "push_to_hub" in ckptools.__all__ and ckptools.push_to_hub is not None


def test_help_and_import_load_neither_torch_nor_huggingface_hub() -> None:
    code = (
        "import sys\n"
        "import ckptools\n"
        "from ckptools.cli.main import cli\n"
        "try:\n"
        "    cli.main(args=['push', '--help'], prog_name='ckpt')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in ('torch', 'huggingface_hub') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("[]")
    assert "--create-pr" in out.stdout and "--dry-run" in out.stdout


@pytest.mark.parametrize(
    "path, step",
    [
        ("out/checkpoint-500", 500),
        ("ckpts/step-1000", 1000),
        ("ckpts/step_20", 20),
        ("ds/global_step300", 300),
        ("lightning/epoch=0-step=100.ckpt", 100),
        ("run/checkpoint-7/pytorch_model_fsdp_0", 7),
        ("some/dir", None),
    ],
)
def test_step_of(path: str, step: int | None) -> None:
    assert step_of(path) == step


def test_step_of_reads_trainer_state(tmp_path: Path) -> None:
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 42}))
    assert step_of(str(tmp_path)) == 42


# --------------------------------------------------------------------------------------------------
# Dry run and limits: no request at all
# --------------------------------------------------------------------------------------------------


def test_dry_run_lists_files_with_sizes_and_sends_nothing(tmp_path: Path, hub: HubServer) -> None:
    model = write_model(tmp_path / "m")
    result = ckptools.push_to_hub(str(model), REPO, endpoint=hub.url, token=TOKEN, dry_run=True)
    assert hub.requests == []
    on_disk = {p.name: p.stat().st_size for p in model.iterdir()}
    listed = {f.name: f.bytes for f in result.files if not f.generated}
    assert listed == on_disk
    card = [f for f in result.files if f.generated]
    assert [c.name for c in card] == ["README.md"] and result.card_text is not None
    assert card[0].bytes == len(result.card_text.encode())
    assert result.commit_url is None and result.created_repo is None
    assert sorted(os.listdir(model)) == sorted(on_disk)  # nothing written into the directory

    code, out = invoke("push", str(model), REPO, "--endpoint", hub.url, "--dry-run")
    assert code == 0, out
    assert "dry run: nothing sent" in out and "model-00001-of-00002.safetensors" in out
    assert "README.md  (generated model card)" in out
    assert hub.requests == []


def test_a_model_without_tokenizer_files_is_said_so(tmp_path: Path) -> None:
    """A consolidated Megatron or DeepSpeed run has no tokenizer: the push says the repository
    will hold the model alone; a tokenizer file silences it."""
    model = write_model(tmp_path / "m")
    url = f"http://127.0.0.1:{closed_port()}"
    result = ckptools.push_to_hub(str(model), REPO, endpoint=url, dry_run=True)
    assert any(n.startswith("no tokenizer files: the repository holds the model alone")
               for n in result.notes), result.notes  # fmt: skip
    (model / "tokenizer.json").write_text("{}")
    result = ckptools.push_to_hub(str(model), REPO, endpoint=url, dry_run=True)
    assert not any(n.startswith("no tokenizer files") for n in result.notes), result.notes


def test_dry_run_needs_no_network(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m")
    url = f"http://127.0.0.1:{closed_port()}"
    result = ckptools.push_to_hub(str(model), REPO, endpoint=url, dry_run=True)
    assert result.dry_run and len(result.files) == 5


def test_file_over_the_limit_is_refused_before_any_request(
    tmp_path: Path, hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = write_model(tmp_path / "m")
    biggest = max(
        (p for p in model.iterdir() if p.suffix == ".safetensors"), key=lambda p: p.stat().st_size
    )
    monkeypatch.setenv(MAX_FILE_BYTES_ENV, str(biggest.stat().st_size - 1))
    with pytest.raises(HubFileTooLargeError) as e:
        ckptools.push_to_hub(str(model), REPO, endpoint=hub.url, token=TOKEN)
    assert e.value.path == str(biggest)
    assert "--max-shard-size 5GB" in str(e.value) and "nothing was uploaded" in str(e.value)
    assert hub.requests == []

    code, out = invoke("push", str(model), REPO, "--endpoint", hub.url, "--token", TOKEN)
    assert code == EXIT_ERROR
    assert out.count("\n") == 1 and out.startswith(f"error: {biggest}: ")
    assert hub.requests == []
    # the dry run checks the limit too
    code, out = invoke("push", str(model), REPO, "--dry-run")
    assert code == EXIT_ERROR and "over the Hub's limit" in out


def test_limit_argument_beats_env_and_bad_env_is_usage_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert resolve_max_file_bytes() == 50 * 10**9
    monkeypatch.setenv(MAX_FILE_BYTES_ENV, "2KB")
    assert resolve_max_file_bytes() == 2000
    assert resolve_max_file_bytes("1MiB") == 2**20
    monkeypatch.setenv(MAX_FILE_BYTES_ENV, "lots")
    with pytest.raises(UsageError, match=MAX_FILE_BYTES_ENV):
        resolve_max_file_bytes()


def test_invalid_repo_id_is_a_usage_error(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m")
    code, out = invoke("push", str(model), "a/b/c", "--dry-run")
    assert code == EXIT_USAGE and out.startswith("error: repo id 'a/b/c'")


# --------------------------------------------------------------------------------------------------
# Incomplete directories: refused, naming the file
# --------------------------------------------------------------------------------------------------


def _remove_shard(m: Path) -> str:
    (m / "model-00002-of-00002.safetensors").unlink()
    return "model-00002-of-00002.safetensors"


def _truncate_shard(m: Path) -> str:
    p = m / "model-00001-of-00002.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    return p.name


def _stray_shard(m: Path) -> str:
    shutil.copy(m / "model-00001-of-00002.safetensors", m / "model-00003-of-00003.safetensors")
    return "model-00003-of-00003.safetensors"


def _drop_index(m: Path) -> str:
    (m / "model.safetensors.index.json").unlink()
    return "model-00001-of-00002.safetensors"


def _index_disagrees(m: Path) -> str:
    index = json.loads((m / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.up_proj.weight"] = "model-00002-of-00002.safetensors"
    (m / "model.safetensors.index.json").write_text(json.dumps(index))
    return "model.safetensors.index.json"


def _no_weights(m: Path) -> str:
    for p in m.glob("model*"):
        p.unlink()
    return ""


@pytest.mark.parametrize(
    "damage", [_remove_shard, _truncate_shard, _stray_shard, _drop_index, _index_disagrees]
)
def test_incomplete_directory_is_refused_naming_the_file(
    tmp_path: Path, hub: HubServer, damage: object
) -> None:
    model = write_model(tmp_path / "m")
    name = damage(model)  # type: ignore[operator]
    with pytest.raises(IncompleteCheckpointError) as e:
        ckptools.push_to_hub(str(model), REPO, endpoint=hub.url, token=TOKEN)
    assert name in str(e.value) and "nothing was uploaded" in str(e.value)
    code, out = invoke("push", str(model), REPO, "--endpoint", hub.url, "--dry-run")
    assert code == EXIT_ERROR and name in out and out.count("\n") == 1
    assert hub.requests == []


def test_directory_without_weights_is_refused(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m")
    _no_weights(model)
    with pytest.raises(IncompleteCheckpointError, match="no model weights"):
        ckptools.push_to_hub(str(model), REPO, dry_run=True)
    with pytest.raises(CheckpointNotFoundError, match="no such directory"):
        ckptools.push_to_hub(str(tmp_path / "missing"), REPO, dry_run=True)


def test_directory_without_config_needs_weights_only(tmp_path: Path) -> None:
    # a --weights-only consolidation pushed with a note, exit 0: a repository from_pretrained
    # cannot load
    model = write_model(tmp_path / "m")
    (model / "config.json").unlink()
    code, out = invoke("push", str(model), REPO, "--dry-run")
    assert code == EXIT_USAGE and out.count("\n") == 1, out
    assert "no config.json, so from_pretrained could not load" in out and "--weights-only" in out
    result = ckptools.push_to_hub(str(model), REPO, dry_run=True, weights_only=True)
    assert any(n.startswith("weights only (--weights-only)") for n in result.notes)


# --------------------------------------------------------------------------------------------------
# What arrives, and the Hub's refusals as one-line errors
# --------------------------------------------------------------------------------------------------


def test_push_sends_every_file_and_the_card(tmp_path: Path, hub: HubServer) -> None:
    model = write_model(tmp_path / "m")
    result = ckptools.push_to_hub(
        str(model), REPO, endpoint=hub.url, token=TOKEN, commit_message="first", quiet=True
    )
    assert hub.routes() == ["create", "validate_yaml", "preupload", "commit"]
    assert all(r.headers["authorization"] == f"Bearer {TOKEN}" for r in hub.to("commit"))
    arrived = hub.files_at(REPO)
    for p in model.iterdir():
        assert arrived[p.name] == p.read_bytes()
    assert arrived["README.md"].decode() == result.card_text
    assert [c.summary for c in hub.commits] == ["first"]
    assert result.commit_url == f"{hub.url}/{REPO}/commit/{hub.commits[0].oid}"
    assert sorted(os.listdir(model)) == sorted(p.name for p in model.iterdir())
    assert "README.md" not in os.listdir(model)


def test_own_readme_is_uploaded_as_it_is(tmp_path: Path, hub: HubServer) -> None:
    model = write_model(tmp_path / "m", shards=1)
    (model / "README.md").write_text("---\nlicense: mit\n---\n# mine\n")
    result = ckptools.push_to_hub(str(model), REPO, endpoint=hub.url, token=TOKEN, quiet=True)
    assert result.card == "existing" and result.card_text is None
    assert hub.files_at(REPO)["README.md"] == b"---\nlicense: mit\n---\n# mine\n"


def test_own_readme_with_invalid_yaml_is_one_line(tmp_path: Path, hub: HubServer) -> None:
    model = write_model(tmp_path / "m", shards=1)
    (model / "README.md").write_text("---\nlicense: [mit\n---\n# mine\n")
    with pytest.raises(HubError) as e:
        ckptools.push_to_hub(str(model), REPO, endpoint=hub.url, token=TOKEN, quiet=True)
    assert "metadata of README.md" in str(e.value) and "invalid YAML" in str(e.value)
    assert "\n" not in str(e.value) and hub.commits == []


def test_no_token_is_401_saying_how_to_log_in(tmp_path: Path, hub: HubServer) -> None:
    model = write_model(tmp_path / "m", shards=1)
    with pytest.raises(HubAuthError) as e:
        ckptools.push_to_hub(str(model), REPO, endpoint=hub.url, quiet=True)
    assert e.value.status == 401 and "hf auth login" in str(e.value)
    code, out = invoke("push", str(model), REPO, "--endpoint", hub.url, "-q")
    assert code == EXIT_ERROR and out.count("\n") == 1 and "HF_TOKEN" in out
    assert "commit" not in hub.routes()


def test_403_says_which_namespace_needs_write_access(tmp_path: Path, hub: HubServer) -> None:
    model = write_model(tmp_path / "m", shards=1)
    hub.fail("create", 403, "You don't have the rights to create a model under the namespace org")
    with pytest.raises(HubAuthError) as e:
        ckptools.push_to_hub(str(model), "org/tiny", endpoint=hub.url, token=TOKEN, quiet=True)
    assert e.value.status == 403
    assert "'org' namespace" in str(e.value) and "rights to create" in str(e.value)
    assert hub.routes() == ["create", "repo_info"]  # it may exist: checked, it does not


@pytest.mark.parametrize(
    "status, error_code, cls, words",
    [
        (404, "RepoNotFound", HubNotFoundError, "repository not found"),
        (409, None, HubConflictError, "re-running the push resumes it"),
        (500, None, HubError, "try again later"),
        (400, None, HubError, "refused the request"),
    ],
)
def test_commit_refusals_become_one_line_errors(
    tmp_path: Path,
    hub: HubServer,
    status: int,
    error_code: str | None,
    cls: type[Exception],
    words: str,
) -> None:
    model = write_model(tmp_path / "m", shards=1)
    hub.fail("commit", status, f"server says {status}", error_code=error_code)
    with pytest.raises(cls) as e:
        ckptools.push_to_hub(str(model), REPO, endpoint=hub.url, token=TOKEN, quiet=True)
    assert isinstance(e.value, HubError) and e.value.status == status
    assert words in str(e.value) and f"server says {status}" in str(e.value)
    assert REPO not in hub.repos or hub.commits == []
    hub.fail("commit", status, f"server says {status}", error_code=error_code)
    code, out = invoke("push", str(model), REPO, "--endpoint", hub.url, "--token", TOKEN, "-q")
    assert code == EXIT_ERROR and out.count("\n") == 1 and words in out


def test_unknown_revision_is_404_naming_it(tmp_path: Path, hub: HubServer) -> None:
    model = write_model(tmp_path / "m", shards=1)
    with pytest.raises(HubNotFoundError, match="revision 'nope' not found"):
        ckptools.push_to_hub(
            str(model), REPO, endpoint=hub.url, token=TOKEN, revision="nope", create_pr=True,
            quiet=True,
        )  # fmt: skip


def test_network_down_is_one_line(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", shards=1)
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(HubConnectionError) as e:
        ckptools.push_to_hub(str(model), REPO, endpoint=url, token=TOKEN, quiet=True)
    assert isinstance(e.value, ConnectionError) and "cannot reach the Hub" in str(e.value)
    code, out = invoke("push", str(model), REPO, "--endpoint", url, "--token", TOKEN, "-q")
    assert code == EXIT_ERROR and out.count("\n") == 1 and out.startswith(f"error: {url}: ")


def http_error(cls: type[BaseException], status: int, said: str = "nope") -> BaseException:
    """An exception of ``huggingface_hub`` carrying a response with ``status``, built with the
    HTTP library that this ``huggingface_hub`` uses."""
    import importlib

    for name in ("httpx2", "httpx"):
        try:
            lib = importlib.import_module(name)
            break
        except ImportError:
            continue
    else:
        pytest.skip("huggingface_hub on requests: covered by the HubServer tests")
    response = lib.Response(status, request=lib.Request("POST", "https://hub.test/api/x"))
    return cls(f"{status} Client Error: {said}", response=response, server_message=said)


def test_error_table_first_match_wins() -> None:
    from huggingface_hub.utils import (  # type: ignore[attr-defined]
        HfHubHTTPError,
        HFValidationError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    from ckptools.hub.errors import hub_error

    def mapped(e: BaseException) -> BaseException | None:
        return hub_error(e, repo_id="me/m", endpoint="https://hub.test", revision=None)

    # The client raises RepositoryNotFoundError for a 401 too: it must read as a login problem.
    e = mapped(http_error(RepositoryNotFoundError, 401))
    assert isinstance(e, HubAuthError) and e.status == 401 and "hf auth login" in str(e)
    e = mapped(http_error(RepositoryNotFoundError, 404))
    assert isinstance(e, HubNotFoundError) and str(e).startswith("me/m: repository not found")
    e = mapped(http_error(HfHubHTTPError, 404))
    assert isinstance(e, HubNotFoundError) and e.status == 404
    e = mapped(http_error(HfHubHTTPError, 403))
    assert isinstance(e, HubAuthError) and "on the 'me' namespace" in str(e)
    e = mapped(http_error(HfHubHTTPError, 502, "bad gateway"))
    assert type(e) is HubError and str(e) == (
        "https://hub.test: the Hub failed (502) (bad gateway): try again later; re-running the "
        "push resumes it (files already on the Hub are not sent again)"
    )
    e = mapped(http_error(HfHubHTTPError, 418))
    assert type(e) is HubError and str(e) == "me/m: the Hub refused the request (418) (nope)"
    # OfflineModeIsEnabled is a ConnectionError, HFValidationError a ValueError: earlier rows.
    e = mapped(OfflineModeIsEnabled("offline"))
    assert isinstance(e, HubConnectionError) and "HF_HUB_OFFLINE" in str(e)
    e = mapped(HFValidationError("Repo id must be in the form 'repo_name'\nmore"))
    assert type(e) is UsageError and str(e) == "'me/m': Repo id must be in the form 'repo_name'"
    e = mapped(ValueError("Invalid metadata in README.md.\n- bad: key\n- other\n- third"))
    assert isinstance(e, HubError) and e.status == 400 and "(bad: key other)" in str(e)
    e = mapped(ConnectionError("refused\ntrace"))
    assert isinstance(e, HubConnectionError) and "(ConnectionError: refused)" in str(e)
    assert mapped(ValueError("a bug")) is None and mapped(KeyError("x")) is None


def test_human_sizes_are_written_once() -> None:
    from ckptools.cli import render
    from ckptools.core import sizes

    assert render.human_bytes is sizes.human_bytes and render.human_count is sizes.human_count
    assert [sizes.human_size(n) for n in (0, 999, 1000, 5 * 10**9, 50 * 10**9 - 1)] == [
        "0 B",
        "999 B",
        "1.0 KB",
        "5.0 GB",
        "50.0 GB",
    ]
    assert [sizes.human_bytes(n) for n in (None, 1023, 1024, 3 * 2**29, 2**50)] == [
        "-",
        "1023 B",
        "1.0 KiB",
        "1.5 GiB",
        "1024.0 TiB",
    ]
    assert [sizes.human_count(n) for n in (999, 1000, 1_235_814_400)] == ["999", "1.00K", "1.24B"]


def test_hub_modules_import_each_other_directly() -> None:
    import ast

    hub_dir = Path(ckptools.__file__).parent / "hub"
    for path in hub_dir.glob("*.py"):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "ckptools.hub", f"{path.name} imports from the package"
