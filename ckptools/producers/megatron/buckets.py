"""The whole distributed optimizer's state, per kind and model FQN, from its saved buckets (pure).

:mod:`ckptools.producers.megatron.optimizer` places one model-parallel rank's parameters in its
gradient buffer; :func:`bucket_state` finds the layer order whose placement falls on the stored
chunk boundaries of every rank's buffer and turns the pieces into one entry per model tensor,
tiled exactly. :func:`model_space_state` reads ``fully_reshardable`` saves, which hold the state
per model FQN already.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptools.core import geometry
from ckptools.core.manifest import Chunk, TensorEntry
from ckptools.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptools.producers.megatron.optimizer import (
    KINDS,
    LAYER_ORDERS,
    STATE_PREFIX,
    WITHOUT_OPTIMIZER,
    LocalParam,
    ModelTensor,
    ParamRange,
    StoredPiece,
    check_boundaries,
    param_chunks,
    place_params,
    stage_params,
)


@dataclass(frozen=True, slots=True)
class Buckets:
    """One model-parallel rank's gradient buffer as saved: ``per_bucket_numel_unpadded``,
    ``per_bucket_numel``, and per ``(bucket, kind)`` its stored pieces."""

    unpadded: tuple[int, ...]
    padded: tuple[int, ...] | None
    pieces: Mapping[tuple[int, str], Sequence[StoredPiece]]


@dataclass(frozen=True, slots=True)
class Parallelism:
    """How the run that saved the buckets was split: tensor- and pipeline-parallel sizes, the
    data-parallel size when the save records it, the transformer layers, and whether the output
    layer is tied to the embedding (it then lies in the first and the last stage)."""

    tp: int
    pp: int
    dp: int | None
    num_layers: int
    tied: bool


def bucket_numels(value: Any, what: str, where: str) -> tuple[int, ...]:
    """The one buffer's bucket sizes from a saved ``per_bucket_numel(_unpadded)`` object
    (a list, per gradient buffer, of ``{(param dtype, grad dtype): [numel, ...]}``).

    Raises:
        UnsupportedCheckpointError: several buffers (virtual pipeline stages, several dtypes).
        CorruptCheckpointError: anything else than that shape.
    """
    if isinstance(value, list | tuple) and len(value) > 1:
        raise UnsupportedCheckpointError(
            f"{where}: {what} lists {len(value)} gradient buffers (virtual pipeline stages or "
            f"several dtypes), which ckptools does not place; {WITHOUT_OPTIMIZER}",
            fqn=what,
        )
    if not (isinstance(value, list | tuple) and len(value) == 1 and isinstance(value[0], dict)):
        raise CorruptCheckpointError(f"{where}: {what} is not a list of one dict", fqn=what)
    (numels,) = value[0].values() if len(value[0]) == 1 else (None,)
    if not isinstance(numels, list | tuple) or not all(
        isinstance(n, int) and n >= 0 for n in numels
    ):
        raise CorruptCheckpointError(
            f"{where}: {what} holds no one list of bucket sizes: {value!r:.200}", fqn=what
        )
    return tuple(numels)


def bucket_state(
    model: Sequence[ModelTensor],
    buffers: Mapping[int, Buckets],
    split: Parallelism,
    *,
    dtype: str,
    itemsize: int,
    where: str = "optimizer",
    stagings: Iterable[Callable[[], Mapping[int, Sequence[LocalParam]]]] | None = None,
) -> dict[str, dict[str, TensorEntry]]:
    """Per kind (:data:`KINDS`, those stored), the model FQN's entry of that state: the model
    tensor's shape, tiled exactly once by raw chunks in the bucket tensors' data.

    ``buffers`` maps each model-parallel rank (``dp_group_idx``) to its saved buffer.
    ``stagings``: the candidate placements of each rank's parameters, tried in turn (default:
    :func:`stage_params` of ``model`` in each of :data:`LAYER_ORDERS`); ``split.tp * split.pp``
    is then the number of ``dp_group_idx`` (an expert optimizer's: expert TP × EP × PP).

    Raises:
        CorruptCheckpointError: the parameters do not add up to the stored buckets, or the
            pieces do not tile a model tensor.
        UnsupportedCheckpointError: a model this placement does not know.
    """
    tp, pp = split.tp, split.pp
    if set(buffers) != set(range(tp * pp)):
        raise CorruptCheckpointError(
            f"{where}: the optimizer's buckets are saved for model-parallel ranks "
            f"{sorted(buffers)}, not the {tp * pp} of TP {tp} x PP {pp}",
            fqn=where,
        )
    if stagings is None:
        stagings = [dense_staging(model, split, order) for order in LAYER_ORDERS]
    placed = _placement(buffers, split, where, stagings)
    kinds = sorted({k for b in buffers.values() for _, k in b.pieces}, key=KINDS.index)
    shapes = {t.fqn: t.shape for t in model}
    out: dict[str, dict[str, TensorEntry]] = {}
    for kind in kinds:
        chunks: dict[str, list[Chunk]] = {}
        for group, ranges in placed.items():
            pieces = buffers[group].pieces
            starts = {k: [s.start for s in found] for k, found in pieces.items()}
            for r in ranges:
                if r.param.replica or not r.param.numel:
                    continue
                found = pieces.get((r.bucket, kind), ())
                here = f"{where} dp_group_idx_{group} {kind}"
                chunks.setdefault(r.param.fqn, []).extend(
                    param_chunks(
                        r, found, itemsize, where=here, starts=starts.get((r.bucket, kind), [])
                    )
                )
        entries = {}
        for fqn, shape in shapes.items():
            got = chunks.get(fqn, [])
            problems = geometry.tiling_problems(shape, [(c.offsets, c.sizes) for c in got])
            if problems:
                raise CorruptCheckpointError(
                    f"{where}: the optimizer's {kind} of {fqn} does not tile its shape "
                    f"{list(shape)}: {problems[0]}",
                    fqn=fqn,
                )
            entries[fqn] = TensorEntry(fqn, dtype, shape, tuple(got))
        out[kind] = entries
    return out


def dense_staging(
    model: Sequence[ModelTensor],
    split: Parallelism,
    order: Sequence[str],
    extra: Callable[[int, int], list[LocalParam]] | None = None,
) -> Callable[[], Mapping[int, Sequence[LocalParam]]]:
    """One candidate placement of ``model``'s parameters in the buckets (:func:`stage_params`
    in the layer order ``order``; ``extra``: what each layer adds after its own, the experts
    an EP-1 MoE run keeps in the dense buffer)."""
    return lambda: stage_params(
        model,
        tp=split.tp,
        pp=split.pp,
        num_layers=split.num_layers,
        layer_order=order,
        tied=split.tied,
        layer_extra=extra,
    )


def _placement(
    buffers: Mapping[int, Buckets],
    split: Parallelism,
    where: str,
    stagings: Iterable[Callable[[], Mapping[int, Sequence[LocalParam]]]],
) -> dict[int, list[ParamRange]]:
    """The ranges of the first candidate placement whose ranges fall on the stored chunk
    boundaries of every buffer."""
    first_problem: str | None = None
    for staging in stagings:
        staged = staging()
        placed: dict[int, list[ParamRange]] = {}
        problem = None
        for group, buf in sorted(buffers.items()):
            here = f"{where} dp_group_idx_{group}"
            try:
                ranges = place_params(staged[group], buf.unpadded, buf.padded, split.dp, where=here)
            except CorruptCheckpointError as e:
                problem = str(e)
                break
            by_bucket: dict[int, list[StoredPiece]] = {}
            for (b, kind), found in buf.pieces.items():
                if kind == KINDS[0] or b not in by_bucket:
                    by_bucket[b] = list(found)
            why = check_boundaries(ranges, by_bucket)
            if why is not None:
                problem = (
                    f"{here}: the model's parameters do not add up to the stored buckets "
                    f"({why}); {WITHOUT_OPTIMIZER}"
                )
                break
            placed[group] = ranges
        if problem is None:
            return placed
        first_problem = first_problem or problem
    raise CorruptCheckpointError(first_problem or where, fqn=where)


def model_space_state(tensors: Mapping[str, TensorEntry]) -> dict[str, dict[str, TensorEntry]]:
    """``fully_reshardable``'s ``optimizer.state.<kind>.<model fqn>`` entries, per kind and
    model FQN (the entries keep their boxes and bytes)."""
    out: dict[str, dict[str, TensorEntry]] = {}
    for fqn, entry in tensors.items():
        if not fqn.startswith(STATE_PREFIX):
            continue
        kind, _, model_fqn = fqn[len(STATE_PREFIX) :].partition(".")
        if kind in KINDS and model_fqn:
            out.setdefault(kind, {})[model_fqn] = TensorEntry(
                model_fqn, entry.dtype, entry.shape, entry.chunks
            )
    return out
