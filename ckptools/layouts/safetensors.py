"""Hugging Face safetensors: one ``*.safetensors`` file, or a directory of shards with an index.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the raw row-major bytes. Reading the manifest reads only the
headers; an index (``model.safetensors.index.json``) is checked against the shards it names.
"""

from __future__ import annotations

import json
import os
import re
import struct
from typing import Any

from ckptools.core import dtypes
from ckptools.core.manifest import Chunk, FileInfo, Manifest, TensorEntry
from ckptools.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsupportedCheckpointError,
)
from ckptools.io import storage
from ckptools.layouts.base import Layout, digest, index_files, read_marker, register

INDEX_SUFFIX = ".safetensors.index.json"
#: transformers' shard names, ``model-00001-of-00003.safetensors``
_SHARD_NAME = re.compile(r"^.+-\d{5}-of-\d{5}\.safetensors$")
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
#: First read of a safetensors file on an object store: headers of models with a few hundred
#: tensors fit, so one round trip suffices; at most this is fetched beyond the header.
_REMOTE_FIRST_READ_BYTES = 64 * 1024


def read_header(path: str) -> tuple[dict[str, Any], int, int]:
    """Return (header dict, data start offset, file size) of a safetensors file."""
    try:
        if storage.is_url(path):
            # One ranged GET usually holds the header too; a second fetches the rest if not.
            size = storage.size(path)
            head = storage.read_range(path, 0, min(size, _REMOTE_FIRST_READ_BYTES))
        else:
            with open(path, "rb") as f:
                head = f.read(8)
                size = os.fstat(f.fileno()).st_size
        if len(head) < 8:
            raise CorruptCheckpointError(f"{path}: too short for a safetensors file", path=path)
        (n,) = struct.unpack("<Q", head[:8])
        if n > _MAX_HEADER_BYTES or 8 + n > size:
            raise CorruptCheckpointError(
                f"{path}: safetensors header length {n} does not fit a {size}-byte file "
                "(truncated or not safetensors)",
                path=path,
            )
        if len(head) >= 8 + n:
            raw = head[8 : 8 + n]
        elif storage.is_url(path):
            raw = head[8:] + storage.read_range(path, len(head), 8 + n - len(head))
        else:
            with open(path, "rb") as f:
                raw = os.pread(f.fileno(), n, 8)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"{path}: file is missing", path=path) from e
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise CorruptCheckpointError(
            f"{path}: safetensors header is not JSON ({e})", path=path
        ) from e
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: safetensors header is not an object", path=path)
    return header, 8 + n, size


def _entries(path: str, rel: str) -> tuple[list[TensorEntry], FileInfo, dict[str, str]]:
    header, start, size = read_header(path)
    meta = header.pop("__metadata__", None) or {}
    out = []
    for fqn, info in header.items():
        try:
            code, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(
                f"{path}: malformed header entry for {fqn!r}", path=path, fqn=fqn
            ) from e
        dt = dtypes.BY_SAFETENSORS.get(code)
        if dt is None:
            raise UnsupportedCheckpointError(
                f"{path}: tensor {fqn!r} has dtype {code!r}, unknown to ckptools",
                path=path,
                fqn=fqn,
            )
        shape = tuple(int(s) for s in shape)
        length = int(end) - int(begin)
        expected = dt.itemsize
        for s in shape:
            expected *= s
        if length != expected or start + int(end) > size:
            raise CorruptCheckpointError(
                f"{path}: tensor {fqn!r} byte range {begin}..{end} does not match its shape "
                f"{list(shape)} or lies past the end of the {size}-byte file (truncated?)",
                path=path,
                fqn=fqn,
            )
        chunk = Chunk(
            offsets=(0,) * len(shape),
            sizes=shape,
            file=rel,
            offset=start + int(begin),
            length=length,
            encoding="raw",
        )
        out.append(TensorEntry(fqn, dt.name, shape, (chunk,)))
    return out, FileInfo(rel, size), {k: str(v) for k, v in meta.items()}


def _index_file(directory: str) -> str | None:
    names = sorted(n for n in storage.listdir(directory) if n.endswith(INDEX_SUFFIX))
    if "model" + INDEX_SUFFIX in names:
        return "model" + INDEX_SUFFIX
    return names[0] if names else None


def read_safetensors(path: str) -> Manifest:
    """Manifest of a safetensors file or model directory (sharded or not)."""
    if storage.isfile(path):
        root, files = storage.dirname(path), [storage.basename(path)]
        index_name = None
        digests: dict[str, str] = {}
    else:
        root = path
        index_name = _index_file(path)
        if index_name is not None:
            index_path = storage.contained(path, index_name, named_by=path, entry="holds")
            try:
                raw = read_marker(index_path)
                digests = {index_name: digest(raw)}
                index = json.loads(raw)
                weight_map = index["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CorruptCheckpointError(
                    f"{index_path}: not a valid safetensors index ({e})", path=index_path
                ) from e
            files = index_files(path, index_path, weight_map)
            present = storage.file_sizes(path, files)
            for name in files:
                if name not in present:
                    raise CheckpointNotFoundError(
                        f"{storage.join(path, name)}: shard is missing ({index_name} names it)",
                        path=storage.join(path, name),
                    )
        else:
            digests = {}
            files = sorted(n for n in storage.listdir(path) if n.endswith(".safetensors"))
            for name in files:
                storage.contained(path, name, named_by=path, entry="holds")
            sharded = [n for n in files if _SHARD_NAME.match(n)]
            if sharded:
                # transformers' shard names without their index: a sharded save that never
                # committed (the index is written last), not a model to read a part of.
                raise IncompleteCheckpointError(
                    f"{path}: holds {sharded[0]} but no {'model' + INDEX_SUFFIX}: the save "
                    "never finished (the index is written last); write it again",
                    path=path,
                )
    tensors: dict[str, TensorEntry] = {}
    infos: dict[str, FileInfo] = {}
    metadata: dict[str, dict[str, str]] = {}
    for name in files:
        entries, info, meta = _entries(storage.join(root, name), name)
        infos[name] = info
        metadata[name] = meta
        for entry in entries:
            if entry.fqn in tensors:
                raise CorruptCheckpointError(
                    f"{storage.join(root, name)}: tensor {entry.fqn!r} also appears in "
                    f"{tensors[entry.fqn].chunks[0].file}",
                    path=storage.join(root, name),
                    fqn=entry.fqn,
                )
            tensors[entry.fqn] = entry
    if index_name is not None:
        for fqn, name in weight_map.items():
            if fqn not in tensors or tensors[fqn].chunks[0].file != name:
                raise CorruptCheckpointError(
                    f"{storage.join(root, index_name)}: index puts {fqn!r} in {name}, "
                    "but that shard does not hold it",
                    path=storage.join(root, index_name),
                    fqn=fqn,
                )
    return Manifest(
        root=path,
        format="safetensors",
        layout="hf" if index_name or root == path else "safetensors",
        tensors=tensors,
        objects={},
        files=infos,
        world_size=None,
        markers=(index_name,) if index_name else (),
        details={"metadata": metadata},
        data_root=root,
        marker_digests=digests,
    )


class SafetensorsLayout(Layout):
    priority = 30
    name = "safetensors"
    description = "Hugging Face safetensors file or model directory (sharded with an index)"

    def probe(self, path: str) -> str | None:
        if storage.isfile(path):
            return None if path.endswith(".safetensors") else "not a .safetensors file"
        if storage.isdir(path):
            names = storage.listdir(path)
            if any(n.endswith(INDEX_SUFFIX) or n.endswith(".safetensors") for n in names):
                return None
            return "no *.safetensors files or model.safetensors.index.json"
        return "not a file or directory"

    def read_manifest(self, path: str) -> Manifest:
        return read_safetensors(path)


register(SafetensorsLayout())
