"""``ckptools.verify``: prove that a checkpoint is whole, or name what is wrong with it.

Two levels, each reporting every problem it finds as a :class:`Finding` (never stopping at the
first one, never raising for damage):

* **structure** (``quick=True`` stops here; metadata and ``stat`` only, seconds at any size): the
  commit marker is present; every referenced file exists and is long enough for every recorded
  byte range; items in one file do not overlap; each tensor's chunks tile its global shape with no
  gap and no overlap (:func:`tiling_problems`, near-linear in the number of chunks); a safetensors
  index and its shards agree.
* **content**: every chunk is read once, streaming, in blocks (memory = ``workers × block``),
  files in parallel: each DCP item's ``torch.save`` archive is parsed (its pickle through the
  allowlist: tensors only, objects are never unpickled) and must hold a tensor of the recorded
  dtype and shape; the CRC-32 that the zip format stores for every record is recomputed, so a
  flipped bit is found and named (file, FQN, chunk, rank); ``check_finite`` counts NaN/Inf per
  tensor; a checksum manifest (:mod:`ckptools.verify.checksums`), when present, is checked per
  chunk and per file.

``against=`` adds a :func:`ckptools.diff` of the model against another checkpoint.

Example:
    >>> import ckptools
    >>> report = ckptools.verify("checkpoints/step-1000")  # doctest: +SKIP
    >>> report.ok, [f.message for f in report.findings]  # doctest: +SKIP
    (True, [])
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ckptools import collective
from ckptools.core import dtypes
from ckptools.core.crc32 import crc32
from ckptools.core.manifest import Chunk, Manifest, TensorEntry
from ckptools.engine.reader import prefetch_archive
from ckptools.errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
    UsageError,
)
from ckptools.formats import safe_pickle, torch_archive
from ckptools.io import storage
from ckptools.io.storage import Reader, open_reader
from ckptools.tunables import WORKERS_ENV, env_int
from ckptools.verify.checksums import (
    CHECKSUM_FILE,
    Checksums,
    FileSum,
    ItemKey,
    ItemSum,
    checksum_path,
    load_checksums,
    new_hasher,
)

if TYPE_CHECKING:
    from ckptools.diff import DiffReport

log = logging.getLogger(__name__)

FindingKind = Literal[
    "missing_file",  # a file the metadata refers to does not exist
    "truncated",  # a file ends before a recorded byte range
    "no_marker",  # the commit marker (.metadata, index) is missing: the save never finished
    "metadata",  # the marker or metadata cannot be read or is inconsistent
    "unsafe",  # the metadata asks to run code (refused, never run)
    "corrupt",  # another inconsistency found while reading the manifest
    "tiling",  # a tensor's chunks leave a gap, overlap, or lie outside its shape
    "overlap",  # two items share bytes of one file
    "index",  # a safetensors index and its shards disagree
    "unreadable",  # a chunk's archive cannot be parsed
    "dtype_shape",  # a chunk holds another dtype or shape than the metadata records
    "crc",  # a zip record's CRC-32 does not match its bytes
    "nonfinite",  # NaN/Inf values (check_finite)
    "checksum",  # bytes differ from the checksum manifest
]

#: Bytes per read: big enough that syscall and per-block Python work stay under 1% of the time
#: spent in crc32/hash; small enough that ``workers`` buffers stay a few tens of MiB.
DEFAULT_BLOCK_BYTES = 8 * 2**20
BLOCK_BYTES_ENV = "CKPTOOLS_VERIFY_BLOCK_BYTES"
#: Threads reading files in parallel; zlib's crc32 releases the GIL, so threads scale until
#: the disk (or the cores) is saturated. 4 keeps a laptop responsive.
DEFAULT_WORKERS = min(4, os.cpu_count() or 1)
#: Gaps between wanted byte ranges shorter than this are read through rather than skipped: one
#: sequential read beats a seek for small gaps (zip headers between DCP items).
_SKIP_GAP_BYTES = 1 * 2**20
_ZIP_MAGIC = b"PK\x03\x04"


def resolve_workers(workers: int | None) -> int:
    """``workers`` argument > ``CKPTOOLS_WORKERS`` > :data:`DEFAULT_WORKERS`."""
    if workers is not None:
        if workers < 1:
            raise UsageError(f"workers={workers}: expected at least 1")
        return workers
    return env_int(WORKERS_ENV, DEFAULT_WORKERS)


def resolve_block_bytes() -> int:
    """``CKPTOOLS_VERIFY_BLOCK_BYTES`` > :data:`DEFAULT_BLOCK_BYTES` (rounded to 64 bytes)."""
    value = env_int(BLOCK_BYTES_ENV, DEFAULT_BLOCK_BYTES)
    return max(64, value - value % 64)


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem: what kind, a message naming file/FQN/rank, and those facts as fields."""

    kind: FindingKind
    message: str
    file: str | None = None
    fqn: str | None = None
    rank: int | None = None
    chunk: tuple[int, ...] | None = None  # offsets of the chunk in the global tensor

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "message": self.message,
            "file": self.file,
            "fqn": self.fqn,
            "rank": self.rank,
            "chunk": list(self.chunk) if self.chunk is not None else None,
        }


@dataclass(frozen=True)
class Digests:
    """Digests computed during a content check (what a checksum manifest records)."""

    items: dict[ItemKey, ItemSum]
    files: dict[str, FileSum]


@dataclass(frozen=True)
class VerifyReport:
    """The result of :func:`verify`.

    Attributes:
        findings: every problem found; empty when the checkpoint is whole.
        checksum_file: where the checksum manifest is (or would be written).
        checksums_checked: whether a checksum manifest was found and checked.
        diff: the comparison with ``against``, when asked for.
    """

    path: str
    format: str | None
    layout: str | None
    quick: bool
    check_finite: bool
    findings: tuple[Finding, ...]
    tensors: int = 0
    chunks: int = 0
    files: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    checksum_file: str | None = None
    checksums_checked: bool = False
    diff: DiffReport | None = None
    digests: Digests | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """No findings, and no differences from ``against``."""
        return not self.findings and (self.diff is None or self.diff.identical)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "layout": self.layout,
            "ok": self.ok,
            "quick": self.quick,
            "check_finite": self.check_finite,
            "tensors": self.tensors,
            "chunks": self.chunks,
            "files": self.files,
            "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 4),
            "checksum_file": self.checksum_file,
            "checksums_checked": self.checksums_checked,
            "findings": [f.to_dict() for f in self.findings],
            "diff": self.diff.to_dict() if self.diff is not None else None,
        }


# --------------------------------------------------------------------------------------------------
# Tiling (pure)
# --------------------------------------------------------------------------------------------------

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass(frozen=True, slots=True)
class TilingProblem:
    """Why a set of boxes does not tile a shape exactly once.

    ``kind``: ``"ndim"`` (a box has another number of dims), ``"outside"`` (a box reaches out of
    the shape), ``"overlap"`` (``box`` and ``other`` share elements), ``"gap"`` (boxes are
    disjoint and inside but cover only ``covered`` of ``numel`` elements).
    """

    kind: Literal["ndim", "outside", "overlap", "gap"]
    box: Box | None = None
    other: Box | None = None
    covered: int = 0
    numel: int = 0


def _boxes_overlap(a: Box, b: Box) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_
        for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1], strict=True)
    )


def tiling_problems(shape: Sequence[int], boxes: Iterable[Box]) -> list[TilingProblem]:
    """What keeps ``boxes`` from covering every element of ``shape`` exactly once.

    Identical boxes (replicas) count once; empty boxes are ignored. Cost is
    ``O(n log n + k)`` for ``n`` boxes, ``k`` being the pairs that overlap along the sweep
    dimension (the dim with the most distinct offsets: for dim-0 sharding ``k = 0``; for a
    ``p × q`` grid, ``k ≈ n·q``), so millions of chunks are checked in seconds.

    Example:
        >>> tiling_problems((4, 2), [((0, 0), (2, 2)), ((2, 0), (2, 2))])
        []
        >>> tiling_problems((4, 2), [((0, 0), (3, 2)), ((2, 0), (2, 2))])[0].kind
        'overlap'
    """
    shape = tuple(shape)
    numel = math.prod(shape)
    ndim = len(shape)
    problems: list[TilingProblem] = []
    unique: dict[Box, int] = {}  # box -> volume; replicas count once
    for offsets, sizes in boxes:  # hot loop: millions of chunks at scale, so no generators
        box = (tuple(offsets), tuple(sizes))
        if len(box[0]) != ndim or len(box[1]) != ndim:
            problems.append(TilingProblem("ndim", box, numel=numel))
            continue
        volume = 1
        for o, s, d in zip(box[0], box[1], shape):  # noqa: B905  (lengths checked above)
            if o < 0 or s < 0 or o + s > d:
                volume = -1
                break
            volume *= s
        if volume < 0:
            problems.append(TilingProblem("outside", box, numel=numel))
        elif volume:
            unique[box] = volume
    valid = list(unique)
    covered = sum(unique.values())
    overlap = _first_overlap(valid, range(ndim))
    if overlap is not None:
        problems.append(TilingProblem("overlap", overlap[0], overlap[1], covered, numel))
    elif covered != numel:
        problems.append(TilingProblem("gap", covered=covered, numel=numel))
    return problems


def _first_overlap(boxes: list[Box], dims: Sequence[int]) -> tuple[Box, Box] | None:
    """A pair of overlapping boxes among distinct ``boxes``, or None.

    Along the dim with the most distinct offsets, boxes whose intervals are identical form a
    group; when groups' intervals are disjoint (every grid sharding), only boxes of one group
    can overlap, so each group is checked on the remaining dims (linear overall). Otherwise a
    sweep compares each box with those whose intervals are still open.
    """
    if len(boxes) < 2:
        return None
    if not dims:
        return boxes[1], boxes[0]  # distinct boxes agreeing on every dim cannot exist
    d = max(dims, key=lambda k: len({b[0][k] for b in boxes}))
    groups: dict[tuple[int, int], list[Box]] = {}
    for b in boxes:
        groups.setdefault((b[0][d], b[0][d] + b[1][d]), []).append(b)
    spans = sorted(groups)
    if all(a[1] <= b[0] for a, b in itertools.pairwise(spans)):
        rest = [k for k in dims if k != d]
        for span in spans:
            found = _first_overlap(groups[span], rest)
            if found is not None:
                return found
        return None
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][d])
    active: list[tuple[int, int]] = []  # heap of (end along d, box index)
    for i in order:
        box = boxes[i]
        start = box[0][d]
        while active and active[0][0] <= start:
            heapq.heappop(active)
        for _, j in active:
            if _boxes_overlap(box, boxes[j]):
                return box, boxes[j]
        heapq.heappush(active, (start + box[1][d], i))
    return None


# --------------------------------------------------------------------------------------------------
# Items: every byte range the metadata records (tensor chunks and DCP objects)
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Item:
    key: ItemKey
    file: str
    offset: int
    length: int
    encoding: str
    rank: int | None
    tensor: TensorEntry | None = None
    chunk: Chunk | None = None

    @property
    def fqn(self) -> str:
        return self.key[0]

    @property
    def end(self) -> int:
        return self.offset + self.length

    def where(self) -> str:
        parts = [f"{self.fqn!r}"]
        if self.chunk is not None and self.chunk.offsets:
            parts.append(f"chunk at {list(self.chunk.offsets)}")
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        return ", ".join(parts)


def _items(manifest: Manifest) -> list[_Item]:
    out: list[_Item] = []
    for t in manifest.tensors.values():
        for c in t.chunks:
            out.append(
                _Item((t.fqn, c.offsets), c.file, c.offset, c.length, c.encoding, c.rank, t, c)
            )
    for o in manifest.objects.values():
        if o.file is not None and not o.has_value:
            info = manifest.files.get(o.file)
            rank = info.rank if info is not None else None
            out.append(_Item((o.fqn, None), o.file, o.offset, o.length, o.encoding, rank))
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


def _read(path: str, format: str | None) -> tuple[Manifest | None, list[Finding]]:
    from ckptools.layouts import detect
    from ckptools.layouts.dcp import read_dcp

    layout = detect(path, format)  # a missing path or unknown format is an error, not a finding
    try:
        if layout.name == "dcp":
            # check_files=False: report every missing or short file below, not just the first.
            return read_dcp(path, check_files=False), []
        return layout.read_manifest(path), []
    except UnsupportedCheckpointError:
        raise
    except CkptError as e:
        return None, [_finding_from_error(e)]


# --------------------------------------------------------------------------------------------------
# Structure
# --------------------------------------------------------------------------------------------------


def _structure(
    manifest: Manifest, items: list[_Item], root: str
) -> tuple[list[Finding], dict[str, int], set[int]]:
    """Findings, the size of each present file, and the ids of items that cannot be read."""
    findings: list[Finding] = []
    for marker in manifest.markers:
        if not storage.exists(storage.join(root, marker)):
            findings.append(
                Finding(
                    "no_marker",
                    f"{storage.join(root, marker)}: commit marker is missing: the save never "
                    "finished; do not use this checkpoint",
                    marker,
                )
            )
    # one listing on an object store, a stat per file on a disk
    sizes = storage.file_sizes(root, sorted({*manifest.files, *(i.file for i in items)}))
    by_file: dict[str, list[_Item]] = {}
    for item in items:
        by_file.setdefault(item.file, []).append(item)
    bad: set[int] = set()
    for rel, file_items in by_file.items():
        full = storage.join(root, rel)
        if rel not in sizes:
            bad.update(id(i) for i in file_items)
            rank = next((i.rank for i in file_items if i.rank is not None), None)
            tensors = {i.fqn for i in file_items}
            findings.append(
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
                    file_items[0].chunk.offsets if file_items[0].chunk else None,
                )
            )
            continue
        size = sizes[rel]
        past = [i for i in file_items if i.end > size]
        if past:
            bad.update(id(i) for i in past)
            first = min(past, key=lambda i: i.offset)
            findings.append(
                Finding(
                    "truncated",
                    f"{full}: file is truncated: {size} bytes, but the metadata records data up "
                    f"to byte {max(i.end for i in past)}; {len(past)} item(s) reach past the "
                    f"end, the first {first.where()} at bytes {first.offset}..{first.end}; the "
                    "save or copy was cut short",
                    rel,
                    first.fqn,
                    first.rank,
                    first.chunk.offsets if first.chunk else None,
                )
            )
        if manifest.format in ("dcp", "safetensors"):
            # torch.save files legitimately share storages (tied weights); these formats never do.
            ordered = sorted((i for i in file_items if i.length), key=lambda i: i.offset)
            for a, b in itertools.pairwise(ordered):
                if b.offset < a.end:
                    findings.append(
                        Finding(
                            "overlap",
                            f"{full}: {a.where()} at bytes {a.offset}..{a.end} and {b.where()} at "
                            f"{b.offset}..{b.end} share bytes; the metadata is damaged",
                            rel,
                            b.fqn,
                            b.rank,
                            b.chunk.offsets if b.chunk else None,
                        )
                    )
                    break
    for t in manifest.tensors.values():
        findings.extend(_tiling_findings(t))
    findings.extend(_index_findings(manifest, root))
    return findings, sizes, bad


def _tiling_findings(t: TensorEntry) -> list[Finding]:
    problems = tiling_problems(t.shape, ((c.offsets, c.sizes) for c in t.chunks))
    if not problems:
        return []
    by_box = {(c.offsets, c.sizes): c for c in t.chunks}
    out = []
    for p in problems:
        chunk = by_box.get(p.box) if p.box is not None else None
        rank = chunk.rank if chunk is not None else None
        file = chunk.file if chunk is not None else None
        shape = list(t.shape)
        if p.kind == "gap":
            why = (
                f"its chunks cover {p.covered} of {p.numel} elements (a chunk is missing from "
                "the metadata)"
            )
        elif p.kind == "overlap":
            assert p.box is not None and p.other is not None
            why = (
                f"chunks at {list(p.other[0])} (size {list(p.other[1])}) and {list(p.box[0])} "
                f"(size {list(p.box[1])}) overlap"
            )
        else:
            assert p.box is not None
            why = f"chunk at {list(p.box[0])} of size {list(p.box[1])} lies outside the shape"
        out.append(
            Finding(
                "tiling",
                f"{t.fqn!r} (shape {shape}): {why}"
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
    """Tensors in safetensors shards that the index does not list (the reverse is checked when
    the manifest is read)."""
    import json

    if manifest.format != "safetensors" or not manifest.markers:
        return []
    index = storage.join(root, manifest.markers[0])
    try:
        weight_map = json.loads(storage.read_bytes(index))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
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
                    manifest.markers[0],
                    fqn,
                )
            )
    return out


# --------------------------------------------------------------------------------------------------
# Content: one streaming pass per file
# --------------------------------------------------------------------------------------------------


class _Sink:
    """Receives consecutive slices of one byte range; the base class only has them read (a raw
    safetensors chunk has no checksum of its own, but an unreadable sector must still show)."""

    def feed(self, data: memoryview) -> None:
        pass

    def finish(self) -> None:
        pass


_READ_ONLY = _Sink()


class _Crc(_Sink):
    def __init__(self, expected: int, on_mismatch: Callable[[int], None]) -> None:
        self.expected = expected
        self.crc = 0
        self.on_mismatch = on_mismatch

    def feed(self, data: memoryview) -> None:
        self.crc = crc32(data, self.crc)

    def finish(self) -> None:
        if self.crc != self.expected:
            self.on_mismatch(self.crc)


class _Hash(_Sink):
    def __init__(self) -> None:
        self.h = new_hasher()
        self.digest = b""

    def feed(self, data: memoryview) -> None:
        self.h.update(data)

    def finish(self) -> None:
        self.digest = self.h.digest()


class _Finite(_Sink):
    """Counts NaN and Inf in a stream of one floating dtype's bytes (elements may straddle
    blocks)."""

    def __init__(self, dtype_name: str, counts: list[int], on_found: Callable[[], None]) -> None:
        import torch

        dt = dtypes.dtype(dtype_name)
        component = {"complex128": "float64", "complex64": "float32", "complex32": "float16"}
        name = component.get(dtype_name, dtype_name)
        self.torch_dtype = getattr(torch, name)
        self.itemsize = dtypes.dtype(name).itemsize
        # Narrow floats go through float32: isnan/isinf exist for every dtype that way.
        self.upcast = dt.itemsize < 4 or name.startswith("float8")
        self.counts = counts  # [nan, inf]
        self.on_found = on_found
        self.carry = b""

    def feed(self, data: memoryview) -> None:
        if self.carry:
            need = self.itemsize - len(self.carry)
            self.carry += bytes(data[:need])
            data = data[need:]
            if len(self.carry) < self.itemsize:
                return
            self._count(memoryview(bytearray(self.carry)))
            self.carry = b""
        whole = len(data) - len(data) % self.itemsize
        if whole:
            self._count(data[:whole])
        if whole < len(data):
            self.carry = bytes(data[whole:])

    def _count(self, data: memoryview) -> None:
        import torch

        t = torch.frombuffer(data, dtype=self.torch_dtype)
        if self.upcast:
            t = t.float()
        if bool(torch.isfinite(t).all()):
            return
        self.counts[0] += int(torch.isnan(t).sum())
        self.counts[1] += int(torch.isinf(t).sum())
        self.on_found()


@dataclass(slots=True)
class _Segment:
    start: int
    end: int
    sink: _Sink


@dataclass
class _FileResult:
    findings: list[Finding] = field(default_factory=list)
    item_digests: dict[ItemKey, ItemSum] = field(default_factory=dict)
    file_digest: FileSum | None = None
    nonfinite: dict[str, list[int]] = field(default_factory=dict)
    nonfinite_where: dict[str, _Item] = field(default_factory=dict)
    bytes_read: int = 0


class _Scanner:
    """Shared state of one content check."""

    def __init__(
        self,
        reader: Reader,
        *,
        check_finite: bool,
        digests: bool,
        block: int,
        progress: Any,
    ) -> None:
        self.reader = reader
        self.check_finite = check_finite
        self.digests = digests
        self.block = block
        self.progress = progress
        self._local = threading.local()

    def buffer(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(bytearray(self.block))
        return buf  # type: ignore[no-any-return]

    def scan_file(self, rel: str, items: list[_Item], size: int, whole_file: bool) -> _FileResult:
        res = _FileResult()
        segments: list[_Segment] = []
        full = storage.join(self.reader.root, rel)
        try:
            self._archive_segments(rel, items, size, full, segments, res)
        except CkptError as e:
            res.findings.append(Finding("unreadable", f"{full}: {e.message}", rel, e.fqn, e.rank))
        hashes: dict[int, _Hash] = {}
        for item in items:
            if item.encoding == "torch_save":
                self._item_segments(item, full, segments, res)
            else:
                segments.append(_Segment(item.offset, item.end, _READ_ONLY))
                if self.check_finite and item.tensor is not None:
                    self._finite_segment(item, item.offset, item.length, segments, res)
            if self.digests:
                h = hashes[id(item)] = _Hash()
                segments.append(_Segment(item.offset, item.end, h))
        segments.sort(key=lambda s: s.start)
        primaries: list[tuple[int, int, _Hash]] = []
        if whole_file:
            last = 0
            for item in sorted(items, key=lambda i: (i.offset, i.length)):
                if item.offset >= last:
                    primaries.append((item.offset, item.end, hashes[id(item)]))
                    last = item.end
        file_hasher = new_hasher() if whole_file else None
        try:
            self._stream(rel, size, segments, primaries, file_hasher, res)
        except CkptError as e:
            res.findings.append(Finding("unreadable", f"{full}: {e.message}", rel))
            return res
        if self.digests:
            for item in items:
                digest = hashes[id(item)].digest.hex()
                res.item_digests[item.key] = ItemSum(item.file, item.offset, item.length, digest)
        if file_hasher is not None:
            res.file_digest = FileSum(size, file_hasher.hexdigest())
        return res

    # -- phase 1: parse archives, lay out what each byte range must satisfy ---------------------

    def _archive_segments(
        self,
        rel: str,
        items: list[_Item],
        size: int,
        full: str,
        segments: list[_Segment],
        res: _FileResult,
    ) -> None:
        """A whole-file ``torch.save`` archive (``model.pt``, ``meta.pt``): check its records."""
        if any(i.encoding == "torch_save" for i in items) or rel.endswith(".safetensors"):
            return
        if size < 22 or self.reader.read(rel, 0, 4) != _ZIP_MAGIC:
            return
        archive = torch_archive.read_archive(self.reader, rel, 0, size)
        for rec in archive.records.values():
            start = torch_archive.record_data_offset(self.reader, archive, rec)
            end = start + rec.size

            def mismatch(got: int, rec: Any = rec, start: int = start, end: int = end) -> None:
                hit = [i for i in items if i.offset < end and start < i.end]
                who = (
                    "tensor " + ", ".join(repr(i.fqn) for i in hit[:5])
                    if hit
                    else f"record {rec.name}"
                )
                res.findings.append(
                    Finding(
                        "crc",
                        f"{full}: CRC-32 mismatch in the bytes of {who} (zip record "
                        f"{rec.name}, bytes {start}..{end}): stored {rec.crc32:#010x}, computed "
                        f"{got:#010x}; the file changed after torch wrote it (bit rot or a "
                        "partial overwrite)",
                        rel,
                        hit[0].fqn if hit else None,
                    )
                )

            segments.append(_Segment(start, end, _Crc(rec.crc32, mismatch)))

    def _item_segments(
        self, item: _Item, full: str, segments: list[_Segment], res: _FileResult
    ) -> None:
        """A DCP item: its archive's records (CRC), and the tensor it must hold."""
        rel = item.file
        chunk_at = item.chunk.offsets if item.chunk is not None else None
        try:
            prefetch_archive(self.reader, rel, item.offset, item.length)
            archive = torch_archive.read_archive(self.reader, rel, item.offset, item.length)
            data_record = None
            ref = None
            if item.tensor is not None and item.chunk is not None:
                ref = torch_archive.load_pickle(self.reader, archive)
                problem = self._check_ref(item, ref)
                if problem:
                    res.findings.append(
                        Finding(
                            "dtype_shape", f"{full}: {problem}", rel, item.fqn, item.rank, chunk_at
                        )
                    )
                    ref = None
                else:
                    assert isinstance(ref, safe_pickle.TensorRef)
                    data_record = f"data/{ref.storage.key}"
            for rec in archive.records.values():
                start = torch_archive.record_data_offset(self.reader, archive, rec)
                end = start + rec.size

                def mismatch(got: int, rec: Any = rec, start: int = start, end: int = end) -> None:
                    what = "tensor data" if rec.name.startswith("data/") else f"record {rec.name}"
                    res.findings.append(
                        Finding(
                            "crc",
                            f"{full}: CRC-32 mismatch in the {what} of {item.where()} (bytes "
                            f"{start}..{end}): stored {rec.crc32:#010x}, computed {got:#010x}; "
                            "the file changed after torch wrote it (bit rot or a partial "
                            "overwrite)",
                            rel,
                            item.fqn,
                            item.rank,
                            chunk_at,
                        )
                    )

                segments.append(_Segment(start, end, _Crc(rec.crc32, mismatch)))
                if rec.name == data_record and ref is not None and self.check_finite:
                    assert item.tensor is not None and item.chunk is not None
                    itemsize = item.tensor.itemsize
                    first = start + ref.storage_offset * itemsize
                    n = item.chunk.numel * itemsize
                    if not ref.is_contiguous:  # the storage span: whole rows of the base tensor
                        n = rec.size - ref.storage_offset * itemsize
                    if first + n > end:
                        res.findings.append(
                            Finding(
                                "dtype_shape",
                                f"{full}: {item.where()}: the tensor needs bytes "
                                f"{first}..{first + n} but its storage record ends at {end}",
                                rel,
                                item.fqn,
                                item.rank,
                                chunk_at,
                            )
                        )
                        continue
                    self._finite_segment(item, first, n, segments, res)
        except CkptError as e:
            res.findings.append(
                Finding(
                    "unreadable",
                    f"{full}: cannot read {item.where()} at bytes {item.offset}..{item.end}: "
                    f"{e.message}",
                    rel,
                    item.fqn,
                    item.rank,
                    chunk_at,
                )
            )

    @staticmethod
    def _check_ref(item: _Item, ref: Any) -> str | None:
        assert item.tensor is not None and item.chunk is not None
        if not isinstance(ref, safe_pickle.TensorRef):
            return f"the item of {item.where()} holds no tensor"
        if ref.dtype != item.tensor.dtype or tuple(ref.shape) != item.chunk.sizes:
            return (
                f"the item of {item.where()} holds a {ref.dtype} tensor of shape "
                f"{list(ref.shape)}; the metadata says {item.tensor.dtype} "
                f"{list(item.chunk.sizes)}"
            )
        return None

    def _finite_segment(
        self, item: _Item, start: int, length: int, segments: list[_Segment], res: _FileResult
    ) -> None:
        assert item.tensor is not None
        dtype = item.tensor.dtype
        if not (dtypes.dtype(dtype).is_floating or dtype.startswith("complex")) or length == 0:
            return
        counts = res.nonfinite.setdefault(item.fqn, [0, 0])

        def found() -> None:
            res.nonfinite_where.setdefault(item.fqn, item)

        segments.append(_Segment(start, start + length, _Finite(dtype, counts, found)))

    # -- phase 2: one sequential pass ------------------------------------------------------------

    def _ranges(self, segments: list[_Segment], size: int, whole: bool) -> list[tuple[int, int]]:
        if whole:
            return [(0, size)] if size else []
        ranges: list[tuple[int, int]] = []
        for s in segments:  # sorted by start
            if s.end <= s.start:
                continue
            if ranges and s.start <= ranges[-1][1] + _SKIP_GAP_BYTES:
                if s.end > ranges[-1][1]:
                    ranges[-1] = (ranges[-1][0], s.end)
            else:
                ranges.append((s.start, s.end))
        return ranges

    def _stream(
        self,
        rel: str,
        size: int,
        segments: list[_Segment],
        primaries: list[tuple[int, int, _Hash]],
        file_hasher: Any,
        res: _FileResult,
    ) -> None:
        buf = self.buffer()
        pending = 0  # index of the next segment not yet active
        active: list[_Segment] = []
        hashed_to = 0  # file hasher position
        prim = 0
        for lo, hi in self._ranges(segments, size, file_hasher is not None):
            pos = lo
            while pos < hi:
                n = min(self.block, hi - pos)
                view = buf[:n]
                self.reader.readinto(rel, pos, view)
                end = pos + n
                while pending < len(segments) and segments[pending].start < end:
                    active.append(segments[pending])
                    pending += 1
                still = []
                for s in active:
                    a, b = max(s.start, pos), min(s.end, end)
                    if a < b:
                        s.sink.feed(view[a - pos : b - pos])
                    if s.end <= end:
                        s.sink.finish()
                    else:
                        still.append(s)
                active = still
                if file_hasher is not None:
                    # The file's bytes in order, each recorded item replaced by its digest.
                    while hashed_to < end:
                        if prim < len(primaries) and primaries[prim][0] <= hashed_to:
                            p_end = primaries[prim][1]
                            if p_end > end:
                                break
                            file_hasher.update(primaries[prim][2].digest)
                            hashed_to = p_end
                            prim += 1
                        else:
                            gap_end = min(
                                end, primaries[prim][0] if prim < len(primaries) else size
                            )
                            file_hasher.update(view[hashed_to - pos : gap_end - pos])
                            hashed_to = gap_end
                res.bytes_read += n
                self.progress.update(n)
                pos = end
        for s in segments[pending:]:  # empty ranges at the very end
            s.sink.finish()
        for s in active:
            s.sink.finish()
        if file_hasher is not None:
            for p in primaries[prim:]:  # empty items at the end of the file
                file_hasher.update(p[2].digest)


# --------------------------------------------------------------------------------------------------
# Checksum manifest comparison
# --------------------------------------------------------------------------------------------------


def _compare_checksums(
    sums: Checksums, digests: Digests, items: list[_Item], checked_files: set[str]
) -> list[Finding]:
    out: list[Finding] = []
    by_key = {i.key: i for i in items}
    item_files_bad: set[str] = set()
    for key, rec in sums.items.items():
        item = by_key.get(key)
        cur = digests.items.get(key)
        label = item.where() if item is not None else repr(key[0])
        chunk_at = key[1]
        if item is None:
            out.append(
                Finding(
                    "checksum",
                    f"{sums.path}: records {label}"
                    + (f" chunk at {list(chunk_at)}" if chunk_at else "")
                    + ", which the checkpoint no longer holds",
                    rec.file,
                    key[0],
                    None,
                    chunk_at,
                )
            )
            continue
        if cur is None:
            continue  # not read (its file is missing or short): reported already
        if (cur.file, cur.offset, cur.length) != (rec.file, rec.offset, rec.length):
            item_files_bad.add(cur.file)
            out.append(
                Finding(
                    "checksum",
                    f"{os.path.join(os.path.dirname(sums.path), cur.file)}: {label} is stored at "
                    f"bytes {cur.offset}..{cur.offset + cur.length} of {cur.file}, but the "
                    f"checksum manifest recorded {rec.offset}..{rec.offset + rec.length} of "
                    f"{rec.file}: the metadata changed since `ckpt checksum`",
                    cur.file,
                    key[0],
                    item.rank,
                    chunk_at,
                )
            )
        elif cur.digest != rec.digest:
            item_files_bad.add(cur.file)
            out.append(
                Finding(
                    "checksum",
                    f"{os.path.join(os.path.dirname(sums.path), cur.file)}: the bytes of {label} "
                    f"(bytes {cur.offset}..{cur.offset + cur.length}) do not match the checksum "
                    f"manifest ({cur.digest} != {rec.digest}): they changed since `ckpt "
                    "checksum`, or another chunk's bytes were put in their place",
                    cur.file,
                    key[0],
                    item.rank,
                    chunk_at,
                )
            )
    for key, item in by_key.items():
        if key not in sums.items and key in digests.items:
            out.append(
                Finding(
                    "checksum",
                    f"{sums.path}: has no checksum for {item.where()}; it was written for another "
                    "version of this checkpoint: rewrite it with `ckpt checksum`",
                    item.file,
                    item.fqn,
                    item.rank,
                    key[1],
                )
            )
    for rel, frec in sums.files.items():
        cur_file = digests.files.get(rel)
        if rel not in checked_files or rel in item_files_bad:
            continue  # missing or short files are reported by the structure check
        if cur_file is None:
            out.append(
                Finding("checksum", f"{sums.path}: records file {rel}, which is not read", rel)
            )
        elif cur_file.size != frec.size or cur_file.digest != frec.digest:
            out.append(
                Finding(
                    "checksum",
                    f"{os.path.join(os.path.dirname(sums.path), rel)}: file differs from the "
                    f"checksum manifest (size {cur_file.size} vs {frec.size}, digest "
                    f"{cur_file.digest} vs {frec.digest}) outside any chunk's bytes",
                    rel,
                )
            )
    return out


# --------------------------------------------------------------------------------------------------
# verify()
# --------------------------------------------------------------------------------------------------


@storage.accepts_storage_options
def verify(
    path: str,
    *,
    quick: bool = False,
    check_finite: bool = False,
    workers: int | None = None,
    against: str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    format: str | None = None,
    quiet: bool = False,
    distributed: bool = False,
    _collect_digests: bool = False,
    storage_options: storage.StorageOptions | None = None,
) -> VerifyReport:
    """Check that the checkpoint at ``path`` is whole; report every problem found.

    Damage is reported as findings, not raised: a missing or truncated rank file, a garbled or
    missing ``.metadata``, chunks that do not tile a tensor, a flipped bit (CRC-32), bytes that
    differ from the checksum manifest, NaN/Inf (with ``check_finite``). Code stored in the
    checkpoint is never run: pickles go through the allowlist and objects are not unpickled.

    Args:
        path: a checkpoint ckptools reads (DCP directory or a wrapper of one, safetensors file
            or directory, ``torch.save`` file or directory).
        quick: structure only (metadata and file sizes; seconds at any size).
        check_finite: count NaN and Inf per floating tensor (a finding per tensor that has any).
        workers: files read in parallel (default ``CKPTOOLS_WORKERS`` or up to 4).
        against: also compare the model with this checkpoint (see :func:`ckptools.diff`).
        atol: absolute tolerance for ``against`` (default: bit-exact).
        rtol: relative tolerance for ``against`` (default: bit-exact).
        format: force the layout of ``path`` (as ``ckpt inspect --format``).
        quiet: no progress bar.
        distributed: under torchrun (``torchrun -m ckptools verify``), or called by every rank
            of an initialised process group: the files to read are split over the ranks by
            bytes and the findings gathered, so every rank returns the report one process would
            (:mod:`ckptools.collective`). Off by default, because one rank of a training job
            calling ``verify`` alone is the common case.
        storage_options: fsspec options for URL paths (credentials, endpoint...), a mapping
            or its JSON text; see :func:`ckptools.io.storage.storage_options`.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is True when nothing was found (the same on
        every rank).

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        UnknownFormatError: ``path`` is no checkpoint ckptools recognises.
        UsageError: contradictory arguments (``quick`` with ``check_finite``).

    Example:
        >>> report = verify("checkpoints/step-1000", check_finite=True)  # doctest: +SKIP
        >>> for f in report.findings:  # doctest: +SKIP
        ...     print(f.kind, f.file, f.fqn, f.rank, f.message)
    """
    if quick and check_finite:
        raise UsageError("quick checks structure only; it cannot check values (drop --quick)")
    t0 = time.perf_counter()
    n_workers = resolve_workers(workers)
    block = resolve_block_bytes()
    ranks = collective.current(distributed)
    quiet = quiet or not ranks.is_root
    manifest, findings = _read(path, format)
    if manifest is None:
        diff_report = _diff(ranks, path, against, atol, rtol, format)
        return VerifyReport(
            path, None, None, quick, check_finite, tuple(findings),
            seconds=time.perf_counter() - t0, diff=diff_report,
        )  # fmt: skip
    root = manifest.data_dir()
    items = _items(manifest)
    structure, sizes, bad = _structure(manifest, items, root)
    findings.extend(structure)
    sums_path = checksum_path(manifest)
    sums: Checksums | None = None
    if storage.exists(sums_path) and not _collect_digests:
        try:
            sums = load_checksums(sums_path)
        except CorruptCheckpointError as e:
            findings.append(Finding("checksum", e.message, CHECKSUM_FILE))
    if sums is not None:
        for rel, rec in sums.files.items():
            if rel in sizes and sizes[rel] != rec.size:
                findings.append(
                    Finding(
                        "checksum",
                        f"{storage.join(root, rel)}: {sizes[rel]} bytes, but the checksum "
                        f"manifest recorded {rec.size}",
                        rel,
                    )
                )
    bytes_read = 0
    digests: Digests | None = None
    if not quick:
        from ckptools.layouts.dcp import require_plain

        require_plain(manifest)
        want_digests = _collect_digests or sums is not None
        files: dict[str, list[_Item]] = {}
        for item in items:
            if id(item) not in bad:
                files.setdefault(item.file, []).append(item)
        # Files whose every byte a checksum covers: data files (all present and long enough) and
        # the commit markers.
        whole = {rel for rel in manifest.files if rel in sizes}
        whole -= {i.file for i in items if id(i) in bad}
        if want_digests:
            for marker in manifest.markers:
                if marker in sizes or storage.exists(storage.join(root, marker)):
                    sizes.setdefault(marker, storage.size(storage.join(root, marker)))
                    whole.add(marker)
                    files.setdefault(marker, [])
        for rel in whole:
            files.setdefault(rel, [])
        results, bytes_read = _scan_shared(
            ranks, root, files, sizes, whole if want_digests else set(), check_finite,
            want_digests, block, n_workers, quiet,
        )  # fmt: skip
        nonfinite: dict[str, list[int]] = {}
        where: dict[str, _Item] = {}
        item_digests: dict[ItemKey, ItemSum] = {}
        file_digests: dict[str, FileSum] = {}
        for rel, res in results:
            findings.extend(res.findings)
            for fqn, counts in res.nonfinite.items():
                total = nonfinite.setdefault(fqn, [0, 0])
                total[0] += counts[0]
                total[1] += counts[1]
            for fqn, item in res.nonfinite_where.items():
                where.setdefault(fqn, item)
            item_digests.update(res.item_digests)
            if res.file_digest is not None:
                file_digests[rel] = res.file_digest
        for fqn in manifest.tensors:
            found = nonfinite.get(fqn)
            if found and (found[0] or found[1]):
                item = where[fqn]
                findings.append(
                    Finding(
                        "nonfinite",
                        f"{fqn!r}: {found[0]} NaN and {found[1]} Inf value(s) (first in "
                        f"{item.where()}, {item.file})",
                        item.file,
                        fqn,
                        item.rank,
                        item.chunk.offsets if item.chunk else None,
                    )
                )
        if want_digests:
            digests = Digests(item_digests, file_digests)
        if sums is not None and digests is not None:
            findings.extend(_compare_checksums(sums, digests, items, set(file_digests)))
    diff_report = _diff(ranks, path, against, atol, rtol, format)
    return VerifyReport(
        path=path,
        format=manifest.format,
        layout=manifest.layout,
        quick=quick,
        check_finite=check_finite,
        findings=tuple(findings),
        tensors=len(manifest.tensors),
        chunks=sum(len(t.chunks) for t in manifest.tensors.values()),
        files=len(manifest.files),
        bytes_read=bytes_read,
        seconds=time.perf_counter() - t0,
        checksum_file=sums_path,
        checksums_checked=sums is not None and not quick,
        diff=diff_report,
        digests=digests,
    )


def _diff(
    ranks: collective.Ranks,
    path: str,
    against: str | None,
    atol: float | None,
    rtol: float | None,
    format: str | None,
) -> DiffReport | None:
    """The comparison with ``against`` (rank 0 compares; every rank gets its report)."""
    if against is None:
        return None
    from ckptools.diff import diff

    return ranks.from_root(
        lambda: diff(path, against, atol=atol, rtol=rtol, format_a=format), "verify --against"
    )


def _scan(
    root: str,
    files: dict[str, list[_Item]],
    sizes: dict[str, int],
    whole: set[str],
    check_finite: bool,
    digests: bool,
    block: int,
    workers: int,
    quiet: bool,
) -> tuple[list[tuple[str, _FileResult]], int]:
    from ckptools.io.progress import ByteProgress

    order = sorted(files, key=lambda rel: -sizes.get(rel, 0))  # biggest first: even finish
    total = sum(sizes.get(rel, 0) for rel in order)
    with open_reader(root) as reader, ByteProgress(total, "verify", quiet=quiet) as bar:
        scanner = _Scanner(
            reader, check_finite=check_finite, digests=digests, block=block, progress=bar
        )

        def one(rel: str) -> tuple[str, _FileResult]:
            return rel, scanner.scan_file(rel, files[rel], sizes[rel], rel in whole)

        if workers == 1 or len(order) <= 1:
            results = [one(rel) for rel in order]
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-verify") as ex:
                results = list(ex.map(one, order))
    return results, sum(r.bytes_read for _, r in results)


def _scan_shared(
    ranks: collective.Ranks,
    root: str,
    files: dict[str, list[_Item]],
    sizes: dict[str, int],
    whole: set[str],
    check_finite: bool,
    digests: bool,
    block: int,
    workers: int,
    quiet: bool,
) -> tuple[list[tuple[str, _FileResult]], int]:
    """:func:`_scan` of this rank's share of the files (balanced by bytes); every rank gets the
    results of all files in :func:`_scan`'s own order, so the report is one process's.

    Collective when ``ranks.world_size`` > 1: every rank calls it (one all-gather).
    """
    if ranks.world_size == 1:
        return _scan(root, files, sizes, whole, check_finite, digests, block, workers, quiet)
    names = list(files)
    share = {names[i]: files[names[i]] for i in ranks.mine([sizes.get(n, 0) for n in names])}
    parts = ranks.from_all(
        lambda: _scan(root, share, sizes, whole, check_finite, digests, block, workers, quiet),
        "verify",
    )
    by_file = {rel: res for results, _ in parts for rel, res in results}
    order = sorted(files, key=lambda rel: -sizes.get(rel, 0))  # as _scan orders them
    return [(rel, by_file[rel]) for rel in order], sum(n for _, n in parts)


# --------------------------------------------------------------------------------------------------
# verify_roundtrip (training code; collective)
# --------------------------------------------------------------------------------------------------

#: Put in place of every non-tensor value before loading, so a value DCP failed to load is seen.
_NOT_LOADED = "<ckptools: not loaded>"


@dataclass(frozen=True)
class RoundtripReport:
    """The result of :func:`verify_roundtrip` (the same on every rank).

    Attributes:
        mismatches: ``"rank R: key: what"`` for every value that came back different, from all
            ranks.
        findings: what :func:`verify` found in the written files (run by rank 0).
        tensors: tensors compared on this rank (local shards of DTensors).
    """

    path: str
    rank: int
    world_size: int
    tensors: int
    values: int
    mismatches: tuple[str, ...]
    findings: tuple[Finding, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.findings

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "rank": self.rank,
            "world_size": self.world_size,
            "tensors": self.tensors,
            "values": self.values,
            "mismatches": list(self.mismatches),
            "findings": [f.to_dict() for f in self.findings],
            "seconds": round(self.seconds, 4),
        }


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _fresh_state(value: Any) -> Any:
    """The same tree, each tensor replaced by one whose every byte differs from the original and
    each non-tensor leaf (as DCP flattens them) by a sentinel: whatever the load does not
    overwrite is then seen as a mismatch."""
    import torch

    if isinstance(value, torch.Tensor):
        fresh = torch.empty_like(value)
        src, dst = _local(value), _local(fresh)
        if src.numel():
            if src.dtype == torch.bool:
                dst.copy_(~src)
            else:
                raw = src.detach().contiguous().reshape(-1).view(torch.uint8) ^ 0xFF
                dst.copy_(raw.view(src.dtype).reshape(src.shape))
        return fresh
    if isinstance(value, dict):
        return {k: _fresh_state(v) for k, v in value.items()}
    if isinstance(value, list) and not _is_dcp_leaf(value):
        return [_fresh_state(v) for v in value]
    return _NOT_LOADED


def _is_dcp_leaf(value: list[Any]) -> bool:
    # DCP flattens a list only when it holds tensors or mappings (at any depth).
    import torch

    for v in value:
        if isinstance(v, torch.Tensor | dict):
            return False
        if isinstance(v, list) and not _is_dcp_leaf(v):
            return False
    return True


def _compare_state(original: Any, loaded: Any, key: str, out: list[str], counts: list[int]) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(original, torch.Tensor):
        counts[0] += 1
        if not isinstance(loaded, torch.Tensor):
            out.append(f"{key}: loaded a {type(loaded).__name__}, saved a tensor")
            return
        if isinstance(original, DTensor) and (
            not isinstance(loaded, DTensor)
            or loaded.placements != original.placements
            or loaded.shape != original.shape
        ):
            out.append(f"{key}: loaded tensor is not sharded as the saved one")
            return
        a, b = _local(original).detach(), _local(loaded).detach()
        if a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{key}: saved {a.dtype} {list(a.shape)}, loaded {b.dtype} {list(b.shape)}")
            return
        if a.numel():
            ba = a.contiguous().reshape(-1).view(torch.uint8).view(a.numel(), -1)
            bb = b.contiguous().reshape(-1).view(torch.uint8).view(b.numel(), -1)
            if not torch.equal(ba, bb):
                differ = int((ba != bb).any(dim=1).sum())
                out.append(f"{key}: {differ} of {a.numel()} element(s) differ after reload")
        return
    if isinstance(original, dict):
        if not isinstance(loaded, dict):
            out.append(f"{key}: loaded a {type(loaded).__name__}, saved a dict")
            return
        for k, v in original.items():
            sub = f"{key}.{k}" if key else str(k)
            if k not in loaded:
                out.append(f"{sub}: missing after reload")
            else:
                _compare_state(v, loaded[k], sub, out, counts)
        return
    if (
        isinstance(original, list)
        and isinstance(loaded, list)
        and len(original) == len(loaded)
        and not _is_dcp_leaf(original)
    ):
        for i, (v, w) in enumerate(zip(original, loaded, strict=True)):
            _compare_state(v, w, f"{key}.{i}", out, counts)
        return
    counts[1] += 1
    if isinstance(loaded, str) and loaded == _NOT_LOADED:
        out.append(f"{key}: not loaded")
    elif loaded != original:
        out.append(f"{key}: saved {original!r}, loaded {loaded!r}")


def verify_roundtrip(
    model: Any,
    optimizer: Any | None,
    path: str,
    *,
    check_files: bool = True,
    process_group: Any | None = None,
) -> RoundtripReport:
    """Save the training state with DCP, load it back into fresh state, and compare bit-exactly.

    The smoke test to run before a long job: ``get_state_dict(model, optimizer)`` is saved with
    ``torch.distributed.checkpoint.save`` to ``path``, loaded with ``dcp.load`` into a copy of
    the state whose every tensor byte (and every non-tensor value) differs from the original,
    and every tensor (each rank's local shard of a DTensor, with its placements) and value is
    compared. With ``check_files`` rank 0 also runs :func:`verify` on the written checkpoint.
    The model and optimizer are not modified.

    Collective: every rank of ``process_group`` (default: the world) calls it with the same
    ``path`` (a directory all ranks share), in the same order relative to other collectives.
    Without an initialized process group it runs in one process. Each rank gets the same report.

    Args:
        model: the (FSDP2/FSDP1/DDP/plain) module.
        optimizer: its optimizer, or None to check the model state only.
        path: the directory to write the checkpoint into (its files are overwritten).
        check_files: also verify the written files (rank 0 reads them).
        process_group: the group to save and load with.

    Returns:
        A :class:`RoundtripReport`; ``report.ok`` is True when everything came back bit-exactly.

    Example:
        >>> report = ckptools.verify_roundtrip(model, optim, "/tmp/roundtrip")  # doctest: +SKIP
        >>> assert report.ok, report.mismatches
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    t0 = time.perf_counter()
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    world = dist.get_world_size(process_group) if distributed else 1
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    dcp_save(state, checkpoint_id=path, process_group=process_group)
    fresh = _fresh_state(state)
    dcp_load(fresh, checkpoint_id=path, process_group=process_group)
    mismatches: list[str] = []
    counts = [0, 0]
    _compare_state(state, fresh, "", mismatches, counts)
    mine = [f"rank {rank}: {m}" for m in mismatches]
    findings: list[Finding] = []
    if check_files and rank == 0:
        findings = list(verify(path, quiet=True).findings)
    if distributed:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine, group=process_group)
        mine = [m for part in gathered for m in part]
        box: list[Any] = [findings]
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        dist.broadcast_object_list(box, src=src, group=process_group)
        findings = box[0]
    return RoundtripReport(
        path=path,
        rank=rank,
        world_size=world,
        tensors=counts[0],
        values=counts[1],
        mismatches=tuple(mine),
        findings=tuple(findings),
        seconds=time.perf_counter() - t0,
    )
