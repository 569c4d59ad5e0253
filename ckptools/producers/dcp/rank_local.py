"""DCP saved without global metadata: ``dcp.save(..., use_collectives=False)`` (torch >= 2.9).

Without collectives no rank sees another's plan, so nobody writes ``.metadata``: rank ``r``
writes its ``__<r>_<n>.distcp`` files and ``__<r>.metadata``, a whole DCP metadata pickle that
gives each tensor's global shape but lists only rank ``r``'s chunks, and holds rank ``r``'s own
copy of every replicated entry (optimizer ``step`` tensors, ``param_groups``, plain values).
torch's ``dcp.load(no_dist=True)`` falls back to ``__0.metadata`` alone and fills rank 0's rows
of every tensor without a word; the global ``.metadata`` users need is what ``ckpt reshard``
writes (to any world size, the same one included).

This layout reads each rank's pickle with :func:`ckptools.producers.dcp.layout.read_dcp` (the same
allowlist, checks and manifest as any DCP directory) and merges them into one manifest:

* a tensor's chunks are the union of the ranks' chunks; its dtype and global shape must agree
  in every file. A box several ranks stored (a replicated ``step``) stays once per rank, as
  replicas: conversions read the first (:func:`ckptools.plan.safetensors.unique_chunks`) and
  ``verify`` checks every copy's CRC;
* a replicated object keeps the lowest rank's copy;
* copies of one entry must hold the same value: the CRC-32s the items' zip directories record
  for their data are compared (the directory read per copy, never the data: ~22 us a copy on a
  local disk, so ~7 s for 1,024 ranks x 300 replicated entries), and a difference is an error
  naming both files.

The world size is what the file names say (the highest rank of any ``__<r>.metadata`` or
``__<r>_<n>.distcp``, plus one). A rank below it without its metadata is named; a trailing rank
deleted whole leaves no name, but its rows do: a tensor whose chunks stop short of the end of
a dimension names ``__<W>.metadata`` as missing. Either way nothing reads half a model. The
exact per-tensor tiling check (:func:`ckptools.core.geometry.tiling_problems`) still runs in
every command that reads tensors.

The commit markers are the ``__<r>.metadata`` files (each written last by its rank, by rename).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptools.core.manifest import Chunk, FileInfo, Manifest, ObjectEntry, TensorEntry
from ckptools.errors import CorruptCheckpointError, IncompleteCheckpointError
from ckptools.formats.torch_archive import read_archive
from ckptools.io import storage
from ckptools.producers.base import register
from ckptools.producers.dcp.layout import RANK_METADATA_FILE, rank_of, read_dcp
from ckptools.producers.probing import DirectoryLayout

LAYOUT = "dcp_rank_local"
#: Missing ranks named one by one, at most: a name such as ``__999999999.metadata`` must not
#: make a billion names (the count is always given).
MISSING_RANKS_NAMED = 64


def rank_metadata_name(rank: int) -> str:
    """The metadata file rank ``rank`` writes: ``__<rank>.metadata``."""
    return f"__{rank}.metadata"


@dataclass
class _Listing:
    """The checkpoint's files, grouped as the merge needs them (one walk of the tree)."""

    tree: dict[str, int]  # relative path -> size, every file below the root
    metadata: dict[int, int] = field(default_factory=dict)  # rank -> size of __r.metadata
    data: dict[int, dict[str, int]] = field(default_factory=dict)  # rank -> its .distcp files

    @classmethod
    def of(cls, root: str) -> _Listing:
        tree = {rel.replace("\\", "/"): size for rel, size in storage.walk_files(root).items()}
        listing = cls(tree)
        for rel, size in tree.items():
            if "/" in rel:
                continue
            m = RANK_METADATA_FILE.match(rel)
            if m is not None:
                listing.metadata[int(m.group(1))] = size
                continue
            rank = rank_of(rel)
            if rank is not None:
                listing.data.setdefault(rank, {})[rel] = size
        return listing

    @property
    def world_size(self) -> int:
        ranks = [*self.metadata, *self.data]
        return max(ranks) + 1 if ranks else 0

    def missing(self) -> tuple[list[int], int]:
        """The first :data:`MISSING_RANKS_NAMED` ranks below the world size without their
        metadata, and how many there are (linear in the files, whatever the names say)."""
        count = self.world_size - len(self.metadata)
        named: list[int] = []
        expected = 0
        for r in [*sorted(self.metadata), self.world_size]:
            named.extend(range(expected, min(r, expected + MISSING_RANKS_NAMED - len(named))))
            expected = r + 1
            if len(named) >= MISSING_RANKS_NAMED:
                break
        return named, count

    def aux_files(self) -> tuple[str, ...]:
        """Files beside the data that belong to the checkpoint: not a rank's ``.distcp`` or
        ``__r.metadata``, and not in a hidden directory (as :func:`read_dcp_tree` decides)."""
        out = []
        for rel in self.tree:
            rel_dir, _, name = rel.rpartition("/")
            if any(d.startswith(".") for d in rel_dir.split("/") if d):
                continue
            if not rel_dir and (RANK_METADATA_FILE.match(name) or rank_of(name) is not None):
                continue
            out.append(rel)
        return tuple(sorted(out))


def read_rank_local(root: str, *, check_files: bool = True) -> Manifest:
    """The merged manifest of the DCP directory ``root`` saved without global metadata.

    With ``check_files`` (every command but ``verify``) a rank's missing metadata, a missing or
    short data file, or rows no rank holds raise. Without it (``verify``, which reports every
    problem) the manifest describes what is there: every expected ``__r.metadata`` is among its
    markers, so a missing one is a finding, and the tiling check reports the rows it lacks.

    Raises:
        IncompleteCheckpointError: a rank's metadata is missing (the rank and file named).
        CheckpointNotFoundError: a data file a rank's metadata names is missing.
        CorruptCheckpointError: a short file; an entry the ranks describe differently (its
            dtype, shape or kind, or a replicated value that differs), naming both files.
    """
    listing = _Listing.of(root)
    world = listing.world_size
    missing, n_missing = listing.missing()
    if missing and check_files:
        r = missing[0]
        path = storage.join(root, rank_metadata_name(r))
        raise IncompleteCheckpointError(
            f"{path}: missing: rank {r} of {world} never finished its save (or the file was "
            f"deleted), so no file describes its chunks ({n_missing} rank(s) missing); "
            "restore it or use another checkpoint",
            path=path,
            rank=r,
        )
    merged = _Merge(root)
    for r in sorted(listing.metadata):
        merged.add(
            read_dcp(
                root,
                check_files=check_files,
                listing=listing.data.get(r, {}),  # its own files: linear in the ranks
                metadata_file=rank_metadata_name(r),
            )
        )
    merged.check_replicas(listing.tree if not check_files else None)
    # every marker there and the missing ones verify should name
    markers = [rank_metadata_name(r) for r in sorted([*listing.metadata, *missing])]
    # rows a rank the names tell of is missing from explain themselves; others are a trailing rank's
    tensors = merged.tensors()
    gap = None if missing else _tail_gap(tensors)
    if gap is not None:
        if check_files:
            raise _trailing_rank_missing(root, world, gap)
        markers.append(rank_metadata_name(world))  # verify names it as a missing marker
    files = merged.files
    for r, names in listing.data.items():  # data of a rank whose metadata is missing
        for name, size in names.items():
            files.setdefault(name, FileInfo(name, size, r))
    return Manifest(
        root=root,
        format="dcp",
        layout=LAYOUT,
        tensors=tensors,
        objects=merged.objects,
        files=dict(sorted(files.items())),
        world_size=world,
        paths=merged.paths,
        markers=tuple(markers),
        notes=(
            "saved without global metadata (dcp.save use_collectives=False): the "
            f"__<rank>.metadata of {len(listing.metadata)} rank(s) merged; `ckpt reshard` "
            "writes a DCP with one global .metadata, which torch's dcp.load needs",
        ),
        details=merged.details,
        data_root=root,
        aux_files=listing.aux_files(),
        marker_digests=merged.digests,
    )


Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class _Copy:
    """Where one rank's copy of an entry is stored."""

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()  # as Chunk.transforms

    @property
    def rank(self) -> int | None:
        return rank_of(self.file)


class _Merge:
    """Rank manifests merged in rank order; each entry a later rank stored again is paired
    with the first copy for :meth:`check_replicas`."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._tensors: dict[str, TensorEntry] = {}
        self._chunks: dict[str, list[Chunk]] = {}
        self._boxes: dict[str, dict[Box, Chunk]] = {}  # FQN -> box -> its first copy
        self._where: dict[str, str] = {}  # FQN -> the metadata file that first described it
        self.objects: dict[str, ObjectEntry] = {}
        self.pairs: list[tuple[str, Box | None, _Copy, _Copy]] = []  # (FQN, box, first, again)
        self.files: dict[str, FileInfo] = {}
        self.paths: dict[str, tuple[str, ...]] = {}
        self.digests: dict[str, str] = {}
        self.details: dict[str, Any] = {}

    def add(self, m: Manifest) -> None:
        (marker,) = m.markers
        for fqn, t in m.tensors.items():
            first = self._tensors.get(fqn)
            if first is None:
                self._conflict_kind(fqn, marker, fqn in self.objects)
                self._tensors[fqn] = t
                self._chunks[fqn] = []
                self._boxes[fqn] = {}
                self._where[fqn] = marker
            elif (first.dtype, first.shape) != (t.dtype, t.shape):
                raise self._differ(
                    fqn,
                    marker,
                    f"{first.dtype} {list(first.shape)} in one, {t.dtype} {list(t.shape)} in "
                    "the other",
                )
            chunks, boxes = self._chunks[fqn], self._boxes[fqn]
            for c in t.chunks:
                chunks.append(c)
                box = (c.offsets, c.sizes)
                kept = boxes.setdefault(box, c)
                if kept is not c and c.numel:
                    self.pairs.append((fqn, box, _copy_of(kept), _copy_of(c)))
        for fqn, o in m.objects.items():
            self._conflict_kind(fqn, marker, fqn in self._tensors)
            kept_object = self.objects.setdefault(fqn, o)
            self._where.setdefault(fqn, marker)
            if kept_object is not o and kept_object.file is not None and o.file is not None:
                self.pairs.append((fqn, None, _copy_of(kept_object), _copy_of(o)))
        self.files.update(m.files)
        self.paths.update(m.paths)
        self.digests.update(m.marker_digests)
        # each rank's writer drew its own save_id, so no one id names the checkpoint
        self.details.setdefault("dcp_version", m.details.get("dcp_version"))

    def tensors(self) -> dict[str, TensorEntry]:
        self._boxes.clear()  # merging is over; at a million chunks this is ~100 MB
        return {
            fqn: TensorEntry(fqn, t.dtype, t.shape, tuple(self._chunks[fqn]))
            for fqn, t in self._tensors.items()
        }

    def _conflict_kind(self, fqn: str, marker: str, other_kind: bool) -> None:
        if other_kind:
            raise self._differ(fqn, marker, "a tensor in one, a non-tensor value in the other")

    def _differ(self, fqn: str, marker: str, how: str) -> CorruptCheckpointError:
        first = storage.join(self.root, self._where[fqn])
        second = storage.join(self.root, marker)
        return CorruptCheckpointError(
            f"{first} and {second} describe {fqn!r} differently ({how}): the files come from "
            "different saves or one is damaged",
            path=second,
            fqn=fqn,
        )

    def check_replicas(self, sizes: Mapping[str, int] | None) -> None:
        """Every copy of an entry several ranks stored holds the first copy's value.

        Compared by the CRC-32 and size of each data record of the copy's ``torch.save``
        archive (read from its zip directory; ``data.pkl`` too for objects, whose value is
        the pickle; a tensor's pickle names its device, which may differ per rank).
        ``sizes`` (relative path -> size) limits the check to copies whose bytes are all
        there; None: every file was checked to hold them.

        Raises:
            CorruptCheckpointError: two copies differ (both files and ranks named).
        """
        if not self.pairs:
            return
        with storage.open_reader(self.root) as reader:
            known: dict[_Copy, tuple[tuple[str, int, int], ...]] = {}

            def fingerprint(c: _Copy, is_object: bool) -> tuple[tuple[str, int, int], ...]:
                found = known.get(c)
                if found is None:
                    archive = read_archive(reader, c.file, c.offset, c.length)
                    found = tuple(
                        sorted(
                            (name, rec.size, rec.crc32)
                            for name, rec in archive.records.items()
                            if name.startswith("data/") or (is_object and name == "data.pkl")
                        )
                    )
                return found

            for fqn, box, first, again in self.pairs:
                if not (_readable(first, sizes) and _readable(again, sizes)):
                    continue
                kept = fingerprint(first, box is None)
                known[first] = kept  # the first copy is compared with every rank's
                if fingerprint(again, box is None) != kept:
                    raise self._replica_differs(fqn, box, first, again)

    def _replica_differs(
        self, fqn: str, box: Box | None, a: _Copy, b: _Copy
    ) -> CorruptCheckpointError:
        what = f"chunk at {list(box[0])}" if box is not None and box[0] else "value"
        path_a, path_b = storage.join(self.root, a.file), storage.join(self.root, b.file)
        return CorruptCheckpointError(
            f"{path_a} (rank {a.rank}) and {path_b} (rank {b.rank}) hold different copies of "
            f"the replicated {what} of {fqn!r}; a replicated entry must be equal on every rank "
            "(the ranks diverged, or a file is damaged: `ckpt verify` checks each copy)",
            path=path_b,
            fqn=fqn,
            rank=b.rank,
        )


def _copy_of(entry: Chunk | ObjectEntry) -> _Copy:
    assert entry.file is not None
    return _Copy(entry.file, entry.offset, entry.length, entry.transforms)


def _readable(c: _Copy, sizes: Mapping[str, int] | None) -> bool:
    if c.transforms:
        # its archive is inside a transformed stream: not compared here (the stored bytes may
        # differ where the values do not: a tensor's pickle names its rank's device); every
        # verb that reads it refuses it first (formats.stream_transforms)
        return False
    if sizes is None:
        return True
    size = sizes.get(c.file)
    return size is not None and c.offset + c.length <= size


@dataclass(frozen=True)
class _Gap:
    fqn: str
    shape: tuple[int, ...]
    dim: int
    end: int  # the chunks reach this index along ``dim``, short of ``shape[dim]``


def _tail_gap(tensors: Mapping[str, TensorEntry]) -> _Gap | None:
    """The first tensor whose stored chunks stop short of the end of a dimension: the rows a
    missing trailing rank held (ranks hold the tails of sharded dimensions)."""
    for t in tensors.values():
        if not t.shape or t.numel == 0:
            continue
        stored = [c for c in t.chunks if c.numel]
        for d, n in enumerate(t.shape):
            end = max((c.offsets[d] + c.sizes[d] for c in stored), default=0)
            if end < n:
                return _Gap(t.fqn, t.shape, d, end)
    return None


def _trailing_rank_missing(root: str, world: int, gap: _Gap) -> IncompleteCheckpointError:
    path = storage.join(root, rank_metadata_name(world))
    return IncompleteCheckpointError(
        f"{path}: missing: the ranks' metadata cover {gap.fqn!r} (shape {list(gap.shape)}) "
        f"only up to index {gap.end} of dim {gap.dim}, so rank {world} (and any after it) "
        f"saved the rest, and its __{world}.metadata and __{world}_*.distcp are gone; "
        "restore them or use another checkpoint",
        path=path,
        fqn=gap.fqn,
        rank=world,
    )


def rank_metadata_ranks(names: Sequence[str]) -> list[int]:
    """The ranks whose ``__<rank>.metadata`` is among ``names``, sorted."""
    return sorted(int(m.group(1)) for n in names if (m := RANK_METADATA_FILE.match(n)))


class DcpRankLocalLayout(DirectoryLayout):
    name = LAYOUT
    description = (
        "DCP directory saved without global metadata (use_collectives=False): "
        "__<rank>.metadata + __<rank>_<n>.distcp"
    )

    def probe_names(self, path: str, names: list[str]) -> str | None:
        if ".metadata" in names:
            return "has a global .metadata (a plain DCP directory)"
        if not rank_metadata_ranks(names):
            return "no __<rank>.metadata files"
        return None

    def read_manifest(self, path: str) -> Manifest:
        return read_rank_local(path)

    def read_manifest_unchecked(self, path: str) -> Manifest:
        return read_rank_local(path, check_files=False)


register(DcpRankLocalLayout())
