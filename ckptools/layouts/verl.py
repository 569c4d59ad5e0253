"""verl's per-rank FSDP checkpoints (``FSDPCheckpointManager.save_checkpoint``), torch-free.

Each rank ``r`` of ``W`` writes, with ``torch.save``, ``model_world_size_W_rank_r.pt`` (its
``model.state_dict()``), ``optim_world_size_W_rank_r.pt`` (its ``optimizer.state_dict()``) and
``extra_state_world_size_W_rank_r.pt`` (LR scheduler and RNG states); rank 0 adds
``fsdp_config.json`` (``{"FSDP_version", "world_size"}``) and ``huggingface/`` (the model's
config, tokenizer, generation config). verl's own loader needs the same world size; this
layout makes the directory one checkpoint that every verb reads.

FSDP2 (``FSDP_version`` 2): both files hold DTensors, read through the stand-ins of
:mod:`ckptools.formats.dtensor` (no process group, nothing of torch's or verl's imported);
each rank's local tensor is a chunk of the global tensor at the offsets its placements give
(uneven splits included), with its bytes in that rank's storage record. The optimizer keeps
``optimizer.state_dict()``'s integer ids in param-group order, named here under ``optimizer``
as a ``torch.save`` directory names its optimizer file, so :mod:`ckptools.plan.training` maps
the ids to FQNs (one group, counts and global shapes checked) for ``reshard``. A tensor that is
not a DTensor (AdamW's ``step``) and every plain value is the same on every rank and read from
rank 0.

FSDP1 (``FSDP_version`` 1, ``SHARDED_STATE_DICT``): the model file holds ShardedTensors, each
local shard at the offsets it records. The optimizer file is ``optimizer.state_dict()`` of
FlatParameters (verl's ``use_orig_params=False``): per wrapped module, 1-D shards of its
parameters concatenated and padded, without the record of which parameter lies where (FSDP
keeps it in memory only). :mod:`ckptools.layouts.fsdp1_flat` recovers it from the model's
parameters and the shards' sizes by FSDP's own rule and places each moment on its parameter
(``optimizer.state.<fqn>.<name>``, the groups' ``params`` as FQNs, as
``FSDP.optim_state_dict`` names them); where the sizes fit no wrapping, or several, the
optimizer is refused with the numbers and ``reshard`` carries it only with
``--drop-optimizer``. With ``use_orig_params=True`` the optimizer holds the original
parameters instead, each rank's state its 1-D slice of the parameter, which the ranks' slices
in rank order make whole (:func:`_orig_params_optimizer`).

A rank's missing model or optimizer file is named; the world size is ``fsdp_config.json``'s and
must agree with the file names. ``extra_state_*.pt`` and ``huggingface/`` are auxiliary files:
``consolidate`` copies ``huggingface/``; ``reshard`` notes that the per-rank RNG and scheduler
state is not carried.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptools.core import dtypes
from ckptools.core.manifest import (
    MODEL_FILES_DIR,
    OPTIMIZER_UNREADABLE,
    Chunk,
    FileInfo,
    Manifest,
    ObjectEntry,
    TensorEntry,
)
from ckptools.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedCheckpointError,
)
from ckptools.formats import dtensor, safe_pickle, torch_archive
from ckptools.io import storage
from ckptools.io.storage import Reader, open_reader
from ckptools.layouts import fsdp1_flat
from ckptools.layouts.base import (
    Layout,
    digest,
    directory_names,
    model_only,
    read_marker,
    register,
)
from ckptools.layouts.deepspeed_partitions import RankFlat, Segment, chunks_of
from ckptools.layouts.torch_save import flatten

LAYOUT = "verl"
CONFIG = "fsdp_config.json"
RANK_FILE = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
#: the key path the optimizer's entries go under (as a torch.save directory names it)
OPTIMIZER = "optimizer"
#: bytes compared to tell a tied copy of the input embedding (random-looking trained values)
_TIE_PROBE_BYTES = 4096
#: fsdp_config.json is two numbers; anything past this is not verl's
_CONFIG_MAX_BYTES = 64 << 10


def rank_file(kind: str, world_size: int, rank: int) -> str:
    """The name verl gives rank ``rank``'s ``kind`` file (``model``, ``optim``...)."""
    return f"{kind}_world_size_{world_size}_rank_{rank}.pt"


def _config(path: str) -> tuple[int, int, bytes]:
    where = storage.join(path, CONFIG)
    if storage.size(where) > _CONFIG_MAX_BYTES:
        raise CorruptCheckpointError(f"{where}: {storage.size(where)} bytes, not verl's config")
    raw = read_marker(where)
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}: not JSON ({e})", path=where) from e
    version = config.get("FSDP_version") if isinstance(config, dict) else None
    world = config.get("world_size") if isinstance(config, dict) else None
    if type(version) is not int or type(world) is not int or world < 1:
        raise CorruptCheckpointError(
            f"{where}: expected integer FSDP_version and world_size >= 1, found "
            f"{safe_pickle.short(config)}",
            path=where,
        )
    return version, world, raw


@dataclass
class _Merged:
    """Entries of every rank's files, merged by FQN in rank 0's order."""

    root: str
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    chunks: dict[str, list[Chunk]] = field(default_factory=dict)
    objects: dict[str, ObjectEntry] = field(default_factory=dict)
    paths: dict[str, tuple[str, ...]] = field(default_factory=dict)
    placements: dict[str, tuple[str, ...]] = field(default_factory=dict)
    mesh: tuple[int, ...] | None = None  # the DeviceMesh's shape (FSDP2: from the first DTensor)
    offsets: dict[tuple[str, str], int] = field(default_factory=dict)  # (file, key) -> data
    sharded: list[str] = field(default_factory=list)  # FSDP1's parameters, in rank 0's order

    def add_file(self, reader: Reader, rel: str, rank: int, under: tuple[str, ...]) -> None:
        archive = torch_archive.read_archive(reader, rel, 0, reader.size(rel))
        obj = torch_archive.load_pickle(reader, archive, dtensor.GLOBALS)
        for key_path, leaf in flatten(obj):
            path = (*under, *key_path)
            fqn = ".".join(path)
            where = f"{storage.join(self.root, rel)}: {fqn!r}"
            if isinstance(leaf, dtensor.DTensorRef):
                self._dtensor(reader, archive, rel, rank, fqn, path, leaf, where)
            elif isinstance(leaf, dtensor.ShardedTensorRef):
                if fqn not in self.paths:
                    self.sharded.append(fqn)
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
        last = sum((s - 1) * st for s, st in zip(ref.shape, ref.strides, strict=True))
        span = (last + 1) * itemsize if all(ref.shape) else 0
        if start + span > rec.size:
            raise CorruptCheckpointError(
                f"{storage.join(self.root, rel)}: a tensor's bytes {start}..{start + span} reach "
                f"past its storage record data/{key} ({rec.size} bytes)"
            )
        whole = ref.is_contiguous and start == 0 and span == rec.size
        return Chunk(
            offsets=offsets,
            sizes=ref.shape,
            file=rel,
            offset=self.offsets[rel, key] + start,
            length=span,
            rank=rank,
            strides=None if ref.is_contiguous else ref.strides,
            crc32=rec.crc32 if whole else None,
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

    def add_to(self, merged: _Merged) -> None:
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


def _flat_optimizer(merged: _Merged, reader: Reader, files: dict[int, str], world: int) -> None:
    """FSDP1's per-rank ``optimizer.state_dict()``, placed on the parameters and added to
    ``merged`` under ``optimizer`` keyed by FQN; nothing is added when it raises. One entry
    per parameter is ``use_orig_params=True``'s slices (:func:`_orig_params_optimizer`),
    else FlatParameter shards (:func:`_place_flat`, :mod:`ckptools.layouts.fsdp1_flat`).

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
            _orig_params_optimizer(merged, reader, ranks, params, ids)
            return
        except UnsupportedCheckpointError as e:
            orig_error = e
    try:
        _place_flat(merged, reader, ranks, params, ids)
    except UnsupportedCheckpointError:
        if orig_error is not None:
            raise orig_error from None
        raise


def _place_flat(
    merged: _Merged,
    reader: Reader,
    ranks: Sequence[_OptimizerFile],
    params: list[fsdp1_flat.Param],
    ids: list[str],
) -> None:
    """FlatParameter shards placed by :func:`fsdp1_flat.partition` (see :func:`_flat_optimizer`)."""
    first = ranks[0]
    world = len(ranks)
    local = [_flat_size(ranks, uid) for uid in ids]
    shared = _maybe_tied(merged, reader)
    placement = fsdp1_flat.partition(params, world, local, first.where, shared)
    out = _Merged(merged.root, offsets=merged.offsets)
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


def _orig_params_optimizer(
    merged: _Merged,
    reader: Reader,
    ranks: Sequence[_OptimizerFile],
    params: list[fsdp1_flat.Param],
    ids: list[str],
) -> None:
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
    first = ranks[0]
    if len(ids) < len(params):
        tied = set(_maybe_tied(merged, reader))
        params = [p for p in params if p.fqn not in tied]
    out = _Merged(merged.root, offsets=merged.offsets)
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
    out: _Merged,
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
        flats[r] = RankFlat(((f.rel, chunk.offset, ref.shape[0]),), ref.dtype, itemsize)
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
        self, merged: _Merged, reader: Reader, rank: int, uid: str, name: str, c: int
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
        return RankFlat(((self.rel, chunk.offset, c),), ref.dtype, dtypes.dtype(ref.dtype).itemsize)


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


def _maybe_tied(merged: _Merged, reader: Reader) -> list[str]:
    """Parameters that may be a tied second name of the first parameter (the input embedding):
    FSDP1's sharded state dict saves a tied weight twice, as separate bytes, while its
    FlatParameter holds it once. A parameter of the first one's shape and dtype whose first
    bytes on rank 0 are the same is such a candidate; :func:`fsdp1_flat.partition` decides."""
    if not merged.sharded:
        return []
    head = merged.sharded[0]
    first = merged.tensors[head]
    prefix = _TIE_PROBE_BYTES

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


def _rank_files(path: str, tree: dict[str, int], world: int) -> dict[str, dict[int, str]]:
    """kind -> rank -> file, checked against ``world``: a rank's missing model (or optimizer,
    when any rank saved one) file is named."""
    found: dict[str, dict[int, str]] = {}
    for rel in tree:
        m = RANK_FILE.match(rel)
        if m is None:
            continue
        kind, w, r = m.group(1), int(m.group(2)), int(m.group(3))
        if w != world or r >= world:
            raise CorruptCheckpointError(
                f"{storage.join(path, rel)}: written at world size {w} rank {r}, but {CONFIG} "
                f"says world size {world}",
                path=storage.join(path, rel),
            )
        found.setdefault(kind, {})[r] = rel
    for kind in ("model", "optim"):
        have = found.get(kind, {})
        if kind == "optim" and not have:
            continue
        if len(have) < world:
            # the first gap lies within len(have) + 1 ranks: never a walk of a huge world size
            first = next(r for r in range(len(have) + 1) if r not in have)
            name = storage.join(path, rank_file(kind, world, first))
            raise CheckpointNotFoundError(
                f"{name}: rank {first}'s {kind} file is missing ({world - len(have)} of {world} "
                "ranks' files absent); each rank's file holds its own shard",
                path=name,
                rank=first,
            )
    return found


def read_verl(path: str) -> Manifest:
    """The manifest of the verl checkpoint directory ``path`` (see the module's description).

    Raises:
        CheckpointNotFoundError: a rank's model or optimizer file is missing (named).
        UnsupportedCheckpointError: a DTensor placed other than by Shard / Replicate.
        CorruptCheckpointError: the config, the file names or the files disagree.
        UnsafeCheckpointError: a pickle names a global outside the allowlist.
    """
    version, world, raw = _config(path)
    tree = {rel.replace("\\", "/"): size for rel, size in storage.walk_files(path).items()}
    files = _rank_files(path, tree, world)
    if version not in (1, 2):
        raise UnsupportedCheckpointError(f"{path}: FSDP_version {version}: verl writes 1 or 2")
    reader = open_reader(path)
    merged = _Merged(path)
    for rank in sorted(files["model"]):
        merged.add_file(reader, files["model"][rank], rank, ())
    notes = []
    unreadable = None
    read = ["model"]
    if files.get("optim") and model_only():
        # the caller exports the model: W optimizer pickles left unparsed
        notes.append(
            f"{len(files['optim'])} optimizer file(s) not read: the model alone is exported"
        )
    elif version == 2:
        for rank in sorted(files.get("optim", {})):
            merged.add_file(reader, files["optim"][rank], rank, (OPTIMIZER,))
        read.append("optim")
    elif files.get("optim"):
        try:
            _flat_optimizer(merged, reader, files["optim"], world)
            read.append("optim")
        except UnsupportedCheckpointError as e:
            unreadable = str(e)
            notes.append(f"optimizer not read: {unreadable}")
    data = {rel for kind in read for rel in files.get(kind, {}).values()}
    if files.get("extra_state"):
        notes.append(
            f"{len(files['extra_state'])} extra_state file(s) (per-rank RNG and LR scheduler "
            "state) are not carried over by conversions"
        )
    return Manifest(
        root=path,
        format=LAYOUT,
        layout=f"verl_fsdp{version}",
        tensors=merged.entries(),
        objects=merged.objects,
        files={rel: FileInfo(rel, tree[rel], _rank_of(rel)) for rel in sorted(data)},
        world_size=world,
        paths=merged.paths,
        markers=(CONFIG,),
        marker_digests={CONFIG: digest(raw)},
        notes=tuple(notes),
        details={
            "verl": {"fsdp_version": version},
            MODEL_FILES_DIR: "huggingface",
            **({OPTIMIZER_UNREADABLE: unreadable} if unreadable else {}),
            "placements": merged.placements,
            **({"mesh": list(merged.mesh)} if merged.mesh is not None else {}),
        },
        data_root=path,
        aux_files=tuple(sorted(rel for rel in tree if rel not in data and rel != CONFIG)),
    )


def _rank_of(rel: str) -> int | None:
    m = RANK_FILE.match(rel)
    return int(m.group(3)) if m else None


class VerlLayout(Layout):
    # Before torch_save (25): a one-rank verl directory is also a directory of .pt files.
    priority = 22
    name = LAYOUT
    description = "verl FSDPCheckpointManager per-rank files (*_world_size_W_rank_r.pt)"

    def probe(self, path: str) -> str | None:
        listed = directory_names(path)
        if listed is None:
            return "not a directory"
        names = set(listed)
        if CONFIG not in names:
            return f"no {CONFIG}"
        if not any(RANK_FILE.match(n) for n in names):
            return "no *_world_size_W_rank_r.pt rank files"
        return None

    def read_manifest(self, path: str) -> Manifest:
        return read_verl(path)


register(VerlLayout())
