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
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ckptools.core import dtypes
from ckptools.core.bulk import gc_paused
from ckptools.core.manifest import Chunk, FileInfo, Manifest, ObjectEntry, Part, TensorEntry
from ckptools.errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ckptools.formats import safe_pickle
from ckptools.io import storage
from ckptools.io.out_rules import is_model_output
from ckptools.producers.base import Layout, digest, read_marker, register

METADATA_FILE = ".metadata"
#: byte sizes must fit int64 for the readers and writers (os offsets, numpy): 2**59 elements of
#: the widest dtype (16 bytes, complex128) is the most a shape may hold
_MAX_NUMEL = 2**59
_RANK_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
#: the metadata each rank writes for itself when saved with ``use_collectives=False``
RANK_METADATA_FILE = re.compile(r"^__(\d+)\.metadata$")


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
    """A shape, offsets or sizes from the metadata: integers, none negative (a negative size
    would plan zero bytes where data belongs and still pass an element count)."""
    dims: tuple[int, ...]
    if type(value) is tuple:  # torch.Size decodes to a tuple; anything else is converted
        dims = value
    elif not isinstance(value, tuple | list):
        raise CorruptCheckpointError(f"{where}: {what} is not a shape", path=where)
    else:
        try:
            dims = tuple(int(v) for v in value)
        except (TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where}: {what} holds a non-integer") from e
    if dims and min(dims) < 0:
        raise CorruptCheckpointError(
            f"{where}: {what} has a negative entry: {list(dims)}", path=where
        )
    return dims


def _metadata_bytes(path: str) -> bytes:
    try:
        return read_marker(path)
    except FileNotFoundError as e:
        raise IncompleteCheckpointError(
            f"{path}: missing: the DCP save never committed (or the file was deleted)", path=path
        ) from e


def parse_metadata(data: bytes, path: str) -> Any:
    """The ``Metadata`` stand-in of the ``.metadata`` bytes ``data`` read from ``path``."""
    # Not walked as a tree: _build follows named fields and checks their types.
    md = safe_pickle.restricted_loads(data, safe_pickle.METADATA_GLOBALS, source=path, walk=False)
    if not safe_pickle.is_record(md, ".metadata.Metadata") or not isinstance(
        getattr(md, "state_dict_metadata", None), dict
    ):
        raise CorruptCheckpointError(f"{path}: not DCP metadata", path=path)
    return md


@dataclass(frozen=True)
class _Where:
    """The DCP directory ``root/subdir`` being read; file paths in its manifest are relative to
    ``root``."""

    root: str
    subdir: str
    directory: str
    meta_path: str
    meta_name: str = METADATA_FILE  # the marker's name in the directory

    def rel(self, name: str) -> str:
        return f"{self.subdir}/{name}" if self.subdir else name

    def named(self, name: str, fqn: str) -> None:
        """Refuse a file name in the metadata that leads outside this directory."""
        storage.contained(
            self.directory, name, named_by=self.meta_path, entry=f"stores {fqn!r} in", fqn=fqn
        )


def read_dcp(
    root: str,
    *,
    subdir: str = "",
    check_files: bool = True,
    listing: Mapping[str, int] | None = None,
    metadata_file: str = METADATA_FILE,
) -> Manifest:
    """Build the manifest of the DCP directory ``root/subdir``; file paths are relative to root.

    With ``check_files`` every referenced file must exist and be long enough for every byte range
    recorded in the metadata (one ``stat`` per file). ``listing`` (relative path -> size of the
    files below ``root/subdir``, from a walk the caller already made) spares listing again.
    ``metadata_file`` is the metadata pickle to read: one rank's ``__<rank>.metadata`` of a save
    without global metadata (:mod:`ckptools.producers.dcp.rank_local`).
    """
    directory = storage.join(root, subdir) if subdir else root
    meta_path = storage.join(directory, metadata_file)
    where = _Where(root, subdir, directory, meta_path, metadata_file)
    storage.contained(root, where.rel(metadata_file), named_by=root, entry="holds")
    data = _metadata_bytes(where.meta_path)
    marker_digest = digest(data)
    with gc_paused():  # millions of records and tuples: 25 s -> 6 s at 878k chunks
        md = parse_metadata(data, where.meta_path)
        del data  # the parse is done; at 878k chunks these bytes are ~100 MB
        with _malformed_as_corrupt(where):
            return _build(md, where, check_files, listing, marker_digest)


@contextlib.contextmanager
def _malformed_as_corrupt(where: _Where) -> Iterator[None]:
    """Metadata of the wrong shape (a field missing or of the wrong type) is a corrupt
    checkpoint named by its file, not a traceback."""
    try:
        yield
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        if isinstance(e, CkptError):
            raise
        raise CorruptCheckpointError(
            f"{where.meta_path}: malformed DCP metadata ({type(e).__name__}: {e})",
            path=where.meta_path,
        ) from e


def _build(
    md: Any,
    where: _Where,
    check_files: bool,
    listing: Mapping[str, int] | None,
    marker_digest: str,
) -> Manifest:
    chunk_locs, object_locs, transforms = _storage_index(md, where.meta_path)
    extents: dict[str, int] = {}  # file name in the directory -> end of its last recorded item
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, ObjectEntry] = {}
    file_of: dict[str, tuple[str, int | None]] = {}
    for fqn, item in md.state_dict_metadata.items():
        if safe_pickle.is_record(item, "BytesStorageMetadata"):
            objects[fqn] = _object_entry(fqn, object_locs.get(fqn), where, extents, file_of)
            if fqn in transforms:
                objects[fqn] = replace(objects[fqn], transforms=transforms[fqn])
        elif safe_pickle.is_record(item, "TensorStorageMetadata"):
            tensors[fqn] = _tensor_entry(fqn, item, chunk_locs, where, extents, file_of, transforms)
        else:
            raise CorruptCheckpointError(
                f"{where.meta_path}: entry {fqn!r} is neither tensor nor bytes",
                path=where.meta_path,
                fqn=fqn,
            )
    files = _data_files(where, extents, check_files, listing, file_of)
    ranks = [r for r in (rank_of(n) for n in files) if r is not None]
    paths = {}
    for fqn, p in (getattr(md, "planner_data", None) or {}).items():
        # key paths hold str keys and int list indices; str() of anything else could expand
        # a hostile shared structure without bound
        if isinstance(p, tuple | list) and all(type(x) in (str, int) for x in p):
            paths[fqn] = tuple(str(x) for x in p)
    storage_meta = getattr(md, "storage_meta", None)
    details: dict[str, Any] = {
        "dcp_version": _text(getattr(md, "version", None)),
        "save_id": _text(getattr(storage_meta, "save_id", None)),
    }
    marker = where.rel(where.meta_name)
    return Manifest(
        root=where.root,
        format="dcp",
        layout="dcp",
        tensors=tensors,
        objects=objects,
        files=files,
        world_size=max(ranks) + 1 if ranks else None,
        paths=paths,
        markers=(marker,),
        details=details,
        data_root=where.root,
        marker_digests={marker: marker_digest},
    )


_new = tuple.__new__  # a Chunk from all its fields, in order (_tensor_entry)


def _text(value: Any) -> str | None:
    """A string field shown as it is; any other value is dropped (it is displayed later)."""
    return value if isinstance(value, str) else None


def _storage_index(
    md: Any, meta_path: str
) -> tuple[dict[tuple[str, tuple[int, ...]], Any], dict[str, Any], dict[Any, tuple[str, ...]]]:
    """Where each chunk (by FQN and offsets) and each object is stored, and the stream
    transforms of the items written through DCP storage extensions (by the same keys; an
    object's by FQN): kept on their chunks, :mod:`ckptools.formats.stream_transforms`."""
    chunk_locs: dict[tuple[str, tuple[int, ...]], Any] = {}
    object_locs: dict[str, Any] = {}
    transforms: dict[Any, tuple[str, ...]] = {}
    # once per chunk (1.16M at 1,024 ranks): the checks are spelled out, not looped over
    for index, info in (getattr(md, "storage_data", None) or {}).items():
        fqn = getattr(index, "fqn", None)
        if not isinstance(fqn, str) or not isinstance(getattr(info, "relative_path", None), str):
            raise CorruptCheckpointError(f"{meta_path}: malformed storage entry", path=meta_path)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (type(offset) is int and type(length) is int and offset >= 0 and length >= 0):
            raise CorruptCheckpointError(
                f"{meta_path}: storage entry of {fqn!r} has offset {offset!r} and length "
                f"{length!r}, not two non-negative integers",
                path=meta_path,
                fqn=fqn,
            )
        at = getattr(index, "offset", None)
        key: Any = fqn if at is None else (fqn, at if type(at) is tuple else tuple(at))
        if at is None:
            object_locs[fqn] = info
        else:
            chunk_locs[key] = info
        # _StorageInfo.__getstate__ leaves out None fields, so absent means "no transforms".
        descriptors = info.__dict__.get("transform_descriptors")
        if descriptors:
            transforms[key] = _descriptors(descriptors, fqn, meta_path)
    return chunk_locs, object_locs, transforms


def _descriptors(value: Any, fqn: str, meta_path: str) -> tuple[str, ...]:
    """An item's ``transform_descriptors`` as text (a non-string one shown as the pickle
    holds it: it names no transform ckptools decodes, so it is refused by that name)."""
    if not isinstance(value, list | tuple):
        raise CorruptCheckpointError(
            f"{meta_path}: transform descriptors of {fqn!r} are not a list", path=meta_path, fqn=fqn
        )
    return tuple(d if isinstance(d, str) else safe_pickle.short(d) for d in value)


def _object_entry(
    fqn: str,
    info: Any,
    where: _Where,
    extents: dict[str, int],
    file_of: dict[str, tuple[str, int | None]],
) -> ObjectEntry:
    if info is None:
        raise CorruptCheckpointError(
            f"{where.meta_path}: object {fqn!r} has no storage entry",
            path=where.meta_path,
            fqn=fqn,
        )
    if info.relative_path not in file_of:
        where.named(info.relative_path, fqn)
        file_of[info.relative_path] = (where.rel(info.relative_path), rank_of(info.relative_path))
    end = int(info.offset) + int(info.length)
    extents[info.relative_path] = max(extents.get(info.relative_path, 0), end)
    return ObjectEntry(
        fqn=fqn,
        file=where.rel(info.relative_path),
        offset=int(info.offset),
        length=int(info.length),
        encoding="torch_save",
    )


def _tensor_entry(
    fqn: str,
    item: Any,
    chunk_locs: Mapping[tuple[str, tuple[int, ...]], Any],
    where: _Where,
    extents: dict[str, int],
    file_of: dict[str, tuple[str, int | None]],
    transforms: Mapping[Any, tuple[str, ...]],
) -> TensorEntry:
    meta_path = where.meta_path
    dtype = _dtype_of(item.properties, fqn, meta_path)
    shape = _tuple(item.size, f"shape of {fqn!r}", meta_path)
    if math.prod(shape) >= _MAX_NUMEL:
        raise CorruptCheckpointError(
            f"{meta_path}: shape of {fqn!r} {list(shape)} has more elements than any file holds",
            path=meta_path,
            fqn=fqn,
        )
    chunks: list[Chunk] = []
    append = chunks.append
    for cm in item.chunks or ():
        # _tuple's checks inline for the usual form (a tuple of non-negative ints): this loop
        # runs once per chunk, 1.16M times for a 405B model at 1,024 ranks
        offsets, sizes = cm.offsets, cm.sizes
        if type(offsets) is not tuple or (offsets and min(offsets) < 0):
            offsets = _tuple(offsets, f"chunk offsets of {fqn!r}", meta_path)
        if type(sizes) is not tuple or (sizes and min(sizes) < 0):
            sizes = _tuple(sizes, f"chunk sizes of {fqn!r}", meta_path)
        info = chunk_locs.get((fqn, offsets))
        if info is None:
            raise CorruptCheckpointError(
                f"{meta_path}: chunk at {list(offsets)} of {fqn!r} has no storage entry",
                path=meta_path,
                fqn=fqn,
            )
        name = info.relative_path
        file = file_of.get(name)
        if file is None:
            where.named(name, fqn)  # once per file, before anything is read or stat'ed
            file = file_of[name] = (where.rel(name), rank_of(name))
        end = info.offset + info.length
        if end > extents.get(name, 0):
            extents[name] = end
        # Built as the tuple it is, every field given: this loop runs once per chunk (millions
        # at scale), and the named tuple's own __new__ costs 2.5x as much
        append(
            _new(Chunk, (offsets, sizes, file[0], info.offset, info.length, "torch_save", file[1],
                         None, None, transforms.get((fqn, offsets), ()) if transforms else (),
                         None))
        )  # fmt: skip
    return TensorEntry(fqn, dtypes.canonical(dtype), shape, tuple(chunks))


def _data_files(
    where: _Where,
    extents: Mapping[str, int],
    check_files: bool,
    listing: Mapping[str, int] | None,
    named: Mapping[str, object],
) -> dict[str, FileInfo]:
    """Every ``.distcp`` file of the directory and every file the metadata refers to, with its
    size; with ``check_files`` each must exist and hold every recorded byte range. The files
    the metadata names were checked to lie inside (:meth:`_Where.named`); the others are here."""
    directory, meta_path = where.directory, where.meta_path
    if listing is not None:
        present = dict(listing)
        listed = {n for n in present if n.endswith(".distcp") and "/" not in n}
        unseen = [n for n in extents if n not in present]
        if unseen and not storage.is_url(directory):
            present.update(storage.file_sizes(directory, unseen))  # a name outside the walk
    elif storage.is_url(directory):
        present = storage.file_sizes(directory)  # one listing, not a request per rank file
        listed = {n for n in present if n.endswith(".distcp")}
    else:
        listed = {n for n in _listdir(directory) if n.endswith(".distcp")}
        present = storage.file_sizes(directory, sorted(set(extents) | listed))
    for name in sorted(listed - set(named)):
        storage.contained(directory, name, named_by=directory, entry="holds")
    files: dict[str, FileInfo] = {}
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
        files[where.rel(name)] = FileInfo(where.rel(name), size, rank_of(name))
    return files


def read_dcp_tree(
    root: str,
    subdirs: Sequence[str] = ("",),
    *,
    layout: str = "dcp",
    notes: Sequence[str] = (),
    check_files: bool = True,
) -> Manifest:
    """One manifest over the DCP directories ``subdirs`` of ``root`` (``""``: root itself);
    ``check_files`` as :func:`read_dcp`.

    The tree is walked once: the walk gives each part its file sizes and the manifest its
    :attr:`~ckptools.core.manifest.Manifest.aux_files`; each part's ``.metadata`` is parsed once
    and kept as a :class:`~ckptools.core.manifest.Part`.
    """
    tree = {rel.replace(os.sep, "/"): size for rel, size in storage.walk_files(root).items()}
    aux_files = _aux_files(tree, subdirs)
    for rel in aux_files:  # copied into outputs beside the data
        storage.contained(root, rel, named_by=root, entry="holds")
    parts = tuple(
        Part(
            subdir=sub,
            manifest=read_dcp(root, subdir=sub, check_files=check_files, listing=_below(tree, sub)),
        )
        for sub in subdirs
    )
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, ObjectEntry] = {}
    files: dict[str, FileInfo] = {}
    paths: dict[str, tuple[str, ...]] = {}
    digests: dict[str, str] = {}
    markers: list[str] = []
    world_size = None
    for part in parts:
        m = part.manifest
        tensors.update(m.tensors)
        objects.update(m.objects)
        files.update(m.files)
        paths.update(m.paths)
        digests.update(m.marker_digests)
        markers.extend(m.markers)
        if m.world_size is not None:
            world_size = max(world_size or 0, m.world_size)
    return Manifest(
        root=root,
        format="dcp",
        layout=layout,
        tensors=tensors,
        objects=objects,
        files=files,
        world_size=world_size,
        paths=paths,
        markers=tuple(markers),
        notes=tuple(notes),
        # one DCP directory: its own facts (DCP version, transforms); several: none
        details=parts[0].manifest.details if len(parts) == 1 else {},
        data_root=root,
        parts=parts,
        aux_files=aux_files,
        marker_digests=digests,
    )


def _below(tree: Mapping[str, int], subdir: str) -> dict[str, int]:
    """The files of ``tree`` below ``subdir``, relative to it."""
    if not subdir:
        return dict(tree)
    prefix = subdir + "/"
    return {rel[len(prefix) :]: size for rel, size in tree.items() if rel.startswith(prefix)}


def _aux_files(tree: Mapping[str, int], subdirs: Sequence[str]) -> tuple[str, ...]:
    """Files beside the DCP data that belong to the checkpoint (trainer_state.json, meta.pt...):
    not in a hidden directory, not a part's ``.distcp`` data or ``.metadata`` marker (any
    other file in a DCP directory belongs to the checkpoint too), and not in a model directory
    consolidated from it (the Trainer callback's ``checkpoint-N/hf/``): an output, not part of
    the checkpoint, so a reshard does not carry it along."""
    below: dict[str, list[str]] = {}
    for rel in tree:
        top, sep, rest = rel.partition("/")
        if sep and top not in subdirs:
            below.setdefault(top, []).append(rest)
    outputs = {top for top, names in below.items() if is_model_output(names)}
    out: list[str] = []
    for rel in tree:
        rel_dir, _, name = rel.rpartition("/")
        if any(d.startswith(".") for d in rel_dir.split("/") if d):
            continue
        if rel.partition("/")[0] in outputs and "/" in rel:
            continue
        if rel_dir in subdirs and (name.endswith(".distcp") or name == METADATA_FILE):
            continue
        out.append(rel)
    return tuple(sorted(out))


def _listdir(path: str) -> list[str]:
    try:
        return storage.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def sharding_summary(manifest: Manifest) -> dict[str, int]:
    """Count tensors by how their chunks split them: "replicated", "dim0", "dim0+dim1", ..."""
    out: dict[str, int] = {}
    for t in manifest.tensors.values():
        dims = sorted({d for c in t.chunks for d, o in enumerate(c.offsets) if o != 0})
        key = "+".join(f"dim{d}" for d in dims) if dims else "whole"
        out[key] = out.get(key, 0) + 1
    return out


def dcp_lacks(path: str) -> str | None:
    """What the DCP directory ``path`` lacks to be read, or None when it is whole: its
    ``.metadata``, and every data file that metadata names (present: sizes are the reader's to
    check). Parses the metadata (kept for the reader's own read), reads no tensor data."""
    meta = storage.join(path, METADATA_FILE)
    if storage.outside_reason(path, METADATA_FILE) is not None:
        return f"its {METADATA_FILE} leads outside it"
    try:
        md = parse_metadata(read_marker(meta, peek=True), meta)
    except (FileNotFoundError, NotADirectoryError):
        return f"no DCP {METADATA_FILE}"
    except CorruptCheckpointError as e:
        return f"unreadable {METADATA_FILE}: {e}"
    named = sorted(
        {
            info.relative_path
            for info in (getattr(md, "storage_data", None) or {}).values()
            if isinstance(getattr(info, "relative_path", None), str)
        }
    )
    inside = [n for n in named if storage.outside_reason(path, n) is None]
    present = storage.file_sizes(path, inside) if inside else {}
    missing = [n for n in inside if n not in present]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return f"{missing[0]}{more} missing ({METADATA_FILE} names it)"
    return None


class DcpLayout(Layout):
    name = "dcp"
    description = "torch.distributed.checkpoint directory (.metadata + __<rank>_<n>.distcp)"

    def probe(self, path: str) -> str | None:
        if not storage.isdir(path):
            return "not a directory"
        names = _listdir(path)
        if METADATA_FILE in names:
            return None
        if any(RANK_METADATA_FILE.match(n) for n in names):
            return (
                "no .metadata but __<rank>.metadata files: saved without global metadata "
                "(layout dcp_rank_local)"
            )
        if any(n.endswith(".distcp") for n in names):
            return None  # read_manifest reports the missing marker precisely
        return "no .metadata file"

    def lacks(self, path: str) -> str | None:
        return dcp_lacks(path)

    def read_manifest(self, path: str) -> Manifest:
        return read_dcp_tree(path)

    def read_manifest_unchecked(self, path: str) -> Manifest:
        return read_dcp_tree(path, check_files=False)


register(DcpLayout())
