"""The content level of verify: every recorded byte range read once, streaming, and checked.

Files are read in parallel (memory = ``workers × block``), each in one sequential pass
(:class:`_Scanner`): each DCP item's ``torch.save`` archive is parsed (its pickle through the
allowlist: tensors only, objects are never unpickled) and must hold a tensor of the recorded dtype
and shape; the CRC-32 that the zip format stores for every record is recomputed, so a flipped bit
is found and named (file, FQN, chunk, rank); ``check_finite`` counts NaN/Inf per tensor; and,
when asked, every item and file is hashed (:mod:`ckptools.verify.digests`). Byte ranges are laid
out first as segments, each feeding a sink (CRC, hash, finite count), then one pass feeds them.

:func:`scan_content` returns findings and digests as data: :func:`ckptools.verify.verify` compares
the digests with a checksum manifest, :func:`ckptools.verify.checksums.write_checksums` records
them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from ckptools.core import dtypes
from ckptools.core.crc32 import crc32
from ckptools.core.manifest import ARCHIVE
from ckptools.engine import collective
from ckptools.engine.reader import decoded_bound, decoded_item, prefetch_archive
from ckptools.errors import CkptError
from ckptools.formats import safe_pickle, torch_archive
from ckptools.io import storage
from ckptools.io.storage import Reader, open_reader
from ckptools.io.tunables import env_int
from ckptools.verify.digests import Digests, FileSum, ItemKey, ItemSum, new_hasher
from ckptools.verify.report import Finding, FindingKind
from ckptools.verify.structure import Item, Structure

#: Bytes per read: big enough that syscall and per-block Python work stay under 1% of the time
#: spent in crc32/hash; small enough that ``workers`` buffers stay a few tens of MiB.
DEFAULT_BLOCK_BYTES = 8 * 2**20
BLOCK_BYTES_ENV = "CKPTOOLS_VERIFY_BLOCK_BYTES"
#: Gaps between wanted byte ranges shorter than this are read through rather than skipped: one
#: sequential read beats a seek for small gaps (zip headers between DCP items).
_SKIP_GAP_BYTES = 1 * 2**20
_ZIP_MAGIC = b"PK\x03\x04"


def _found(kind: FindingKind, message: str, item: Item) -> Finding:
    return Finding(kind, message, item.file, item.fqn, item.rank, item.chunk_at)


def _unreadable(item: Item, full: str, e: CkptError) -> Finding:
    """The finding for an item whose bytes could not be read as what the metadata records."""
    where = f"{full}: cannot read {item.where()} at bytes {item.offset}..{item.end}"
    return _found("unreadable", f"{where}: {e.message}", item)


def resolve_block_bytes() -> int:
    """``CKPTOOLS_VERIFY_BLOCK_BYTES`` > :data:`DEFAULT_BLOCK_BYTES` (rounded to 64 bytes)."""
    value = env_int(BLOCK_BYTES_ENV, DEFAULT_BLOCK_BYTES)
    return max(64, value - value % 64)


@dataclass(frozen=True)
class ScanOptions:
    """What a content scan checks and computes, and with what.

    Attributes:
        check_finite: count NaN and Inf per floating tensor.
        digests: hash every item and every whole file (:mod:`ckptools.verify.digests`).
        block: bytes per read (:func:`resolve_block_bytes`).
        workers: files read in parallel.
        quiet: no progress bar.
    """

    check_finite: bool = False
    digests: bool = False
    block: int = DEFAULT_BLOCK_BYTES
    workers: int = 1
    quiet: bool = False


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
    nonfinite_where: dict[str, Item] = field(default_factory=dict)
    bytes_read: int = 0


class _Scanner:
    """Shared state of one content check."""

    def __init__(self, reader: Reader, options: ScanOptions, progress: Any) -> None:
        self.reader = reader
        self.check_finite = options.check_finite
        self.digests = options.digests
        self.block = options.block
        self.progress = progress
        self._local = threading.local()

    def buffer(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(bytearray(self.block))
        return buf  # type: ignore[no-any-return]

    def scan_file(self, rel: str, items: list[Item], size: int, whole_file: bool) -> _FileResult:
        res = _FileResult()
        segments: list[_Segment] = []
        full = storage.join(self.reader.root, rel)
        try:
            self._archive_segments(rel, items, size, full, segments, res)
        except CkptError as e:
            res.findings.append(Finding("unreadable", f"{full}: {e.message}", rel, e.fqn, e.rank))
        hashes: dict[int, _Hash] = {}
        for item in items:
            if item.transforms:
                self._decoded_item(item, full, res)
            elif item.encoding == ARCHIVE:
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
        items: list[Item],
        size: int,
        full: str,
        segments: list[_Segment],
        res: _FileResult,
    ) -> None:
        """A whole-file ``torch.save`` archive (``model.pt``, ``meta.pt``): check its records."""
        if any(i.encoding == ARCHIVE for i in items) or rel.endswith(".safetensors"):
            return
        if size < 22 or self.reader.read(rel, 0, 4) != _ZIP_MAGIC:
            return
        archive = torch_archive.read_archive(self.reader, rel, 0, size)
        for rec in archive.records.values():
            start = torch_archive.record_data_offset(self.reader, archive, rec)
            end = start + rec.size

            def mismatch(got: int, rec: Any = rec, start: int = start, end: int = end) -> None:
                # a tensor stored as several boxes of the record (a flat partition's rows) once
                hit = list(dict.fromkeys(i.fqn for i in items if i.offset < end and start < i.end))
                who = "tensor " + ", ".join(map(repr, hit[:5])) if hit else f"record {rec.name}"
                res.findings.append(
                    Finding(
                        "crc",
                        f"{full}: CRC-32 mismatch in the bytes of {who} (zip record "
                        f"{rec.name}, bytes {start}..{end}): stored {rec.crc32:#010x}, computed "
                        f"{got:#010x}; the file changed after torch wrote it (bit rot or a "
                        "partial overwrite)",
                        rel,
                        hit[0] if hit else None,
                    )
                )

            segments.append(_Segment(start, end, _Crc(rec.crc32, mismatch)))

    def _item_segments(
        self, item: Item, full: str, segments: list[_Segment], res: _FileResult
    ) -> None:
        """A DCP item: its archive's records (CRC), and the tensor it must hold."""
        rel = item.file
        try:
            prefetch_archive(self.reader, rel, item.offset, item.length)
            archive = torch_archive.read_archive(self.reader, rel, item.offset, item.length)
            data_record = None
            ref = None
            if item.tensor is not None and item.chunk is not None:
                ref = torch_archive.load_pickle(self.reader, archive)
                problem = self._check_ref(item, ref)
                if problem:
                    res.findings.append(_found("dtype_shape", f"{full}: {problem}", item))
                    ref = None
                else:
                    assert isinstance(ref, safe_pickle.TensorRef)
                    data_record = f"data/{ref.storage.key}"
            for rec in archive.records.values():
                start = torch_archive.record_data_offset(self.reader, archive, rec)
                end = start + rec.size

                def mismatch(got: int, rec: Any = rec, start: int = start, end: int = end) -> None:
                    what = "tensor data" if rec.name.startswith("data/") else f"record {rec.name}"
                    message = (
                        f"{full}: CRC-32 mismatch in the {what} of {item.where()} (bytes "
                        f"{start}..{end}): stored {rec.crc32:#010x}, computed {got:#010x}; "
                        "the file changed after torch wrote it (bit rot or a partial overwrite)"
                    )
                    res.findings.append(_found("crc", message, item))

                segments.append(_Segment(start, end, _Crc(rec.crc32, mismatch)))
                if rec.name == data_record and ref is not None and self.check_finite:
                    assert item.tensor is not None and item.chunk is not None
                    itemsize = item.tensor.itemsize
                    first = start + ref.storage_offset * itemsize
                    n = item.chunk.numel * itemsize
                    if not ref.is_contiguous:  # the storage span: whole rows of the base tensor
                        n = rec.size - ref.storage_offset * itemsize
                    if first + n > end:
                        message = (
                            f"{full}: {item.where()}: the tensor needs bytes "
                            f"{first}..{first + n} but its storage record ends at {end}"
                        )
                        res.findings.append(_found("dtype_shape", message, item))
                        continue
                    self._finite_segment(item, first, n, segments, res)
        except CkptError as e:
            res.findings.append(_unreadable(item, full, e))

    def _decoded_item(self, item: Item, full: str, res: _FileResult) -> None:
        """An item stored through stream transforms: decoded (once, bounded, into the reader's
        spool), then checked there as any item's archive, in a pass of its own."""
        try:
            kind = "object" if item.chunk is None else "tensor"
            name, size = decoded_item(
                self.reader, item.file, item.offset, item.length, item.transforms,
                bound=decoded_bound(item.tensor, item.chunk), entry=f"{kind} {item.fqn!r}",
            )  # fmt: skip
            decoded = replace(item, file=name, offset=0, length=size, transforms=())
            segments: list[_Segment] = []
            self._item_segments(decoded, storage.join(self.reader.root, name), segments, res)
            self._stream(name, size, sorted(segments, key=lambda s: s.start), [], None, res)
        except CkptError as e:
            res.findings.append(_unreadable(item, full, e))

    @staticmethod
    def _check_ref(item: Item, ref: Any) -> str | None:
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
        self, item: Item, start: int, length: int, segments: list[_Segment], res: _FileResult
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


@dataclass(frozen=True)
class _Work:
    """What one scan reads: the items of each file, every file's size, the files hashed whole."""

    root: str
    files: dict[str, list[Item]]
    sizes: dict[str, int]
    whole: set[str]

    def order(self) -> list[str]:
        return sorted(self.files, key=lambda rel: -self.sizes.get(rel, 0))  # biggest first

    def share(self, ranks: collective.Ranks) -> _Work:
        """This rank's share of the files, balanced by bytes."""
        names = list(self.files)
        mine = ranks.mine([self.sizes.get(n, 0) for n in names])
        files = {names[i]: self.files[names[i]] for i in mine}
        return _Work(self.root, files, self.sizes, self.whole)


def _scan(work: _Work, options: ScanOptions) -> tuple[list[tuple[str, _FileResult]], int]:
    """Scan every file of ``work``, ``options.workers`` at a time, biggest first (even finish)."""
    from ckptools.io.progress import ByteProgress

    order = work.order()
    total = sum(work.sizes.get(rel, 0) for rel in order)
    with (
        open_reader(work.root) as reader,
        ByteProgress(total, "verify", quiet=options.quiet) as bar,
    ):
        scanner = _Scanner(reader, options, bar)

        def one(rel: str) -> tuple[str, _FileResult]:
            return rel, scanner.scan_file(rel, work.files[rel], work.sizes[rel], rel in work.whole)

        if options.workers == 1 or len(order) <= 1:
            results = [one(rel) for rel in order]
        else:
            with ThreadPoolExecutor(options.workers, thread_name_prefix="ckpt-verify") as ex:
                results = list(ex.map(one, order))
    return results, sum(r.bytes_read for _, r in results)


def _scan_shared(
    ranks: collective.Ranks, work: _Work, options: ScanOptions
) -> tuple[list[tuple[str, _FileResult]], int]:
    """:func:`_scan` of this rank's share of the files; every rank gets the results of all
    files in :func:`_scan`'s own order, so the report is one process's.

    Collective when ``ranks.world_size`` > 1: every rank calls it (one all-gather).
    """
    if ranks.world_size == 1:
        return _scan(work, options)
    mine = work.share(ranks)
    parts = ranks.from_all(lambda: _scan(mine, options), "verify")
    by_file = {rel: res for results, _ in parts for rel, res in results}
    return [(rel, by_file[rel]) for rel in work.order()], sum(n for _, n in parts)


# --------------------------------------------------------------------------------------------------
# The content check of a checkpoint
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Content:
    """What :func:`scan_content` found: problems, the digests (when asked), bytes read."""

    findings: list[Finding]
    digests: Digests | None
    bytes_read: int


def scan_content(ranks: collective.Ranks, structure: Structure, options: ScanOptions) -> Content:
    """Read every readable item of a checked checkpoint once; with ``options.digests``, hash
    every item and every whole file (data files and commit markers).

    Collective when ``ranks.world_size`` > 1 (:func:`_scan_shared`); every rank gets the same.
    """
    manifest, root = structure.manifest, structure.root
    sizes = dict(structure.sizes)
    files: dict[str, list[Item]] = {}
    for item in structure.items:
        if id(item) not in structure.unreadable:
            files.setdefault(item.file, []).append(item)
    # Files whose every byte a checksum covers: data files (all present and long enough) and
    # the commit markers.
    whole = {rel for rel in manifest.files if rel in sizes}
    whole -= {i.file for i in structure.items if id(i) in structure.unreadable}
    if options.digests:
        for marker in manifest.markers:
            if marker in sizes or storage.exists(storage.join(root, marker)):
                sizes.setdefault(marker, storage.size(storage.join(root, marker)))
                whole.add(marker)
                files.setdefault(marker, [])
    for rel in whole:
        files.setdefault(rel, [])
    work = _Work(root, files, sizes, whole if options.digests else set())
    results, bytes_read = _scan_shared(ranks, work, options)
    findings = [f for _, res in results for f in res.findings]
    findings.extend(_nonfinite_findings(manifest.tensors, [res for _, res in results]))
    found = None
    if options.digests:
        found = Digests({}, {})
        for rel, res in results:
            found.items.update(res.item_digests)
            if res.file_digest is not None:
                found.files[rel] = res.file_digest
    return Content(findings, found, bytes_read)


def _nonfinite_findings(tensors: Iterable[str], results: list[_FileResult]) -> list[Finding]:
    """One finding per tensor holding NaN or Inf, counted over all its chunks, in manifest order."""
    nonfinite: dict[str, list[int]] = {}
    where: dict[str, Item] = {}
    for res in results:
        for fqn, counts in res.nonfinite.items():
            total = nonfinite.setdefault(fqn, [0, 0])
            total[0] += counts[0]
            total[1] += counts[1]
        for fqn, item in res.nonfinite_where.items():
            where.setdefault(fqn, item)
    out = []
    for fqn in tensors:
        found = nonfinite.get(fqn)
        if found and (found[0] or found[1]):
            item = where[fqn]
            out.append(
                Finding(
                    "nonfinite",
                    f"{fqn!r}: {found[0]} NaN and {found[1]} Inf value(s) (first in "
                    f"{item.where()}, {item.file})",
                    item.file,
                    fqn,
                    item.rank,
                    item.chunk_at,
                )
            )
    return out
