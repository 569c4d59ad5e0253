"""Planning a consolidation: which stored chunks land where in which safetensors file (pure).

The planner takes a :class:`~ckptools.core.manifest.Manifest` and the output names of the tensors to
export, and returns a frozen :class:`ConsolidationPlan`: the output files, each with its complete
safetensors header (as bytes) and, for every tensor, its byte range in the file and the source
chunks that tile it. It does no I/O and imports no torch, so ``--dry-run`` can print it and
property tests can check it. Cost is linear in the number of chunks; per-row work (a chunk sharded
on dim 1 lands as one run per row) is left to :func:`ckptools.core.geometry.tensor_runs`, which the
executor calls per chunk.

Source byte locations of DCP chunks are only known after reading each item's archive directory
(:func:`ckptools.engine.reader.resolve_chunk`), which is I/O, so the plan names chunks and the
executor resolves them; :func:`~ckptools.core.geometry.tensor_runs` then maps a chunk's (contiguous)
elements to output elements.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptools.core import dtypes
from ckptools.core.bulk import without_gc
from ckptools.core.geometry import Box, tensor_runs, tiling_problems
from ckptools.core.geometry import chunk_span as chunk_span
from ckptools.core.hf_files import INDEX_NAME as INDEX_NAME
from ckptools.core.manifest import Chunk, Manifest, TensorEntry
from ckptools.errors import CorruptCheckpointError
from ckptools.formats.safetensors_header import header_bytes, safetensors_code

#: The names the executor and ``save_pretrained`` place chunks with; the geometry (one runs
#: function, one span) lives in :mod:`ckptools.core.geometry`.
runs = tensor_runs

SINGLE_FILE_NAME = "model.safetensors"


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """One output tensor: its place in the file and the stored chunks that tile it.

    Attributes:
        name: key in the output file.
        fqn: stored FQN in the manifest.
        dtype: output dtype (torch name); differs from ``src_dtype`` only when casting.
        src_dtype: stored dtype.
        shape: global shape.
        begin: absolute byte offset of the tensor's first byte in the output file.
        nbytes: bytes in the output file.
        chunks: stored chunks, duplicates (replicas) removed, tiling ``shape`` exactly.
    """

    name: str
    fqn: str
    dtype: str
    src_dtype: str
    shape: tuple[int, ...]
    begin: int
    nbytes: int
    chunks: tuple[Chunk, ...]

    @property
    def is_cast(self) -> bool:
        return self.dtype != self.src_dtype


@dataclass(frozen=True, slots=True)
class FilePlan:
    """One output safetensors file: its header bytes (length prefix included) and tensors."""

    name: str
    header: bytes
    size: int
    tensors: tuple[TensorPlan, ...]

    @property
    def data_bytes(self) -> int:
        return self.size - len(self.header)


@dataclass(frozen=True)
class ConsolidationPlan:
    """Everything the executor needs to write the output directory.

    Attributes:
        files: output files in order.
        index: the ``model.safetensors.index.json`` content, or None for a single file.
        total_size: tensor bytes over all files (the index's ``metadata.total_size``).
    """

    files: tuple[FilePlan, ...]
    index: Mapping[str, Any] | None
    total_size: int

    @property
    def tensors(self) -> Iterator[TensorPlan]:
        for f in self.files:
            yield from f.tensors

    @property
    def bytes_to_write(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": [
                {
                    "name": f.name,
                    "bytes": f.size,
                    "tensors": [
                        {
                            "name": t.name,
                            "dtype": t.dtype,
                            "shape": list(t.shape),
                            "bytes": t.nbytes,
                        }
                        for t in f.tensors
                    ],
                }
                for f in self.files
            ],
            "total_size": self.total_size,
            "index": INDEX_NAME if self.index is not None else None,
        }


def unique_chunks(tensor: TensorEntry) -> tuple[Chunk, ...]:
    """The non-empty chunks of ``tensor``, replicas removed, checked to tile its shape exactly.

    The check is :func:`ckptools.core.geometry.tiling_problems`, the one verify reports from,
    so consolidate, reshard and verify agree on which checkpoints are whole.

    Raises:
        CorruptCheckpointError: a chunk lies outside the shape, chunks overlap, or leave a gap.
    """
    seen: dict[Box, Chunk] = {}
    for c in tensor.chunks:  # the first replica of each box is the one read
        seen.setdefault((c.offsets, c.sizes), c)
    problems = tiling_problems(tensor.shape, seen)
    if problems:
        p = problems[0]
        chunk = seen.get(p.box) if p.box is not None else None
        more = f" ({len(problems)} problems)" if len(problems) > 1 else ""
        raise CorruptCheckpointError(
            f"{tensor.fqn!r}: stored chunks do not tile its shape {list(tensor.shape)}: "
            f"{p.describe()}{more}; the checkpoint is incomplete or its metadata is damaged",
            fqn=tensor.fqn,
            rank=chunk.rank if chunk is not None else None,
        )
    return tuple(c for c in seen.values() if 0 not in c.sizes)  # not empty (1.16M at scale)


def shard_groups(sizes: Sequence[int], max_shard_size: int) -> list[list[int]]:
    """Indices of ``sizes`` grouped into shards, in order, as ``transformers`` splits them.

    A shard is closed when adding the next tensor would exceed ``max_shard_size``; a tensor
    larger than the limit gets a shard of its own.

    Example:
        >>> shard_groups([4, 4, 4, 10, 1], 8)
        [[0, 1], [2], [3], [4]]
    """
    groups: list[list[int]] = []
    current: list[int] = []
    current_size = 0
    for i, n in enumerate(sizes):
        if current and current_size + n > max_shard_size:
            groups.append(current)
            current, current_size = [], 0
        current.append(i)
        current_size += n
    if current or not groups:
        groups.append(current)
    return groups


@without_gc  # millions of items at scale: the collector would walk them again and again
def plan_consolidation(
    manifest: Manifest,
    names: Mapping[str, str],
    *,
    max_shard_size: int,
    dtype: str | None = None,
    kept_dtypes: Mapping[str, str] | None = None,
) -> ConsolidationPlan:
    """Plan the safetensors files for the tensors ``names`` (output name → stored FQN).

    Tensors are assigned to shards in the order of ``names``; inside a file they are laid out by
    decreasing dtype size, then name, as ``safetensors.torch.save_file`` does. ``dtype`` casts
    floating tensors only; ``kept_dtypes`` (output name → dtype) gives the tensors the model
    keeps in a dtype of their own (:attr:`ckptools.plan.conversions.KeyMap.kept_dtypes`) that
    dtype instead, whatever ``dtype`` says.

    Example:
        >>> from ckptools.core.manifest import Chunk, Manifest, TensorEntry
        >>> t = TensorEntry("w", "float32", (2, 3), (Chunk((0, 0), (2, 3), "f", 0, 24),))
        >>> m = Manifest("ck", "safetensors", "hf", {"w": t}, {}, {})
        >>> plan = plan_consolidation(m, {"w": "w"}, max_shard_size=10**9)
        >>> [(f.name, f.size) for f in plan.files]
        [('model.safetensors', 120)]
    """
    out_dtype = dtypes.canonical(dtype) if dtype is not None else None
    prepared: list[tuple[str, TensorEntry, str, int]] = []
    for name, fqn in names.items():
        entry = manifest.tensors[fqn]
        target = entry.dtype
        if kept_dtypes and name in kept_dtypes:
            target = dtypes.canonical(kept_dtypes[name])
        elif out_dtype is not None and dtypes.dtype(entry.dtype).is_floating:
            target = out_dtype
        safetensors_code(target, fqn=fqn)
        prepared.append((name, entry, target, entry.numel * dtypes.dtype(target).itemsize))

    groups = shard_groups([p[3] for p in prepared], max_shard_size)
    n = len(groups)
    files: list[FilePlan] = []
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups, start=1):
        fname = SINGLE_FILE_NAME if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
        members = sorted(
            (prepared[i] for i in group),
            key=lambda p: (-dtypes.dtype(p[2]).itemsize, p[0]),
        )
        entries = []
        pos = 0
        for name, entry, target, nbytes in members:
            entries.append((name, target, entry.shape, pos, pos + nbytes))
            pos += nbytes
        header = header_bytes(entries)
        tensors = tuple(
            TensorPlan(
                name=name,
                fqn=entry.fqn,
                dtype=target,
                src_dtype=entry.dtype,
                shape=entry.shape,
                begin=len(header) + begin,
                nbytes=end - begin,
                chunks=unique_chunks(entry),
            )
            for (name, entry, target, _), (_, _, _, begin, end) in zip(
                members, entries, strict=True
            )
        )
        files.append(FilePlan(fname, header, len(header) + pos, tensors))
        weight_map.update({t.name: fname for t in tensors})
    total = sum(f.data_bytes for f in files)
    index = None
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return ConsolidationPlan(tuple(files), index, total)
