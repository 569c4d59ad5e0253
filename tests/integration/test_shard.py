"""`ckpt shard`: a full model (safetensors / torch.save) becomes a DCP checkpoint for N ranks."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

import ckptools
from ckptools.cli.main import cli
from tests.conftest import Produced
from tests.support.reference import load_reference, tensor_bytes


def _run(*args: str) -> dict[str, object]:
    result = CliRunner().invoke(cli, [*args, "--json", "-q"])
    assert result.exit_code == 0, result.output
    data: dict[str, object] = json.loads(result.output)
    return data


@pytest.mark.parametrize("source", ["hf_sharded", "torch_save"])
@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_shard_loads_with_dcp(
    produced: Callable[..., Produced], tmp_path: Path, source: str, world_size: int
) -> None:
    p = produced(source)
    out = tmp_path / "dcp"
    _run("shard", str(p.path), str(out), "--world-size", str(world_size))
    ref = load_reference(p.ref_path)["model"]
    target = {"model": {k: torch.empty_like(v) for k, v in ref.items()}}
    dcp.load(target, checkpoint_id=str(out), no_dist=True)
    for k, v in ref.items():
        assert torch.equal(tensor_bytes(target["model"][k]), tensor_bytes(v)), k
    manifest = ckptools.read_manifest(str(out))
    assert manifest.world_size == world_size
    assert all(manifest.paths[f"model.{k}"] == ("model", k) for k in ref)


def test_shard_refuses_sharded_input_and_existing_output(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    result = CliRunner().invoke(
        cli, ["shard", str(produced("single").path), str(tmp_path / "x"), "--world-size", "2"]
    )
    assert result.exit_code == 2 and "ckpt reshard" in result.output
    (tmp_path / "exists").mkdir()
    result = CliRunner().invoke(
        cli,
        ["shard", str(produced("hf_sharded").path), str(tmp_path / "exists"), "--world-size", "2"],
    )
    assert result.exit_code == 2 and "--overwrite" in result.output


@pytest.mark.parametrize("prefix", ["model", "model..", ".model."])
def test_shard_prefix_that_is_no_key_path_is_refused(
    produced: Callable[..., Produced], tmp_path: Path, prefix: str
) -> None:
    """Each name is stored as prefix + name: ``--prefix model`` (the dot forgotten) wrote
    ``modelmodel.embed_tokens.weight``, exit 0, which no ``dcp.load({"model": sd})`` finds."""
    src = str(produced("hf_sharded").path)
    out = tmp_path / "dcp"
    result = CliRunner().invoke(
        cli, ["shard", src, str(out), "--world-size", "2", "--prefix", prefix]
    )
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"error: --prefix {prefix!r}: give a key path ending in '.' ('model.' is what "
        "dcp.save({'model': sd}) writes, 'app.model.' a nested one) or '' for none"
    ]
    assert not out.exists()
    # a nested key path and none at all are key paths
    for good, path in (("app.model.", ("app", "model")), ("", ())):
        _run("shard", src, str(tmp_path / f"ok{len(path)}"), "--world-size", "2", "--prefix", good)
        manifest = ckptools.read_manifest(str(tmp_path / f"ok{len(path)}"))
        name = "model.embed_tokens.weight"
        assert manifest.paths[f"{good}{name}"] == (*path, name)


def test_interrupted_shard_leaves_nothing(
    produced: Callable[..., Produced], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptools.engine.dcp_writer as dw

    def boom(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(dw, "write_metadata", boom)
    with pytest.raises(KeyboardInterrupt):
        ckptools.shard(str(produced("hf_sharded").path), str(tmp_path / "out"), world_size=2)
    assert list(tmp_path.iterdir()) == []


def test_consolidate_shard_consolidate_is_byte_identical(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    p = produced("fsdp2", world_size=3, optimizer=True)
    first = tmp_path / "hf1"
    ckptools.consolidate(
        str(p.path), str(first), max_shard_size="100KB", quiet=True, weights_only=True
    )
    sharded = tmp_path / "dcp"
    ckptools.shard(str(first), str(sharded), world_size=4, quiet=True)
    second = tmp_path / "hf2"
    ckptools.consolidate(
        str(sharded), str(second), max_shard_size="100KB", quiet=True, weights_only=True
    )
    names = sorted(f.name for f in first.iterdir())
    assert names == sorted(f.name for f in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_reshard_rewrites_checksums_and_never_copies_markers(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(produced("single").path, src)
    _run("checksum", str(src))
    (src / ".ckptools-complete").write_text("{}")  # the training manager's commit marker
    out = tmp_path / "out"
    _run("reshard", str(src), str(out), "--world-size", "3")
    assert not (out / ".ckptools-complete").exists()
    report = _run("verify", str(out))
    assert report["ok"] is True
    assert report["checksums_checked"] is True


@pytest.mark.parametrize("world_size", [2, 1])
def test_merging_reshard_combines_record_crcs(
    produced: Callable[..., Produced], tmp_path: Path, world_size: int
) -> None:
    # 4 -> 2 and 4 -> 1: every piece is whole source records, moved in the kernel, with a CRC
    # combined from theirs; verify re-reads every byte and checks each record's CRC-32.
    from tests.support.reference import assert_bitwise_equal, expected_checkpoints, load_with_dcp

    p = produced("fsdp2", world_size=4, tied=True)
    out = tmp_path / "merged"
    _run("reshard", str(p.path), str(out), "--world-size", str(world_size))
    assert _run("verify", str(out))["ok"] is True
    ref = load_reference(p.ref_path)
    assert_bitwise_equal(load_with_dcp(out, ref), expected_checkpoints(ref))


def test_many_ranks_under_a_low_open_files_limit(
    produced: Callable[..., Produced], tmp_path: Path
) -> None:
    # A reshard to 64 ranks and a consolidate of it, in a process whose soft RLIMIT_NOFILE is
    # 40: the writer keeps only the files it is writing open; the reader, which keeps one
    # descriptor per rank file, raises the soft limit to the hard one when it runs out.
    import subprocess
    import sys

    src = produced("fsdp2", world_size=2)
    code = (
        "import resource, sys, ckptools\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (40, hard))\n"
        "ckptools.reshard(sys.argv[1], sys.argv[2], world_size=64, quiet=True)\n"
        "ckptools.consolidate(sys.argv[2], sys.argv[3], quiet=True, weights_only=True)\n"
    )
    wide, hf = tmp_path / "ws64", tmp_path / "hf"
    subprocess.run([sys.executable, "-c", code, str(src.path), str(wide), str(hf)], check=True)
    assert len(list(wide.glob("__*_0.distcp"))) == 64
    assert _run("verify", str(wide))["ok"] is True
    result = CliRunner().invoke(cli, ["diff", str(src.path), str(hf), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["identical"] is True
