"""The structure level of verify: what metadata and ``stat`` alone can prove (seconds at any size).

The commit marker is present; every referenced file exists and is long enough for every recorded
byte range; items in one file do not overlap; each tensor's chunks tile its global shape exactly
(:func:`ckptools.core.geometry.tiling_problems`, the one check consolidate and reshard use too);
a safetensors index and its shards agree. Reading the manifest itself never stops at damage:
what cannot be read becomes a finding.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ckptools.core.geometry import tiling_problems
from ckptools.core.manifest import Chunk, Manifest, TensorEntry
from ckptools.errors import (
    CheckpointNotFoundError,
    CkptError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
)
from ckptools.io import storage
from ckptools.producers.hf.safetensors import parse_index
from ckptools.verify.digests import ItemKey
from ckptools.verify.report import Finding, FindingKind

# --------------------------------------------------------------------------------------------------
# Items: every byte range the metadata records (tensor chunks and DCP objects)
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Item:
    """One byte range the metadata records: a tensor chunk or a DCP object, where it is."""

    key: ItemKey
    file: str
    offset: int
    length: int
    encoding: str
    rank: int | None
    tensor: TensorEntry | None = None
    chunk: Chunk | None = None
    #: the stream transforms the item is stored through (its bytes are decoded before checking)
    transforms: tuple[str, ...] = ()

    @property
    def fqn(self) -> str:
        return self.key[0]

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def chunk_at(self) -> tuple[int, ...] | None:
        """The chunk's offsets in its tensor (None for an object)."""
        return self.chunk.offsets if self.chunk is not None else None

    def where(self) -> str:
        parts = [f"{self.fqn!r}"]
        if self.chunk is not None and self.chunk.offsets:
            parts.append(f"chunk at {list(self.chunk.offsets)}")
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        return ", ".join(parts)


def items_of(manifest: Manifest) -> list[Item]:
    """Every byte range ``manifest`` records, tensor chunks first."""
    out: list[Item] = []
    for t in manifest.tensors.values():
        for c in t.chunks:
            out.append(
                Item(
                    (t.fqn, c.offsets),
                    c.file,
                    c.offset,
                    c.length,
                    c.encoding,
                    c.rank,
                    t,
                    c,
                    c.transforms,
                )
            )
    for o in manifest.objects.values():
        if o.file is not None and not o.has_value:
            info = manifest.files.get(o.file)
            rank = info.rank if info is not None else None
            out.append(
                Item((o.fqn, None), o.file, o.offset, o.length, o.encoding, rank,
                     transforms=o.transforms)
            )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------------
# Reading the manifest without stopping at damage
# --------------------------------------------------------------------------------------------------


def _finding_from_error(e: CkptError) -> Finding:
    kind: FindingKind
    if isinstance(e, UnsafeCheckpointError):
        kind = "unsafe"
    elif isinstance(e, IncompleteCheckpointError):
        kind = "no_marker"
    elif isinstance(e, CheckpointNotFoundError):
        kind = "missing_file"
    elif "truncated" in e.message:
        kind = "truncated"
    elif e.path is not None and e.path.endswith((".metadata", ".json")):
        kind = "metadata"
    else:
        kind = "corrupt"
    return Finding(kind, e.message, e.path, e.fqn, e.rank)


def read(path: str, format: str | None) -> tuple[Manifest | None, list[Finding]]:
    """The manifest of ``path``, or None and the finding that says why it cannot be read."""
    from ckptools.producers import detect

    layout = detect(path, format)  # a missing path or unknown format is an error, not a finding
    try:
        # every missing or short file is reported below, not just the first (a run
        # directory: its chosen save, with the note)
        return layout.read_manifest_unchecked(path), []
    except UnsupportedCheckpointError:
        raise
    except CkptError as e:
        return None, [_finding_from_error(e)]


# --------------------------------------------------------------------------------------------------
# Structure
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Structure:
    """What the structure check learnt, and what the content scan starts from.

    Attributes:
        root: the directory the manifest's files are relative to.
        items: every byte range the metadata records (:func:`items_of`).
        sizes: the size of each present file.
        unreadable: ids of the items that cannot be read (missing or short file).
        findings: the problems found.
    """

    manifest: Manifest
    root: str
    items: list[Item]
    sizes: dict[str, int]
    unreadable: set[int]
    findings: list[Finding]


def check_structure(manifest: Manifest) -> Structure:
    """Markers, files, byte ranges, tiling and the index of ``manifest``'s checkpoint."""
    root = manifest.data_dir()
    items = items_of(manifest)
    findings = _marker_findings(manifest, root)
    # one listing on an object store, a stat per file on a disk
    sizes = storage.file_sizes(root, sorted({*manifest.files, *(i.file for i in items)}))
    by_file: dict[str, list[Item]] = {}
    for item in items:
        by_file.setdefault(item.file, []).append(item)
    unreadable: set[int] = set()
    for rel, file_items in by_file.items():
        findings.extend(_file_findings(manifest, root, rel, file_items, sizes, unreadable))
    for t in manifest.tensors.values():
        findings.extend(tiling_findings(t))
    findings.extend(_index_findings(manifest, root))
    return Structure(manifest, root, items, sizes, unreadable, findings)


def _marker_findings(manifest: Manifest, root: str) -> list[Finding]:
    return [
        Finding(
            "no_marker",
            f"{storage.join(root, marker)}: commit marker is missing: the save never "
            "finished; do not use this checkpoint",
            marker,
        )
        for marker in manifest.markers
        if not storage.exists(storage.join(root, marker))
    ]


def _file_findings(
    manifest: Manifest,
    root: str,
    rel: str,
    file_items: list[Item],
    sizes: dict[str, int],
    unreadable: set[int],
) -> list[Finding]:
    """A missing or short file, or items sharing its bytes; adds what cannot be read to
    ``unreadable``."""
    full = storage.join(root, rel)
    if rel not in sizes:
        unreadable.update(id(i) for i in file_items)
        rank = next((i.rank for i in file_items if i.rank is not None), None)
        tensors = {i.fqn for i in file_items}
        return [
            Finding(
                "missing_file",
                f"{full}: data file is missing"
                + (f" (rank {rank})" if rank is not None else "")
                + f": it should hold {len(file_items)} item(s) of {len(tensors)} entries, "
                f"e.g. {file_items[0].fqn!r}; the save did not finish on that rank or the "
                "file was deleted: restore it or use another checkpoint",
                rel,
                file_items[0].fqn,
                rank,
                file_items[0].chunk_at,
            )
        ]
    out = []
    size = sizes[rel]
    past = [i for i in file_items if i.end > size]
    if past:
        unreadable.update(id(i) for i in past)
        first = min(past, key=lambda i: i.offset)
        out.append(
            Finding(
                "truncated",
                f"{full}: file is truncated: {size} bytes, but the metadata records data up "
                f"to byte {max(i.end for i in past)}; {len(past)} item(s) reach past the "
                f"end, the first {first.where()} at bytes {first.offset}..{first.end}; the "
                "save or copy was cut short",
                rel,
                first.fqn,
                first.rank,
                first.chunk_at,
            )
        )
    if manifest.format in ("dcp", "safetensors"):
        # torch.save files legitimately share storages (tied weights); these formats never do.
        ordered = sorted((i for i in file_items if i.length), key=lambda i: i.offset)
        for a, b in itertools.pairwise(ordered):
            if b.offset < a.end:
                out.append(
                    Finding(
                        "overlap",
                        f"{full}: {a.where()} at bytes {a.offset}..{a.end} and {b.where()} at "
                        f"{b.offset}..{b.end} share bytes; the metadata is damaged",
                        rel,
                        b.fqn,
                        b.rank,
                        b.chunk_at,
                    )
                )
                break
    return out


def tiling_findings(t: TensorEntry) -> list[Finding]:
    """A finding for each reason ``t``'s chunks do not tile its shape exactly once."""
    problems = tiling_problems(t.shape, ((c.offsets, c.sizes) for c in t.chunks))
    if not problems:
        return []
    by_box = {(c.offsets, c.sizes): c for c in t.chunks}
    out = []
    for p in problems:
        chunk = by_box.get(p.box) if p.box is not None else None
        rank = chunk.rank if chunk is not None else None
        file = chunk.file if chunk is not None else None
        out.append(
            Finding(
                "tiling",
                f"{t.fqn!r} (shape {list(t.shape)}): {p.describe()}"
                + (f" (rank {rank}, {file})" if file is not None else "")
                + "; the checkpoint metadata is damaged or incomplete",
                file,
                t.fqn,
                rank,
                p.box[0] if p.box is not None else None,
            )
        )
    return out


def _index_findings(manifest: Manifest, root: str) -> list[Finding]:
    """Tensors in safetensors shards that the index does not list, and ``.safetensors`` files in
    the directory that it does not name (a stray shard: from another save, or half a copy).
    Entries naming missing shards stop the manifest from being read, and become a finding there.
    """
    if manifest.format != "safetensors" or not manifest.markers:
        return []
    marker = manifest.markers[0]
    index = storage.join(root, marker)
    try:
        weight_map = parse_index(storage.read_bounded(index, what="index"), index)
    except (OSError, CkptError):
        return []  # reading the manifest already checked it
    out = []
    for fqn, t in manifest.tensors.items():
        if fqn not in weight_map:
            file = t.chunks[0].file
            out.append(
                Finding(
                    "index",
                    f"{index}: does not list {fqn!r}, which {file} holds; loaders that follow "
                    "the index will not load it",
                    marker,
                    fqn,
                )
            )
    named = set(weight_map.values())
    for name in sorted(storage.listdir(root)):
        if name.endswith(".safetensors") and name not in named:
            out.append(
                Finding(
                    "index",
                    f"{storage.join(root, name)}: stray shard: {marker} does not name it, so "
                    "loaders that follow the index ignore it; remove it or rewrite the index",
                    name,
                )
            )
    return out
