"""The torch-free .metadata writer produces what torch's own classes pickle to."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptools.formats.dcp_metadata import ChunkMeta, ObjectMeta, TensorMeta, metadata_pickle


def test_unpickles_to_the_metadata_torch_builds() -> None:
    tensors = {
        "model.w": TensorMeta(
            "bfloat16",
            (5, 3),
            [
                ChunkMeta((0, 0), (3, 3), "__0_0.distcp", 1200, 2000),
                ChunkMeta((3, 0), (2, 3), "__1_0.distcp", 0, 1900),
                ChunkMeta((5, 0), (0, 3), "__2_0.distcp", 0, 1500),
            ],
        ),
        "optim.step": TensorMeta("int64", (), [ChunkMeta((), (), "__0_0.distcp", 3200, 1000)]),
        "big": TensorMeta(
            "float8_e4m3fn", (70000,), [ChunkMeta((0,), (70000,), "f", 2**33, 2**31)]
        ),
    }
    objects = {"extra.name": ObjectMeta("__0_0.distcp", 0, 1200)}
    paths = {"model.w": ("model", "w"), "optim.step": ("optim", "step"), "big": ("big",),
             "extra.name": ("extra", "name")}  # fmt: skip
    ours = pickle.loads(metadata_pickle(tensors, objects, paths, "save-1"))

    expected = Metadata(
        state_dict_metadata={
            "extra.name": BytesStorageMetadata(),
            **{
                fqn: TensorStorageMetadata(
                    properties=TensorProperties(dtype=getattr(torch, t.dtype)),
                    size=torch.Size(t.shape),
                    chunks=[
                        ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
                        for c in t.chunks
                    ],
                )
                for fqn, t in tensors.items()
            },
        },
        planner_data=paths,
        storage_data={
            MetadataIndex("extra.name"): _StorageInfo("__0_0.distcp", 0, 1200),
            **{
                MetadataIndex(fqn, torch.Size(c.offsets), i): _StorageInfo(
                    c.file, c.offset, c.length
                )
                for fqn, t in tensors.items()
                for i, c in enumerate(t.chunks)
            },
        },
        storage_meta=StorageMeta(save_id="save-1"),
        version="1.0.0",
    )
    assert ours == expected
    assert list(ours.state_dict_metadata) == list(expected.state_dict_metadata)
    assert type(ours.state_dict_metadata["model.w"].size) is torch.Size
    # Equality of dataclasses does not cover these: torch's reader relies on them.
    props = ours.state_dict_metadata["model.w"].properties
    assert props.memory_format == torch.contiguous_format and props.layout == torch.strided
    assert pickle.loads(pickle.dumps(expected)) == ours


def _write_dcp(directory: Path, key: str) -> bytes:
    """A DCP directory written by ckptools' own metadata writer; returns the .metadata bytes."""
    directory.mkdir(parents=True)
    tensors = {
        f"{key}.w": TensorMeta("float32", (4,), [ChunkMeta((0,), (4,), "__0_0.distcp", 0, 16)])
    }
    data = metadata_pickle(tensors, {}, {f"{key}.w": (key, "w")}, "save-1")
    (directory / "__0_0.distcp").write_bytes(b"\0" * 16)
    (directory / ".metadata").write_bytes(data)
    return data


def test_read_manifest_records_parts_aux_files_and_marker_digests(tmp_path: Path) -> None:
    from ckptools.producers import read_manifest
    from ckptools.producers.base import digest

    model = _write_dcp(tmp_path / "pytorch_model_fsdp_0", "model")
    optim = _write_dcp(tmp_path / "optimizer_0", "optimizer")
    (tmp_path / "scheduler.bin").write_bytes(b"s")
    (tmp_path / "pytorch_model_fsdp_0" / "notes.txt").write_bytes(b"n")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "x").write_bytes(b"x")  # hidden directories are not the checkpoint's

    m = read_manifest(str(tmp_path))
    assert m.layout == "accelerate" and m.data_dir() == str(tmp_path)
    assert [p.subdir for p in m.parts] == ["optimizer_0", "pytorch_model_fsdp_0"]
    assert set(m.parts[1].manifest.tensors) == {"model.w"}
    assert m.parts[1].manifest.files["pytorch_model_fsdp_0/__0_0.distcp"].size == 16
    assert m.aux_files == ("pytorch_model_fsdp_0/notes.txt", "scheduler.bin")
    assert m.marker_digests == {
        "optimizer_0/.metadata": digest(optim),
        "pytorch_model_fsdp_0/.metadata": digest(model),
    }
    plain = read_manifest(str(tmp_path / "optimizer_0"))
    assert [p.subdir for p in plain.parts] == [""] and plain.aux_files == ()


def test_fingerprint_uses_the_recorded_digests(tmp_path: Path) -> None:
    from ckptools.io.resume import fingerprint
    from ckptools.producers import read_manifest

    _write_dcp(tmp_path / "ck", "model")
    m = read_manifest(str(tmp_path / "ck"))
    before = fingerprint("reshard", m, {"world_size": 2})
    (tmp_path / "ck" / ".metadata").unlink()  # the fingerprint needs no second read
    assert fingerprint("reshard", m, {"world_size": 2}) == before
    assert fingerprint("reshard", m, {"world_size": 3}) != before
