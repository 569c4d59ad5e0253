"""Full state dicts saved with ``torch.save`` (``.pt``, ``.pth``, ``.bin``), and HF ``.bin`` dirs.

The archive's ``data.pkl`` is unpickled through the allowlist (the equivalent of
``torch.load(weights_only=True)``, but without torch and without reading tensor bytes): each tensor
becomes a raw chunk pointing into its storage record. Nested dicts are flattened to dotted FQNs
the way DCP flattens them; tensors that share a storage (tied weights) point at the same bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

from ckptools.core.manifest import Chunk, FileInfo, Manifest, ObjectEntry, TensorEntry
from ckptools.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedCheckpointError,
)
from ckptools.formats import safe_pickle, torch_archive
from ckptools.io import storage
from ckptools.io.storage import Reader, open_reader
from ckptools.layouts.base import Layout, digest, index_files, read_marker, register

SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
BIN_INDEX = "pytorch_model.bin.index.json"


def flatten(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Yield (key path, leaf) like DCP's ``flatten_state_dict``: dicts always, sequences only
    when they hold tensors; everything else is a leaf.

    ``value`` comes from :func:`~ckptools.formats.torch_archive.load_pickle`, whose walk
    bounded its size as a tree and its depth; whether a sequence holds a tensor is remembered
    per object, so nested sequences are searched once, not once per level.
    """
    holds: dict[int, bool] = {}

    def contains_tensor(v: Any) -> bool:
        found = holds.get(id(v))
        if found is None:
            if isinstance(v, dict):
                found = any(contains_tensor(x) for x in v.values())
            elif isinstance(v, list | tuple):
                found = any(contains_tensor(x) for x in v)
            else:
                found = isinstance(v, safe_pickle.TensorRef)
            holds[id(v)] = found
        return found

    def walk(v: Any, at: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
        if isinstance(v, dict) and v:
            for k, x in v.items():
                yield from walk(x, (*at, str(k)))
        elif isinstance(v, list | tuple) and v and contains_tensor(v):
            for i, x in enumerate(v):
                yield from walk(x, (*at, str(i)))
        else:
            yield at, v

    return walk(value, path)


def _span_bytes(ref: safe_pickle.TensorRef, itemsize: int) -> int:
    if math.prod(ref.shape) == 0:
        return 0
    last = sum((s - 1) * st for s, st in zip(ref.shape, ref.strides, strict=True))
    return (last + 1) * itemsize


def read_torch_save_file(
    reader: Reader, rel: str
) -> tuple[list[TensorEntry], list[ObjectEntry], dict[str, tuple[str, ...]], FileInfo]:
    """Tensors (as raw chunks), plain values and key paths of one ``torch.save`` file."""
    path = storage.join(reader.root, rel)
    size = reader.size(rel)
    head = reader.read(rel, 0, min(4, size))
    if not torch_archive.is_zip(head):
        raise UnsupportedCheckpointError(
            f"{path}: not a zip-format torch.save file (the legacy pre-1.6 format, or not a "
            "torch file at all); re-save it with a current torch",
            path=path,
        )
    archive = torch_archive.read_archive(reader, rel, 0, size)
    obj = torch_archive.load_pickle(reader, archive)
    data_offsets: dict[str, int] = {}
    tensors: list[TensorEntry] = []
    objects: list[ObjectEntry] = []
    paths: dict[str, tuple[str, ...]] = {}
    from ckptools.core import dtypes

    for key_path, leaf in flatten(obj):
        fqn = ".".join(key_path)
        paths[fqn] = key_path
        if isinstance(leaf, safe_pickle.TensorRef):
            if leaf.flags:
                raise UnsupportedCheckpointError(
                    f"{path}: tensor {fqn!r} carries {leaf.flags} bits; save it resolved "
                    "(e.g. t.resolve_conj())",
                    path=path,
                    fqn=fqn,
                )
            key = leaf.storage.key
            if key not in data_offsets:
                rec = archive.record(f"data/{key}")
                data_offsets[key] = torch_archive.record_data_offset(reader, archive, rec)
            storage_bytes = archive.record(f"data/{key}").size
            itemsize = dtypes.dtype(leaf.dtype).itemsize
            start = leaf.storage_offset * itemsize
            span = _span_bytes(leaf, itemsize)
            if start + span > storage_bytes:
                raise CorruptCheckpointError(
                    f"{path}: tensor {fqn!r} reaches past its storage", path=path, fqn=fqn
                )
            chunk = Chunk(
                offsets=(0,) * len(leaf.shape),
                sizes=leaf.shape,
                file=rel,
                offset=data_offsets[key] + start,
                length=span,
                encoding="raw",
                strides=None if leaf.is_contiguous else leaf.strides,
            )
            tensors.append(TensorEntry(fqn, leaf.dtype, leaf.shape, (chunk,)))
        else:
            value = safe_pickle.unwrap(leaf)
            objects.append(ObjectEntry(fqn, value=value, has_value=True, encoding="raw"))
    return tensors, objects, paths, FileInfo(rel, size)


def read_torch_save(path: str) -> Manifest:
    """Manifest of a ``torch.save`` file, or of an HF directory of ``pytorch_model*.bin``."""
    if storage.isfile(path):
        root, files = storage.dirname(path), [storage.basename(path)]
        marker: tuple[str, ...] = ()
        digests: dict[str, str] = {}
    else:
        root = path
        index_path = storage.join(path, BIN_INDEX)
        if storage.lexists(index_path):
            storage.contained(path, BIN_INDEX, named_by=path, entry="holds")
            try:
                raw = read_marker(index_path)
                digests = {BIN_INDEX: digest(raw)}
                weight_map = json.loads(raw)["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CorruptCheckpointError(
                    f"{index_path}: not a valid index ({e})", path=index_path
                ) from e
            files = index_files(path, index_path, weight_map)
            marker = (BIN_INDEX,)
        else:
            files = ["pytorch_model.bin"]
            storage.contained(path, files[0], named_by=path, entry="holds")
            marker = ()
            digests = {}
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, ObjectEntry] = {}
    paths: dict[str, tuple[str, ...]] = {}
    infos: dict[str, FileInfo] = {}
    present = storage.file_sizes(root, files)
    with open_reader(root) as reader:
        for rel in files:
            if rel not in present:
                raise CheckpointNotFoundError(
                    f"{storage.join(root, rel)}: file is missing", path=storage.join(root, rel)
                )
            ts, objs, ps, info = read_torch_save_file(reader, rel)
            tensors.update((t.fqn, t) for t in ts)
            objects.update((o.fqn, o) for o in objs)
            paths.update(ps)
            infos[rel] = info
    return Manifest(
        root=path,
        format="torch_save",
        layout="torch_save",
        tensors=tensors,
        objects=objects,
        files=infos,
        paths=paths,
        markers=marker,
        data_root=root,
        marker_digests=digests,
    )


class TorchSaveLayout(Layout):
    priority = 40
    name = "torch_save"
    description = "full state dict saved with torch.save (.pt/.pth/.bin), or an HF .bin directory"

    def probe(self, path: str) -> str | None:
        if storage.isfile(path):
            if path.endswith(SUFFIXES):
                return None
            if torch_archive.is_zip(storage.read_range(path, 0, 4)):
                return None
            return f"file is not a zip archive and its name does not end in {SUFFIXES}"
        if storage.isdir(path):
            names = set(storage.listdir(path))
            if BIN_INDEX in names or "pytorch_model.bin" in names:
                return None
            return "no pytorch_model.bin or its index"
        return "not a file or directory"

    def read_manifest(self, path: str) -> Manifest:
        return read_torch_save(path)


register(TorchSaveLayout())
