"""Checks that ckptools' reading of a checkpoint agrees with torch's own reading of it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

import ckptools
from ckptools.cli.main import cli
from ckptools.formats import safe_pickle
from tests.support.reference import flat_expected, load_reference, tensor_bytes


def inspect_json(path: str | Path, *args: str) -> dict[str, Any]:
    result = CliRunner().invoke(cli, ["inspect", str(path), "--json", *args])
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.output)
    return data


def assert_inspect_agrees_with_torch_metadata(path: str | Path, subdirs: list[str]) -> None:
    """``ckpt inspect --json`` lists exactly what torch's ``read_metadata`` lists, per DCP dir."""
    report = inspect_json(path)
    tensors = {t["fqn"]: t for t in report["tensors"]}
    objects = {o["fqn"] for o in report["objects"]}
    seen_tensors: set[str] = set()
    seen_objects: set[str] = set()
    manifest = ckptools.read_manifest(str(path))
    for sub in subdirs:
        md = dcp.FileSystemReader(os.path.join(str(path), sub)).read_metadata()
        for fqn, item in md.state_dict_metadata.items():
            if isinstance(item, BytesStorageMetadata):
                assert fqn in objects, f"{sub}: object {fqn} missing from inspect"
                seen_objects.add(fqn)
                continue
            t = tensors[fqn]
            assert t["dtype"] == str(item.properties.dtype).removeprefix("torch."), fqn
            assert t["shape"] == list(item.size), fqn
            assert t["chunks"] == len(item.chunks), fqn
            ours = sorted((c.offsets, c.sizes) for c in manifest.tensors[fqn].chunks)
            theirs = sorted((tuple(c.offsets), tuple(c.sizes)) for c in item.chunks)
            assert ours == theirs, f"{fqn}: chunk boxes differ"
            seen_tensors.add(fqn)
        for index, info in md.storage_data.items():
            rel = info.relative_path if sub == "." else f"{sub}/{info.relative_path}"
            if index.offset is None:
                o = manifest.objects[index.fqn]
                assert (o.file, o.offset, o.length) == (rel, info.offset, info.length)
            else:
                match = [
                    c
                    for c in manifest.tensors[index.fqn].chunks
                    if c.offsets == tuple(index.offset)
                ]
                assert [(c.file, c.offset, c.length) for c in match] == [
                    (rel, info.offset, info.length)
                ], index.fqn
    lightning_meta = {f for f in objects if f.startswith("meta.")}
    assert seen_tensors == set(tensors), sorted(set(tensors) - seen_tensors)[:5]
    assert seen_objects == objects - lightning_meta


def _same_value(actual: Any, expected: Any) -> bool:
    """Decoded value equals the reference; the reference stores ``io.BytesIO`` as ``bytes``."""
    if isinstance(actual, safe_pickle.BytesValue):
        return isinstance(expected, bytes) and actual.data == expected
    if isinstance(expected, dict):
        return (
            isinstance(actual, dict)
            and set(actual) == set(expected)
            and all(_same_value(actual[k], expected[k]) for k in expected)
        )
    if isinstance(expected, list | tuple):
        return (
            type(actual) is type(expected)
            and len(actual) == len(expected)
            and all(_same_value(a, e) for a, e in zip(actual, expected, strict=True))
        )
    return type(actual) is type(expected) and bool(actual == expected)


def assert_reads_match_reference(path: str | Path, ref_path: str | Path) -> int:
    """Every tensor (assembled by ckptools from its chunks) and every object (decoded through the
    allowlist) equals what the producer gathered with torch, bit for bit. Returns #tensors."""
    ref = load_reference(ref_path)
    manifest = ckptools.read_manifest(str(path))
    checked = 0
    for _sub, flat in flat_expected(ref).items():
        for fqn, expected in flat.items():
            if isinstance(expected, torch.Tensor):
                actual = ckptools.read_tensor(manifest, fqn)
                assert actual.dtype == expected.dtype, fqn
                assert actual.shape == expected.shape, fqn
                assert torch.equal(tensor_bytes(actual), tensor_bytes(expected)), fqn
                checked += 1
            else:
                actual = ckptools.read_object(manifest, fqn)
                assert _same_value(actual, expected), f"{fqn}: {actual!r} != {expected!r}"
    return checked


def assert_model_tensors_equal(path: str | Path, ref_model: dict[str, torch.Tensor]) -> None:
    """The checkpoint holds exactly ``ref_model``'s tensors (flat keys), bit for bit."""
    manifest = ckptools.read_manifest(str(path))
    assert set(manifest.tensors) == set(ref_model)
    for fqn, expected in ref_model.items():
        actual = ckptools.read_tensor(manifest, fqn)
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, fqn
        assert torch.equal(tensor_bytes(actual), tensor_bytes(expected)), fqn
