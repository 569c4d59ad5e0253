"""FSDP1's per-rank optimizer files (verl's ``optim_world_size_W_rank_r.pt``) placed on the
model's parameters (torch-free).

Each rank's file is its ``optimizer.state_dict()`` with integer ids. Two layouts:

* ``use_orig_params=False`` (verl's default): one entry per FlatParameter, 1-D padded shards of
  a wrapped module's parameters concatenated, placed by the one wrapping whose FlatParameter
  sizes, by FSDP's rule, are the saved ones (:mod:`ckptools.producers.fsdp1.flat`);
* ``use_orig_params=True``: one entry per parameter, each rank's state its 1-D slice of the
  parameter; the slices in rank order are the parameter flattened.

Either way each moment becomes ``optimizer.state.<fqn>.<name>`` with the parameter's global
shape, as ``FSDP.optim_state_dict`` names it, and nothing is added to the merged entries when
the optimizer cannot be placed (the caller notes why and the model still reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ckptools.core import dtypes
from ckptools.core.flat_ranges import RankFlat, Segment, chunks_of
from ckptools.core.manifest import Chunk, record_of
from ckptools.errors import UnsupportedCheckpointError
from ckptools.formats import dtensor, safe_pickle, torch_archive
from ckptools.io import storage
from ckptools.io.storage import Reader
from ckptools.producers.fsdp1 import flat as fsdp1_flat
from ckptools.producers.fsdp1.rank_pickles import OPTIMIZER, Merged

#: bytes compared to tell a tied copy of the input embedding (random-looking trained values)
TIE_PROBE_BYTES = 4096


def flat_optimizer(merged: Merged, reader: Reader, files: dict[int, str], world: int) -> None:
    """FSDP1's per-rank ``optimizer.state_dict()``, placed on the parameters and added to
    ``merged`` under ``optimizer`` keyed by FQN; nothing is added when it raises. One entry
    per parameter is ``use_orig_params=True``'s slices (:func:`_orig_params_optimizer`),
    else FlatParameter shards (:func:`_place_flat`, :mod:`ckptools.producers.fsdp1.flat`).

    Raises:
        UnsupportedCheckpointError: the files are not such state dicts, or the shards fit no
            single wrapping, or the slices do not add up (the message says why).
    """
    ranks = [_OptimizerFile.read(merged.root, reader, files[r]) for r in range(world)]
    first = ranks[0]
    ids = [str(x) for g in first.groups for x in g["params"]]
    params = [fsdp1_flat.Param(fqn, merged.tensors[fqn].shape) for fqn in merged.sharded]
    orig_error = None
    if len(ids) > 1 and len(ids) in (len(params), len(params) - len(_maybe_tied(merged, reader))):
        # one entry per parameter: use_orig_params=True (or every FlatParameter one
        # parameter, which the FlatParameter reading below also places)
        try:
            _orig_params_optimizer(_FSDP1Optimizer(merged, reader, ranks, params, ids))
            return
        except UnsupportedCheckpointError as e:
            orig_error = e
    try:
        _place_flat(_FSDP1Optimizer(merged, reader, ranks, params, ids))
    except UnsupportedCheckpointError:
        if orig_error is not None:
            raise orig_error from None
        raise


class _FSDP1Optimizer(NamedTuple):
    """What both FSDP1 optimizer readings take: the model read so far, the ranks' files, the
    model's parameters and the optimizer's ids."""

    merged: Merged
    reader: Reader
    ranks: Sequence[_OptimizerFile]
    params: list[fsdp1_flat.Param]
    ids: list[str]


def _place_flat(opt: _FSDP1Optimizer) -> None:
    """FlatParameter shards placed by :func:`fsdp1_flat.partition` (see :func:`_flat_optimizer`)."""
    merged, reader, ranks, params, ids = opt
    first = ranks[0]
    world = len(ranks)
    local = [_flat_size(ranks, uid) for uid in ids]
    shared = _maybe_tied(merged, reader)
    placement = fsdp1_flat.partition(params, world, local, first.where, shared)
    out = Merged(merged.root, offsets=merged.offsets)
    names: dict[str, list[str]] = {}  # FlatParameter id -> its parameters' FQNs
    for unit, (uid, members) in enumerate(zip(ids, placement.units, strict=True)):
        names[uid] = [p.fqn for p, _ in members]
        for name, value in first.state[uid].items():
            c = local[unit]
            if isinstance(value, safe_pickle.TensorRef) and value.shape == (c,):
                flats = {r: f.flat(out, reader, r, uid, name, c) for r, f in enumerate(ranks)}
                for p, start in members:
                    chunks = fsdp1_flat.state_chunks(p, start, c, flats)
                    out.put_state(p.fqn, name, value.dtype, p.shape, chunks)
            elif isinstance(value, safe_pickle.TensorRef) and not value.shape:
                chunk = out._chunk(reader, first.archive, first.rel, 0, value, ())
                for p, _ in members:
                    out.put_state(p.fqn, name, value.dtype, (), (chunk,))
            elif isinstance(value, safe_pickle.TensorRef | safe_pickle.OtherTensor):
                what = (
                    f"{value.dtype} {list(value.shape)}"
                    if isinstance(value, safe_pickle.TensorRef)
                    else value.describe()
                )
                raise UnsupportedCheckpointError(
                    f"{first.where}: state {name!r} of FlatParameter {uid} is {what}, neither "
                    f"its {c} flat elements nor a scalar"
                )
            else:
                for p, _ in members:
                    out.put_value((OPTIMIZER, "state", p.fqn, name), safe_pickle.unwrap(value))
    # the parameters in FlatParameter order, as FSDP.optim_state_dict lists them
    groups = [
        {**g, "params": [n for u in g["params"] for n in names[str(u)]]} for g in first.groups
    ]
    out.put_value((OPTIMIZER, "param_groups"), groups)
    out.add_to(merged)


def _orig_params_optimizer(opt: _FSDP1Optimizer) -> None:
    """FSDP1 with ``use_orig_params=True``: the optimizer holds the original parameters, in
    model order (a tied one once), each rank's state the 1-D slice of the parameter its part of
    the FlatParameter holds (none where it holds no element). The ranks' parts follow each other
    in the FlatParameter, so a parameter's slices in rank order, back to back, are the
    parameter flattened: no wrapping or padding needs knowing. Every parameter's slices must
    add up to its elements.

    Raises:
        UnsupportedCheckpointError: a parameter's slices do not add up, or a state is neither
            1-D slices nor a scalar.
    """
    merged, reader, ranks, params, ids = opt
    first = ranks[0]
    if len(ids) < len(params):
        tied = set(_maybe_tied(merged, reader))
        params = [p for p in params if p.fqn not in tied]
    out = Merged(merged.root, offsets=merged.offsets)
    for uid, param in zip(ids, params, strict=True):
        held = [(r, f) for r, f in enumerate(ranks) if f.state.get(uid)]
        if not held:
            raise UnsupportedCheckpointError(
                f"{first.where}: no rank holds optimizer state {uid} ({param.fqn!r})"
            )
        for name, value in held[0][1].state[uid].items():
            if isinstance(value, safe_pickle.TensorRef) and len(value.shape) == 1:
                chunks = _slices(out, reader, held, uid, name, param)
                out.put_state(param.fqn, name, value.dtype, param.shape, chunks)
            elif isinstance(value, safe_pickle.TensorRef) and not value.shape:
                r, f = held[0]
                chunk = out._chunk(reader, f.archive, f.rel, r, value, ())
                out.put_state(param.fqn, name, value.dtype, (), (chunk,))
            elif isinstance(value, safe_pickle.TensorRef | safe_pickle.OtherTensor):
                raise UnsupportedCheckpointError(
                    f"{first.where}: state {name!r} of {param.fqn!r} is neither 1-D slices nor "
                    "a scalar"
                )
            else:
                out.put_value((OPTIMIZER, "state", param.fqn, name), safe_pickle.unwrap(value))
    names = dict(zip(ids, (p.fqn for p in params), strict=True))
    groups = [{**g, "params": [names[str(u)] for u in g["params"]]} for g in first.groups]
    out.put_value((OPTIMIZER, "param_groups"), groups)
    out.add_to(merged)


def _slices(
    out: Merged,
    reader: Reader,
    held: list[tuple[int, _OptimizerFile]],
    uid: str,
    name: str,
    param: fsdp1_flat.Param,
) -> tuple[Chunk, ...]:
    """``param``'s chunks of state ``name`` from the ranks' 1-D slices, in rank order."""
    segments, flats, at = [], {}, 0
    for r, f in held:
        ref = f.state[uid].get(name)
        if not isinstance(ref, safe_pickle.TensorRef) or len(ref.shape) != 1:
            raise UnsupportedCheckpointError(
                f"{f.where}: state {name!r} of {param.fqn!r} is {safe_pickle.short(ref)}, not "
                "a 1-D slice"
            )
        chunk = out._chunk(reader, f.archive, f.rel, r, ref, (0,))
        itemsize = dtypes.dtype(ref.dtype).itemsize
        flats[r] = RankFlat(
            ((f.rel, chunk.offset, ref.shape[0]),), ref.dtype, itemsize, (record_of(chunk),)
        )
        segments.append(Segment(r, 0, at, ref.shape[0]))
        at += ref.shape[0]
    if at != param.numel:
        raise UnsupportedCheckpointError(
            f"{held[0][1].where}: the ranks' slices of {param.fqn!r}'s {name!r} hold {at} "
            f"elements, the parameter {param.numel}: not FSDP1's use_orig_params layout"
        )
    return chunks_of(param.shape, segments, flats)


@dataclass(frozen=True)
class _OptimizerFile:
    """One rank's ``optimizer.state_dict()`` of FlatParameters, as pickled."""

    rel: str
    where: str
    archive: torch_archive.Archive
    state: dict[str, dict[str, Any]]
    groups: list[dict[str, Any]]

    @classmethod
    def read(cls, root: str, reader: Reader, rel: str) -> _OptimizerFile:
        where = storage.join(root, rel)
        archive = torch_archive.read_archive(reader, rel, 0, reader.size(rel))
        obj = torch_archive.load_pickle(reader, archive, dtensor.GLOBALS)
        state = obj.get("state") if isinstance(obj, dict) else None
        groups = obj.get("param_groups") if isinstance(obj, dict) else None
        if (
            not isinstance(state, dict)
            or not all(isinstance(v, dict) for v in state.values())
            or not isinstance(groups, list)
            or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
        ):
            raise UnsupportedCheckpointError(
                f"{where}: not an optimizer state_dict() ({{'state', 'param_groups'}})"
            )
        return cls(rel, where, archive, {str(k): v for k, v in state.items()}, groups)

    def flat(
        self, merged: Merged, reader: Reader, rank: int, uid: str, name: str, c: int
    ) -> RankFlat:
        """This rank's 1-D tensor of state ``name`` of FlatParameter ``uid``."""
        ref = self.state.get(uid, {}).get(name)
        if not isinstance(ref, safe_pickle.TensorRef) or ref.shape != (c,):
            raise UnsupportedCheckpointError(
                f"{self.where}: state {name!r} of FlatParameter {uid} is "
                f"{safe_pickle.short(ref)}, not the {c} flat elements rank 0 holds"
            )
        chunk = merged._chunk(reader, self.archive, self.rel, rank, ref, (0,))
        if chunk.strides is not None:
            raise UnsupportedCheckpointError(f"{self.where}: state {name!r} of {uid} is strided")
        itemsize = dtypes.dtype(ref.dtype).itemsize
        return RankFlat(((self.rel, chunk.offset, c),), ref.dtype, itemsize, (record_of(chunk),))


def _flat_size(ranks: Sequence[_OptimizerFile], uid: str) -> int:
    """``c`` of FlatParameter ``uid``: the length of its 1-D state, the same on every rank."""
    sizes = set()
    for f in ranks:
        shapes = {
            v.shape for v in f.state.get(uid, {}).values() if isinstance(v, safe_pickle.TensorRef)
        }
        flat = {s for s in shapes if len(s) == 1}
        if len(flat) != 1 or shapes - flat - {()}:
            raise UnsupportedCheckpointError(
                f"{f.where}: FlatParameter {uid}'s state is {sorted(shapes)}, not one 1-D shard "
                "(and scalars)"
            )
        sizes |= {s[0] for s in flat}
    if len(sizes) != 1:
        raise UnsupportedCheckpointError(
            f"{ranks[0].where}: FlatParameter {uid} is {sorted(sizes)} elements on different "
            "ranks; FSDP1 pads every rank's shard to one size"
        )
    return sizes.pop()


def _maybe_tied(merged: Merged, reader: Reader) -> list[str]:
    """Parameters that may be a tied second name of the first parameter (the input embedding):
    FSDP1's sharded state dict saves a tied weight twice, as separate bytes, while its
    FlatParameter holds it once. A parameter of the first one's shape and dtype whose first
    bytes on rank 0 are the same is such a candidate; :func:`fsdp1_flat.partition` decides."""
    if not merged.sharded:
        return []
    head = merged.sharded[0]
    first = merged.tensors[head]
    prefix = TIE_PROBE_BYTES

    def start(fqn: str) -> bytes:
        chunk = min(merged.chunks[fqn], key=lambda c: (c.rank or 0, c.offsets))
        return reader.read(chunk.file, chunk.offset, min(prefix, chunk.length))

    if not merged.chunks[head]:
        return []
    bytes0 = start(head)
    return [
        fqn
        for fqn in merged.sharded[1:]
        if (merged.tensors[fqn].shape, merged.tensors[fqn].dtype) == (first.shape, first.dtype)
        and merged.chunks[fqn]
        and start(fqn) == bytes0
    ]
