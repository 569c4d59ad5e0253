"""FSDP1's flat-parameter optimizer state, placed on the parameters it holds (pure, torch-free).

FSDP1 (``FullyShardedDataParallel`` with ``use_orig_params=False``, verl's default) replaces the
parameters of every wrapped module by one ``FlatParameter``: the module's parameters that no
nested wrapped module owns, in ``named_modules`` / ``named_parameters`` order (a shared
parameter once), flattened and concatenated without padding between them; rank ``r`` of ``W``
holds elements ``[r*c, (r+1)*c)`` with ``c = ceil(numel / W)``, the last ranks padded to ``c``
(``FlatParamHandle._get_shard``: ``torch.chunk`` then pad). The optimizer sees only those
FlatParameters, so ``optimizer.state_dict()`` on rank ``r`` holds, per FlatParameter in
``model.parameters()`` order (a wrapped module's own FlatParameter before those of the modules
it contains: the root's first), 1-D moments of ``c`` elements and a scalar ``step``.

The files do not say which parameters a FlatParameter holds (FSDP keeps that record in memory),
but the model's parameters (names, shapes, in the same order) and ``c`` per FlatParameter do,
given FSDP's rule: the wrapped modules are whole modules, each the contiguous run of parameters
under one name prefix, in order, none inside another but the root, which holds what is left.
:func:`partition` finds every wrapping of that kind whose FlatParameter sizes give the saved
``c`` at ``W`` (a search, bounded in steps and pruned by the elements still needed) and accepts
exactly one; none, or two that place elements differently, is refused with the numbers, since a
guess would put moments on the wrong parameters. Nested wrapping below the root's children fits
no such wrapping and is refused by it. (``use_orig_params=True`` keeps per-parameter state,
each rank's slice of a parameter: no FlatParameters to place; the verl layout reads it as is.)

:func:`state_chunks` then turns one moment's per-rank flat tensors into a parameter's chunks:
the parameter's range of the FlatParameter met with each rank's range, each piece a few boxes
(:func:`~ckptools.core.flat_ranges.flat_boxes`), each a ``raw`` chunk at its byte
offset in that rank's file.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckptools.core.flat_ranges import RankFlat, Segment, chunks_of
from ckptools.core.manifest import Chunk
from ckptools.errors import UnsupportedCheckpointError

#: candidate extensions the search may try before it gives up (a few per FlatParameter in a
#: real model; a hostile one cannot make it walk more)
SEARCH_BUDGET = 200_000

Range = tuple[int, int]  # [first, last + 1) in the model's parameter order


@dataclass(frozen=True, slots=True)
class Param:
    """A model parameter: its FQN and global shape, in ``named_parameters`` order."""

    fqn: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Placement:
    """Where each FlatParameter's elements come from: per FlatParameter (in the optimizer's
    order), its parameters' indices and each one's first element in the flat vector."""

    units: tuple[tuple[tuple[Param, int], ...], ...]  # ((parameter, flat start), ...)
    local: tuple[int, ...]  # elements per rank (``c``) of each FlatParameter
    world_size: int


def _modules(params: Sequence[Param]) -> dict[Range, str]:
    """The parameter range of every module whose parameters are one contiguous run (all but
    the whole model), keyed by range: two modules with the same parameters are one candidate."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    count: dict[str, int] = {}
    for i, p in enumerate(params):
        parts = p.fqn.split(".")
        for d in range(1, len(parts)):
            name = ".".join(parts[:d])
            first.setdefault(name, i)
            last[name] = i
            count[name] = count.get(name, 0) + 1
    out: dict[Range, str] = {}
    for name, start in first.items():
        rng = (start, last[name] + 1)
        if rng[1] - rng[0] == count[name] and rng != (0, len(params)):
            out.setdefault(rng, name)
    return out


def _local(numel: int, world: int) -> int:
    return -(-numel // world)


def _nested_ways(
    params: Sequence[Param], world: int, sizes: Sequence[int], budget: list[int]
) -> list[tuple[tuple[Range, ...], int, int]]:
    """The ways to choose disjoint modules, in order, whose FlatParameters have ``sizes``
    elements per rank, by where they end: (one way's ranges, the elements left for the root,
    how many ways end there, counted up to 2)."""
    prefix = [0]
    for p in params:
        prefix.append(prefix[-1] + p.numel)
    total = prefix[-1]
    by_local: dict[int, list[Range]] = {}
    for rng in sorted(_modules(params)):
        numel = prefix[rng[1]] - prefix[rng[0]]
        if numel:
            by_local.setdefault(_local(numel, world), []).append(rng)
    # the fewest elements the FlatParameters from j on can hold: prunes a state with too few left
    need = [0] * (len(sizes) + 1)
    for j in range(len(sizes) - 1, -1, -1):
        need[j] = need[j + 1] + (sizes[j] - 1) * world + 1
    # state (position, elements taken) -> (ways there, capped at 2; first way's back-pointer)
    layer: dict[tuple[int, int], tuple[int, tuple[tuple[int, int], Range] | None]] = {
        (0, 0): (1, None)
    }
    history = [layer]
    for j, c in enumerate(sizes):
        cands = by_local.get(c, [])
        starts = [r[0] for r in cands]
        nxt: dict[tuple[int, int], tuple[int, tuple[tuple[int, int], Range] | None]] = {}
        for (pos, taken), (ways, _) in layer.items():
            for rng in cands[bisect.bisect_left(starts, pos) :]:
                budget[0] -= 1
                if budget[0] < 0:
                    raise _TooMany
                if total - prefix[rng[0]] < need[j]:
                    break
                key = (rng[1], taken + prefix[rng[1]] - prefix[rng[0]])
                old = nxt.get(key)
                nxt[key] = (min(2, old[0] + ways), old[1]) if old else (ways, ((pos, taken), rng))
        layer = nxt
        history.append(layer)
    out = []
    for key, (ways, _) in layer.items():
        chosen: list[Range] = []
        at: tuple[int, int] = key
        for step in range(len(sizes), 0, -1):
            back = history[step][at][1]
            assert back is not None
            at, rng = back
            chosen.append(rng)
        out.append((tuple(reversed(chosen)), total - key[1], ways))
    return out


class _TooMany(Exception):
    pass


def partition(
    params: Sequence[Param],
    world: int,
    local: Sequence[int],
    where: str,
    shared: Sequence[str] = (),
) -> Placement:
    """Which parameters each FlatParameter holds (see the module's description).

    Args:
        params: the model's parameters in ``named_parameters`` order.
        world: the world size the shards were cut for.
        local: ``c`` of each FlatParameter, in the optimizer's order.
        where: the file, for messages.
        shared: FQNs that may be a second name of an earlier parameter (tied embeddings, saved
            twice by the state dict but flattened once): wrappings with and without them are
            tried, and still exactly one must fit.

    Raises:
        UnsupportedCheckpointError: no wrapping of whole modules gives these sizes, or more
            than one does (the message gives the numbers).
    """
    variants = [list(params)]
    if shared:
        variants.append([p for p in params if p.fqn not in set(shared)])
    # distinct placements (two wrappings may place every element alike: a wrapped module that
    # is the root's only parameters); ways that end at one state hold different modules
    placements: dict[tuple[tuple[str, ...], ...], Placement] = {}
    several = False
    budget = [SEARCH_BUDGET]
    try:
        for ps in variants:
            # the root holds parameters of its own (its FlatParameter first), or none
            for nested, root in ((local[1:], True), (local, False)):
                for ranges, left, count in _nested_ways(ps, world, nested, budget):
                    if (left > 0 and _local(left, world) == local[0]) if root else left == 0:
                        placement = _placement(ps, world, local, ranges, root)
                        key = tuple(tuple(p.fqn for p, _ in u) for u in placement.units)
                        placements.setdefault(key, placement)
                        several = several or count > 1
    except _TooMany:
        raise UnsupportedCheckpointError(
            f"{where}: {len(local)} FlatParameters over {len(params)} parameters fit too many "
            f"wrappings to tell apart within {SEARCH_BUDGET:,} steps"
        ) from None
    if several or len(placements) != 1:
        sizes = ", ".join(str(c) for c in local[:8]) + (", ..." if len(local) > 8 else "")
        why = (
            "no wrapping of whole modules (each FSDP unit a module, none nested below the root's "
            "children) has FlatParameters of these sizes"
            if not placements
            else "several wrappings of whole modules give these sizes"
        )
        raise UnsupportedCheckpointError(
            f"{where}: {len(local)} FlatParameter shards of [{sizes}] elements per rank at "
            f"world size {world}, over {len(params)} parameters / "
            f"{sum(p.numel for p in params):,} elements: {why}, so which moment belongs to which "
            "parameter is not known (nested wrapping is not read)"
        )
    return next(iter(placements.values()))


def _placement(
    params: Sequence[Param],
    world: int,
    local: Sequence[int],
    ranges: Sequence[Range],
    root: bool,
) -> Placement:
    nested = [list(range(a, b)) for a, b in ranges]
    owned = {i for members in nested for i in members}
    members = ([[i for i in range(len(params)) if i not in owned]] if root else []) + nested
    units = []
    for unit in members:
        at = 0
        placed = []
        for i in unit:
            placed.append((params[i], at))
            at += params[i].numel
        units.append(tuple(placed))
    return Placement(tuple(units), tuple(local), world)


def state_chunks(
    param: Param, flat_start: int, c: int, flats: Mapping[int, RankFlat]
) -> tuple[Chunk, ...]:
    """``param``'s chunks of one moment of a FlatParameter: ``flats[r]`` is rank ``r``'s 1-D
    tensor of it (``c`` elements, one piece), ``flat_start`` the parameter's first element in
    the flat vector."""
    segments = []
    for rank in range(len(flats)):
        lo = max(flat_start, rank * c)
        hi = min(flat_start + param.numel, (rank + 1) * c)
        if lo < hi:
            segments.append(Segment(rank, lo - rank * c, lo - flat_start, hi - lo))
    return chunks_of(param.shape, segments, flats)
