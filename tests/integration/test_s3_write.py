"""consolidate, reshard and shard reading from and writing to s3:// (moto on loopback + s3fs).

Truth: the same conversion done locally (byte-identical files), torch's own ``dcp.load`` of the
downloaded output against the producer's reference, and bytes counted at s3fs's request
function. Interrupted writes must never leave a commit marker, and a later run must finish.
"""

from __future__ import annotations

import filecmp
import os
from pathlib import Path

import pytest
import torch

import ckptools
from ckptools.errors import CkptError, IncompleteCheckpointError, UsageError
from ckptools.io import paths, storage
from ckptools.io import staging as commit
from tests.support.reference import assert_checkpoint_matches, load_reference
from tests.support.s3 import GetCounter, download, objects, upload

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def _same_files(a: Path, b: Path, names: list[str]) -> None:
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert (mismatch, errors) == ([], []), (mismatch, errors)
    assert sorted(match) == sorted(names)


@pytest.fixture
def fsdp2_on_s3(s3_bucket: str) -> str:
    url = f"{s3_bucket}/ckpt"
    upload(str(FIXTURES / "fsdp2_ws2"), url)
    return url


def test_consolidate_s3_to_local_and_to_s3_is_byte_identical(
    fsdp2_on_s3: str, s3_bucket: str, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    ckptools.consolidate(
        str(FIXTURES / "fsdp2_ws2"), str(local), max_shard_size=800, quiet=True, weights_only=True
    )
    names = sorted(os.listdir(local))
    assert "model.safetensors.index.json" in names and len(names) > 2

    from_s3 = tmp_path / "from_s3"
    ckptools.consolidate(
        fsdp2_on_s3, str(from_s3), max_shard_size=800, quiet=True, weights_only=True
    )
    assert sorted(os.listdir(from_s3)) == names
    _same_files(local, from_s3, names)

    out = f"{s3_bucket}/hf"
    result = ckptools.consolidate(
        fsdp2_on_s3, out, max_shard_size=800, quiet=True, weights_only=True
    )
    assert sorted(objects(out)) == names  # no in-progress note, no spool leftovers
    got = tmp_path / "s3_to_s3"
    download(out, str(got))
    _same_files(local, got, names)
    assert result.bytes_written == sum(objects(out)[n] for n in names if n.endswith("safetensors"))


def test_consolidate_to_s3_copies_config_from_beside_the_checkpoint(
    s3_bucket: str, tmp_path: Path
) -> None:
    src = tmp_path / "run" / "step-1"
    src.parent.mkdir()
    import shutil

    shutil.copytree(FIXTURES / "fsdp2_ws2", src)
    (src.parent / "config.json").write_text('{"model_type": "llama", "tie_word_embeddings": false}')
    upload(str(tmp_path / "run"), f"{s3_bucket}/run")
    result = ckptools.consolidate(f"{s3_bucket}/run/step-1", f"{s3_bucket}/hf", quiet=True)
    assert result.config_files == ("config.json",)
    assert set(objects(f"{s3_bucket}/hf")) == {"config.json", "model.safetensors"}


def test_reshard_s3_to_s3_loads_with_dcp(fsdp2_on_s3: str, s3_bucket: str, tmp_path: Path) -> None:
    local = tmp_path / "local"
    ckptools.reshard(str(FIXTURES / "fsdp2_ws2"), str(local), world_size=3, quiet=True)
    out = f"{s3_bucket}/re3"
    ckptools.reshard(fsdp2_on_s3, out, world_size=3, quiet=True)
    got = tmp_path / "got"
    names = download(out, str(got))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    # the data files are the local conversion's, byte for byte (.metadata holds a fresh save id)
    _same_files(local, got, names[1:])
    assert_checkpoint_matches(got, load_reference(FIXTURES / "fsdp2_ws2.reference.pt"))
    assert ckptools.verify(out).ok


def test_shard_to_s3_and_back(s3_bucket: str, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    ckptools.consolidate(str(FIXTURES / "fsdp2_ws2"), str(hf), quiet=True, weights_only=True)
    upload(str(hf), f"{s3_bucket}/hf")
    out = f"{s3_bucket}/dcp4"
    ckptools.shard(f"{s3_bucket}/hf", out, world_size=4, quiet=True)
    assert sorted(objects(out)) == [".metadata", *(f"__{r}_0.distcp" for r in range(4))]
    assert ckptools.diff(out, str(FIXTURES / "fsdp2_ws2")).identical
    back = tmp_path / "back"
    ckptools.consolidate(out, str(back), quiet=True, weights_only=True)
    _same_files(hf, back, ["model.safetensors"])


def test_existing_destination_needs_overwrite(fsdp2_on_s3: str, s3_bucket: str) -> None:
    out = f"{s3_bucket}/re2"
    ckptools.reshard(fsdp2_on_s3, out, world_size=2, quiet=True)
    with pytest.raises(UsageError, match="already holds a checkpoint"):
        ckptools.reshard(fsdp2_on_s3, out, world_size=4, quiet=True)
    ckptools.reshard(fsdp2_on_s3, out, world_size=4, quiet=True, overwrite=True)
    # the replaced checkpoint's extra rank files are gone, not mixed in
    assert sorted(objects(out)) == [".metadata", *(f"__{r}_0.distcp" for r in range(4))]
    storage.write_bytes(f"{s3_bucket}/foreign/notes.txt", b"not ours")
    with pytest.raises(UsageError, match="not empty"):
        ckptools.consolidate(fsdp2_on_s3, f"{s3_bucket}/foreign", quiet=True)
    assert objects(f"{s3_bucket}/foreign") == {"notes.txt": 8}


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_out_in_a_bucket_that_does_not_exist_is_one_line(
    fsdp2_on_s3: str, s3_bucket: str, overwrite: bool
) -> None:
    # s3fs raised FileNotFoundError from listing OUT: a traceback, for every writing verb
    missing = s3_bucket + "-missing"
    for write in (
        lambda out: ckptools.consolidate(
            fsdp2_on_s3, out, quiet=True, weights_only=True, overwrite=overwrite
        ),
        lambda out: ckptools.reshard(
            fsdp2_on_s3, out, world_size=2, quiet=True, overwrite=overwrite
        ),
        lambda out: ckptools.shard(
            str(FIXTURES / "hf_sharded"), out, world_size=2, quiet=True, overwrite=overwrite
        ),
    ):
        with pytest.raises(UsageError, match=r"-missing/out: cannot be written \(.*bucket"):
            write(f"{missing}/out")
    assert not storage.exists(missing + "/out")


def _patch_uploads(monkeypatch: pytest.MonkeyPatch, put: object) -> None:
    """Every upload goes through ``put``: the spool's uploader calls ``io.paths.put_file``
    (io.spool sits below the storage facade), the staging commit ``storage.put_file``."""
    monkeypatch.setattr(paths, "put_file", put)
    monkeypatch.setattr(storage, "put_file", put)


def test_failed_upload_leaves_no_marker_and_a_rerun_finishes(
    fsdp2_on_s3: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = f"{s3_bucket}/hf"
    real_put = storage.put_file
    calls = []

    def flaky(local: str, dst: str) -> None:
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("connection reset (injected)")
        real_put(local, dst)

    # A process killed mid-run: the failure is not cleaned up (kill -9 runs no handler).
    _patch_uploads(monkeypatch, flaky)
    monkeypatch.setattr(commit, "discard", lambda *args, **kwargs: None)
    with pytest.raises(OSError, match="injected"):
        ckptools.consolidate(fsdp2_on_s3, out, max_shard_size=800, quiet=True, weights_only=True)
    left = objects(out)
    assert commit.IN_PROGRESS in left
    assert not any(name in commit.MARKER_NAMES for name in left)
    assert any(name.endswith(".safetensors") for name in left)  # the first shard made it
    with pytest.raises(IncompleteCheckpointError):
        ckptools.inspect(out)
    monkeypatch.undo()

    # The rerun needs no --overwrite: the prefix holds only an interrupted ckptools write.
    ckptools.consolidate(fsdp2_on_s3, out, max_shard_size=800, quiet=True, weights_only=True)
    local = tmp_path / "local"
    ckptools.consolidate(fsdp2_on_s3, str(local), max_shard_size=800, quiet=True, weights_only=True)
    got = tmp_path / "got"
    names = download(out, str(got))
    assert names == sorted(os.listdir(local))
    _same_files(local, got, names)


def test_failed_reshard_removes_what_it_uploaded(
    fsdp2_on_s3: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = f"{s3_bucket}/re4"
    real_put = storage.put_file

    def flaky(local: str, dst: str) -> None:
        if dst.endswith("__2_0.distcp"):
            raise OSError("connection reset (injected)")
        real_put(local, dst)

    _patch_uploads(monkeypatch, flaky)
    with pytest.raises((OSError, CkptError)):
        ckptools.reshard(fsdp2_on_s3, out, world_size=4, workers=1, quiet=True)
    assert objects(out) == {}
    monkeypatch.undo()
    ckptools.reshard(fsdp2_on_s3, out, world_size=4, quiet=True)
    assert ckptools.verify(out).ok


def test_consolidate_from_s3_reads_about_the_output_bytes(s3_bucket: str, tmp_path: Path) -> None:
    """Ranged reads fetch only what is needed: bytes received <= 1.05 x bytes written."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    state = {
        "model": {f"layers.{i}.w": torch.randn(384, 512) for i in range(8)},
        "step": 3,
    }
    src = tmp_path / "dcp"
    dcp.save(state, checkpoint_id=str(src), no_dist=True)
    upload(str(src), f"{s3_bucket}/dcp")
    with GetCounter() as counter:
        result = ckptools.consolidate(
            f"{s3_bucket}/dcp", str(tmp_path / "hf"), quiet=True, weights_only=True
        )
    ratio = counter.bytes / result.bytes_written
    print(f"bytes read from S3 per output byte: {ratio:.4f} ({counter.requests} GETs)")
    assert result.bytes_written > 6 * 2**20
    assert 1.0 <= ratio <= 1.05
