"""Reading a ZeRO save's parameters into tensor entries: the rank files decoded once
(:class:`Reading`), the trainable parameters from the rank partitions of the fp32 masters and
the frozen ones from the model states, for stages 1/2 (:func:`read_zero12`) and stage 3
(:func:`read_zero3`), with the optimizer moments as a side table. The save is found and
checked whole by :mod:`ckptools.producers.deepspeed.layout`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ckptools.core import dtypes
from ckptools.core.flat_ranges import (
    RankFlat,
    Segment,
    chunks_of,
    zero3_segments,
    zero12_segments,
)
from ckptools.core.manifest import Chunk, FileInfo, TensorEntry, stored_in
from ckptools.errors import CorruptCheckpointError
from ckptools.formats import safe_pickle
from ckptools.producers.deepspeed import files as dsf


class Reading:
    """One read of a ZeRO checkpoint: the decoded files and the entries made from them."""

    def __init__(self, root: str, tag_rel: str, tag: str | None, reader: Any) -> None:
        self.root, self.tag_rel, self.tag, self.reader = root, tag_rel, tag, reader
        self.notes: list[str] = []
        self.opened: list[dsf.ArchiveFile] = []
        self.files: dict[str, FileInfo] = {}

    def rel(self, name: str) -> str:
        return f"{self.tag_rel}/{name}" if self.tag_rel else name

    def open(self, name: str, size: int, rank: int | None) -> dsf.ArchiveFile:
        rel = self.rel(name)
        self.files[rel] = FileInfo(rel, size, rank)
        opened = dsf.open_file(self.reader, rel, size)
        self.opened.append(opened)
        return opened

    def flats(
        self,
        f: dsf.ArchiveFile,
        refs: Sequence[safe_pickle.TensorRef],
        what: str,
        limits: Sequence[int] | None = None,
    ) -> RankFlat:
        """``refs`` as one flat space; ``limits``: take only the first so many elements of
        each (stage 1/2 moments keep the padding the saved masters drop)."""
        if not all(isinstance(r, safe_pickle.TensorRef) and len(r.shape) == 1 for r in refs):
            raise CorruptCheckpointError(
                f"{f.path}: {what} is not a list of flat tensors", path=f.path
            )
        dts = {r.dtype for r in refs}
        if len(dts) > 1:
            raise CorruptCheckpointError(f"{f.path}: {what} mixes dtypes {sorted(dts)}")
        dtype = dts.pop() if dts else "float32"
        pieces, records = [], []
        for g, ref in enumerate(refs):
            n = ref.shape[0]
            if limits is not None:
                if limits[g] > n:
                    raise CorruptCheckpointError(
                        f"{f.path}: {what}[{g}] holds {n} elements, fewer than the "
                        f"{limits[g]} of the fp32 masters' partition",
                        path=f.path,
                    )
                n = limits[g]
            pieces.append((f.rel, f.locate(ref, f"{what}[{g}]"), n))
            records.append(f.record(ref))
        return RankFlat(tuple(pieces), dtype, dtypes.dtype(dtype).itemsize, tuple(records))

    def entry(
        self,
        name: str,
        shape: tuple[int, ...],
        segs: Sequence[Segment],
        flats: Mapping[int, RankFlat],
    ) -> TensorEntry:
        dtype = next(iter(flats.values())).dtype
        return TensorEntry(name, dtype, shape, chunks_of(shape, segs, flats))

    def whole(self, f: dsf.ArchiveFile, name: str, ref: Any, what: str) -> TensorEntry:
        """An entry stored whole in ``f`` (a buffer, a stage 1/2 frozen parameter)."""
        at = f.locate(ref, what)
        n = math.prod(ref.shape)
        size = n * dtypes.dtype(ref.dtype).itemsize
        checks = stored_in(f.record(ref), at, size)
        chunk = Chunk((0,) * len(ref.shape), ref.shape, f.rel, at, size, **checks)
        return TensorEntry(name, ref.dtype, ref.shape, (chunk,))

    def module(self, model: dsf.ArchiveFile) -> dict[str, Any]:
        module = model.get("module")
        if not isinstance(module, dict):
            raise CorruptCheckpointError(f"{model.path}: 'module' is not a state dict")
        return module

    def moments(
        self,
        files: Mapping[int, dsf.ArchiveFile],
        base_keys: tuple[str, ...],
        nflat: int,
        masters: Mapping[int, RankFlat],
        params: Mapping[str, tuple[tuple[int, ...], Sequence[Segment]]],
    ) -> dict[str, Any]:
        """The Adam moments (partitioned as the masters) and the step counters."""
        out: dict[str, Any] = {"step": {}}
        states = {}
        for r, f in files.items():
            state = f.get(*base_keys).get("state") if isinstance(f.get(*base_keys), dict) else None
            if not isinstance(state, dict) or any(
                not isinstance(state.get(g), dict) for g in range(nflat)
            ):
                self.notes.append(
                    "optimizer state: no per-group state in the rank files (not Adam-like, or "
                    "not saved); only the model can be converted"
                )
                return {}
            states[r] = state
        for kind in ("exp_avg", "exp_avg_sq"):
            if any(kind not in states[r][g] for r in states for g in range(nflat)):
                continue
            flats = {
                r: self.flats(
                    f,
                    [states[r][g][kind] for g in range(nflat)],
                    kind,
                    [n for _, _, n in masters[r].pieces],
                )
                for r, f in files.items()
            }
            out[kind] = {
                name: self.entry(name, shape, segs, flats) for name, (shape, segs) in params.items()
            }
        f0 = files[0]
        for g in range(nflat):
            step = states[0][g].get("step")
            if isinstance(step, safe_pickle.TensorRef):
                out["step"][g] = self.whole(f0, f"step[{g}]", step, f"state[{g}]/step")
            elif isinstance(step, int | float):
                out["step"][g] = step
        out["param_groups"] = tuple(safe_pickle.plain(f0.get(*base_keys).get("param_groups", [])))
        return out


def read_zero12(
    rd: Reading,
    files: Mapping[int, dsf.ArchiveFile],
    model: dsf.ArchiveFile,
    world: int,
) -> tuple[dict[str, TensorEntry], dict[str, Any]]:
    """Stages 1/2: trainable parameters from the rank partitions, frozen ones from the model
    states; returns the entries and the optimizer side table."""
    raw_groups = model.get("param_shapes")
    if not isinstance(raw_groups, list):
        raise CorruptCheckpointError(f"{model.path}: param_shapes is not a list of groups")
    groups = [dsf.shapes_of(model, g, f"param_shapes[{i}]") for i, g in enumerate(raw_groups)]
    osds = {r: f.mapping("optimizer_state_dict") for r, f in files.items()}
    refs = {
        r: dsf.tensor_list(
            files[r],
            osds[r].get("single_partition_of_fp32_groups"),
            "single_partition_of_fp32_groups",
        )
        for r in files
    }
    saved = [[ref.shape[0] for ref in refs[r]] for r in range(world)]
    if any(len(row) != len(groups) for row in saved):
        raise CorruptCheckpointError(
            f"{files[0].path}: {len(saved[0])} flat groups, but param_shapes lists {len(groups)}",
            path=files[0].path,
        )
    raw_aligns = osds[0].get("param_alignment_paddings")
    aligns = (
        [dsf.int_list(files[0], a, "param_alignment_paddings") for a in raw_aligns]
        if isinstance(raw_aligns, list)
        else [[0] * len(g) for g in groups]
    )
    if [len(a) for a in aligns] != [len(g) for g in groups]:
        raise CorruptCheckpointError(
            f"{files[0].path}: param_alignment_paddings does not list one padding per parameter",
            path=files[0].path,
        )
    segs, used = zero12_segments(groups, aligns, saved)
    dsf.check_zero12_paddings(files, osds, saved, used)
    masters = {r: rd.flats(files[r], refs[r], "single_partition_of_fp32_groups") for r in files}
    dsf.check_slice_mappings(files, osds, groups, saved, segs)
    params = {n: (s, segs[n]) for g in groups for n, s in g.items()}
    entries = {n: rd.entry(n, shape, ss, masters) for n, (shape, ss) in params.items()}
    frozen_shapes = model.obj.get("frozen_param_shapes")
    if frozen_shapes:
        shapes = dsf.shapes_of(model, frozen_shapes, "frozen_param_shapes")
        fragments = model.get("frozen_param_fragments")
        for name, shape in shapes.items():
            ref = fragments.get(name) if isinstance(fragments, dict) else None
            entry = rd.whole(model, name, ref, f"frozen_param_fragments[{name!r}]")
            if entry.shape != shape:
                raise CorruptCheckpointError(
                    f"{model.path}: frozen parameter {name!r} is stored as {list(entry.shape)}, "
                    f"frozen_param_shapes says {list(shape)}",
                    path=model.path,
                    fqn=name,
                )
            entries[name] = entry
    side = rd.moments(
        files, ("optimizer_state_dict", "base_optimizer_state"), len(groups), masters, params
    )
    side["group_of"] = {n: g for g, shapes in enumerate(groups) for n in shapes}
    return entries, side


def read_zero3(
    rd: Reading,
    files: Mapping[int, dsf.ArchiveFile],
    models: Mapping[int, dsf.ArchiveFile],
    world: int,
) -> tuple[dict[str, TensorEntry], dict[str, Any]]:
    """Stage 3: every parameter cut on its own across all ranks, frozen ones in the per-rank
    model states; returns the entries and the optimizer side table."""
    model = models[0]
    raw_groups = model.get("param_shapes")
    if not isinstance(raw_groups, list):
        raise CorruptCheckpointError(f"{model.path}: param_shapes is not a list of groups")
    groups = [dsf.shapes_of(model, g, f"param_shapes[{i}]") for i, g in enumerate(raw_groups)]
    merged = {n: s for g in groups for n, s in g.items()}
    segs, per_rank = zero3_segments(merged, world)
    masters: dict[int, RankFlat] = {}
    nflat = None
    for r, f in files.items():
        refs = dsf.tensor_list(
            f, f.get("optimizer_state_dict", "fp32_flat_groups"), "fp32_flat_groups"
        )
        masters[r] = rd.flats(f, refs, "fp32_flat_groups")
        nflat = len(refs) if nflat is None else nflat
        if masters[r].numel != per_rank or len(refs) != nflat:
            raise CorruptCheckpointError(
                f"{f.path}: rank {r} holds {masters[r].numel} master elements in {len(refs)} "
                f"groups; param_shapes over {world} ranks (each parameter padded to a multiple "
                f"of {world}) needs {per_rank} on every rank",
                path=f.path,
                rank=r,
            )
    params = {n: (s, segs[n]) for n, s in merged.items()}
    entries = {n: rd.entry(n, shape, ss, masters) for n, (shape, ss) in params.items()}
    frozen_shapes = model.obj.get("frozen_param_shapes")
    if frozen_shapes:
        shapes = dsf.shapes_of(model, frozen_shapes, "frozen_param_shapes")
        frozen_segs, _ = zero3_segments(shapes, world)
        for name, shape in shapes.items():
            flats = {}
            for r, m in models.items():
                frags = m.get("frozen_param_fragments")
                what = f"frozen_param_fragments[{name!r}]"
                ref = frags.get(name) if isinstance(frags, dict) else None
                if not isinstance(ref, safe_pickle.TensorRef) or len(ref.shape) != 1:
                    raise CorruptCheckpointError(
                        f"{m.path}: {what} is {safe_pickle.short(ref)}, not a flat tensor",
                        path=m.path,
                        rank=r,
                    )
                flats[r] = rd.flats(m, [ref], what)
            entries[name] = rd.entry(
                name,
                shape,
                [Segment(s.rank, 0, s.start, s.count) for s in frozen_segs[name]],
                flats,
            )
    side = rd.moments(
        files, ("optimizer_state_dict", "optimizer_state_dict"), nflat or 0, masters, params
    )
    side["group_of"] = {n: g for g, shapes in enumerate(groups) for n in shapes}
    return entries, side
