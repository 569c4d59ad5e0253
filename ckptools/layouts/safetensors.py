"""Hugging Face safetensors: one ``*.safetensors`` file, or a directory of shards with an index.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the raw row-major bytes. Reading the manifest reads only the
headers; an index (``model.safetensors.index.json``) is checked against the shards it names.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from .. import dtypes
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError
from ..manifest import Chunk, FileInfo, Manifest, TensorEntry
from .base import Layout, register

INDEX_SUFFIX = ".safetensors.index.json"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


def read_header(path: str) -> tuple[dict[str, Any], int, int]:
    """Return (header dict, data start offset, file size) of a safetensors file."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = os.fstat(f.fileno()).st_size
            if len(head) < 8:
                raise CorruptCheckpointError(f"{path}: too short for a safetensors file", path=path)
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER_BYTES or 8 + n > size:
                raise CorruptCheckpointError(
                    f"{path}: safetensors header length {n} does not fit a {size}-byte file "
                    "(truncated or not safetensors)",
                    path=path,
                )
            raw = f.read(n)
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
    names = sorted(n for n in os.listdir(directory) if n.endswith(INDEX_SUFFIX))
    if "model" + INDEX_SUFFIX in names:
        return "model" + INDEX_SUFFIX
    return names[0] if names else None


def read_safetensors(path: str) -> Manifest:
    """Manifest of a safetensors file or model directory (sharded or not)."""
    if os.path.isfile(path):
        root, files = os.path.dirname(path), [os.path.basename(path)]
        index_name = None
    else:
        root = path
        index_name = _index_file(path)
        if index_name is not None:
            index_path = os.path.join(path, index_name)
            try:
                with open(index_path) as f:
                    index = json.load(f)
                weight_map = index["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CorruptCheckpointError(
                    f"{index_path}: not a valid safetensors index ({e})", path=index_path
                ) from e
            files = sorted(set(weight_map.values()))
            for name in files:
                if not os.path.exists(os.path.join(path, name)):
                    raise CheckpointNotFoundError(
                        f"{os.path.join(path, name)}: shard is missing ({index_name} names it)",
                        path=os.path.join(path, name),
                    )
        else:
            files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    tensors: dict[str, TensorEntry] = {}
    infos: dict[str, FileInfo] = {}
    metadata: dict[str, dict[str, str]] = {}
    for name in files:
        entries, info, meta = _entries(os.path.join(root, name), name)
        infos[name] = info
        metadata[name] = meta
        for entry in entries:
            if entry.fqn in tensors:
                raise CorruptCheckpointError(
                    f"{os.path.join(root, name)}: tensor {entry.fqn!r} also appears in "
                    f"{tensors[entry.fqn].chunks[0].file}",
                    path=os.path.join(root, name),
                    fqn=entry.fqn,
                )
            tensors[entry.fqn] = entry
    if index_name is not None:
        for fqn, name in weight_map.items():
            if fqn not in tensors or tensors[fqn].chunks[0].file != name:
                raise CorruptCheckpointError(
                    f"{os.path.join(root, index_name)}: index puts {fqn!r} in {name}, "
                    "but that shard does not hold it",
                    path=os.path.join(root, index_name),
                    fqn=fqn,
                )
    return Manifest(
        root=path,
        format="safetensors",
        layout="hf" if index_name or os.path.isdir(path) else "safetensors",
        tensors=tensors,
        objects={},
        files=infos,
        world_size=None,
        markers=(index_name,) if index_name else (),
        details={"metadata": metadata},
    )


class SafetensorsLayout(Layout):
    priority = 30
    name = "safetensors"
    description = "Hugging Face safetensors file or model directory (sharded with an index)"

    def probe(self, path: str) -> str | None:
        if os.path.isfile(path):
            return None if path.endswith(".safetensors") else "not a .safetensors file"
        if os.path.isdir(path):
            names = os.listdir(path)
            if any(n.endswith(INDEX_SUFFIX) or n.endswith(".safetensors") for n in names):
                return None
            return "no *.safetensors files or model.safetensors.index.json"
        return "not a file or directory"

    def read_manifest(self, path: str) -> Manifest:
        return read_safetensors(path)


register(SafetensorsLayout())
