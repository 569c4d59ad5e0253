"""torch.distributed.checkpoint (DCP) directories: ``.metadata`` + ``__<rank>_<n>.distcp``.

The ``.metadata`` pickle (written last by the coordinator, so it is the commit marker) lists each
tensor's global shape and chunks and, per chunk and per object, the file and byte range that
holds it as a ``torch.save`` archive. Every producer (FSDP2 DTensor, FSDP1 ShardedTensor, HSDP,
TP+FSDP, single-process ``dcp.save``) writes the same metadata; what differs is how chunks tile
the tensors, which :func:`sharding_summary` reports.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import re
from collections.abc import Iterator
from typing import Any

from ckptools.core import dtypes
from ckptools.core.manifest import Chunk, FileInfo, Manifest, ObjectEntry, TensorEntry
from ckptools.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsupportedCheckpointError,
)
from ckptools.formats import safe_pickle
from ckptools.io import storage
from ckptools.layouts.base import Layout, register

METADATA_FILE = ".metadata"
_RANK_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


@functools.lru_cache(maxsize=65536)
def rank_of(filename: str) -> int | None:
    m = _RANK_FILE.match(os.path.basename(filename))
    return int(m.group(1)) if m else None


def _dtype_of(properties: Any, fqn: str, where: str) -> str:
    state = getattr(properties, "_state", None)
    raw = state[0] if isinstance(state, tuple) and state else getattr(properties, "dtype", None)
    if not isinstance(raw, safe_pickle.DTypeName):
        raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has no dtype in metadata", fqn=fqn)
    return str(raw)


def _tuple(value: Any, what: str, where: str) -> tuple[int, ...]:
    if type(value) is tuple:  # built by the allowlisted ``tuple`` for torch.Size
        return value
    if not isinstance(value, tuple | list):
        raise CorruptCheckpointError(f"{where}: {what} is not a shape")
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: {what} holds a non-integer") from e


def load_metadata(path: str) -> Any:
    """Read a DCP ``.metadata`` file through the allowlist; returns the ``Metadata`` stand-in."""
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError as e:
        raise IncompleteCheckpointError(
            f"{path}: missing: the DCP save never committed (or the file was deleted)", path=path
        ) from e
    md = safe_pickle.restricted_loads(data, safe_pickle.METADATA_GLOBALS, source=path)
    if not safe_pickle.is_record(md, ".metadata.Metadata") or not isinstance(
        getattr(md, "state_dict_metadata", None), dict
    ):
        raise CorruptCheckpointError(f"{path}: not DCP metadata", path=path)
    return md


def read_dcp(root: str, *, subdir: str = "", check_files: bool = True) -> Manifest:
    """Build the manifest of the DCP directory ``root/subdir``; file paths are relative to root.

    With ``check_files`` every referenced file must exist and be long enough for every byte range
    recorded in the metadata (one ``stat`` per file).
    """
    directory = storage.join(root, subdir) if subdir else root
    meta_path = storage.join(directory, METADATA_FILE)
    with _gc_paused():
        md = load_metadata(meta_path)
        return _build_checked(md, root, subdir, directory, meta_path, check_files)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Parsing builds millions of small acyclic objects (3 records and 3 tuples per chunk); the
    cyclic collector would rescan them again and again: 25 s -> 6 s for 878k chunks."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _build_checked(
    md: Any, root: str, subdir: str, directory: str, meta_path: str, check_files: bool
) -> Manifest:
    try:
        return _build(md, root, subdir, directory, meta_path, check_files)
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        if isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(
            f"{meta_path}: malformed DCP metadata ({type(e).__name__}: {e})", path=meta_path
        ) from e


def _build(
    md: Any, root: str, subdir: str, directory: str, meta_path: str, check_files: bool
) -> Manifest:

    def rel(name: str) -> str:
        return f"{subdir}/{name}" if subdir else name

    chunk_locs: dict[tuple[str, tuple[int, ...]], Any] = {}
    object_locs: dict[str, Any] = {}
    transforms: dict[str, list[str]] = {}
    for index, info in (getattr(md, "storage_data", None) or {}).items():
        fqn = getattr(index, "fqn", None)
        if not isinstance(fqn, str) or not isinstance(getattr(info, "relative_path", None), str):
            raise CorruptCheckpointError(f"{meta_path}: malformed storage entry", path=meta_path)
        # _StorageInfo.__getstate__ leaves out None fields, so absent means "no transforms".
        descriptors = info.__dict__.get("transform_descriptors")
        if descriptors:
            transforms[fqn] = list(descriptors)
        if getattr(index, "offset", None) is None:
            object_locs[fqn] = info
        else:
            chunk_locs[(fqn, tuple(index.offset))] = info

    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, ObjectEntry] = {}
    extents: dict[str, int] = {}
    file_of: dict[str, tuple[str, int | None]] = {}
    for fqn, item in md.state_dict_metadata.items():
        if safe_pickle.is_record(item, "BytesStorageMetadata"):
            info = object_locs.get(fqn)
            if info is None:
                raise CorruptCheckpointError(
                    f"{meta_path}: object {fqn!r} has no storage entry", path=meta_path, fqn=fqn
                )
            objects[fqn] = ObjectEntry(
                fqn, rel(info.relative_path), int(info.offset), int(info.length), "torch_save"
            )
            extents[info.relative_path] = max(
                extents.get(info.relative_path, 0), int(info.offset) + int(info.length)
            )
            continue
        if not safe_pickle.is_record(item, "TensorStorageMetadata"):
            raise CorruptCheckpointError(
                f"{meta_path}: entry {fqn!r} is neither tensor nor bytes", path=meta_path, fqn=fqn
            )
        dtype = _dtype_of(item.properties, fqn, meta_path)
        shape = _tuple(item.size, f"shape of {fqn!r}", meta_path)
        chunks = []
        for cm in item.chunks or ():
            offsets = _tuple(cm.offsets, f"chunk offsets of {fqn!r}", meta_path)
            info = chunk_locs.get((fqn, offsets))
            if info is None:
                raise CorruptCheckpointError(
                    f"{meta_path}: chunk at {list(offsets)} of {fqn!r} has no storage entry",
                    path=meta_path,
                    fqn=fqn,
                )
            name = info.relative_path
            where = file_of.get(name)
            if where is None:
                where = file_of[name] = (rel(name), rank_of(name))
            end = info.offset + info.length
            if end > extents.get(name, 0):
                extents[name] = end
            # Positional construction: this loop runs once per chunk (millions at scale).
            chunks.append(
                Chunk(
                    offsets,
                    _tuple(cm.sizes, f"chunk sizes of {fqn!r}", meta_path),
                    where[0],
                    info.offset,
                    info.length,
                    "torch_save",
                    where[1],
                )
            )
        tensors[fqn] = TensorEntry(fqn, dtypes.canonical(dtype), shape, tuple(chunks))

    files: dict[str, FileInfo] = {}
    if storage.is_url(directory):
        present = storage.file_sizes(directory)  # one listing, not a request per rank file
        listed = {n for n in present if n.endswith(".distcp")}
    else:
        listed = {n for n in _listdir(directory) if n.endswith(".distcp")}
        present = storage.file_sizes(directory, sorted(set(extents) | listed))
    for name in sorted(set(extents) | listed):
        full = storage.join(directory, name)
        size: int | None = present.get(name)
        if size is None and check_files:
            raise CheckpointNotFoundError(
                f"{full}: data file is missing (rank {rank_of(name)}; {meta_path} refers to it)",
                path=full,
                rank=rank_of(name),
            )
        if check_files and size is not None and size < extents.get(name, 0):
            raise CorruptCheckpointError(
                f"{full}: file is truncated: {size} bytes, but the metadata records data up to "
                f"byte {extents[name]}",
                path=full,
                rank=rank_of(name),
            )
        files[rel(name)] = FileInfo(rel(name), size, rank_of(name))

    ranks = [r for r in (rank_of(n) for n in files) if r is not None]
    paths = {}
    for fqn, p in (getattr(md, "planner_data", None) or {}).items():
        if isinstance(p, tuple | list):
            paths[fqn] = tuple(str(x) for x in p)
    storage_meta = getattr(md, "storage_meta", None)
    details: dict[str, Any] = {
        "dcp_version": getattr(md, "version", None),
        "save_id": getattr(storage_meta, "save_id", None) if storage_meta is not None else None,
    }
    if transforms:
        details["transforms"] = transforms
    return Manifest(
        root=root,
        format="dcp",
        layout="dcp",
        tensors=tensors,
        objects=objects,
        files=files,
        world_size=max(ranks) + 1 if ranks else None,
        paths=paths,
        markers=(rel(METADATA_FILE),),
        details=details,
    )


def _listdir(path: str) -> list[str]:
    try:
        return storage.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def require_plain(manifest: Manifest) -> None:
    """Refuse checkpoints whose items were written through DCP storage extensions."""
    transforms = manifest.details.get("transforms")
    if transforms:
        fqn, descriptors = next(iter(transforms.items()))
        raise UnsupportedCheckpointError(
            f"{manifest.root}: items are stored through DCP extensions {descriptors} "
            f"(e.g. {fqn!r}); ckptools reads only plain torch.save items",
            path=manifest.root,
            fqn=fqn,
        )


def sharding_summary(manifest: Manifest) -> dict[str, int]:
    """Count tensors by how their chunks split them: "replicated", "dim0", "dim0+dim1", ..."""
    out: dict[str, int] = {}
    for t in manifest.tensors.values():
        dims = sorted({d for c in t.chunks for d, o in enumerate(c.offsets) if o != 0})
        key = "+".join(f"dim{d}" for d in dims) if dims else "whole"
        out[key] = out.get(key, 0) + 1
    return out


class DcpLayout(Layout):
    priority = 20
    name = "dcp"
    description = "torch.distributed.checkpoint directory (.metadata + __<rank>_<n>.distcp)"

    def probe(self, path: str) -> str | None:
        if not storage.isdir(path):
            return "not a directory"
        names = _listdir(path)
        if METADATA_FILE in names:
            return None
        if any(n.endswith(".distcp") for n in names):
            return None  # read_manifest reports the missing marker precisely
        return "no .metadata file"

    def read_manifest(self, path: str) -> Manifest:
        return read_dcp(path)


register(DcpLayout())
