r"""Copying source records with their stored CRC-32 checked on the way.

Every ``.distcp`` item (and every record of a ``torch.save`` archive) stores the CRC-32 of its
bytes. consolidate and reshard check it as they stream, from the bytes they copy, so a flipped
bit in the source stops the run with one line naming the file, the byte range and the tensor,
instead of being copied into a fresh output whose own CRCs would then look clean.

* :func:`copy_range` moves a byte range of a record to the output and returns its CRC-32:
  from memory for an item decoded there (each window checksummed, then written), else in the
  kernel (``copy_file_range``), window by window, each window checksummed in place over
  the source's page cache (``Reader.crc32``: a read-only mapping, no copy) right before the
  kernel copies those same pages, so the bytes come from the disk once; where the kernel cannot
  copy, or the source has no page cache (an object store), through the block buffer, the CRC
  computed on the buffer.
* :class:`RecordChecks` checks records whose bytes are copied as several ranges (a reshard that
  splits one source record over several output pieces): each range's CRC is handed in as it is
  copied, and once the ranges cover the record they are combined (``crc32_combine``) and
  compared with the stored CRC.
* :func:`check_object_item` checks a non-tensor item (a ``torch.save`` archive copied byte for
  byte, never unpickled) before it is copied: its zip structure, then every record's CRC-32.
* :class:`ReadChecks` checks records read front to back in pieces, by a reader that copies
  nothing (``diff``), from the bytes it reads.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from ckptools.core.crc32 import crc32, crc32_combine
from ckptools.core.manifest import Chunk
from ckptools.engine.runtime import kernel_copy, pwrite_all
from ckptools.errors import CorruptCheckpointError
from ckptools.formats import torch_archive
from ckptools.io.storage import Reader

#: Bytes checksummed in place, then copied in the kernel, at a time: large enough that the
#: calls are few (~120 per GB), small enough that the window's pages are still cached when the
#: copy reads them, and that the window mapped for its CRC (which counts in the resident set:
#: 64 MiB windows put the 1.84 GiB bench's peak RSS at ~180 MiB with 2 workers) stays small.
WINDOW_BYTES = 8 * 2**20

#: A buffer, or what makes one when the buffered path first needs it: a kernel copy needs none,
#: and a 16 MiB buffer made (and zero-filled) for nothing costs its pages in the resident set.
BufferSource = memoryview | Callable[[], memoryview]


def _buffer(source: BufferSource) -> memoryview:
    return source if isinstance(source, memoryview) else source()


#: What a writer's CRC mismatch adds after "the file is damaged".
NOT_COMMITTED = (
    "and no output was committed (`ckpt verify` on the source lists every damaged record)"
)


def mismatch(
    reader: Reader, raw: Chunk, fqn: str, computed: int, then: str = NOT_COMMITTED
) -> CorruptCheckpointError:
    """The one-line error for a record whose bytes do not match its stored CRC-32 (``then``:
    what follows "the file is damaged", in the caller's terms). ``raw`` still naming its
    ``record``: the whole record, which holds ``fqn`` among other bytes."""
    assert raw.crc32 is not None
    path = f"{reader.root}/{raw.file}"
    whose = f"the record holding tensor {fqn!r}" if raw.record else f"tensor {fqn!r}"
    return CorruptCheckpointError(
        f"{path}: bytes {raw.offset}..{raw.offset + raw.length} of {whose} fail their "
        f"CRC-32 check (stored {raw.crc32:08x}, computed {computed:08x}): the file is damaged "
        f"{then}",
        path=path,
        fqn=fqn,
        rank=raw.rank,
    )


class ReadChecks:
    """Checks records whose bytes a reader reads front to back in pieces (``diff``'s slabs of
    rows): each piece's CRC is folded into its record's as it is read, and the record is
    checked when its last byte is in, so the check costs no read of its own. A piece that does
    not continue where the record's last one ended (the record read again from its start, or
    out of order) restarts or drops that record's check: a check is never made of bytes that
    were not all seen. Records without a stored CRC are not checked.

    ``fqn``: the tensor named in the error; ``then``: what the error says follows (see
    :func:`mismatch`). Not thread-safe: one reader, one thread.
    """

    def __init__(self, reader: Reader, fqn: str, then: str) -> None:
        self._reader = reader
        self._fqn = fqn
        self._then = then
        self._running: dict[tuple[str, int], tuple[int, int]] = {}  # record -> (bytes, CRC)

    def add(self, raw: Chunk, start: int, data: Any) -> None:
        """Bytes ``start..start+len(data)`` of record ``raw`` (``raw.offset``-relative), read.

        Raises:
            CorruptCheckpointError: the record is complete and fails its stored CRC-32.
        """
        check_record_of(self._reader, raw, self._fqn, self._then)
        if raw.crc32 is None or not len(data):
            return
        key = (raw.file, raw.offset)
        done, crc = self._running.get(key, (0, 0))
        if start == 0:
            done, crc = 0, 0
        elif start != done:
            self._running.pop(key, None)
            return
        crc = crc32(data, crc)
        done += len(data)
        if done < raw.length:
            self._running[key] = (done, crc)
            return
        self._running.pop(key, None)
        if done == raw.length:
            check(reader=self._reader, raw=raw, fqn=self._fqn, computed=crc, then=self._then)


def check(reader: Reader, raw: Chunk, fqn: str, computed: int, then: str = NOT_COMMITTED) -> None:
    """Raise :func:`mismatch` unless ``computed`` is ``raw``'s stored CRC (or it has none)."""
    if raw.crc32 is not None and computed != raw.crc32:
        raise mismatch(reader, raw, fqn, computed, then)


class _WholeRecords:
    """The records one reader's chunks are parts of, each checked once (see
    :func:`check_record_of`)."""

    def __init__(self) -> None:
        self.done: set[tuple[str, int]] = set()
        self.lock = threading.Lock()


_WHOLE: weakref.WeakKeyDictionary[Reader, _WholeRecords] = weakref.WeakKeyDictionary()
_WHOLE_LOCK = threading.Lock()


def check_record_of(reader: Reader, raw: Chunk, fqn: str, then: str = NOT_COMMITTED) -> None:
    """Check the stored record ``raw``'s bytes are only a part of (:attr:`Chunk.record`: a
    view, a parameter of a ZeRO or FSDP flat partition), whole, before they are read: their own
    bytes have no CRC, the record's does. Once per record and reader (a run's source), however
    many chunks and threads share it; in place over the page cache (a copy right after reads
    the same pages). Where the source has no page cache (an object store), not here: reading
    every partition twice over the network is what ``ckpt verify`` is for.

    Raises:
        CorruptCheckpointError: the record fails its CRC-32: one line naming the file, its
            byte range and a tensor in it.
    """
    rec = raw.record
    if rec is None:
        return
    with _WHOLE_LOCK:
        seen = _WHOLE.get(reader)
        if seen is None:
            seen = _WHOLE[reader] = _WholeRecords()
    with seen.lock:
        if (raw.file, rec.offset) in seen.done:
            return
        seen.done.add((raw.file, rec.offset))  # a thread meeting it meanwhile copies on
    computed = reader.crc32(raw.file, rec.offset, rec.length)
    if computed is not None and computed != rec.crc32:
        whole = raw._replace(offset=rec.offset, length=rec.length, crc32=rec.crc32)
        raise mismatch(reader, whole, fqn, computed, then)


def truncated(reader: Reader, raw: Chunk, at: int) -> CorruptCheckpointError:
    path = f"{reader.root}/{raw.file}"
    return CorruptCheckpointError(f"{path}: file is truncated at byte {at}", path=path)


def copy_range(
    reader: Reader,
    raw: Chunk,
    start: int,
    length: int,
    fd: int,
    pos: int,
    progress: Callable[[int], None],
    buffer: BufferSource,
    *,
    kernel: bool = True,
    stop: threading.Event | None = None,
    checksum: bool = True,
) -> tuple[int, int]:
    """Copy bytes ``start..start+length`` of record ``raw`` to ``fd`` at ``pos``; return their
    CRC-32 (see the module's description for how) and how many of them the kernel moved.
    ``kernel`` False: through ``buffer`` (any size; made only if the kernel cannot copy).
    ``checksum`` False: the CRC is not wanted (0 is returned), so none is computed: a slice of
    a record without a stored CRC going to an output that stores none (a DeepSpeed master
    partition consolidated: 0.2 CPU s saved per GB, the mapping's page faults and the CRC
    itself, on this project's 2-core VM)."""
    src = raw.offset + start
    crc = 0
    done = 0
    held = reader.decoded.view(raw.file)
    if held is not None:  # an item decoded in memory: written from there, no copy between
        if src + length > len(held):
            raise truncated(reader, raw, len(held))
        while done < length:
            if stop is not None and stop.is_set():
                break
            view = held[src + done : src + min(length, done + WINDOW_BYTES)]
            if checksum:
                crc = crc32(view, crc)
            pwrite_all(fd, view, pos + done)
            done += len(view)
            progress(len(view))
        return crc, 0
    src_fd = reader.fileno(raw.file) if kernel else None
    while src_fd is not None and done < length:
        n = min(WINDOW_BYTES, length - done)
        part = reader.crc32(raw.file, src + done, n) if checksum else 0
        if part is None:
            break
        try:
            copied = kernel_copy(src_fd, fd, src + done, pos + done, n, progress, stop)
        except EOFError as e:
            raise truncated(reader, raw, e.args[0]) from e
        if not copied:
            break
        if checksum:
            crc = crc32_combine(crc, part, n)
        done += n
    in_kernel = done
    block = _buffer(buffer) if done < length else None
    while block is not None and done < length:
        n = min(len(block), length - done)
        view = block[:n]
        reader.readinto(raw.file, src + done, view)
        if checksum:
            crc = crc32(view, crc)
        pwrite_all(fd, view, pos + done)
        done += n
        progress(n)
    return crc, in_kernel


class RecordChecks:
    """Checks records copied as several ranges, once their ranges are all in.

    ``expected[(file, offset)]`` is the number of ranges of each such record this process
    copies; they must tile the record (the caller checks). Thread-safe: ranges arrive from
    whichever threads copy them, and the thread that hands in the last one does the check.
    """

    def __init__(self, expected: dict[tuple[str, int], int]) -> None:
        self._expected = expected
        self._parts: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
        self._lock = threading.Lock()

    def __contains__(self, raw: Chunk) -> bool:
        return (raw.file, raw.offset) in self._expected

    def add(self, reader: Reader, raw: Chunk, fqn: str, start: int, length: int, crc: int) -> None:
        key = (raw.file, raw.offset)
        with self._lock:
            parts = self._parts.setdefault(key, [])
            parts.append((start, crc, length))
            if len(parts) < self._expected[key]:
                return
            del self._parts[key]
        whole = 0
        for _, part, n in sorted(parts):
            whole = crc32_combine(whole, part, n)
        check(reader, raw, fqn, whole)


def record_crc(reader: Reader, raw: Chunk, buffer: BufferSource) -> int:
    """CRC-32 of a whole record: in place over the page cache, or read through ``buffer``."""
    in_place = reader.crc32(raw.file, raw.offset, raw.length)
    if in_place is not None:
        return in_place
    buffer = _buffer(buffer)
    crc = 0
    done = 0
    while done < raw.length:
        view = buffer[: min(len(buffer), raw.length - done)]
        reader.readinto(raw.file, raw.offset + done, view)
        crc = crc32(view, crc)
        done += len(view)
    return crc


def check_object_item(
    reader: Reader, file: str, offset: int, length: int, fqn: str, block: int
) -> None:
    """Check the object item ``fqn`` at ``[offset, offset+length)`` of ``file`` as torch will
    load it: a whole zip archive (its directory found at the item's end) whose records all
    match their stored CRC-32, read ``block`` bytes at a time. An item recorded 1 byte short
    would otherwise be copied as is into an output whose object no longer loads.

    Raises:
        CorruptCheckpointError: one line naming the file, the byte range and the entry.
    """
    path = f"{reader.root}/{file}"
    where = f"{path}: bytes {offset}..{offset + length} of object {fqn!r}"
    try:
        archive = torch_archive.read_archive(reader, file, offset, length)
        for rec in archive.records.values():
            start = torch_archive.record_data_offset(reader, archive, rec)
            computed = 0
            for pos in range(0, rec.size, block):
                computed = crc32(
                    reader.read(file, start + pos, min(block, rec.size - pos)), computed
                )
            if computed != rec.crc32:
                raise CorruptCheckpointError(
                    f"record {rec.name} fails its CRC-32 check (stored {rec.crc32:08x}, "
                    f"computed {computed:08x})",
                    path=path,
                )
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(
            f"{where} are not the torch.save archive its metadata records ({e}); the file is "
            "damaged and no output was committed (`ckpt verify` on the source lists every "
            "damaged item)",
            path=path,
            fqn=fqn,
        ) from e
