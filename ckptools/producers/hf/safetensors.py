"""Hugging Face safetensors: one ``*.safetensors`` file, or a directory of shards with an index.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the raw row-major bytes. Reading the manifest reads only the
headers, validated by :mod:`ckptools.formats.safetensors_header` to the safetensors spec; an index
(``model.safetensors.index.json``) is checked against the shards it names.
"""

from __future__ import annotations

import json
import re

from ckptools.core.manifest import MODEL_ORDER_UNKNOWN, Chunk, FileInfo, Manifest, TensorEntry
from ckptools.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ckptools.formats import safetensors_header
from ckptools.io import storage
from ckptools.producers.base import Layout, digest, read_marker, register
from ckptools.producers.hf.index import index_files

INDEX_SUFFIX = ".safetensors.index.json"
#: transformers' shard names, ``model-00001-of-00003.safetensors``
_SHARD_NAME = re.compile(r"^.+-\d{5}-of-\d{5}\.safetensors$")


def _entries(path: str, rel: str) -> tuple[list[TensorEntry], FileInfo, dict[str, str]]:
    header = safetensors_header.read_header(path)
    out = []
    for t in header.tensors:
        chunk = Chunk(
            offsets=(0,) * len(t.shape),
            sizes=t.shape,
            file=rel,
            offset=header.data_start + t.begin,
            length=t.end - t.begin,
            encoding="raw",
        )
        out.append(TensorEntry(t.name, t.dtype, t.shape, (chunk,)))
    return out, FileInfo(rel, header.file_size), header.metadata


def parse_index(raw: bytes, index_path: str) -> dict[str, str]:
    """The ``weight_map`` of a safetensors index, checked to map tensor names to file names."""
    try:
        index = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"{index_path}: not a valid safetensors index ({e})", path=index_path
        ) from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(
            f'{index_path}: not a valid safetensors index (no "weight_map" object)',
            path=index_path,
        )
    for fqn, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise CorruptCheckpointError(
                f"{index_path}: weight_map puts {fqn!r} in {name!r}, not a file name",
                path=index_path,
                fqn=fqn,
            )
    return weight_map


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
            raw = read_marker(index_path, limit=storage.SMALL_FILE_LIMIT)
            digests = {index_name: digest(raw)}
            weight_map = parse_index(raw, index_path)
            files = index_files(path, index_path, weight_map)
            present = storage.file_sizes(path, files)
            missing = [name for name in files if name not in present]
            if missing:
                first = storage.join(path, missing[0])
                more = f"; so are {', '.join(missing[1:])}" if missing[1:] else ""
                raise CheckpointNotFoundError(
                    f"{first}: shard is missing ({index_name} names it){more}", path=first
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
        details={"metadata": metadata, MODEL_ORDER_UNKNOWN: True},
        data_root=root,
        marker_digests=digests,
    )


class SafetensorsLayout(Layout):
    name = "safetensors"
    model_directory = True
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
