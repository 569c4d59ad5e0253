"""The torch-free .metadata writer produces what torch's own classes pickle to."""

from __future__ import annotations

import pickle

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
