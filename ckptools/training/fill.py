"""Fill a sharded model's local tensors from a manifest's chunks with ranged reads.

The part of :func:`ckptools.load_pretrained` that :func:`ckptools.load` shares for sources
``save`` did not write: each rank finds the boxes of the global tensors its local tensors hold
(:func:`find_targets`: a DTensor's chunk, an FSDP1 ``ShardedTensor``'s local shards, or a whole
plain tensor), and a :class:`Filler` copies the intersection of each stored chunk with each box
(:func:`ckptools.core.geometry.copy_runs`) straight from the file into the local tensor: into
its own memory when dtype and device agree, else through one bounded buffer with a cast per
piece. Nothing is gathered; extra memory is one read buffer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ckptools.core import dtypes
from ckptools.core.geometry import copy_runs, tiling_problems
from ckptools.core.manifest import Chunk, TensorEntry
from ckptools.errors import UnsupportedCheckpointError, UsageError
from ckptools.io import memory, storage

__all__ = [
    "Box",
    "Copy",
    "Filler",
    "Target",
    "check_entry",
    "check_raw",
    "check_tiling",
    "dtype_name",
    "find_targets",
    "overlaps",
    "torch_dtype",
]

#: Runs of a box closer than this in the file are read together: one read of a small gap costs
#: less than a second call (a dim-1 shard is one run per row).
_GAP_BYTES = 64 * 1024


@dataclass(frozen=True)
class Box:
    """A box of a global tensor and the local tensor (row-major, same shape) that holds it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local: torch.Tensor


@dataclass(frozen=True)
class Target:
    """One entry of the model's sharded state dict: global shape, dtype, this rank's boxes."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: tuple[Box, ...]


@dataclass(frozen=True)
class Copy:
    """Copy the intersection of a stored chunk (of file tensor ``source``) with a box."""

    target: str
    source: str
    chunk: Chunk
    box: Box
    dtype: str  # the stored dtype


def torch_dtype(name: str) -> torch.dtype:
    value = getattr(torch, dtypes.canonical(name))
    assert isinstance(value, torch.dtype)
    return value


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtensor_boxes(fqn: str, value: DTensor) -> tuple[Box, ...]:
    for placement in value.placements:
        if type(placement) not in (Shard, Replicate):
            raise UnsupportedCheckpointError(
                f"{fqn!r}: placement {placement} is not supported (only Shard and Replicate "
                "DTensors, as FSDP2 and plain tensor parallelism make)",
                fqn=fqn,
            )
    chunks = value.__create_chunk_list__()  # type: ignore[no-untyped-call]  # as dcp.save
    if len(chunks) != 1:
        raise UnsupportedCheckpointError(
            f"{fqn!r}: the local tensor holds {len(chunks)} boxes, expected one", fqn=fqn
        )
    local = value.to_local()
    return (Box(tuple(chunks[0].offsets), tuple(chunks[0].sizes), local),)


def find_targets(state: Mapping[str, Any]) -> dict[str, Target]:
    """This rank's boxes of every tensor of the model's sharded state dict."""
    out: dict[str, Target] = {}
    for fqn, value in state.items():
        if isinstance(value, DTensor):
            boxes = _dtensor_boxes(fqn, value)
            shape, dtype = tuple(value.shape), value.dtype
        elif hasattr(value, "local_shards"):  # FSDP1's ShardedTensor (private class: duck-typed)
            boxes = tuple(
                Box(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes), s.tensor)
                for s in value.local_shards()
            )
            shape, dtype = tuple(value.size()), value.dtype
        elif isinstance(value, torch.Tensor):
            boxes = (Box((0,) * value.dim(), tuple(value.shape), value),)
            shape, dtype = tuple(value.shape), value.dtype
        else:
            continue  # non-tensor extra state: not in a safetensors file
        for box in boxes:
            if box.local.device.type == "meta":
                raise UsageError(
                    f"{fqn!r} is on the meta device: allocate the model first "
                    '(model.to_empty(device="cpu") or "cuda"), then call load_pretrained',
                    fqn=fqn,
                )
            if not box.local.is_contiguous():
                raise UnsupportedCheckpointError(
                    f"{fqn!r}: the local tensor is not contiguous; load into a model whose "
                    "parameters are (as nn.Module, FSDP and DTensor make them)",
                    fqn=fqn,
                )
        out[fqn] = Target(fqn, shape, dtype, boxes)
    return out


def check_entry(root: str, entry: TensorEntry) -> None:
    """A (converted) entry's chunks are raw row-major runs that tile its shape exactly once."""
    for chunk in entry.chunks:
        check_raw(root, entry.fqn, chunk)
    check_tiling(root, entry)


def check_raw(root: str, fqn: str, chunk: Chunk) -> None:
    """``chunk`` is a raw row-major run of bytes (what :class:`Filler` reads)."""
    if chunk.encoding != "raw" or chunk.strides is not None:
        raise UnsupportedCheckpointError(
            f"{storage.join(root, chunk.file)}: {fqn!r} is not stored as raw row-major bytes",
            path=storage.join(root, chunk.file),
            fqn=fqn,
        )


def check_tiling(root: str, entry: TensorEntry) -> None:
    """``entry``'s chunks tile its shape exactly once."""
    problems = tiling_problems(entry.shape, [(c.offsets, c.sizes) for c in entry.chunks])
    if problems:
        raise UsageError(
            f"{root}: the stored pieces of {entry.fqn!r} do not tile its shape "
            f"{list(entry.shape)} ({problems[0].kind})",
            path=root,
            fqn=entry.fqn,
        )


def overlaps(chunk: Chunk, box: Box) -> bool:
    """Whether the stored ``chunk`` and ``box`` share an element (a 0-dim tensor: always)."""
    return all(
        c < b + bs and b < c + cs
        for c, cs, b, bs in zip(chunk.offsets, chunk.sizes, box.offsets, box.sizes, strict=True)
    )


def _windows(
    runs: Iterable[tuple[int, int, int]], limit: int, gap: int
) -> Iterator[tuple[int, int, list[tuple[int, int, int]]]]:
    """Group runs ``(src, dst, n)`` (elements) into reads ``(start, end, runs)`` of at most
    ``limit`` elements, splitting longer runs and joining runs at most ``gap`` apart."""
    start = end = 0
    group: list[tuple[int, int, int]] = []
    for src, dst, n in runs:
        while n:
            k = min(n, limit)
            if group and (src - end > gap or src + k - start > limit):
                yield start, end, group
                group = []
            if not group:
                start = src
            group.append((src, dst, k))
            end = src + k
            src, dst, n = src + k, dst + k, n - k
    if group:
        yield start, end, group


def _direct(local: torch.Tensor, stored: torch.dtype) -> bool:
    """Whether pieces can be read straight into ``local``'s memory (no buffer, no cast)."""
    return local.dtype == stored and local.device.type == "cpu"


def _flat_bytes(flat: torch.Tensor, start: int, n: int) -> memoryview:
    piece: Any = flat[start : start + n].view(torch.uint8).numpy()
    return memoryview(piece).cast("B")


class Filler:
    """Executes copies through one reader and one reusable buffer; counts the bytes read."""

    def __init__(self, reader: storage.Reader, buffer_bytes: int) -> None:
        self.reader = reader
        self.buffer_bytes = buffer_bytes
        self.buffer: bytearray | None = None
        self.bytes_read = 0

    def _buffer(self, nbytes: int) -> bytearray:
        if self.buffer is None or len(self.buffer) < nbytes:
            self.buffer = bytearray(min(self.buffer_bytes, max(nbytes, 1)))
        return self.buffer

    def copy(self, c: Copy) -> None:
        stored = torch_dtype(c.dtype)
        itemsize = dtypes.dtype(c.dtype).itemsize
        flat = c.box.local.detach().view(-1)  # contiguous: checked with the targets
        direct = _direct(flat, stored)
        runs = list(copy_runs(c.chunk.offsets, c.chunk.sizes, c.box.offsets, c.box.sizes))
        if direct:
            if runs:  # one system call faults in the pages the reads will fill (io.memory)
                low = min(dst for _, dst, _ in runs)
                high = max(dst + n for _, dst, n in runs)
                memory.populate(flat.data_ptr() + low * itemsize, (high - low) * itemsize)
            for src, dst, n in runs:  # straight into the parameter: one read per run
                self.reader.readinto(
                    c.chunk.file, c.chunk.offset + src * itemsize, _flat_bytes(flat, dst, n)
                )
                self.bytes_read += n * itemsize
        else:
            limit = max(1, self.buffer_bytes // itemsize)
            for start, end, group in _windows(runs, limit, max(1, _GAP_BYTES // itemsize)):
                nbytes = (end - start) * itemsize
                buf = self._buffer(nbytes)
                self.reader.readinto(
                    c.chunk.file, c.chunk.offset + start * itemsize, memoryview(buf)[:nbytes]
                )
                self.bytes_read += nbytes
                pieces = torch.frombuffer(buf, dtype=stored, count=end - start)
                for src, dst, n in group:  # copy_ casts to the parameter's dtype
                    flat[dst : dst + n].copy_(pieces[src - start : src - start + n])


def entry_file(root: str, entry: TensorEntry) -> str:
    """The file an error about ``entry`` names: its first chunk's, else the checkpoint."""
    return storage.join(root, entry.chunks[0].file) if entry.chunks else root


def check_shape(root: str, target: Target, entry: TensorEntry, holder: str) -> str:
    """Refuse ``entry`` unless it has ``target``'s shape (nothing sensible can be loaded);
    ``holder`` names whose tensor ``target`` is (``"model"``, ``"job"``). Returns the file
    named in errors, for the caller's own checks."""
    where = entry_file(root, entry)
    if entry.shape != target.shape:
        raise UsageError(
            f"{where}: {entry.fqn!r} has shape {list(entry.shape)}, the {holder}'s "
            f"{target.fqn!r} has {list(target.shape)}",
            path=where,
            fqn=entry.fqn,
        )
    return where
