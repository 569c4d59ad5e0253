"""Paths stay inside the checkpoint (issue 19, items 1-3 and 10).

Every case starts from a real checkpoint (``dcp.save``, safetensors ``save_file``, ``torch.save``
with an HF index), then edits what it names (``.metadata`` items, ``index.json``) or adds links to
a secret file outside it. Every command must refuse with one line naming the entry, never print
the secret's path nor copy its bytes, and leave the source as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from safetensors.torch import save_file

import ckptools
from ckptools.cli.main import cli
from ckptools.errors import OutsideCheckpointError, UsageError

SECRET = b"TOP-SECRET-" + b"x" * 64


# --------------------------------------------------------------------------------------------------
# Builders and checks
# --------------------------------------------------------------------------------------------------


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(8, 4, generator=g),
        "layer.weight": torch.randn(4, 4, generator=g),
        "layer.bias": torch.randn(4, generator=g),
    }


def _dcp(path: Path) -> Path:
    dcp.save({"model": _tensors(), "extra": {"step": 3}}, checkpoint_id=str(path))
    return path


def _secret_dir(tmp_path: Path) -> Path:
    """A directory outside every checkpoint holding the secret in the forms a reader would take:
    raw bytes, a copy of a valid data file (filled in by the cases)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.bin").write_bytes(SECRET)
    return outside


def _edit_metadata(ckpt: Path, rel: Callable[[str], str]) -> None:
    """Rewrite the relative_path of every item of ``ckpt/.metadata`` with ``rel`` (our own
    file, written by dcp.save just above: plain pickle is fine here)."""
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    md.storage_data = {
        k: dataclasses.replace(v, relative_path=rel(v.relative_path))
        for k, v in md.storage_data.items()
    }
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


def _tree_digest(root: Path) -> str:
    """Every entry below ``root``: links by their target, files by their bytes."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if os.path.islink(Path(dirpath, d))]):
            p = Path(dirpath, name)
            h.update(str(p.relative_to(root)).encode() + b"\0")
            h.update(os.readlink(p).encode() if p.is_symlink() else p.read_bytes())
    return h.hexdigest()


def _no_secret_anywhere(tmp_path: Path, text: str, outside: Path) -> None:
    assert str(outside) not in text, text  # the name as written may show, never the target
    for dirpath, _, filenames in os.walk(tmp_path):
        if Path(dirpath) == outside or Path(dirpath).is_relative_to(outside):
            continue
        for name in filenames:
            p = Path(dirpath, name)
            if not p.is_symlink():
                assert SECRET not in p.read_bytes(), f"secret bytes copied into {p}"


def _refused(args: list[str], *, code: int = 1) -> str:
    result = CliRunner().invoke(cli, args)
    text = result.output.strip()
    assert result.exit_code == code, text
    assert text.startswith("error: ") and "\n" not in text, text
    assert "Traceback" not in text
    return text


def _all_commands_refuse(ckpt: Path, tmp_path: Path, outside: Path, entry: str) -> None:
    """consolidate, reshard or shard, inspect, diff refuse naming ``entry``; verify reports it
    as a finding; nothing outside is read and the source is unchanged."""
    before = _tree_digest(ckpt)
    out = tmp_path / "out"
    is_dcp = (ckpt / ".metadata").exists()
    texts = [
        _refused(["consolidate", str(ckpt), str(out)]),
        _refused(["reshard" if is_dcp else "shard", str(ckpt), str(out), "--world-size", "2"]),
        _refused(["inspect", str(ckpt)]),
        _refused(["diff", str(ckpt), str(ckpt)]),
    ]
    for text in texts:
        assert entry in text and "outside the checkpoint" in text, text
    verify = CliRunner().invoke(cli, ["verify", str(ckpt)])
    assert verify.exit_code == 3, verify.output
    assert "outside the checkpoint" in verify.output and "OK" not in verify.output.split()
    texts.append(verify.output)
    with pytest.raises(OutsideCheckpointError):
        ckptools.read_manifest(str(ckpt))
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))
    assert _tree_digest(ckpt) == before
    _no_secret_anywhere(tmp_path, "\n".join(texts), outside)


# --------------------------------------------------------------------------------------------------
# DCP: .metadata relative_path and data files that are links
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["dotdot", "absolute", "nested-dotdot"])
def test_dcp_relative_path_outside_is_refused(tmp_path: Path, how: str) -> None:
    outside = _secret_dir(tmp_path)
    ckpt = _dcp(tmp_path / "ckpt")
    # the secret as a valid data file: a reader that followed the name would succeed silently
    (outside / "secret.distcp").write_bytes((ckpt / "__0_0.distcp").read_bytes() + SECRET)
    target = {
        "dotdot": "../outside/secret.distcp",
        "absolute": str(outside / "secret.distcp"),
        "nested-dotdot": "sub/../../outside/secret.distcp",
    }[how]
    _edit_metadata(ckpt, lambda _: target)
    # an absolute name is not shown at all: it would print the outside path
    entry = "stores 'model.embed.weight' in " + ("a file" if how == "absolute" else repr(target))
    _all_commands_refuse(ckpt, tmp_path, outside, entry)


def test_dcp_data_file_linking_outside_is_refused(tmp_path: Path) -> None:
    outside = _secret_dir(tmp_path)
    ckpt = _dcp(tmp_path / "ckpt")
    data = ckpt / "__0_0.distcp"
    (outside / "secret.distcp").write_bytes(data.read_bytes() + SECRET)
    data.unlink()
    data.symlink_to(outside / "secret.distcp")
    _all_commands_refuse(ckpt, tmp_path, outside, "'__0_0.distcp'")


def test_dcp_marker_and_aux_file_linking_outside_are_refused(tmp_path: Path) -> None:
    outside = _secret_dir(tmp_path)
    ckpt = _dcp(tmp_path / "ckpt")
    (ckpt / "trainer_state.json").symlink_to(outside / "secret.bin")  # copied by reshard
    _all_commands_refuse(ckpt, tmp_path, outside, "'trainer_state.json'")

    ckpt2 = _dcp(tmp_path / "ckpt2")
    os.replace(ckpt2 / ".metadata", outside / "meta")
    (ckpt2 / ".metadata").symlink_to(outside / "meta")
    text = _refused(["inspect", str(ckpt2)])
    assert "'.metadata'" in text and str(outside) not in text


def test_links_inside_the_checkpoint_are_fine(tmp_path: Path) -> None:
    ckpt = _dcp(tmp_path / "ckpt")
    os.replace(ckpt / "__0_0.distcp", ckpt / "data.bin")
    (ckpt / "__0_0.distcp").symlink_to("data.bin")
    (ckpt.parent / "alias").symlink_to(ckpt)
    result = ckptools.consolidate(str(tmp_path / "alias"), str(tmp_path / "out"), weights_only=True)
    assert result.tensors == 3


# --------------------------------------------------------------------------------------------------
# safetensors and torch.save indexes
# --------------------------------------------------------------------------------------------------


def _hf_sharded(path: Path) -> Path:
    path.mkdir()
    t = _tensors()
    save_file({"embed.weight": t["embed.weight"]}, str(path / "model-00001-of-00002.safetensors"))
    rest = {k: v for k, v in t.items() if k != "embed.weight"}
    save_file(rest, str(path / "model-00002-of-00002.safetensors"))
    index = {
        "metadata": {"total_size": 0},
        "weight_map": {
            "embed.weight": "model-00001-of-00002.safetensors",
            **{k: "model-00002-of-00002.safetensors" for k in rest},
        },
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


@pytest.mark.parametrize("how", ["dotdot", "absolute", "link"])
def test_safetensors_index_outside_is_refused(tmp_path: Path, how: str) -> None:
    outside = _secret_dir(tmp_path)
    ckpt = _hf_sharded(tmp_path / "ckpt")
    shard = ckpt / "model-00001-of-00002.safetensors"
    # a valid shard outside: following the name would consolidate the secret's neighbour
    os.replace(shard, outside / "secret.safetensors")
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    if how == "link":
        shard.symlink_to(outside / "secret.safetensors")
        entry = repr(shard.name)
    else:
        name = "../outside/secret.safetensors" if how == "dotdot" else str(outside / "secret")
        if how == "absolute":
            name += ".safetensors"
        index["weight_map"]["embed.weight"] = name
        index_path.write_text(json.dumps(index))
        entry = "'embed.weight'"
    _all_commands_refuse(ckpt, tmp_path, outside, entry)


def test_safetensors_without_index_shard_linking_outside(tmp_path: Path) -> None:
    outside = _secret_dir(tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(_tensors(), str(outside / "secret.safetensors"))
    (ckpt / "model.safetensors").symlink_to(outside / "secret.safetensors")
    _all_commands_refuse(ckpt, tmp_path, outside, "'model.safetensors'")


def test_bin_index_outside_is_refused(tmp_path: Path) -> None:
    outside = _secret_dir(tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    torch.save(_tensors(), outside / "secret.bin.pt")
    weight_map = {k: "../outside/secret.bin.pt" for k in _tensors()}
    (ckpt / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    before = _tree_digest(ckpt)
    for args in (["consolidate", str(ckpt), str(tmp_path / "out")], ["inspect", str(ckpt)]):
        text = _refused(args)
        assert "'../outside/secret.bin.pt'" in text and "outside the checkpoint" in text
        _no_secret_anywhere(tmp_path, text, outside)
    assert _tree_digest(ckpt) == before and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------
# The Hugging Face cache: links into the same repository's blobs/ are fine, nothing wider
# --------------------------------------------------------------------------------------------------


def _hf_cache_repo(cache: Path, repo: str, files: dict[str, bytes]) -> Path:
    """``models--<org>--<name>`` as huggingface_hub lays it out: blobs named by their hash, and
    ``snapshots/<rev>/<file>`` relative links to ``../../blobs/<hash>``, made by its own
    ``_create_symlink`` where it has one."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    rev = "0123456789abcdef0123456789abcdef01234567"
    (repo_dir / "blobs").mkdir(parents=True)
    (repo_dir / "snapshots" / rev).mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(rev)
    try:
        from huggingface_hub.file_download import _create_symlink as link
    except ImportError:  # pragma: no cover - older or newer huggingface_hub

        def link(src: str, dst: str, new_blob: bool = False) -> None:
            os.symlink(os.path.relpath(src, os.path.dirname(dst)), dst)

    for name, data in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link(str(blob), str(repo_dir / "snapshots" / rev / name))
    return repo_dir / "snapshots" / rev


def _safetensors_bytes(tmp_path: Path) -> bytes:
    save_file(_tensors(), str(tmp_path / "tmp.safetensors"))
    data = (tmp_path / "tmp.safetensors").read_bytes()
    (tmp_path / "tmp.safetensors").unlink()
    return data


def test_hf_cache_snapshot_links_are_allowed(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    snapshot = _hf_cache_repo(
        cache,
        "org/tiny",
        {"model.safetensors": _safetensors_bytes(tmp_path), "config.json": b'{"a": 1}'},
    )
    assert os.readlink(snapshot / "model.safetensors").startswith("../../blobs/")
    from huggingface_hub import scan_cache_dir

    (repo_info,) = scan_cache_dir(cache).repos  # the hub's own reader takes it as a real cache
    assert repo_info.repo_id == "org/tiny"
    before = _tree_digest(cache)
    result = ckptools.consolidate(str(snapshot), str(tmp_path / "out"))
    assert result.tensors == 3 and "config.json" in result.config_files
    assert ckptools.verify(str(snapshot)).ok
    ckptools.shard(str(snapshot), str(tmp_path / "dcp"), world_size=2)
    assert _tree_digest(cache) == before


def test_hf_cache_links_elsewhere_are_refused(tmp_path: Path) -> None:
    outside = _secret_dir(tmp_path)
    cache = tmp_path / "hub"
    weights = _safetensors_bytes(tmp_path)
    snapshot = _hf_cache_repo(cache, "org/tiny", {"model.safetensors": weights})
    other = _hf_cache_repo(cache, "org/other", {"model.safetensors": weights})
    # a link into another repository's blobs
    shard = snapshot / "model.safetensors"
    shard.unlink()
    shard.symlink_to(os.path.relpath(os.path.realpath(other / "model.safetensors"), snapshot))
    with pytest.raises(OutsideCheckpointError, match=r"'model\.safetensors'"):
        ckptools.read_manifest(str(snapshot))
    # a link from the snapshot to a file outside the cache
    shard.unlink()
    save_file(_tensors(), str(outside / "secret.safetensors"))
    shard.symlink_to(outside / "secret.safetensors")
    _all_commands_refuse(snapshot, tmp_path, outside, "'model.safetensors'")


# --------------------------------------------------------------------------------------------------
# OUT apart from SRC; model files copied beside the weights
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["same", "parent", "inside"])
@pytest.mark.parametrize("command", ["consolidate", "reshard"])
def test_out_must_not_be_src_hold_it_or_lie_inside_it(
    tmp_path: Path, where: str, command: str
) -> None:
    ckpt = _dcp(tmp_path / "parent" / "ckpt")
    out = {"same": ckpt, "parent": ckpt.parent, "inside": ckpt / "hf"}[where]
    before = _tree_digest(tmp_path / "parent")
    args = [command, str(ckpt), str(out), "--overwrite"]
    if command == "reshard":
        args += ["--world-size", "2"]
    # consolidate too: an output inside its source travels with it into the next conversion
    # (the Trainer callback's checkpoint-N/hf/ is written from the model's DCP directory)
    text = _refused(args, code=2)
    assert "source checkpoint" in text
    assert _tree_digest(tmp_path / "parent") == before
    with pytest.raises(UsageError):
        api = ckptools.consolidate if command == "consolidate" else ckptools.reshard
        kwargs = {"world_size": 2} if command == "reshard" else {}
        api(str(ckpt) + "/", str(out), overwrite=True, **kwargs)
    assert _tree_digest(tmp_path / "parent") == before


def test_out_apart_from_src_through_a_link(tmp_path: Path) -> None:
    ckpt = _dcp(tmp_path / "ckpt")
    (tmp_path / "alias").symlink_to(ckpt)
    before = _tree_digest(ckpt)
    with pytest.raises(UsageError, match="source checkpoint itself"):
        ckptools.reshard(str(ckpt), str(tmp_path / "alias"), world_size=2, overwrite=True)
    assert _tree_digest(ckpt) == before


def test_config_file_linking_outside_is_refused(tmp_path: Path) -> None:
    outside = _secret_dir(tmp_path)
    (outside / "secret.json").write_bytes(b'{"secret": "' + SECRET + b'"}')
    ckpt = _dcp(tmp_path / "ckpt")
    (ckpt / "config.json").symlink_to(outside / "secret.json")
    before = _tree_digest(ckpt)
    text = _refused(["consolidate", str(ckpt), str(tmp_path / "out")])
    assert "'config.json'" in text and "outside the checkpoint" in text
    _no_secret_anywhere(tmp_path, text, outside)
    assert _tree_digest(ckpt) == before and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------
# prune: a step directory that is a link
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("relative", [False, True])
def test_prune_removes_a_linked_step_not_its_target(tmp_path: Path, relative: bool) -> None:
    from ckptools.training.retention import RetentionPolicy
    from ckptools.training.store import prune

    root = tmp_path / "root"
    manager = ckptools.CheckpointManager(str(root))
    for step in (1, 2):
        manager.save(step, model=torch.nn.Linear(2, 2))
    elsewhere = tmp_path / "elsewhere"
    os.replace(root / "step-1", elsewhere)
    (root / "step-1").symlink_to(os.path.relpath(elsewhere, root) if relative else elsewhere)
    kept = _tree_digest(elsewhere)
    result = prune(str(root), RetentionPolicy(keep_last=1))
    assert result.decision.delete == (1,)
    assert sorted(os.listdir(root)) == ["step-2"]  # no .tmp-delete-* link left behind
    assert _tree_digest(elsewhere) == kept


# --------------------------------------------------------------------------------------------------
# Stale OUT.tmp-* left by runs killed with SIGKILL
# --------------------------------------------------------------------------------------------------

_HOLD = textwrap.dedent(
    """
    import os, signal, sys
    from ckptools.io import staging
    tmp = staging.make_tmp_dir(sys.argv[1])
    open(os.path.join(tmp, "partial"), "wb").write(b"half")
    print(tmp, flush=True)
    if sys.argv[2] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.read()  # alive, holding its staging, until told to go
    """
)


def _holder(out: Path, mode: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(out), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_stale_staging_dirs_are_removed_live_ones_kept(tmp_path: Path) -> None:
    src = tmp_path / "ckpt"  # 64 MiB: a run writes long enough to be killed while writing
    dcp.save({"model": {**_tensors(), "big": torch.zeros(16, 2**20)}}, checkpoint_id=str(src))
    out = tmp_path / "out"
    for _ in range(3):  # killed right after creating (and locking) their staging directory
        proc, tmp = _holder(out, "die")
        assert proc.wait() == -signal.SIGKILL and os.path.isdir(tmp)
    # another conversion's interrupted work: dead, but resumable by that conversion
    proc, other = _holder(out, "die")
    proc.wait()
    journal = {"format": "ckptools-resume", "fingerprint": "another", "done": {"partial": {}}}
    Path(other, ".ckptools-resume-0.json").write_text(json.dumps(journal))
    # real consolidate runs killed with SIGKILL at random points early in the run
    rng = random.Random(19)
    for _ in range(3):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ckptools",
                "consolidate",
                str(src),
                str(out),
                "--quiet",
                "--weights-only",
            ]
        )
        before, deadline = set(tmp_path.glob("out.tmp-*")), time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            if set(tmp_path.glob("out.tmp-*")) - before:
                break  # its staging directory exists: kill it somewhere in what follows
            time.sleep(0.001)
        time.sleep(rng.uniform(0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if out.exists():  # it finished before the kill landed: only its orphans matter here
            shutil.rmtree(out)
    live, live_tmp = _holder(out, "live")
    try:
        ckptools.consolidate(str(src), str(out), weights_only=True)
        left = sorted(str(p) for p in tmp_path.glob("out.tmp-*"))
        assert left == sorted([live_tmp, other]), left  # the dead runs' removed, these kept
    finally:
        assert live.stdin is not None
        live.stdin.close()
        live.wait()
    ckptools.consolidate(str(src), str(out), overwrite=True, weights_only=True)
    assert [str(p) for p in tmp_path.glob("out.tmp-*")] == [other]
    assert out.is_dir()


# --------------------------------------------------------------------------------------------------
# Object stores and the training store's marker
# --------------------------------------------------------------------------------------------------


def test_object_store_keys_outside_are_refused(tmp_path: Path) -> None:
    import uuid

    import fsspec

    ckpt = _dcp(tmp_path / "ckpt")
    _edit_metadata(ckpt, lambda name: "../" + name)
    url = f"memory://hostile-{uuid.uuid4().hex[:8]}/ckpt"
    fs = fsspec.filesystem("memory")
    for p in ckpt.iterdir():
        fs.pipe_file(f"{url}/{p.name}".removeprefix("memory://"), p.read_bytes())
    with pytest.raises(OutsideCheckpointError, match=r"'\.\./__0_0\.distcp'"):
        ckptools.read_manifest(url)
    with pytest.raises(UsageError, match="lies inside the source"):
        ckptools.reshard(url, url + "/resharded/", world_size=2)
    with pytest.raises(UsageError, match="holds the source"):
        ckptools.reshard(url, url.rsplit("/", 1)[0], world_size=2, overwrite=True)
    assert fs.exists(url.removeprefix("memory://") + "/.metadata")


def test_training_marker_naming_outside_files_is_incomplete(tmp_path: Path) -> None:
    from ckptools.training.store import MARKER_NAME, list_checkpoints

    root = tmp_path / "root"
    ckptools.CheckpointManager(str(root)).save(1, model=torch.nn.Linear(2, 2))
    marker_path = root / "step-1" / MARKER_NAME
    marker = json.loads(marker_path.read_text())
    marker["files"]["../../outside/secret.bin"] = len(SECRET)
    marker_path.write_text(json.dumps(marker))
    (info,) = list_checkpoints(str(root))
    assert not info.complete and "'..' segment" in info.reason
