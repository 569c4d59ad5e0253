"""The one description of a checkpoint that every command starts from (torch-free).

A layout (DCP, safetensors, torch.save, and the wrappers around DCP) reads its on-disk metadata
into a :class:`Manifest`: for each FQN either a :class:`TensorEntry` (dtype, global shape, and the
stored :class:`Chunk` pieces with their byte locations) or an :class:`ObjectEntry` (non-tensor
state). Nothing here touches tensor bytes; planners work on manifests alone.

Byte locations come in two encodings:

* ``"raw"``: the chunk's elements are at ``offset`` in ``file``, laid out with ``strides``
  (``None`` means row-major contiguous); safetensors and ``torch.save`` files.
* ``"torch_save"``: ``[offset, offset + length)`` of ``file`` is one ``torch.save`` archive that
  holds the chunk (a DCP ``.distcp`` item); the raw bytes are found by reading the archive's
  directory, see :mod:`ckptools.formats.torch_archive`.

Either may have been passed through stream transforms when written (a DCP storage extension:
``transforms``, e.g. ``("stream.zstd/1",)``): the byte range then holds the transformed stream.
The layout records them once, at read; :mod:`ckptools.formats.stream_transforms` is the one place
that maps them to a decoder or to the refusal every command gives.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from ckptools.core import dtypes

Encoding = Literal["raw", "torch_save"]
#: an item stored as one ``torch.save`` archive (a chunk encoding, not the ``torch_save`` layout)
ARCHIVE: Encoding = "torch_save"


class Record(NamedTuple):
    """A stored record with a CRC-32 of its bytes (a ``torch.save`` archive's ``data/<key>``):
    ``length`` bytes at byte ``offset`` of the chunk's file."""

    offset: int
    length: int
    crc32: int


def stored_in(record: Record, offset: int, length: int, contiguous: bool = True) -> dict[str, Any]:
    """The ``crc32``/``record`` fields of a chunk whose bytes are ``[offset, offset+length)`` of
    its file, inside ``record``: the record's CRC when they are all of it, in order; else the
    record, checked whole before the chunk is read (:func:`ckptools.engine.checked_copy.
    check_record_of`): a view or a flat partition's parameter has no CRC of its own."""
    whole = contiguous and offset == record.offset and length == record.length
    return {"crc32": record.crc32} if whole else {"crc32": None, "record": record}


def record_of(chunk: Chunk) -> Record | None:
    """The stored record whose CRC-32 checks ``chunk``'s bytes: the chunk itself, when it is
    a whole record, or the one it is part of; None when its container stores no CRC."""
    if chunk.crc32 is not None:
        return Record(chunk.offset, chunk.length, chunk.crc32)
    return chunk.record


class Chunk(NamedTuple):
    """One stored piece of a tensor: a box of the global tensor and where its bytes are.

    A named tuple, not a frozen dataclass: a 405B checkpoint at 1,024 ranks has 1.16M of them,
    and a frozen dataclass's ``__init__`` cost 1.4 µs each (1.65 s of a 20 s ``inspect``), the
    tuple's 0.35 µs. Change one with ``chunk._replace(...)``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # path relative to the checkpoint root
    offset: int  # byte offset in ``file``
    length: int  # bytes occupied in ``file`` (the archive for torch_save, the span for raw)
    encoding: Encoding = "raw"
    rank: int | None = None  # the rank that wrote it, when the layout records one
    strides: tuple[int, ...] | None = None  # element strides for raw data; None = contiguous
    # CRC-32 of exactly this chunk's raw bytes, when the container records one (a DCP item whose
    # storage is the chunk); lets writers combine CRCs instead of re-reading bytes.
    crc32: int | None = None
    # stream transforms the stored bytes went through (DCP ``transform_descriptors``), in the
    # order that undoes them; () = stored as they are. Read with stream_transforms.decoder.
    transforms: tuple[str, ...] = ()
    # the record these bytes are only part of (crc32 is None then), when it stores a CRC-32:
    # checked whole, once, before they are read (:func:`stored_in`)
    record: Record | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    fqn: str
    dtype: str  # torch name, e.g. "bfloat16"
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return dtypes.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (global) tensor."""
        return self.numel * self.itemsize

    @property
    def stored_bytes(self) -> int:
        """Bytes of tensor data actually stored, summed over chunks (replicas count once each)."""
        return sum(c.numel for c in self.chunks) * self.itemsize


@dataclass(frozen=True, slots=True)
class ObjectEntry:
    """Non-tensor state (ints, strings, dicts, ``io.BytesIO``...).

    ``value`` holds the decoded value when the layout could decode it safely (plain Python data);
    DCP stores objects as separate ``torch.save`` items, located by ``file``/``offset``/``length``,
    which are only decoded on request (:func:`ckptools.formats.safe_pickle.load_object`).
    """

    fqn: str
    file: str | None = None
    offset: int = 0
    length: int = 0
    encoding: Encoding = "torch_save"
    value: Any = None
    has_value: bool = False
    transforms: tuple[str, ...] = ()  # as Chunk.transforms


@dataclass(frozen=True, slots=True)
class FileInfo:
    path: str  # relative to the checkpoint root
    size: int | None  # bytes on disk; None when not looked at
    rank: int | None = None


#: ``Manifest.details`` key a layout sets, to the reason, when the source holds optimizer state
#: the layout cannot place (verl's FSDP1 flat shards): a conversion that would carry the
#: optimizer refuses unless told to drop it, since the model alone would look whole
OPTIMIZER_UNREADABLE = "optimizer_unreadable"
#: ``Manifest.details`` key a layout sets when its producer keeps the model's ``config.json``
#: and tokenizer in a subdirectory of the checkpoint (verl's ``huggingface/``): relative to
#: ``root``, searched first for the files a conversion copies
MODEL_FILES_DIR = "model_files_dir"
#: ``Manifest.details`` key a layout sets (True) when the order of its model's tensors is not
#: the model's own (safetensors stores them sorted by name): integer optimizer ids, which are
#: in ``model.parameters()`` order, are then never placed by the stored order
MODEL_ORDER_UNKNOWN = "model_order_unknown"


@dataclass(frozen=True)
class Manifest:
    """A whole checkpoint: what it holds and where.

    Everything a command needs from the source is here, read once by the layout: no command
    parses a marker again or walks the tree again (at 878k chunks a parse costs ~6 s).

    Attributes:
        root: the path the user gave (a directory or a file).
        format: the storage format, ``"dcp"``, ``"safetensors"`` or ``"torch_save"``.
        layout: who wrote it, e.g. ``"fsdp2"``, ``"fsdp1"``, ``"accelerate"``, ``"trainer"``,
            ``"lightning"``, ``"torchtitan"``, ``"dcp"``, ``"hf"``, ``"torch_save"``.
        tensors: FQN → entry, in stored order.
        objects: FQN → non-tensor entry.
        files: relative path → :class:`FileInfo` of every data file the checkpoint consists of.
        world_size: number of ranks that wrote it, when known.
        paths: FQN → key path in the nested state dict (DCP's ``planner_data``), when known;
            needed where a key itself contains a dot.
        markers: files whose presence commits the checkpoint (e.g. ``.metadata``).
        notes: facts worth showing the user (e.g. "picked checkpoint-40 of 3").
        details: layout-specific facts (``placements`` per FQN, DCP version, ...).
        data_root: the directory ``files`` are relative to, as the layout found it (``root``,
            or the directory holding a single-file checkpoint); None means ``root``.
        parts: the DCP directories of a ``"dcp"`` checkpoint, each with its own manifest
            (accelerate's ``pytorch_model_fsdp_0/`` and ``optimizer_0/``; one part ``""`` for
            a plain DCP directory); empty for other formats and for manifests not read through
            a layout.
        aux_files: files below ``root`` (``/``-separated, relative) that are not the parts'
            data files or markers, found while the layout walked the tree: what a conversion
            copies beside the data (``trainer_state.json``, ``meta.pt``, RNG state...).
        marker_digests: marker → digest of the bytes the layout read, so that a resume
            fingerprint names the source without reading the markers again.
    """

    root: str
    format: str
    layout: str
    tensors: Mapping[str, TensorEntry]
    objects: Mapping[str, ObjectEntry]
    files: Mapping[str, FileInfo]
    world_size: int | None = None
    paths: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    markers: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)
    data_root: str | None = None
    parts: tuple[Part, ...] = ()
    aux_files: tuple[str, ...] = ()
    marker_digests: Mapping[str, str] = field(default_factory=dict)

    def __iter__(self) -> Iterator[str]:
        yield from self.tensors
        yield from self.objects

    def data_dir(self) -> str:
        """The directory that ``files`` (and every chunk's ``file``) are relative to."""
        return self.root if self.data_root is None else self.data_root

    def aliases(self) -> set[str]:
        """FQNs whose bytes are an earlier tensor's: a tied weight a ``torch.save`` state dict
        keeps once under two names (same dtype, shape and stored chunks)."""
        return set(self._aliases)

    @functools.cached_property
    def _aliases(self) -> frozenset[str]:
        # found once per manifest: ``inspect`` asks four times (totals, dtypes, model), and each
        # look keys every chunk (1.16M for a 405B model at 1,024 ranks)
        seen: set[tuple[Any, ...]] = set()
        out: set[str] = set()
        for fqn, t in self.tensors.items():
            if not t.chunks or not t.numel:
                continue
            where = tuple(sorted((c.file, c.offset, c.length, c.encoding) for c in t.chunks))
            key = (t.dtype, t.shape, where)
            if key in seen:
                out.add(fqn)
            else:
                seen.add(key)
        return frozenset(out)

    def placeholders_only(self, fqns: Iterable[str] | None = None) -> str | None:
        """When every weight (a tensor named ``*.weight``; without any, every tensor) of
        ``fqns`` (default: all) holds zero elements: why that is no model, for the error
        (ZeRO-3's model files keep each parameter as a ``[0]`` placeholder beside the real
        buffers, its data in the optimizer files); else None. Nothing converted from such
        tensors can work."""
        chosen = [self.tensors[f] for f in (self.tensors if fqns is None else fqns)]
        weights = [t for t in chosen if t.fqn.rsplit(".", 1)[-1] == "weight"] or chosen
        if not weights or any(t.numel for t in weights):
            return None
        what = "weights" if weights is not chosen else "tensors"
        return (
            f"{self.root}: all {len(weights)} {what} hold zero elements ({weights[0].fqn}: "
            f"{list(weights[0].shape)}...): placeholders, not weights; point at the whole "
            "checkpoint"
        )

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors at their global shapes, a tied alias (:meth:`aliases`) once."""
        aliases = self.aliases()
        return sum(t.nbytes for fqn, t in self.tensors.items() if fqn not in aliases)

    @property
    def total_params(self) -> int:
        """Elements of all tensors, a tied alias (:meth:`aliases`) once, as
        ``model.num_parameters()`` counts them."""
        aliases = self.aliases()
        return sum(t.numel for fqn, t in self.tensors.items() if fqn not in aliases)

    def bytes_per_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        aliases = self.aliases()
        for fqn, t in self.tensors.items():
            if fqn not in aliases:
                out[t.dtype] = out.get(t.dtype, 0) + t.nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def bytes_per_file(self) -> dict[str, int]:
        """Tensor bytes stored in each file (chunk payload, not container overhead)."""
        out: dict[str, int] = dict.fromkeys(self.files, 0)
        for t in self.tensors.values():
            for c in t.chunks:
                out[c.file] = out.get(c.file, 0) + c.numel * t.itemsize
        return out

    def bytes_per_rank(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for t in self.tensors.values():
            for c in t.chunks:
                if c.rank is not None:
                    out[c.rank] = out.get(c.rank, 0) + c.numel * t.itemsize
        return dict(sorted(out.items()))


@dataclass(frozen=True)
class Part:
    """One DCP directory of a checkpoint: ``subdir`` below the root (``""`` for the root itself)
    and its own manifest, whose file paths are relative to the checkpoint root."""

    subdir: str
    manifest: Manifest


def ordered(entries: Iterable[TensorEntry]) -> dict[str, TensorEntry]:
    return {e.fqn: e for e in entries}
