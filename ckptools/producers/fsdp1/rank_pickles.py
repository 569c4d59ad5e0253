"""Per-rank ``torch.save`` files merged into one set of entries by FQN (torch-free).

A checkpoint that each rank writes as its own ``torch.save`` of its sharded state dict (verl's
``model_world_size_W_rank_r.pt`` files) holds, per FQN, one local piece per rank: a pickled
``DTensor`` (FSDP2's, or FSDP1's given a ``device_mesh``; placed by
:func:`ckptools.formats.dtensor.local_box`, a ``_StridedShard`` run by run), an FSDP1
``ShardedTensor`` (its local shards at their recorded offsets), or a plain value that every
rank holds alike (read from rank 0). :class:`Merged` adds files one
by one and checks that the ranks agree on every tensor's dtype and global shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptools.core import dtypes
from ckptools.core.manifest import Chunk, ObjectEntry, Record, TensorEntry, stored_in
from ckptools.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptools.formats import dtensor, safe_pickle, torch_archive
from ckptools.io import storage
from ckptools.io.storage import Reader
from ckptools.producers.hf.torch_save import flatten

#: the key path an optimizer's entries go under (as a torch.save directory names its file)
OPTIMIZER = "optimizer"


@dataclass
class Merged:
    """Entries of every rank's files, merged by FQN in rank 0's order."""

    root: str
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    chunks: dict[str, list[Chunk]] = field(default_factory=dict)
    objects: dict[str, ObjectEntry] = field(default_factory=dict)
    paths: dict[str, tuple[str, ...]] = field(default_factory=dict)
    placements: dict[str, tuple[str, ...]] = field(default_factory=dict)
    mesh: tuple[int, ...] | None = None  # the DeviceMesh's shape (FSDP2: from the first DTensor)
    offsets: dict[tuple[str, str], int] = field(default_factory=dict)  # (file, key) -> data
    #: the sharded tensors (FSDP1's parameters, ShardedTensors or, given a device_mesh,
    #: DTensors), in rank 0's order
    sharded: list[str] = field(default_factory=list)

    def add_file(self, reader: Reader, rel: str, rank: int, under: tuple[str, ...]) -> None:
        archive = torch_archive.read_archive(reader, rel, 0, reader.size(rel))
        obj = torch_archive.load_pickle(reader, archive, dtensor.GLOBALS)
        for key_path, leaf in flatten(obj):
            path = (*under, *key_path)
            fqn = ".".join(path)
            where = f"{storage.join(self.root, rel)}: {fqn!r}"
            sharded = isinstance(leaf, dtensor.DTensorRef | dtensor.ShardedTensorRef)
            if sharded and fqn not in self.paths:
                self.sharded.append(fqn)
            if isinstance(leaf, dtensor.DTensorRef):
                self._dtensor(reader, archive, rel, rank, fqn, path, leaf, where)
            elif isinstance(leaf, dtensor.ShardedTensorRef):
                self.paths.setdefault(fqn, path)
                self._put(fqn, leaf.dtype, leaf.shape, None, where)
                for offsets, local in leaf.shards:
                    if not isinstance(local, safe_pickle.TensorRef):
                        raise UnsupportedCheckpointError(
                            f"{where}: a local shard is {local.describe()}", fqn=fqn
                        )
                    if all(local.shape):
                        chunk = self._chunk(reader, archive, rel, rank, local, offsets)
                        self._put(fqn, leaf.dtype, leaf.shape, chunk, where)
            elif rank == 0:
                self.paths[fqn] = path
                if isinstance(leaf, safe_pickle.TensorRef):
                    chunk = self._chunk(reader, archive, rel, rank, leaf, (0,) * len(leaf.shape))
                    self._put(fqn, leaf.dtype, leaf.shape, chunk, where)
                elif isinstance(leaf, safe_pickle.OtherTensor):
                    raise UnsupportedCheckpointError(
                        f"{where} is {leaf.describe()}, not a dense tensor", fqn=fqn
                    )
                else:
                    value = safe_pickle.unwrap(leaf)
                    self.objects[fqn] = ObjectEntry(
                        fqn, value=value, has_value=True, encoding="raw"
                    )

    def _dtensor(
        self,
        reader: Reader,
        archive: torch_archive.Archive,
        rel: str,
        rank: int,
        fqn: str,
        path: tuple[str, ...],
        ref: dtensor.DTensorRef,
        where: str,
    ) -> None:
        try:
            box = dtensor.local_box(ref)
        except (CorruptCheckpointError, UnsupportedCheckpointError) as e:
            raise type(e)(f"{where}: {e}", fqn=fqn) from e
        saved_by = getattr(getattr(ref.spec, "mesh", None), "_rank", None)
        if type(saved_by) is int and saved_by != rank:
            raise CorruptCheckpointError(
                f"{where}: saved by rank {saved_by}, but the file is named rank {rank}'s "
                "(a copied or renamed rank file)",
                fqn=fqn,
            )
        if not isinstance(ref.local, safe_pickle.TensorRef):
            raise UnsupportedCheckpointError(
                f"{where}: its local tensor is {ref.local.describe()}", fqn=fqn
            )
        self.paths.setdefault(fqn, path)
        self.placements.setdefault(fqn, box.placements)
        if self.mesh is None:
            self.mesh = box.mesh
        if box.replica or 0 in box.sizes:
            self._put(fqn, ref.dtype, ref.shape, None, where)
            return
        local = ref.local
        for offsets, sizes, at in box.pieces:
            # a strided placement leaves the local rows apart: each run is a box of its own
            start = local.storage_offset + sum(
                a * st for a, st in zip(at, local.strides, strict=True)
            )
            part = dataclasses.replace(local, storage_offset=start, shape=sizes)
            self._put(
                fqn,
                ref.dtype,
                ref.shape,
                self._chunk(reader, archive, rel, rank, part, offsets),
                where,
            )

    def _chunk(
        self,
        reader: Reader,
        archive: torch_archive.Archive,
        rel: str,
        rank: int,
        ref: safe_pickle.TensorRef,
        offsets: tuple[int, ...],
    ) -> Chunk:
        key = ref.storage.key
        rec = archive.record(f"data/{key}")
        if (rel, key) not in self.offsets:
            self.offsets[rel, key] = torch_archive.record_data_offset(reader, archive, rec)
        itemsize = dtypes.dtype(ref.dtype).itemsize
        start = ref.storage_offset * itemsize
        span = ref.span_bytes(itemsize)
        problem = ref.expansion_problem(itemsize)
        if problem:
            raise CorruptCheckpointError(f"{storage.join(self.root, rel)}: a tensor {problem}")
        if start + span > rec.size:
            raise CorruptCheckpointError(
                f"{storage.join(self.root, rel)}: a tensor's bytes {start}..{start + span} reach "
                f"past its storage record data/{key} ({rec.size} bytes)"
            )
        record = Record(self.offsets[rel, key], rec.size, rec.crc32)
        return Chunk(
            offsets=offsets,
            sizes=ref.shape,
            file=rel,
            offset=self.offsets[rel, key] + start,
            length=span,
            rank=rank,
            strides=None if ref.is_contiguous else ref.strides,
            **stored_in(record, self.offsets[rel, key] + start, span, ref.is_contiguous),
        )

    def _put(
        self, fqn: str, dtype: str, shape: tuple[int, ...], chunk: Chunk | None, where: str
    ) -> None:
        entry = self.tensors.get(fqn)
        if entry is None:
            self.tensors[fqn] = TensorEntry(fqn, dtype, shape, ())
            self.chunks[fqn] = []
        elif (entry.dtype, entry.shape) != (dtype, shape):
            raise CorruptCheckpointError(
                f"{where} is {dtype} {list(shape)} here and {entry.dtype} {list(entry.shape)} "
                "in rank 0's file",
                fqn=fqn,
            )
        if chunk is not None:
            self.chunks[fqn].append(chunk)

    def put_state(
        self, fqn: str, name: str, dtype: str, shape: tuple[int, ...], chunks: Sequence[Chunk]
    ) -> None:
        """Optimizer state ``name`` of parameter ``fqn`` (FSDP1's, placed by FQN)."""
        path = (OPTIMIZER, "state", fqn, name)
        key = ".".join(path)
        self.paths[key] = path
        self.tensors[key] = TensorEntry(key, dtype, shape, ())
        self.chunks[key] = list(chunks)

    def put_value(self, path: tuple[str, ...], value: Any) -> None:
        key = ".".join(path)
        self.paths[key] = path
        self.objects[key] = ObjectEntry(key, value=value, has_value=True, encoding="raw")

    def add_to(self, merged: Merged) -> None:
        """Add this one's entries (read into a fresh one, so that a refusal adds none)."""
        merged.tensors.update(self.tensors)
        merged.chunks.update(self.chunks)
        merged.objects.update(self.objects)
        merged.paths.update(self.paths)

    def entries(self) -> dict[str, TensorEntry]:
        return {
            fqn: TensorEntry(fqn, e.dtype, e.shape, tuple(self.chunks[fqn]))
            for fqn, e in self.tensors.items()
        }
