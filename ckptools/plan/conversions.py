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
  of its bytes, :func:`~ckptools.plan.conversion_entries.split_entries`);
* :meth:`Rules.to_memory` maps on-disk names to the same pieces (``shard``: the fused tensor's
  chunks are the per-expert tensors' chunks placed at their boxes,
  :func:`~ckptools.plan.conversion_entries.merge_entries`).

The rules come from the installed transformers at run time (:func:`rules_for`), never from a copied
table, and each name they produce is checked against transformers' own loading rename
(``core_model_loading.rename_source_key``). ``Concatenate`` alone (parts joined in memory) and
``Chunk`` alone (one file tensor cut into in-memory parts: the fused side is on disk,
``Piece.fused_shape``) are boxes too. An operation that is not a stack, join or cut (a
transpose, a RoPE permutation...) is refused by name when a tensor meets it. Without transformers,
or for a model without a conversion, :func:`rules_for` returns None and names stay as stored.

Only :func:`rules_for` imports transformers (lazily, through
:mod:`~ckptools.plan.conversion_lookup`, which finds the rules per sub-model as transformers
does); the rest is string and box arithmetic, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptools.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptools.plan.conversion_lookup import lookup_names, mentioned, model_transforms

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
        fused_shape: when not empty, the fused tensor is the on-disk one, of this shape, and the
            box is in it: the in-memory tensor is a ``Chunk`` of a file tensor (a fused
            ``qkv``), the reverse of the usual MoE case.
        at: when not empty, the box is only part of the on-disk tensor, at these offsets in it
            (``stack_dim`` dropped), and ``whole_shape`` is the on-disk tensor's shape: several
            pieces (row ranges of a producer's fused QKV, one per query group) make one tensor.
        whole_shape: the on-disk tensor's shape when ``at`` is set.
    """

    disk: str
    memory: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    stack_dim: int | None
    rule: str
    fused_shape: tuple[int, ...] = ()
    at: tuple[int, ...] = ()
    whole_shape: tuple[int, ...] = ()

    @property
    def fused_on_disk(self) -> bool:
        return bool(self.fused_shape)

    @property
    def disk_shape(self) -> tuple[int, ...]:
        return self.whole_shape or self.fused_shape or drop_dim(self.sizes, self.stack_dim)

    @property
    def disk_box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) of the box in the on-disk tensor."""
        sizes = drop_dim(self.sizes, self.stack_dim)
        return (self.at or (0,) * len(sizes)), sizes

    @property
    def whole(self) -> bool:
        """The on-disk tensor is the in-memory tensor, only (perhaps) renamed."""
        return self.rule in ("", "rename")


@dataclass(frozen=True)
class KeyMap:
    """Every tensor's pieces, and the in-memory shapes (fused tensors included).

    ``kept_dtypes``: on-disk name -> the dtype the model keeps that tensor in whatever the
    model's dtype (transformers' ``_keep_in_fp32_modules_strict``): ``save_pretrained`` writes
    it so, and a model loaded in bf16 holds it so; a narrower stored tensor is widened to it
    (exactly: every bf16 or fp16 value is a float32 value) and ``--dtype`` leaves it alone.
    """

    pieces: tuple[Piece, ...]
    memory_shapes: Mapping[str, tuple[int, ...]]
    mapping: str  # what was applied, for reports: "transformers qwen3_moe (2 rules)"
    kept_dtypes: Mapping[str, str] = field(default_factory=dict)

    @property
    def rules(self) -> tuple[str, ...]:
        return tuple(sorted({p.rule for p in self.pieces if p.rule}))

    @property
    def converted(self) -> bool:
        return any(p.rule for p in self.pieces)


def drop_dim(dims: tuple[int, ...], dim: int | None) -> tuple[int, ...]:
    return dims if dim is None else dims[:dim] + dims[dim + 1 :]


def insert_dim(dims: tuple[int, ...], dim: int | None, value: int) -> tuple[int, ...]:
    return dims if dim is None else (*dims[:dim], value, *dims[dim:])


@dataclass(frozen=True)
class _Fusion:
    """One transformers ``WeightConverter``, classified as a byte re-arrangement or refused.

    ``kind``: "stack" (``MergeModulelist`` [+ ``Concatenate``]: experts stacked on
    ``stack_dim``, parts joined on ``join_dim``), "join" (``Concatenate`` only: the parts joined
    on ``join_dim``), "chunk" (``Chunk`` only: one file tensor cut on ``join_dim`` into the
    in-memory parts, the reverse of "join"), or "refused" (``refusal`` says why).
    """

    converter: Any  # transformers WeightConverter (load direction: disk -> memory)
    reverse: Any  # its reverse_transform() (save direction)
    kind: str
    stack_dim: int | None
    join_dim: int | None  # in the stacked tensor
    name: str
    refusal: str | None  # why it is not a byte re-arrangement, if it is not


def _classify(c: Any) -> tuple[str, int | None, int | None, str | None]:
    """(kind, stack dim, join dim, refusal) of converter ``c``; see :class:`_Fusion`."""
    from transformers.core_model_loading import Chunk, Concatenate, MergeModulelist

    ops = list(c.operations)
    sources, targets = c._original_source_patterns, c._original_target_patterns
    plain = all(getattr(op, "num_shards_attribute", None) is None for op in ops)
    if plain and ops and type(ops[0]) is MergeModulelist and len(targets) == 1:
        if len(ops) == 1 and len(sources) == 1:
            return "stack", ops[0].dim, None, None
        if len(ops) == 2 and type(ops[1]) is Concatenate:
            return "stack", ops[0].dim, ops[1].dim, None
    if plain and len(ops) == 1 and type(ops[0]) is Concatenate and len(targets) == 1:
        return "join", None, ops[0].dim, None
    if plain and len(ops) == 1 and type(ops[0]) is Chunk and len(sources) == 1 and len(targets) > 1:
        return "chunk", None, ops[0].dim, None
    return "refused", None, None, f"operations {[type(op).__name__ for op in ops]}"


class Rules:
    """The conversion mapping of one model type, from the installed transformers.

    Build with :func:`rules_for`; ``to_disk`` / ``to_memory`` are pure.
    """

    def __init__(self, model_type: str, transforms: list[Any]) -> None:
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        self.model_type = model_type
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.reverse_renamings: list[Any] = [t.reverse_transform() for t in self.renamings[::-1]]
        self.fusions: list[_Fusion] = []
        for c in self.converters:
            name = " + ".join(c._original_source_patterns)
            name = f"{name} -> {' + '.join(c._original_target_patterns)}"
            kind, stack, join, refusal = _classify(c)
            self.fusions.append(_Fusion(c, c.reverse_transform(), kind, stack, join, name, refusal))
        scopes = sorted({t.scope_prefix for t in transforms if t.scope_prefix})
        scoped = f"; scoped to {', '.join(scopes)}" if scopes else ""
        self.mapping = f"transformers {model_type} ({len(transforms)} rules{scoped})"

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
                re-arrangement, its experts are not numbered 0..E-1, or its parts are incomplete.
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
            if f.kind == "chunk":
                for p in self._chunked(f, disk, memory, shapes[disk]):
                    pieces.append(p)
                    mem_shapes[p.memory] = p.sizes
                continue
            expert = _expert(f.converter, disk, part) if f.kind == "stack" else 0
            groups.setdefault(memory, {})[(expert, part)] = disk
            fusion_of[memory] = f
        for memory, members in groups.items():
            shape, made = _stacked(memory, fusion_of[memory], members, shapes)
            mem_shapes[memory] = shape
            pieces.extend(made)
        return KeyMap(tuple(pieces), mem_shapes, self.mapping)

    def _chunked(self, f: _Fusion, disk: str, first: str, shape: tuple[int, ...]) -> list[Piece]:
        """The in-memory parts ``Chunk`` cuts from file tensor ``disk`` (transformers names the
        first ``first``): equal boxes on the chunked dim."""
        from transformers.core_model_loading import apply_renamings

        targets = f.converter._original_target_patterns
        dim = f.join_dim
        assert dim is not None
        if dim >= len(shape) or shape[dim] % len(targets):
            raise UnsupportedCheckpointError(
                f"{disk!r}: shape {list(shape)} does not split on dim {dim} into {len(targets)} "
                f"equal parts as rule {f.name!r} needs"
            )
        matched = f.converter._scoped_match(apply_renamings(disk, self.renamings))
        prefix, key, match = matched
        step = shape[dim] // len(targets)
        sizes = tuple(step if d == dim else n for d, n in enumerate(shape))
        out = []
        for h, target in enumerate(targets):
            memory = (prefix or "") + key.replace(match.group(0), target, 1)
            if h == 0 and memory != first:
                raise UnsupportedCheckpointError(
                    f"{disk!r}: rule {f.name!r} names its first part {memory!r} here but "
                    f"{first!r} in transformers; this mapping cannot be followed by name"
                )
            offsets = tuple(h * step if d == dim else 0 for d in range(len(shape)))
            out.append(Piece(disk, memory, offsets, sizes, None, f.name, fused_shape=shape))
        return out

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
        joined: dict[str, dict[int, str]] = {}  # "chunk" rules: file tensor -> part -> memory
        join_of: dict[str, _Fusion] = {}
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
            if f.kind == "chunk":
                part = next(int(g[1:]) for g, v in match.groupdict().items() if v is not None)
                local = match.string.replace(
                    match.group(0), f.converter._original_source_patterns[0], 1
                )
                disk = apply_renamings(memory.replace(match.string, local), self.reverse_renamings)
                joined.setdefault(disk, {})[part] = memory
                join_of[disk] = f
                continue
            pieces.extend(self._split(f, match, memory, shape))
        for disk, members in joined.items():
            pieces.extend(self._joined(join_of[disk], disk, members, shapes))
        return KeyMap(tuple(pieces), dict(shapes), self.mapping)

    def _split(self, f: _Fusion, match: Any, memory: str, shape: tuple[int, ...]) -> list[Piece]:
        """The file tensors a "stack" or "join" rule writes for in-memory tensor ``memory``."""
        from transformers.core_model_loading import apply_renamings

        parts = f.converter._original_source_patterns
        experts = shape[f.stack_dim] if f.stack_dim is not None else 1
        sizes = insert_dim(drop_dim(shape, f.stack_dim), f.stack_dim, 1)
        step = 0
        if f.join_dim is not None:
            if f.join_dim >= len(shape) or shape[f.join_dim] % len(parts):
                raise UnsupportedCheckpointError(
                    f"{memory!r}: dim {f.join_dim} of shape {list(shape)} does not split into "
                    f"{len(parts)} equal parts as rule {f.name!r} needs"
                )
            step = shape[f.join_dim] // len(parts)
            sizes = tuple(step if d == f.join_dim else n for d, n in enumerate(sizes))
        out = []
        for e in range(experts):
            for h, pattern in enumerate(parts):
                local = match.string.replace(match.group(0), pattern.replace("*", str(e)), 1)
                disk = apply_renamings(memory.replace(match.string, local), self.reverse_renamings)
                back, g, part = self._load_name(disk)
                if (back, g, part) != (memory, f, h):
                    raise UnsupportedCheckpointError(
                        f"{memory!r}: rule {f.name!r} would write part {h} (expert {e}) as "
                        f"{disk!r}, which transformers loads as {back!r}; this mapping cannot be "
                        "reversed by name"
                    )
                offsets = [0] * len(shape)
                if f.stack_dim is not None:
                    offsets[f.stack_dim] = e
                if f.join_dim is not None:
                    offsets[f.join_dim] = h * step
                out.append(Piece(disk, memory, tuple(offsets), sizes, f.stack_dim, f.name))
        return out

    def _joined(
        self, f: _Fusion, disk: str, members: dict[int, str], shapes: Shapes
    ) -> list[Piece]:
        """File tensor ``disk`` that a "chunk" rule's reverse joins from ``members`` (part →
        in-memory name): equal parts, as the load's ``Chunk`` will cut them again."""
        targets = f.converter._original_target_patterns
        dim = f.join_dim
        assert dim is not None
        if sorted(members) != list(range(len(targets))):
            raise UnsupportedCheckpointError(
                f"{disk!r}: rule {f.name!r} joins {len(targets)} tensors into it, found only "
                f"{sorted(members.values())}"
            )
        first = shapes[members[0]]
        for h in range(len(targets)):
            if shapes[members[h]] != first or dim >= len(first):
                raise UnsupportedCheckpointError(
                    f"{members[h]!r}: shape {list(shapes[members[h]])} differs from {members[0]!r} "
                    f"{list(first)}; rule {f.name!r} joins them into {disk!r} and cuts it equally"
                )
        back, g, _ = self._load_name(disk)
        if (back, g) != (members[0], f):
            raise UnsupportedCheckpointError(
                f"{members[0]!r}: rule {f.name!r} would write it into {disk!r}, which "
                f"transformers loads as {back!r}; this mapping cannot be reversed by name"
            )
        fused = tuple(n * len(targets) if d == dim else n for d, n in enumerate(first))
        at = [
            tuple(h * first[dim] if d == dim else 0 for d in range(len(first)))
            for h in sorted(members)
        ]
        return [Piece(disk, members[h], at[h], first, None, f.name, fused) for h in sorted(members)]


def _stacked(
    memory: str, f: _Fusion, members: dict[tuple[int, int], str], shapes: Shapes
) -> tuple[tuple[int, ...], list[Piece]]:
    """In-memory tensor ``memory`` a "stack" or "join" rule makes of file tensors ``members``
    ((expert, part) → name): its shape and the boxes of its members. A "join" takes parts of
    any size on the joined dim (``Concatenate`` does); a "stack" takes equal ones."""
    parts = len(f.converter.source_patterns)
    experts = 1 + max(e for e, _ in members)
    if len(members) != experts * parts:
        what = f"experts 0..{experts - 1}" if f.kind == "stack" else "one tensor each"
        raise UnsupportedCheckpointError(
            f"{memory!r}: rule {f.name!r} needs {parts} part(s) of {what}, found "
            f"{len(members)} tensors; the {'experts' if f.kind == 'stack' else 'parts'} are "
            "incomplete"
        )
    part_shape = shapes[members[(0, 0)]]
    join = f.join_dim
    ends = [0]
    for h in range(parts):
        for e in range(experts):
            disk = members[(e, h)]
            got = shapes[disk]
            same = got == part_shape or (
                f.kind == "join" and join is not None and len(got) == len(part_shape) > join
                and drop_dim(got, join) == drop_dim(part_shape, join)
            )  # fmt: skip
            if not same:
                raise CorruptCheckpointError(
                    f"{disk!r}: shape {list(got)} differs from {members[(0, 0)]!r} "
                    f"{list(part_shape)}; rule {f.name!r} joins them into {memory!r}"
                )
        if join is not None:
            ends.append(ends[-1] + insert_dim(shapes[members[(0, h)]], f.stack_dim, 1)[join])
    shape = insert_dim(part_shape, f.stack_dim, experts)
    if join is not None:
        shape = tuple(ends[-1] if d == join else n for d, n in enumerate(shape))
    pieces = []
    for (e, h), disk in sorted(members.items()):
        offsets = [0] * len(shape)
        if f.stack_dim is not None:
            offsets[f.stack_dim] = e
        if join is not None:
            offsets[join] = ends[h]
        sizes = insert_dim(shapes[disk], f.stack_dim, 1)
        pieces.append(Piece(disk, memory, tuple(offsets), sizes, f.stack_dim, f.name))
    return shape, pieces


def _refuse(f: _Fusion, name: str) -> None:
    if f.refusal is not None:
        raise UnsupportedCheckpointError(
            f"{name!r}: transformers converts it with rule {f.name!r} ({f.refusal}); ckptools "
            "turns only MergeModulelist [+ Concatenate], Concatenate and Chunk into byte runs; "
            "keep the stored form (--keep-in-memory-names, or --keep-stored-names for shard)"
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


def rules_for(config: Mapping[str, Any] | None) -> Rules | None:
    """The installed transformers' conversion rules for the model ``config`` (a config.json).

    Looks the model up as transformers does: every sub-model's rules, scoped to its prefix
    (:func:`~ckptools.plan.conversion_lookup.model_transforms`); for a model that does not build
    from ``config``, by the root's class name from ``architectures`` then ``model_type``.
    Returns None without transformers, for a config naming neither, or for a model without a
    conversion. Imports transformers only when its mapping names the model or a sub-model.

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
    if not names or not mentioned(lookup_names(config)):
        return None
    transforms = model_transforms(config)
    if transforms is not None:
        label = model_type if isinstance(model_type, str) else names[0]
        return Rules(label, transforms) if transforms else None
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    for name in names:
        transforms = get_checkpoint_conversion_mapping(name)  # type: ignore[no-untyped-call]
        if transforms:
            return Rules(name, list(transforms))
    return None
