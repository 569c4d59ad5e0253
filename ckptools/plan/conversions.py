"""transformers' on-disk formats: the conversion mapping turned into byte re-arrangements (pure).

transformers 5 keeps some models in memory in another shape than their files: a mixture-of-experts
layer holds its experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H]) where ``save_pretrained``
writes one tensor per expert and half (``mlp.experts.<e>.gate_proj.weight`` [I, H]), through the
``WeightConverter`` entries of ``transformers/conversion_mapping.py`` (``MergeModulelist`` stacks
the experts, ``Concatenate`` joins the halves; both reversed on save). Every such tensor on disk is
a box of the fused tensor (expert ``e`` on the stacked dim, part ``h`` on the joined dim), so
both directions are byte runs:

* :meth:`Rules.to_disk` maps in-memory names and shapes to :class:`Piece` s: each on-disk tensor
  and the box of the in-memory tensor it is (``consolidate``: a box of a stored chunk is a run
  of its bytes, :func:`split_entries`);
* :meth:`Rules.to_memory` maps on-disk names to the same pieces (``shard``: the fused tensor's
  chunks are the per-expert tensors' chunks placed at their boxes, :func:`merge_entries`).

The rules come from the installed transformers at run time (:func:`rules_for`), never from a copied
table, and each name they produce is checked against transformers' own loading rename
(``core_model_loading.rename_source_key``). An operation that is not a stack or a join (a
transpose, a RoPE permutation...) is refused by name when a tensor meets it. Without transformers,
or for a model without a conversion, :func:`rules_for` returns None and names stay as stored.

Only :func:`rules_for` imports transformers (lazily; the import costs seconds, so it runs only
when ``config.json`` names a model type or class the mapping's source text mentions); the rest is
string and box arithmetic, no torch.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckptools.core.manifest import Chunk, Manifest, TensorEntry
from ckptools.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptools.plan.dcp import ChunkIndex
from ckptools.plan.safetensors import unique_chunks

Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class Piece:
    """One on-disk tensor and the box of an in-memory tensor it is.

    Attributes:
        disk: the name ``save_pretrained`` writes.
        memory: the in-memory FQN (the fused tensor, or the same tensor renamed).
        offsets: the box's offsets in the in-memory tensor.
        sizes: the box's sizes in the in-memory tensor.
        stack_dim: the in-memory dim the on-disk tensor lacks (the experts), or None when the
            on-disk tensor has the in-memory tensor's dims.
        rule: the transformers transform that relates them ("" for an unchanged name).
    """

    disk: str
    memory: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    stack_dim: int | None
    rule: str

    @property
    def disk_shape(self) -> tuple[int, ...]:
        return _drop(self.sizes, self.stack_dim)

    @property
    def whole(self) -> bool:
        """The on-disk tensor is the in-memory tensor, only (perhaps) renamed."""
        return self.rule in ("", "rename")


@dataclass(frozen=True)
class KeyMap:
    """Every tensor's pieces, and the in-memory shapes (fused tensors included)."""

    pieces: tuple[Piece, ...]
    memory_shapes: Mapping[str, tuple[int, ...]]
    mapping: str  # what was applied, for reports: "transformers qwen3_moe (2 rules)"

    @property
    def rules(self) -> tuple[str, ...]:
        return tuple(sorted({p.rule for p in self.pieces if p.rule}))

    @property
    def converted(self) -> bool:
        return any(p.rule for p in self.pieces)


def _drop(dims: tuple[int, ...], dim: int | None) -> tuple[int, ...]:
    return dims if dim is None else dims[:dim] + dims[dim + 1 :]


def _insert(dims: tuple[int, ...], dim: int | None, value: int) -> tuple[int, ...]:
    return dims if dim is None else (*dims[:dim], value, *dims[dim:])


@dataclass(frozen=True)
class _Fusion:
    """One transformers ``WeightConverter`` that stacks experts and perhaps joins parts."""

    converter: Any  # transformers WeightConverter (load direction: disk -> memory)
    reverse: Any  # its reverse_transform() (save direction)
    stack_dim: int
    join_dim: int | None  # in the stacked tensor
    name: str
    refusal: str | None  # why it is not a byte re-arrangement, if it is not


class Rules:
    """The conversion mapping of one model type, from the installed transformers.

    Build with :func:`rules_for`; ``to_disk`` / ``to_memory`` are pure.
    """

    def __init__(self, model_type: str, transforms: list[Any]) -> None:
        from transformers.core_model_loading import (
            Concatenate,
            MergeModulelist,
            WeightConverter,
            WeightRenaming,
        )

        self.model_type = model_type
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.reverse_renamings: list[Any] = [t.reverse_transform() for t in self.renamings[::-1]]
        self.fusions: list[_Fusion] = []
        for c in self.converters:
            ops = list(c.operations)
            kinds = [type(op).__name__ for op in ops]
            name = f"{' + '.join(c._original_source_patterns)} -> {c._original_target_patterns[0]}"
            refusal = None
            stack = join = None
            if ops and isinstance(ops[0], MergeModulelist):
                stack = ops[0].dim
                if len(ops) == 2 and isinstance(ops[1], Concatenate):
                    join = ops[1].dim
                elif len(ops) != 1 or len(c._original_target_patterns) != 1:
                    refusal = f"operations {kinds}"
            else:
                refusal = f"operations {kinds}"
            if stack is not None and len(c._original_source_patterns) > 1 and join is None:
                refusal = f"operations {kinds}"
            self.fusions.append(_Fusion(c, c.reverse_transform(), stack or 0, join, name, refusal))
        self.mapping = f"transformers {model_type} ({len(transforms)} rules)"

    # -- load direction -------------------------------------------------------------------------

    def _load_name(self, disk: str) -> tuple[str, _Fusion | None, int]:
        """transformers' own rename of an on-disk key: (in-memory key, fusion, part index)."""
        from transformers.core_model_loading import apply_renamings

        renamed = apply_renamings(disk, self.renamings)
        for f in self.fusions:
            out, pattern = f.converter.rename_source_key(renamed)
            if pattern is not None:
                return out, f, f.converter.source_patterns.index(pattern)
        return renamed, None, 0

    def to_memory(self, shapes: Shapes) -> KeyMap:
        """Pieces for on-disk tensors ``shapes`` (name → shape): what ``from_pretrained`` loads.

        Raises:
            UnsupportedCheckpointError: a tensor meets an operation that is not a byte
                re-arrangement, or its experts are not numbered 0..E-1.
            CorruptCheckpointError: the parts of one fused tensor disagree in shape.
        """
        groups: dict[str, dict[tuple[int, int], str]] = {}
        fusion_of: dict[str, _Fusion] = {}
        pieces: list[Piece] = []
        mem_shapes: dict[str, tuple[int, ...]] = {}
        for disk in shapes:
            memory, f, part = self._load_name(disk)
            if f is None:
                pieces.append(Piece(disk, memory, (0,) * len(shapes[disk]), shapes[disk], None,
                                    "" if memory == disk else "rename"))  # fmt: skip
                mem_shapes[memory] = shapes[disk]
                continue
            _refuse(f, disk)
            groups.setdefault(memory, {})[(_expert(f.converter, disk, part), part)] = disk
            fusion_of[memory] = f
        for memory, members in groups.items():
            f = fusion_of[memory]
            parts = len(f.converter.source_patterns)
            experts = 1 + max(e for e, _ in members)
            if len(members) != experts * parts:
                raise UnsupportedCheckpointError(
                    f"{memory!r}: rule {f.name!r} needs {parts} part(s) of experts 0..{experts - 1}"
                    f", found {len(members)} tensors; the experts are incomplete"
                )
            part_shape = shapes[members[(0, 0)]]
            for disk in members.values():
                if shapes[disk] != part_shape:
                    raise CorruptCheckpointError(
                        f"{disk!r}: shape {list(shapes[disk])} differs from {members[(0, 0)]!r} "
                        f"{list(part_shape)}; rule {f.name!r} stacks them into {memory!r}"
                    )
            stacked = _insert(part_shape, f.stack_dim, experts)
            step = stacked[f.join_dim] if f.join_dim is not None else 0
            shape = stacked
            if f.join_dim is not None:
                shape = tuple(n * parts if d == f.join_dim else n for d, n in enumerate(stacked))
            mem_shapes[memory] = shape
            for (e, h), disk in sorted(members.items()):
                offsets = [0] * len(shape)
                offsets[f.stack_dim] = e
                if f.join_dim is not None:
                    offsets[f.join_dim] += h * step
                sizes = _insert(part_shape, f.stack_dim, 1)
                pieces.append(Piece(disk, memory, tuple(offsets), sizes, f.stack_dim, f.name))
        return KeyMap(tuple(pieces), mem_shapes, self.mapping)

    # -- save direction -------------------------------------------------------------------------

    def to_disk(self, shapes: Shapes) -> KeyMap:
        """Pieces for in-memory tensors ``shapes``: what ``save_pretrained`` writes.

        Every on-disk name made here is renamed back by transformers' own loading rename to the
        in-memory name and part it came from; a disagreement is an error, not a guess.

        Raises:
            UnsupportedCheckpointError: a tensor meets an operation that is not a byte
                re-arrangement, or transformers would load a name made here elsewhere.
        """
        from transformers.core_model_loading import apply_renamings

        pieces: list[Piece] = []
        for memory, shape in shapes.items():
            found = None
            for f in self.fusions:
                matched = f.reverse._scoped_match(memory)
                if matched is not None:
                    found = (f, matched[2])
                    break
            if found is None:
                disk = apply_renamings(memory, self.reverse_renamings)
                pieces.append(Piece(disk, memory, (0,) * len(shape), shape, None,
                                    "" if disk == memory else "rename"))  # fmt: skip
                continue
            f, match = found
            _refuse(f, memory)
            parts = f.converter._original_source_patterns
            experts = shape[f.stack_dim]
            sizes = _insert(_drop(shape, f.stack_dim), f.stack_dim, 1)
            step = 0
            if f.join_dim is not None:
                if shape[f.join_dim] % len(parts):
                    raise UnsupportedCheckpointError(
                        f"{memory!r}: dim {f.join_dim} of shape {list(shape)} does not split into "
                        f"{len(parts)} equal parts as rule {f.name!r} needs"
                    )
                step = shape[f.join_dim] // len(parts)
                sizes = tuple(step if d == f.join_dim else n for d, n in enumerate(sizes))
            for e in range(experts):
                for h, pattern in enumerate(parts):
                    local = match.string.replace(match.group(0), pattern.replace("*", str(e)), 1)
                    disk = apply_renamings(
                        memory.replace(match.string, local), self.reverse_renamings
                    )
                    back, g, part = self._load_name(disk)
                    if (back, g, part) != (memory, f, h):
                        raise UnsupportedCheckpointError(
                            f"{memory!r}: rule {f.name!r} would write expert {e} as {disk!r}, "
                            f"which transformers loads as {back!r}; this mapping cannot be "
                            "reversed by name"
                        )
                    offsets = [0] * len(shape)
                    offsets[f.stack_dim] = e
                    if f.join_dim is not None:
                        offsets[f.join_dim] = h * step
                    pieces.append(Piece(disk, memory, tuple(offsets), sizes, f.stack_dim, f.name))
        return KeyMap(tuple(pieces), dict(shapes), self.mapping)


def _refuse(f: _Fusion, name: str) -> None:
    if f.refusal is not None:
        raise UnsupportedCheckpointError(
            f"{name!r}: transformers converts it with rule {f.name!r} ({f.refusal}); ckptools "
            "turns only MergeModulelist [+ Concatenate] into byte runs; keep the stored form "
            "(--keep-in-memory-names, or --keep-stored-names for shard)"
        )


def _expert(converter: Any, disk: str, part: int) -> int:
    pattern = converter._original_source_patterns[part]
    regex = re.escape(pattern).replace(r"\*", r"(\d+)")
    found = re.search(regex, disk)
    if found is None or not found.groups():
        raise UnsupportedCheckpointError(
            f"{disk!r}: no expert index where pattern {pattern!r} has '*'"
        )
    return int(found.group(1))


def _mentioned(names: list[str]) -> bool:
    """Whether the installed transformers' mapping source mentions any of ``names`` (quoted):
    a read of one file instead of a multi-second import for models it cannot convert."""
    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    for location in spec.submodule_search_locations:
        try:
            with open(f"{location}/conversion_mapping.py", encoding="utf-8") as f:
                text = f.read()
        except OSError:
            continue
        return any(f'"{n}"' in text for n in names)
    return False


def rules_for(config: Mapping[str, Any] | None) -> Rules | None:
    """The installed transformers' conversion rules for the model ``config`` (a config.json).

    Looks the model up as transformers does (class name from ``architectures`` first, then
    ``model_type``); returns None without transformers, for a config naming neither, or for a
    model without a conversion. Imports transformers only when its mapping names the model.

    Example:
        >>> rules_for({"model_type": "llama"}) is None  # doctest: +SKIP
        True
    """
    if not config:
        return None
    names = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    model_type = config.get("model_type")
    if isinstance(model_type, str):
        names.append(model_type)
    if not names or not _mentioned(names):
        return None
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    for name in names:
        transforms = get_checkpoint_conversion_mapping(name)  # type: ignore[no-untyped-call]
        if transforms:
            return Rules(name, list(transforms))
    return None


def _strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    out = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        out[d] = out[d + 1] * sizes[d + 1]
    return tuple(out)


def _sub_chunk(raw: Chunk, chunk: Chunk, piece: Piece, itemsize: int) -> Chunk:
    """The part of ``chunk`` (resolved to ``raw``) in ``piece``'s box, in on-disk coordinates."""
    lo = tuple(max(a, b) for a, b in zip(chunk.offsets, piece.offsets, strict=True))
    hi = tuple(
        min(a + n, b + m)
        for a, n, b, m in zip(chunk.offsets, chunk.sizes, piece.offsets, piece.sizes, strict=True)
    )
    sizes = tuple(h - low for low, h in zip(lo, hi, strict=True))
    strides = raw.strides or _strides(chunk.sizes)
    start = sum((low - o) * s for low, o, s in zip(lo, chunk.offsets, strides, strict=True))
    span = 1 + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))
    out_offsets = _drop(tuple(low - o for low, o in zip(lo, piece.offsets, strict=True)),
                        piece.stack_dim)  # fmt: skip
    numel = math.prod(sizes)
    contiguous = raw.strides is None and span == numel
    return replace(
        raw,
        offsets=out_offsets,
        sizes=_drop(sizes, piece.stack_dim),
        offset=raw.offset + start * itemsize,
        length=(numel if contiguous else span) * itemsize,
        strides=None if contiguous else _drop(strides, piece.stack_dim),
        crc32=raw.crc32 if sizes == chunk.sizes else None,
    )


def split_fqn(fqn: str, disk: str) -> str:
    """The FQN :func:`split_entries` gives the on-disk tensor ``disk`` cut from stored ``fqn``."""
    return f"{fqn}/{disk}"


def split_entries(
    manifest: Manifest,
    names: Mapping[str, str],
    keymap: KeyMap,
    raw: Callable[[TensorEntry, Chunk], Chunk],
) -> tuple[Manifest, dict[str, str], list[tuple[str, Chunk]]]:
    """The on-disk tensors of ``names`` (in-memory name → stored FQN) as manifest entries.

    A piece that is a whole tensor keeps its stored entry under its on-disk name; a piece that
    is a box of a fused tensor gets an entry ``"<stored FQN>/<on-disk name>"`` whose chunks are
    the boxes of the stored chunks inside it, as raw byte ranges (``raw`` resolves a stored
    chunk: the one I/O step, the caller's).

    Returns:
        The manifest with those entries added, on-disk name → FQN in it (in ``names``' order),
        and ``(stored FQN, resolved chunk)`` of the records no new chunk covers whole (their
        CRC-32 is for the caller to check).
    """
    by_memory: dict[str, list[Piece]] = {}
    for p in keymap.pieces:
        by_memory.setdefault(p.memory, []).append(p)
    added: dict[str, TensorEntry] = {}
    out: dict[str, str] = {}
    unchecked: dict[tuple[str, int], tuple[str, Chunk]] = {}
    for memory, fqn in names.items():
        entry = manifest.tensors[fqn]
        sources: ChunkIndex | None = None  # built once per stored tensor: linear in its chunks
        for p in by_memory.get(memory, ()):
            if p.whole:
                out[p.disk] = fqn
                continue
            new_fqn = split_fqn(fqn, p.disk)
            chunks = []
            sources = sources or ChunkIndex(entry)
            for c in sources.meeting(p.offsets, p.sizes):
                r = raw(entry, c)
                sub = _sub_chunk(r, c, p, entry.itemsize)
                if not r.file:  # boxes only (save_pretrained's manifest): no bytes to point at
                    sub = replace(sub, offset=0, length=0, strides=None)
                if r.crc32 is not None and sub.crc32 is None:
                    unchecked[(r.file, r.offset)] = (fqn, r)
                chunks.append(sub)
            added[new_fqn] = TensorEntry(new_fqn, entry.dtype, p.disk_shape, tuple(chunks))
            out[p.disk] = new_fqn
    tensors = {**manifest.tensors, **added}
    return replace(manifest, tensors=tensors), out, list(unchecked.values())


def merge_entries(
    manifest: Manifest,
    names: Mapping[str, str],
    keymap: KeyMap,
    raw: Callable[[TensorEntry, Chunk], Chunk],
) -> tuple[Manifest, dict[str, str]]:
    """The in-memory tensors of ``names`` (on-disk name → stored FQN) as manifest entries.

    A fused tensor gets an entry under its in-memory name whose chunks are its parts' stored
    chunks (resolved to raw byte ranges by ``raw``) placed at their boxes; a whole piece keeps
    its stored entry.

    Returns:
        The manifest with those entries added, and in-memory name → FQN in it.

    Raises:
        CorruptCheckpointError: the parts of one fused tensor differ in dtype.
    """
    added: dict[str, list[Chunk]] = {}
    dtype: dict[str, tuple[str, str]] = {}
    out: dict[str, str] = {}
    for p in keymap.pieces:
        fqn = names[p.disk]
        entry = manifest.tensors[fqn]
        if p.whole:
            out[p.memory] = fqn
            continue
        first = dtype.setdefault(p.memory, (entry.dtype, fqn))
        if first[0] != entry.dtype:
            raise CorruptCheckpointError(
                f"{fqn!r} is {entry.dtype} but {first[1]!r} is {first[0]}; rule {p.rule!r} "
                f"stacks both into {p.memory!r}",
                fqn=fqn,
            )
        placed = added.setdefault(p.memory, [])
        for c in unique_chunks(entry):
            r = raw(entry, c)
            placed.append(
                replace(
                    r,
                    offsets=tuple(
                        a + b
                        for a, b in zip(_insert(c.offsets, p.stack_dim, 0), p.offsets, strict=True)
                    ),
                    sizes=_insert(c.sizes, p.stack_dim, 1),
                    strides=None if r.strides is None else _insert(r.strides, p.stack_dim, 0),
                )
            )
        # a stored tensor of the same name (never the case for a real model) is not replaced
        out[p.memory] = p.memory if p.memory not in manifest.tensors else f"{p.memory}/fused"
    tensors = dict(manifest.tensors)
    for memory, chunks in added.items():
        key = out[memory]
        shape = keymap.memory_shapes[memory]
        tensors[key] = TensorEntry(key, dtype[memory][0], shape, tuple(chunks))
    return replace(manifest, tensors=tensors), out
