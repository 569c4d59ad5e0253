"""Reading tensor chunks and objects of a manifest.

:func:`resolve_chunk` turns any chunk into its raw form (file, byte offset, strides), reading
just the archive directory and pickle of a DCP item; byte movers (consolidate, reshard, verify)
work from that, and :class:`SourceCache` keeps those forms for a writer that meets a chunk more
than once. :func:`read_tensor` assembles a whole tensor with torch, for tests, diffs and small
reads; :class:`RowBytes` reads whole rows of a tensor as row-major bytes without torch, for
byte-exact comparisons. :func:`read_object` decodes a non-tensor entry through the allowlist.
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any

from ckptools.core import dtypes
from ckptools.core.geometry import MAX_STRIDED_STEPS, copy_runs, gather_strided, strided_steps
from ckptools.core.manifest import Chunk, Manifest, ObjectEntry, TensorEntry
from ckptools.errors import CorruptCheckpointError
from ckptools.formats import safe_pickle, stream_transforms, torch_archive
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
    if chunk.transforms:
        # the one decision (stream_transforms.DECODERS is empty: this refuses); a decoder's
        # item is then read from its decoded stream, not from a byte range: that plugs in here
        decode = stream_transforms.decoder(
            chunk.transforms, path=f"{reader.root}/{chunk.file}", entry=f"tensor {tensor.fqn!r}"
        )
        raise AssertionError(f"no reader of decoded items yet ({decode})")
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
    start = torch_archive.record_data_offset(reader, archive, rec) + ref.storage_offset * itemsize
    span = chunk.numel * itemsize if ref.is_contiguous else rec.size - ref.storage_offset * itemsize
    whole_record = ref.is_contiguous and ref.storage_offset == 0 and span == rec.size
    return chunk._replace(
        offset=start,
        length=span,
        encoding="raw",
        strides=None if ref.is_contiguous else ref.strides,
        crc32=rec.crc32 if whole_record else None,
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
    if entry.transforms:  # as resolve_chunk
        decode = stream_transforms.decoder(
            entry.transforms, path=f"{manifest.data_dir()}/{entry.file}", entry=f"object {fqn!r}"
        )
        raise AssertionError(f"no reader of decoded items yet ({decode})")
    own = reader is None
    reader = reader or open_reader(manifest.data_dir())
    try:
        archive = torch_archive.read_archive(reader, entry.file, entry.offset, entry.length)
        return safe_pickle.unwrap(torch_archive.load_pickle(reader, archive))
    finally:
        if own:
            reader.close()
