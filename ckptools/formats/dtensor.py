"""Pickled DTensors and ShardedTensors, read by stand-ins that only carry data (torch-free).

A ``torch.save`` of a state dict holding DTensors (verl's per-rank files, any FSDP2 or tensor
parallel job that saves ``model.state_dict()`` itself) pickles each one as
``_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (DTensor, dtype, size, stride,
...), {"_local_tensor": tensor, "_spec": DTensorSpec(...)})``: the global size, this rank's
local tensor (an ordinary storage record), and the spec with the ``DeviceMesh``, its
placements and this rank's coordinates on the mesh. :data:`GLOBALS` admits those classes as
:class:`~ckptools.formats.safe_pickle.Record` stand-ins (their pickled state becomes their
attributes; nothing of theirs runs) and turns the call into a :class:`DTensorRef`.

:func:`local_box` places the local tensor in the global one as torch's
``compute_local_shape_and_global_offset`` does for the default shard order: mesh dimensions in
order, each ``Shard(d)`` splitting what is left of dim ``d`` in ``ceil(n / mesh size)`` pieces
(the last ones shorter or empty: uneven splits); a ``Replicate`` dimension holds copies, so only
coordinate 0 on it is kept (every other rank's copy is named a replica). ``_StridedShard(d,
split_factor=k)`` (FSDP2 over tensor parallelism) cuts dim ``d`` in ``k`` pieces first and takes
its part of each, as torch's ``_StridedShard.local_shard_size_and_offset`` does, so a local
tensor may lie in the global one as several boxes (:attr:`LocalBox.pieces`; one again when the
tensor-parallel ``Shard`` that follows undoes the striding, as FSDP2 + TP's does). ``Partial``
(pending sums) is refused by name.

FSDP1's ``SHARDED_STATE_DICT`` values are ``ShardedTensor``s, pickled the same way with the
state ``(local_shards, ShardedTensorMetadata, ProcessGroupState, sharding_spec, ...)``: each
local ``Shard`` names its tensor and its ``shard_offsets`` / ``shard_sizes`` in the global
``size``, so it becomes a :class:`ShardedTensorRef` of ``(offsets, tensor)`` pairs. The one
``getattr`` such a pickle makes, ``getattr(ShardedTensor, "ProcessGroupState")``, is admitted for
exactly that pair.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Any

from ckptools.errors import (
    CorruptCheckpointError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
)
from ckptools.formats import safe_pickle
from ckptools.formats.tensor_refs import OtherTensor, TensorRef

_T = "torch.distributed.tensor"


class _DTensorClass(safe_pickle.Record):
    """``torch.distributed.tensor.DTensor`` named as the type a tensor is rebuilt as."""

    _qualname = f"{_T}.DTensor"


def _record(qualname: str) -> type[safe_pickle.Record]:
    return type(qualname.rsplit(".", 1)[-1], (safe_pickle.Record,), {"_qualname": qualname})


class _ShardedTensorClass(safe_pickle.Record):
    """``ShardedTensor`` named as the type a tensor is rebuilt as."""

    _qualname = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"


_SPEC = f"{_T}._dtensor_spec"
_ST = "torch.distributed._shard"
_PLACEMENTS = f"{_T}.placement_types"
#: the classes a DTensor's spec is made of, as data-only records
_RECORDS = {
    q: _record(q)
    for q in (
        f"{_SPEC}.DTensorSpec",
        f"{_SPEC}.TensorMeta",
        f"{_SPEC}.ShardOrderEntry",
        "torch.distributed.device_mesh.DeviceMesh",
        "torch.distributed._mesh_layout._MeshLayout",
        "torch.distributed._mesh_layout._FlatLayout",
        f"{_PLACEMENTS}.Shard",
        f"{_PLACEMENTS}.Replicate",
        f"{_PLACEMENTS}._StridedShard",
        f"{_PLACEMENTS}.Partial",
        f"{_ST}.sharded_tensor.shard.Shard",
        f"{_ST}.metadata.ShardMetadata",
        f"{_ST}.sharded_tensor.metadata.ShardedTensorMetadata",
        f"{_ST}.sharding_spec.chunk_sharding_spec.ChunkShardingSpec",
        "torch.distributed.remote_device._remote_device",
    )
}


class _TensorProperties(safe_pickle.Record):
    """``TensorProperties``, whose ``__getstate__`` is a tuple (dtype, layout, ...): kept."""

    _qualname = f"{_ST}.sharded_tensor.metadata.TensorProperties"

    def _other_state(self, state: Any) -> None:
        self.__dict__["_state"] = state


_RECORDS[_TensorProperties._qualname] = _TensorProperties
_PG_STATE = _record("torch.distributed._shard.sharded_tensor.api.ShardedTensor.ProcessGroupState")


def _getattr(owner: Any, name: Any) -> Any:
    if owner is _ShardedTensorClass and name == "ProcessGroupState":
        return _PG_STATE
    raise UnsafeCheckpointError(
        f"refusing getattr({safe_pickle.short(owner)}, {safe_pickle.short(name)}) in a pickle "
        "(only getattr(ShardedTensor, 'ProcessGroupState') is what checkpoints contain)",
        global_name="builtins.getattr",
    )


@dataclass(frozen=True, slots=True)
class ShardedTensorRef:
    """A ShardedTensor in a pickle: its global ``shape`` and this rank's local shards as
    ``(offsets, tensor)``."""

    shape: tuple[int, ...]
    dtype: str
    shards: tuple[tuple[tuple[int, ...], TensorRef | OtherTensor], ...]


def _sharded_tensor(wrapper: OtherTensor, state: Any) -> ShardedTensorRef:
    if not isinstance(state, tuple) or not state or not isinstance(state[0], list):
        raise CorruptCheckpointError("a ShardedTensor in the pickle has no local shards")
    shape = wrapper.shape or ()
    shards = []
    for shard in state[0]:
        meta = getattr(shard, "metadata", None)
        tensor = getattr(shard, "tensor", None)
        offsets = _ints(getattr(meta, "shard_offsets", None), "shard offsets")
        sizes = _ints(getattr(meta, "shard_sizes", None), "shard sizes")
        if not isinstance(tensor, TensorRef | OtherTensor) or tensor.shape != sizes:
            raise CorruptCheckpointError(
                f"a ShardedTensor's local shard is not a tensor of its sizes {list(sizes)}"
            )
        if len(offsets) != len(shape) or any(
            o + n > s for o, n, s in zip(offsets, sizes, shape, strict=True)
        ):
            raise CorruptCheckpointError(
                f"a ShardedTensor shard at {list(offsets)} of {list(sizes)} is outside its "
                f"size {list(shape)}"
            )
        shards.append((offsets, tensor))
    return ShardedTensorRef(shape, str(wrapper.dtype), tuple(shards))


@dataclass(frozen=True, slots=True)
class DTensorRef:
    """A DTensor in a pickle: its global ``shape``, this rank's ``local`` tensor, the ``spec``
    record (mesh, placements) as pickled."""

    shape: tuple[int, ...]
    dtype: str
    local: TensorRef | OtherTensor
    spec: Any


_PLAIN_REBUILD = safe_pickle.WEIGHTS_ONLY_GLOBALS["torch._tensor._rebuild_from_type_v2"]


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if new_type is not _DTensorClass and new_type is not _ShardedTensorClass:
        return _PLAIN_REBUILD(func, new_type, args, state)
    wrapper = func(*args) if callable(func) and isinstance(args, tuple) else None
    if not isinstance(wrapper, OtherTensor) or wrapper.shape is None:
        raise CorruptCheckpointError("a DTensor in the pickle has no global size")
    if new_type is _ShardedTensorClass:
        return _sharded_tensor(wrapper, state)
    if isinstance(state, tuple) and len(state) == 2 and state[0] in (None, {}):
        state = state[1]  # (instance dict, slots): DTensor keeps its fields in __slots__
    if not isinstance(state, dict) or "_local_tensor" not in state or "_spec" not in state:
        raise CorruptCheckpointError("a DTensor in the pickle has no local tensor or spec")
    local = state["_local_tensor"]
    if not isinstance(local, TensorRef | OtherTensor):
        raise CorruptCheckpointError("a DTensor's local tensor in the pickle is not a tensor")
    return DTensorRef(wrapper.shape, str(wrapper.dtype), local, state["_spec"])


#: what a ``torch.save`` pickle of DTensors may name: ``torch.load(weights_only=True)``'s
#: globals, and the DTensor classes as records
GLOBALS: dict[str, Any] = {
    **safe_pickle.WEIGHTS_ONLY_GLOBALS,
    **_RECORDS,
    f"{_T}.DTensor": _DTensorClass,
    # torch < 2.5 kept the class under torch.distributed._tensor
    "torch.distributed._tensor.api.DTensor": _DTensorClass,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "torch.distributed._shard.sharded_tensor.api.ShardedTensor": _ShardedTensorClass,
    f"{_ST}.sharded_tensor.metadata.MEM_FORMAT_ENCODING": safe_pickle.METADATA_GLOBALS[
        f"{_ST}.sharded_tensor.metadata.MEM_FORMAT_ENCODING"
    ],
    "builtins.getattr": _getattr,
}


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(type(v) is int and v >= 0 for v in value):
        raise CorruptCheckpointError(f"DTensor {what} is not a tuple of sizes")
    return tuple(value)


def _mesh_shape(mesh: Any, ndim: int) -> tuple[int, ...]:
    """The mesh's sizes: its ``mesh`` tensor's shape (torch < 2.10), else its layout's
    ``top_level_sizes`` (one ``_FlatLayout`` per mesh dimension, sized by its shape's product)."""
    tensor = getattr(mesh, "mesh", None)
    if isinstance(tensor, TensorRef) and len(tensor.shape) == ndim:
        return tensor.shape
    axes = getattr(getattr(mesh, "_layout", None), "axes", None)
    if isinstance(axes, tuple) and len(axes) == ndim:
        return tuple(math.prod(_ints(getattr(a, "shape", None), "mesh shape")) for a in axes)
    raise UnsupportedCheckpointError(
        f"a DTensor's DeviceMesh does not say its shape in a form ckptools reads ({mesh!r})"
    )


#: a ``_StridedShard`` split factor is the tensor-parallel degree; past this a file is hostile
MAX_SPLIT_FACTOR = 4096
#: boxes one local tensor may be cut into (strided placements that no later Shard undoes)
MAX_PIECES = 65536


def _placement(p: Any) -> tuple[str, int | None, int]:
    """``(kind, tensor dim or None, split factor)`` of a pickled placement."""
    if not isinstance(p, safe_pickle.Record):
        raise CorruptCheckpointError(f"DTensor placement {safe_pickle.short(p)} is not one")
    kind = p._qualname.rsplit(".", 1)[-1]
    if kind == "Replicate":
        return kind, None, 1
    if kind in ("Shard", "_StridedShard"):
        dim = getattr(p, "dim", None)
        split = getattr(p, "split_factor", 1) if kind == "_StridedShard" else 1
        if type(dim) is not int:
            raise CorruptCheckpointError(f"DTensor {kind} placement without a dimension")
        if type(split) is not int or not 1 <= split <= MAX_SPLIT_FACTOR:
            raise CorruptCheckpointError(
                f"DTensor {kind}({dim}) split factor {safe_pickle.short(split)} is not an "
                f"integer in 1..{MAX_SPLIT_FACTOR}"
            )
        return kind, dim, split
    raise UnsupportedCheckpointError(
        f"a DTensor placed {kind} ({p!r}): ckptools reads Shard, _StridedShard and Replicate "
        "placements (Partial holds unreduced sums)"
    )


Intervals = list[tuple[int, int]]  # global [start, stop) runs of one dim, in local order


def _take(runs: Intervals, at: list[int], start: int, stop: int, out: Intervals) -> None:
    """Append local positions ``[start, stop)`` of ``runs`` (``at``: each run's first local
    position) to ``out`` as global runs, merging a run that continues the last one."""
    i = max(bisect.bisect_right(at, start) - 1, 0)
    while i < len(runs) and at[i] < stop:
        lo, hi = runs[i]
        a, b = max(start, at[i]), min(stop, at[i] + hi - lo)
        if a < b:
            g0, g1 = lo + a - at[i], lo + b - at[i]
            if out and out[-1][1] == g0:
                out[-1] = (out[-1][0], g1)
            else:
                out.append((g0, g1))
        i += 1


def _shard(runs: Intervals, chunks: int, coord: int, split: int) -> Intervals:
    """What coordinate ``coord`` of ``chunks`` keeps of ``runs``: ``Shard`` takes the
    ``coord``-th ``ceil(n / chunks)`` positions; ``_StridedShard`` first cuts the ``n``
    positions into ``split`` pieces of ``ceil(n / split)``, then each piece so, and keeps its
    part of every piece, in order (torch's ``_StridedShard.local_shard_size_and_offset``)."""
    at = list(itertools.accumulate((hi - lo for lo, hi in runs), initial=0))
    n = at.pop()
    first = -(-n // split)
    out: Intervals = []
    for piece in range(split):
        start, stop = min(first * piece, n), min(first * (piece + 1), n)
        if start >= stop:
            break
        per = -(-(stop - start) // chunks)
        _take(runs, at, min(start + per * coord, stop), min(start + per * (coord + 1), stop), out)
    return out


@dataclass(frozen=True, slots=True)
class LocalBox:
    """Where a rank's local tensor sits: ``offsets``/``sizes`` in the global shape (its first
    piece's offsets and the local tensor's sizes); ``pieces``, ``(global offsets, sizes,
    local offsets)`` boxes, more than one where a ``_StridedShard`` leaves the local rows
    apart in the global tensor; ``replica`` when another rank (coordinate 0 on a Replicate
    dimension) holds the same box."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    replica: bool
    mesh: tuple[int, ...]
    placements: tuple[str, ...]
    pieces: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = ()


def local_box(ref: DTensorRef) -> LocalBox:
    """The box of ``ref``'s local tensor in its global shape (see the module's description).

    Raises:
        UnsupportedCheckpointError: a placement other than Shard / _StridedShard / Replicate,
            or a mesh whose shape is not recorded as ckptools reads it.
        CorruptCheckpointError: the spec is malformed, or the local tensor's shape is not the
            one its placements give.
    """
    spec = ref.spec
    coord = _ints(getattr(getattr(spec, "mesh", None), "_coordinate_on_dim", None), "coordinate")
    placements = getattr(spec, "placements", None)
    if not isinstance(placements, tuple) or len(placements) != len(coord):
        raise CorruptCheckpointError("DTensor placements do not match its mesh's dimensions")
    mesh = _mesh_shape(spec.mesh, len(coord))
    runs: list[Intervals] = [[(0, s)] if s else [] for s in ref.shape]
    replica = False
    names = []
    for axis, p in enumerate(placements):
        kind, dim, split = _placement(p)
        names.append(
            kind if dim is None else f"{kind}({dim}" + (f", {split})" if split > 1 else ")")
        )
        if coord[axis] >= mesh[axis]:
            raise CorruptCheckpointError(f"DTensor coordinate {coord} outside its mesh {mesh}")
        if dim is None:
            replica = replica or coord[axis] != 0
            continue
        if not 0 <= dim < len(runs):
            raise CorruptCheckpointError(f"DTensor {kind}({dim}) of a {len(runs)}-d tensor")
        runs[dim] = _shard(runs[dim], mesh[axis], coord[axis], split)
    sizes = [sum(hi - lo for lo, hi in r) for r in runs]
    local_shape = ref.local.shape
    if isinstance(ref.local, TensorRef) and tuple(sizes) != local_shape:
        raise CorruptCheckpointError(
            f"DTensor local tensor of shape {list(local_shape or ())}, where its placements "
            f"{names} on mesh {list(mesh)} at {list(coord)} give {sizes}"
        )
    if math.prod(max(len(r), 1) for r in runs) > MAX_PIECES:
        raise UnsupportedCheckpointError(
            f"DTensor placements {names} cut a local tensor into more than {MAX_PIECES} boxes"
        )
    offsets = tuple(r[0][0] if r else 0 for r in runs)
    return LocalBox(offsets, tuple(sizes), replica, mesh, tuple(names), _pieces(runs))


def _pieces(
    runs: list[Intervals],
) -> tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]:
    """Every box of the cartesian product of the dims' runs, with its local offsets."""
    out: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = [((), (), ())]
    for dim_runs in runs:
        local, options = 0, []
        for lo, hi in dim_runs or [(0, 0)]:
            options.append((lo, hi - lo, local))
            local += hi - lo
        out = [((*g, lo), (*s, n), (*p, at)) for g, s, p in out for lo, n, at in options]
    return tuple(out)
