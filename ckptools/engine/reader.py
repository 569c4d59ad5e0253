"""Reading tensor chunks and objects of a manifest.

:func:`resolve_chunk` turns any chunk into its raw form (file, byte offset, strides), reading
just the archive directory and pickle of a DCP item; byte movers (consolidate, reshard, verify)
work from that, and :class:`SourceCache` keeps those forms for a writer that meets a chunk more
than once. :func:`read_tensor` assembles a whole tensor with torch, for tests, diffs and small
reads; :class:`RowBytes` reads whole rows of a tensor as row-major bytes without torch, for
byte-exact comparisons. :func:`read_object` decodes a non-tensor entry through the allowlist.

An item stored through stream transforms (a DCP extension such as zstd) is read through
:func:`decoded_item`, the one reader of decoded items: it is decoded once per reader, in bounded
memory (:class:`~ckptools.io.readers.DecodedFiles`: into a buffer, or into the reader's spool
for an item larger than a buffer takes), never beyond the size the item can legitimately have;
from then on it is an ordinary item of a file the reader knows, so its archive is parsed, its
CRCs checked and its bytes cut from there by every verb.
"""

from __future__ import annotations

import contextlib
import io
import math
import mmap
import os
import threading
from typing import IO, TYPE_CHECKING, Any

from ckptools.core import dtypes
from ckptools.core.geometry import MAX_STRIDED_STEPS, copy_runs, gather_strided, strided_steps
from ckptools.core.manifest import Chunk, Manifest, ObjectEntry, Record, TensorEntry, stored_in
from ckptools.errors import CkptError, CorruptCheckpointError
from ckptools.formats import safe_pickle, stream_transforms, torch_archive
from ckptools.io import tunables
from ckptools.io.storage import Reader, open_reader

if TYPE_CHECKING:
    import torch

    from ckptools.engine.checked_copy import ReadChecks

#: Bytes at the start of a DCP item holding its pickle and the record headers before the tensor
#: data (torch.save aligns data to 64 bytes after ~400-700 bytes of them).
_ARCHIVE_HEAD_BYTES = 2048
#: Largest DCP item fetched whole when its tensor is read right after (FSDP shards of large
#: models are often 1-8 MiB): beyond it, the head/tail request is a small share of the time.
_WHOLE_ITEM_BYTES = 4 * 2**20
#: Bytes of a ``torch.save`` archive beside its tensor data: the pickle, the record headers
#: and 64-byte alignment, ``byteorder``, ``version``, the zip directory (~1-2 KiB for one
#: tensor). A decoded tensor item may be at most its data plus this.
ARCHIVE_FRAMING_BYTES = 64 * 1024
#: Most bytes a decoded non-tensor item (step counters, RNG and data-loader states, kilobytes
#: to a few megabytes) may have: the metadata records no size for them, so this bounds what a
#: hostile frame may make ckptools write to its spool.
MAX_DECODED_OBJECT_BYTES = 256 * 2**20
#: Bytes decoded at a time: the memory decoding an item takes, whatever its size.
_DECODE_BLOCK_BYTES = 2**20


class _StoredRange(io.RawIOBase):
    """Bytes ``[offset, offset+length)`` of ``file`` as a readable stream (a decoder's input)."""

    def __init__(self, reader: Reader, file: str, offset: int, length: int) -> None:
        self._reader, self._file, self._pos, self._end = reader, file, offset, offset + length

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = min(len(view), self._end - self._pos)
        if n <= 0:
            return 0
        self._reader.readinto(self._file, self._pos, view[:n])
        self._pos += n
        return n


def _anonymous(size: int) -> mmap.mmap:
    """``size`` bytes of private memory: an anonymous mapping, whose pages are the process's
    only once written and freed (unmapped) once the last view of them goes, in huge pages
    where the kernel has them (a 2 MiB page faulted in instead of 512: the faults of 4 KiB
    pages took 0.8 s of system time per decoded GiB, twice the decoding's writes)."""
    mem = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mem.madvise(mmap.MADV_HUGEPAGE)
    return mem


def decoded_item(
    reader: Reader,
    file: str,
    offset: int,
    length: int,
    transforms: tuple[str, ...],
    *,
    bound: int,
    entry: str,
) -> tuple[str, int]:
    """The item at ``[offset, offset+length)`` of ``file``, stored through ``transforms``, as
    ``(name, size)`` of its decoded bytes: a name ``reader`` reads (see
    :class:`~ckptools.io.readers.DecodedFiles`) holding the ``torch.save`` archive the item was
    made from. Decoded once per reader (threads asking for the same item wait for the first):
    into memory, in place, up to :func:`~ckptools.io.tunables.decoded_item_memory` bytes; a
    larger item into the reader's spool (:func:`_spool`), so memory does not grow with it.

    Args:
        bound: most bytes the item may decode to (its data plus
            :data:`ARCHIVE_FRAMING_BYTES` for a tensor); decoding stops there.
        entry: what the item is, for messages: ``"tensor 'model.w'"``.

    Raises:
        UnsupportedCheckpointError: a transform ckptools does not decode (or whose package is
            not installed); one line.
        CorruptCheckpointError: the stored bytes do not decode, or decode past ``bound``.
    """
    key = (file, offset)
    found = reader.decoded.get(key)
    if found is not None:
        return found
    where = f"{reader.root}/{file}"
    undo = stream_transforms.decoder(transforms, path=where, entry=entry)
    assert undo is not None
    what = f"{where}: bytes {offset}..{offset + length} of {entry}"

    def too_big() -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{what} decode to more than {bound} bytes, more than the item can hold (stored "
            f"with {' + '.join(transforms)}); the item is damaged or hostile, and decoding "
            "stopped there",
            path=where,
        )

    def undone(e: ValueError) -> CorruptCheckpointError:  # what a decoder raises
        return CorruptCheckpointError(
            f"{what} do not decode through {' + '.join(transforms)} ({e}); the file is "
            "damaged (`ckpt verify` lists every damaged item)",
            path=where,
        )

    memory = min(bound, tunables.decoded_item_memory())

    def in_memory() -> tuple[memoryview, bytes, IO[bytes]]:
        """The item decoded into memory, as far as ``memory`` bytes; the byte after them
        (empty: the item ended there) and the stream, for an item larger than that."""
        mem = memoryview(_anonymous(memory))
        source = undo(io.BufferedReader(_StoredRange(reader, file, offset, length)))
        size = 0
        try:
            while size < memory and (n := _fill(source, mem[size:memory])):
                size += n
            more = source.read(1) if size == memory else b""
        except ValueError as e:
            raise undone(e) from e
        return mem[:size], more, source

    with reader.decoded.lock(key):
        found = reader.decoded.get(key)
        if found is not None:
            return found
        with reader.decoded.room(memory):
            data, more, source = in_memory()
            if not more:  # decoded whole in memory: its bytes are read from there
                decoded = len(data)

                def redo() -> memoryview:  # let go (the memory bound) and asked for again
                    again, rest, _ = in_memory()
                    if len(again) != decoded or rest:
                        raise undone(ValueError("it decodes to other bytes a second time"))
                    return again

                return reader.decoded.hold(key, data, redo), decoded
        if len(data) >= bound:
            raise too_big()
        local = reader.decoded.new_file()  # larger than memory takes: into the spool
        try:
            size = _spool(local, (data, more), source, bound)
        except CkptError:  # before ValueError: CorruptCheckpointError is one
            os.remove(local)
            raise
        except ValueError as e:  # what a decoder raises for bytes it cannot decode
            os.remove(local)
            raise undone(e) from e
        if size is None:
            os.remove(local)
            raise too_big()
        return reader.decoded.add(key, local, size), size


def _fill(source: IO[bytes], view: memoryview) -> int:
    """Decoded bytes read from ``source`` straight into ``view``; how many (0: its end)."""
    readinto = getattr(source, "readinto", None)
    if readinto is not None:
        return int(readinto(view))
    data = source.read(len(view))
    view[: len(data)] = data
    return len(data)


def _spool(local: str, head: tuple[memoryview, bytes], source: IO[bytes], bound: int) -> int | None:
    """Write ``head`` (the bytes decoded so far), then the rest of ``source``,
    :data:`_DECODE_BLOCK_BYTES` at a time, to the file ``local``; its size, or None once past
    ``bound`` (decoding stops there)."""
    size = 0
    with open(local, "wb") as out:
        for part in head:
            out.write(part)
            size += len(part)
        head[0].release()
        while block := source.read(_DECODE_BLOCK_BYTES):
            size += len(block)
            if size > bound:
                return None
            out.write(block)
    return size


def decoded_bound(tensor: TensorEntry | None, chunk: Chunk | None) -> int:
    """Most bytes the item of ``chunk`` of ``tensor`` (None, None: a non-tensor item) may
    decode to: the chunk's data plus :data:`ARCHIVE_FRAMING_BYTES`, from the metadata."""
    if tensor is None or chunk is None:
        return MAX_DECODED_OBJECT_BYTES
    return chunk.numel * dtypes.dtype(tensor.dtype).itemsize + ARCHIVE_FRAMING_BYTES


def _decoded_chunk(reader: Reader, tensor: TensorEntry, chunk: Chunk) -> Chunk:
    """``chunk``, stored through transforms, as the item of its decoded archive."""
    name, size = decoded_item(
        reader, chunk.file, chunk.offset, chunk.length, chunk.transforms,
        bound=decoded_bound(tensor, chunk), entry=f"tensor {tensor.fqn!r}",
    )  # fmt: skip
    return chunk._replace(file=name, offset=0, length=size, transforms=())


def decoded_object(reader: Reader, entry: ObjectEntry) -> tuple[str, int]:
    """``(name, size)`` of the non-tensor item ``entry``, stored through transforms, decoded
    (:func:`decoded_item`): its ``torch.save`` archive is bytes ``[0, size)`` of ``name``."""
    assert entry.file is not None and entry.transforms
    return decoded_item(
        reader, entry.file, entry.offset, entry.length, entry.transforms,
        bound=decoded_bound(None, None), entry=f"object {entry.fqn!r}",
    )  # fmt: skip


def prefetch_archive(
    reader: Reader, file: str, offset: int, length: int, *, with_data: bool = False
) -> None:
    """Announce the reads that parsing the archive at ``[offset, offset+length)`` makes: its first
    few hundred bytes (pickle, record headers) and its zip directory at the end. An object store
    fetches both in one concurrent round trip instead of ~6 sequential ones; a disk ignores it.

    With ``with_data`` (the caller reads the tensor right after), an item of at most
    :data:`_WHOLE_ITEM_BYTES` is fetched whole: one request for the chunk instead of two, and
    only ~1 KiB of archive framing more than the tensor itself.
    """
    if with_data and length <= _WHOLE_ITEM_BYTES:
        reader.prefetch(file, [(offset, length)])
        return
    head = min(length, _ARCHIVE_HEAD_BYTES)
    tail = min(length, reader.archive_tail_bytes)
    reader.prefetch(file, [(offset, head), (offset + length - tail, tail)])


def resolve_chunk(
    reader: Reader, tensor: TensorEntry, chunk: Chunk, *, reading_data: bool = False
) -> Chunk:
    """The raw location of ``chunk``'s elements (a no-op for raw chunks).

    ``reading_data``: the caller reads the chunk's bytes right after (see
    :func:`prefetch_archive`); not when resolving many chunks ahead of their reads.
    """
    if chunk.transforms:  # decoded once (in memory, or into the spool), then read as any item
        chunk = _decoded_chunk(reader, tensor, chunk)
    if chunk.encoding == "raw":
        return chunk
    prefetch_archive(reader, chunk.file, chunk.offset, chunk.length, with_data=reading_data)
    archive = torch_archive.read_archive(reader, chunk.file, chunk.offset, chunk.length)
    ref = torch_archive.load_tensor_pickle(reader, archive)
    if not isinstance(ref, safe_pickle.TensorRef):
        raise _bad_item(reader, tensor, chunk, "holds no tensor")
    if ref.dtype != tensor.dtype or ref.shape != chunk.sizes:
        raise _bad_item(
            reader,
            tensor,
            chunk,
            f"holds a {ref.dtype} tensor of shape {list(ref.shape)}; metadata says "
            f"{tensor.dtype} {list(chunk.sizes)}",
        )
    rec = archive.record(f"data/{ref.storage.key}")
    itemsize = dtypes.dtype(ref.dtype).itemsize
    problem = ref.expansion_problem(itemsize)
    if problem or ref.storage_offset * itemsize + ref.span_bytes(itemsize) > rec.size:
        what = problem or f"reaches past its storage record data/{ref.storage.key}"
        raise _bad_item(reader, tensor, chunk, what)
    data_at = torch_archive.record_data_offset(reader, archive, rec)
    start = data_at + ref.storage_offset * itemsize
    span = chunk.numel * itemsize if ref.is_contiguous else rec.size - ref.storage_offset * itemsize
    record = Record(data_at, rec.size, rec.crc32)
    return chunk._replace(
        offset=start,
        length=span,
        encoding="raw",
        strides=None if ref.is_contiguous else ref.strides,
        **stored_in(record, start, span, ref.is_contiguous),
    )


def _bad_item(
    reader: Reader, tensor: TensorEntry, chunk: Chunk, what: str
) -> CorruptCheckpointError:
    """The one-line error for a DCP item of ``tensor`` that is not what the metadata says."""
    return CorruptCheckpointError(
        f"{reader.root}/{chunk.file}@{chunk.offset}: item for {tensor.fqn!r} {what}",
        path=chunk.file,
        fqn=tensor.fqn,
        rank=chunk.rank,
    )


class SourceCache:
    """Raw locations of source chunks, resolved once (a DCP item's archive directory is read
    once even when the chunk feeds several output pieces: the DCP writer's). Thread-safe."""

    def __init__(self, reader: Reader, manifest: Manifest) -> None:
        self._reader = reader
        self._manifest = manifest
        self._raw: dict[tuple[str, int], Chunk] = {}
        self._lock = threading.Lock()

    def raw(self, fqn: str, chunk: Chunk) -> Chunk:
        key = (chunk.file, chunk.offset)
        found = self._raw.get(key)
        if found is None:
            found = resolve_chunk(self._reader, self._manifest.tensors[fqn], chunk)
            with self._lock:
                self._raw[key] = found
        return found


class RowBytes:
    """Rows ``[r0, r1)`` of one tensor as row-major bytes, read from its stored chunks without
    torch (replicas read once): comparing bytes needs no tensors, and importing torch costs
    ~2 s of CPU, ten times a whole ``ckpt diff`` of two small checkpoints.

    A chunk stored with non-contiguous strides (a transposed view saved as is) is read whole
    once and gathered row-major (:func:`~ckptools.core.geometry.gather_strided`);
    ``contiguous`` is False only for one of very many short rows, which :meth:`read` does not
    place: the caller reads it with torch.
    ``checks``: the bytes read are handed to it, so each record read to its end is checked
    against its stored CRC-32 (:class:`~ckptools.engine.checked_copy.ReadChecks`).
    """

    def __init__(
        self, reader: Reader, tensor: TensorEntry, checks: ReadChecks | None = None
    ) -> None:
        self.reader = reader
        self.tensor = tensor
        self.checks = checks
        self.itemsize = dtypes.dtype(tensor.dtype).itemsize
        seen: dict[tuple[tuple[int, ...], tuple[int, ...]], Chunk] = {}
        for c in tensor.chunks:
            if c.numel:
                seen.setdefault((c.offsets, c.sizes), c)
        self.chunks = [resolve_chunk(reader, tensor, c) for c in seen.values()]
        k = self.itemsize
        self.contiguous = all(
            c.strides is None or strided_steps(k, c.sizes, c.strides) <= MAX_STRIDED_STEPS
            for c in self.chunks
        )
        self._gathered: dict[int, memoryview] = {}

    def read(self, r0: int, r1: int) -> bytearray:
        """Rows ``[r0, r1)`` (a 0-dim tensor: ``read(0, 1)``), each chunk's rows read once."""
        assert self.contiguous
        shape, k = self.tensor.shape, self.itemsize
        if not shape:
            c = self.chunks[0]
            scalar = bytearray(self.reader.read(c.file, c.offset, k))
            if self.checks is not None:
                self.checks.add(c, 0, scalar)
            return scalar
        slab_offsets = (r0,) + (0,) * (len(shape) - 1)
        slab_sizes = (r1 - r0, *shape[1:])
        out = bytearray(math.prod(slab_sizes) * k)
        view = memoryview(out)
        for i, c in enumerate(self.chunks):
            lo, hi = max(r0, c.offsets[0]), min(r1, c.offsets[0] + c.sizes[0])
            if lo >= hi:
                continue
            skip = (lo - c.offsets[0]) * math.prod(c.sizes[1:])  # elements before row lo
            length = (hi - lo) * (c.numel // c.sizes[0]) * k
            if c.strides is not None:
                data = self._strided(i, c)[skip * k : skip * k + length]
            else:
                data = memoryview(self.reader.read(c.file, c.offset + skip * k, length))
                if self.checks is not None:
                    self.checks.add(c, skip * k, data)
            for src, dst, n in copy_runs(c.offsets, c.sizes, slab_offsets, slab_sizes):
                view[dst * k : (dst + n) * k] = data[(src - skip) * k : (src - skip + n) * k]
        return out

    def _strided(self, index: int, c: Chunk) -> memoryview:
        """Strided chunk ``c``'s elements row-major: read whole (and checked) once."""
        got = self._gathered.get(index)
        if got is None:
            assert c.strides is not None
            data = self.reader.read(c.file, c.offset, c.length)
            if self.checks is not None:
                self.checks.add(c, 0, memoryview(data))
            got = memoryview(gather_strided(data, self.itemsize, c.sizes, c.strides))
            self._gathered[index] = got
        return got


def _chunk_tensor(reader: Reader, tensor: TensorEntry, chunk: Chunk) -> torch.Tensor:
    import torch

    raw = resolve_chunk(reader, tensor, chunk)
    itemsize = dtypes.dtype(tensor.dtype).itemsize
    if raw.numel == 0:
        return torch.empty(raw.sizes, dtype=getattr(torch, tensor.dtype))
    data = bytearray(reader.read(raw.file, raw.offset, raw.length))
    flat = torch.frombuffer(data, dtype=torch.uint8).view(getattr(torch, tensor.dtype))
    if raw.strides is None:
        return flat[: raw.numel].view(raw.sizes)
    assert len(data) % itemsize == 0
    return flat.as_strided(raw.sizes, raw.strides).contiguous()


def read_tensor(manifest: Manifest, fqn: str, reader: Reader | None = None) -> torch.Tensor:
    """Assemble the full tensor ``fqn`` from its chunks (needs torch; memory = tensor size)."""
    import torch

    tensor = manifest.tensors[fqn]
    own = reader is None
    reader = reader or open_reader(manifest.data_dir())
    try:
        out = torch.empty(tensor.shape, dtype=getattr(torch, tensor.dtype))
        for chunk in tensor.chunks:
            piece = _chunk_tensor(reader, tensor, chunk)
            view = out
            for dim, (o, s) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                view = view.narrow(dim, o, s)
            view.copy_(piece)
        return out
    finally:
        if own:
            reader.close()


def read_object(manifest: Manifest, fqn: str, reader: Reader | None = None) -> Any:
    """Decode the non-tensor entry ``fqn`` through the allowlist (never runs checkpoint code).

    Returns plain Python values; ``io.BytesIO`` as
    :class:`~ckptools.formats.safe_pickle.BytesValue`,
    tensors as :class:`~ckptools.formats.safe_pickle.TensorRef`.

    Raises:
        UnsafeCheckpointError: the object needs a global outside the allowlist.
    """
    entry: ObjectEntry = manifest.objects[fqn]
    if entry.has_value:
        return entry.value
    assert entry.file is not None
    if entry.transforms:  # refused before a file is opened when not decodable
        stream_transforms.decoder(
            entry.transforms, path=f"{manifest.data_dir()}/{entry.file}", entry=f"object {fqn!r}"
        )
    own = reader is None
    reader = reader or open_reader(manifest.data_dir())
    try:
        file, length = entry.file, entry.length
        offset = entry.offset
        if entry.transforms:
            file, length = decoded_object(reader, entry)
            offset = 0
        archive = torch_archive.read_archive(reader, file, offset, length)
        return safe_pickle.unwrap(torch_archive.load_pickle(reader, archive))
    finally:
        if own:
            reader.close()
