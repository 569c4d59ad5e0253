"""Megatron-core's distributed optimizer state placed on the model's tensors (pure, torch-free).

Megatron-core's ``DistributedOptimizer`` saves each parameter's fp32 master (``param``) and Adam
moments (``exp_avg``, ``exp_avg_sq``) in one of two forms (``distrib_optim_sharding_type``):

* ``fully_reshardable``: ``optimizer.state.<kind>.<model fqn>``, each with the model tensor's
  shape and boxes; :func:`model_space_state` only renames them.
* ``dp_reshardable`` (Megatron-LM's default): one flat fp32 tensor per bucket of each
  tensor/pipeline rank's gradient buffer, ``optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<j>
  .dtype_(<param dtype>, <grad dtype>).bucket_idx_<k>.<kind>``, beside the buffer's
  ``per_bucket_numel`` and ``per_bucket_numel_unpadded`` objects. ``i`` is the rank in the
  model-parallel group (``tp + TP * pp``). Nothing in the checkpoint names which parameter lies
  where: :func:`place_params` replays Megatron's buffer layout
  (``DistributedOptimizer._compute_per_buffer_param_layout``, core 0.19):

  - the buffer holds the rank's trainable parameters in reverse ``named_parameters()`` order
    (backprop order);
  - each parameter starts on a multiple of :data:`ALIGN_ELEMENTS` elements (the gap holds
    whatever the allocator left there, saved as a "padding" chunk);
  - a bucket closes once it reaches ``bucket_size`` (or never, without overlapped grad
    reduction), and around a pipeline-shared embedding; its unpadded size is recorded in
    ``per_bucket_numel_unpadded`` and its end padded to a multiple of ``lcm(DP, 128)`` (or
    ``lcm(DP, 128, 2**16)`` for NCCL bus bandwidth): ``per_bucket_numel``.

  ``bucket_size`` is not saved, so the bucket ends are taken from
  ``per_bucket_numel_unpadded``. The saved bucket tensor has the bucket's unpadded size and
  holds bucket coordinates; each DP rank saves its slice of the bucket as one DCP chunk per
  parameter piece (a parameter straddling two ranks' slices is two chunks), so a parameter's
  range must begin and end on chunk boundaries: :func:`check_boundaries` proves the replayed
  order against the stored chunks before anything is read.

A parameter's range of a bucket becomes boxes of the model tensor
(:func:`ckptools.core.flat_ranges.flat_boxes`), each a ``raw`` chunk at its byte
offset in the rank file: :func:`bucket_state` returns, per kind, one :class:`TensorEntry` per
model FQN with the model tensor's shape, tiled exactly once (TP and pipeline replicas of a
parameter, such as a norm every TP rank keeps, are taken from the lowest model-parallel rank).
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptools.core import geometry
from ckptools.core.flat_ranges import flat_boxes
from ckptools.core.manifest import Chunk, Record, stored_in
from ckptools.errors import CorruptCheckpointError, UnsupportedCheckpointError

#: every parameter of a Megatron gradient buffer starts on a multiple of this many elements
#: (``param_layout.pad_param_start``)
ALIGN_ELEMENTS = 64
#: a bucket's end is padded to a multiple of ``lcm(DP, 128)`` (``bucket_end_divisor``)
BUCKET_END_ELEMENTS = 128
#: ... or of ``lcm(DP, 128, 2**16)`` with ``pad_buckets_for_high_nccl_busbw``
HIGH_BUSBW_ELEMENTS = 2**16
#: what the distributed optimizer keeps per parameter element (Adam's names)
KINDS = ("param", "exp_avg", "exp_avg_sq")
#: the ``dp_reshardable`` bucket tensors and objects
DISTRIBUTED_PREFIX = "optimizer.distributed."
#: the ``fully_reshardable`` per-parameter tensors
STATE_PREFIX = "optimizer.state."
#: the way forward every refusal names: the model alone converts without the optimizer
WITHOUT_OPTIMIZER = (
    "convert the model alone (consolidate without --masters; reshard --drop-optimizer)"
)

_BUCKET_FQN = re.compile(
    r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\(([\w.]+), ([\w.]+)\)"
    r"\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)"
)

#: a decoder layer's tensors as Megatron's checkpoint names them, in ``named_parameters()``
#: order of the local layer spec (``get_gpt_layer_local_spec``: the norms are modules of their
#: own, registered first, and saved under the fused names) and of the Transformer Engine spec
#: (the norms are parameters of the fused linear layers, registered before their weight);
#: ``Attention`` registers ``linear_proj`` before ``SelfAttention`` adds ``linear_qkv``
_LOCAL_LAYER_ORDER = (
    "input_layernorm.weight",
    "input_layernorm.bias",
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    # multi-latent attention (``MLASelfAttention.__init__``, ``transformer/
    # multi_latent_attention.py`` lines 509-629 of core 0.19.2): after ``linear_proj`` (its
    # base class's, line 221) the q projection(s), the kv projections, then the latent norms (the
    # Transformer Engine spec fuses them into the up projections, registered before their weight)
    "self_attention.linear_q_proj.weight",
    "self_attention.linear_q_down_proj.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.linear_q_up_proj.weight",
    "self_attention.linear_kv_down_proj.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight",
    "self_attention.linear_kv_up_proj.weight",
    "self_attention.q_layernorm.weight",
    "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight",
    "self_attention.k_layernorm.bias",
    "self_attention.kv_layernorm.weight",
    "self_attention.kv_layernorm.bias",
    "pre_mlp_layernorm.weight",
    "pre_mlp_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias",
    # an MoE layer's MLP (``MoELayer.__init__``, ``transformer/moe/moe_layer.py`` lines 259, 326,
    # 338) registers its router first, then its experts (placed by
    # :mod:`ckptools.producers.megatron.moe_optimizer`: ``stage_params``' ``layer_extra``), then
    # its shared experts (``SharedExpertMLP``, an ``MLP``: ``linear_fc1`` then ``linear_fc2``,
    # ``transformer/mlp.py`` lines 222, 242; dense parameters, ``is_expert=False``)
    "mlp.router.weight",
    "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_experts.linear_fc2.weight",
)
#: a layer's tensors that are buffers, not parameters: saved with the model, in no gradient
#: buffer and with no optimizer state (the router's ``expert_bias``: ``register_buffer``,
#: ``transformer/moe/router.py`` line 188)
BUFFERS = ("mlp.router.expert_bias",)
#: the layer tensor after which a layer's ``layer_extra`` parameters (an MoE layer's experts)
#: are registered
_EXTRA_AFTER = "mlp.router.weight"


def _projection_first(order: tuple[str, ...]) -> tuple[str, ...]:
    """Transformer Engine's order: its ``linear_proj`` is registered before the fused
    ``linear_qkv`` (and its norm), the rest as the local spec orders it."""
    proj = tuple(n for n in order if n.startswith("self_attention.linear_proj."))
    rest = [n for n in order if n not in proj]
    at = rest.index("self_attention.linear_qkv.layer_norm_weight")
    return (*rest[:at], *proj, *rest[at:])


_TE_LAYER_ORDER = _projection_first(_LOCAL_LAYER_ORDER)
#: the candidate orders, tried in turn against the stored chunk boundaries
LAYER_ORDERS = (_LOCAL_LAYER_ORDER, _TE_LAYER_ORDER)
_FIRST_STAGE = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_LAST_STAGE = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias")
_OUTPUT = "output_layer.weight"
_LAYERS = "decoder.layers."
#: a SwiGLU fc1 (dense or shared experts): its TP rank holds gate rows and up rows
_FC1 = ".linear_fc1"
_LAYER_INDEX = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def is_buffer(fqn: str) -> bool:
    """``fqn`` (a model tensor, stacked or per layer) is a buffer (:data:`BUFFERS`), which the
    optimizer does not hold."""
    return fqn.startswith(_LAYERS) and fqn.endswith(tuple("." + b for b in BUFFERS))


@dataclass(frozen=True, slots=True)
class BucketName:
    """What a ``dp_reshardable`` bucket tensor's FQN says."""

    dp_group: int
    gbuf: int
    dtypes: tuple[str, str]
    bucket: int
    kind: str


def parse_bucket_fqn(fqn: str) -> BucketName | None:
    """The parts of a bucket tensor's FQN, or None for any other FQN.

    Example:
        >>> parse_bucket_fqn("optimizer.distributed.dp_group_idx_1.gbuf_idx_0."
        ...                  "dtype_(torch.float32, torch.float32).bucket_idx_2.exp_avg")
        BucketName(dp_group=1, gbuf=0, dtypes=('torch.float32', 'torch.float32'), bucket=2, kind='exp_avg')
    """  # noqa: E501
    m = _BUCKET_FQN.fullmatch(fqn)
    if m is None:
        return None
    return BucketName(int(m[1]), int(m[2]), (m[3], m[4]), int(m[5]), m[6])


@dataclass(frozen=True, slots=True)
class LocalParam:
    """One parameter as one tensor/pipeline rank holds it: boxes of a model tensor.

    Attributes:
        fqn: the model tensor's FQN in the checkpoint (stacked or per layer).
        boxes: ``(offsets, sizes)`` in the model tensor; the parameter's flat elements are
            their row-major flattenings back to back (one box, but two for a SwiGLU
            ``linear_fc1``, whose TP rank holds its gate rows and its up rows; a stacked
            layer's box has size 1 on the layer dimension).
        replica: another model-parallel rank holds the same boxes (a norm every TP rank keeps,
            the embedding the last pipeline stage ties to); its state is not taken.
    """

    fqn: str
    boxes: tuple[geometry.Box, ...]
    replica: bool = False

    @property
    def numel(self) -> int:
        return sum(math.prod(sizes) for _, sizes in self.boxes)


@dataclass(frozen=True, slots=True)
class ParamRange:
    """Where a parameter's elements lie: ``[start, stop)`` of bucket ``bucket``'s tensor."""

    param: LocalParam
    bucket: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class StoredPiece:
    """Elements ``[start, start + count)`` of a bucket tensor, stored contiguously at byte
    ``offset`` of ``file`` (a DCP chunk's raw data, its archive already resolved)."""

    start: int
    count: int
    file: str
    offset: int
    rank: int | None = None
    record: Record | None = None  # the stored record holding it, with its CRC-32


def _pad(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


def bucket_end_choices(dp_size: int) -> tuple[int, int]:
    """The two multiples Megatron pads a bucket's end to at data-parallel size ``dp_size``."""
    base = math.lcm(dp_size, BUCKET_END_ELEMENTS)
    return base, math.lcm(base, HIGH_BUSBW_ELEMENTS)


def place_params(
    params: Sequence[LocalParam],
    unpadded: Sequence[int],
    padded: Sequence[int] | None = None,
    dp_size: int | None = None,
    *,
    where: str = "optimizer",
) -> list[ParamRange]:
    """Each parameter's range in its bucket, replaying Megatron's buffer layout (see the module).

    Args:
        params: the buffer's parameters in ``named_parameters()`` order.
        unpadded: ``per_bucket_numel_unpadded`` of the buffer.
        padded: ``per_bucket_numel`` of the buffer, checked when given.
        dp_size: the data-parallel size, checked against ``padded`` when both are given.
        where: names the buffer in errors.

    Raises:
        CorruptCheckpointError: the parameters do not add up to the recorded buckets.
    """
    out: list[ParamRange] = []
    bucket, cursor, held = 0, 0, 0

    def refuse(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{where}: the model's parameters do not add up to the optimizer's buckets "
            f"{list(unpadded)} ({why}); {WITHOUT_OPTIMIZER}",
            fqn=where,
        )

    for p in reversed(params):
        if bucket >= len(unpadded):
            raise refuse(f"{p.fqn} lies past the last bucket")
        start = _pad(cursor, ALIGN_ELEMENTS)
        if held and start == unpadded[bucket] and cursor < start:
            # a pipeline-shared embedding opens a bucket of its own, the previous one closed
            # at the aligned start
            bucket, cursor, held, start = bucket + 1, 0, 0, 0
            if bucket >= len(unpadded):
                raise refuse(f"{p.fqn} lies past the last bucket")
        stop = start + p.numel
        if stop > unpadded[bucket]:
            raise refuse(f"{p.fqn} ends at {stop}, past bucket {bucket}'s {unpadded[bucket]}")
        out.append(ParamRange(p, bucket, start, stop))
        held += 1
        if stop == unpadded[bucket]:
            bucket, cursor, held = bucket + 1, 0, 0
        else:
            cursor = stop
    if held or bucket != len(unpadded):
        raise refuse(f"the parameters fill {bucket + bool(held)} bucket(s)")
    if padded is not None:
        _check_padding(unpadded, padded, dp_size, refuse)
    return out


def _check_padding(
    unpadded: Sequence[int], padded: Sequence[int], dp_size: int | None, refuse: Any
) -> None:
    if len(padded) != len(unpadded):
        raise refuse(f"per_bucket_numel has {len(padded)} bucket(s)")
    for k, (n, full) in enumerate(zip(unpadded, padded, strict=True)):
        if dp_size is not None:
            ok = full in {_pad(n, d) for d in bucket_end_choices(dp_size)}
        else:
            ok = full >= n and full % BUCKET_END_ELEMENTS == 0
        if not ok:
            raise refuse(f"bucket {k} is padded to {full}, not from {n} at DP {dp_size}")


def check_boundaries(
    ranges: Iterable[ParamRange], pieces: Mapping[int, Sequence[StoredPiece]]
) -> str | None:
    """Why the ranges cannot be the stored ones, or None: every parameter must begin and end
    on a boundary of its bucket's stored chunks (each DP rank saves one chunk per parameter
    piece), and lie within what is stored."""
    starts: dict[int, list[int]] = {}
    ends: dict[int, set[int]] = {}
    for b, found in pieces.items():
        starts[b] = sorted(p.start for p in found)
        ends[b] = {p.start + p.count for p in found}
    for r in ranges:
        if r.stop == r.start:
            continue
        bounds = starts.get(r.bucket)
        if not bounds:
            return f"bucket {r.bucket} is not stored"
        i = bisect.bisect_left(bounds, r.start)
        if i == len(bounds) or bounds[i] != r.start:
            return f"{r.param.fqn} would start at {r.start} of bucket {r.bucket}, inside a chunk"
        if r.stop not in ends[r.bucket]:
            return f"{r.param.fqn} would end at {r.stop} of bucket {r.bucket}, inside a chunk"
    return None


def param_chunks(
    r: ParamRange,
    pieces: Sequence[StoredPiece],
    itemsize: int,
    *,
    where: str = "optimizer",
    starts: Sequence[int] | None = None,
) -> list[Chunk]:
    """Raw chunks, in the model tensor's coordinates, of one parameter's elements.

    ``pieces`` are its bucket's stored pieces sorted by ``start``; ``starts`` their starts,
    when the caller places many parameters in one bucket (found by bisection, so placing a
    bucket stays linear in its pieces).

    Raises:
        CorruptCheckpointError: the stored pieces do not cover the parameter's range.
    """
    p = r.param
    out: list[Chunk] = []
    covered = 0
    if starts is None:
        starts = [s.start for s in pieces]
    i = max(0, bisect.bisect_right(starts, r.start) - 1)
    while i < len(pieces) and pieces[i].start < r.stop:
        s = pieces[i]
        lo, hi = max(r.start, s.start), min(r.stop, s.start + s.count)
        if lo < hi:
            covered += hi - lo
            out.extend(
                _box_chunks(
                    p, lo - r.start, hi - r.start, s, s.offset + (lo - s.start) * itemsize, itemsize
                )
            )
        i += 1
    if covered != r.stop - r.start:
        raise CorruptCheckpointError(
            f"{where}: the optimizer stores {covered} of the {r.stop - r.start} elements of "
            f"{p.fqn} at {list(p.boxes[0][0])} (bucket {r.bucket}, elements {r.start}..{r.stop})",
            fqn=p.fqn,
        )
    return out


def _box_chunks(
    p: LocalParam, first: int, stop: int, s: StoredPiece, at: int, itemsize: int
) -> Iterator[Chunk]:
    """Chunks of the parameter's flat elements ``[first, stop)``, stored from byte ``at``."""
    base = 0
    for offsets, sizes in p.boxes:
        n = math.prod(sizes)
        lo, hi = max(first, base), min(stop, base + n)
        for (offs, part), flat_at in flat_boxes(sizes, lo - base, hi - base) if lo < hi else ():
            offset = at + (base + flat_at - first) * itemsize
            length = math.prod(part) * itemsize
            yield Chunk(
                offsets=tuple(a + b for a, b in zip(offsets, offs, strict=True)),
                sizes=part,
                file=s.file,
                offset=offset,
                length=length,
                rank=s.rank,
                **({} if s.record is None else stored_in(s.record, offset, length)),
            )
        base += n


# ------------------------------------------------------------------------------------------------
# Which parameters each tensor/pipeline rank holds, in its named_parameters() order
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelTensor:
    """What the placement needs of a model tensor: its FQN, shape and stored boxes."""

    fqn: str
    shape: tuple[int, ...]
    boxes: tuple[geometry.Box, ...]


def _split_boxes(
    boxes: Iterable[geometry.Box], tp: int, fqn: str
) -> list[tuple[geometry.Box, ...]]:
    """Each TP rank's boxes of a tensor (or of one layer of it), in rank order: the one box
    (every TP rank keeps the whole), one box per rank, or for a SwiGLU ``linear_fc1`` (saved as
    its gate rows then its up rows, each split over TP) the rank's gate and up boxes."""
    distinct = sorted(set(boxes))
    if len(distinct) == 1:
        return [(distinct[0],)] * tp
    if len(distinct) == tp:
        return [(b,) for b in distinct]
    if len(distinct) == 2 * tp and fqn.rsplit(".", 1)[0].endswith(_FC1):
        return list(zip(distinct[:tp], distinct[tp:], strict=True))
    raise UnsupportedCheckpointError(
        f"{fqn}: stored as {len(distinct)} pieces per layer, neither whole nor one per "
        f"tensor-parallel rank ({tp}); {WITHOUT_OPTIMIZER}",
        fqn=fqn,
    )


def _layer_boxes(t: ModelTensor) -> dict[int, list[geometry.Box]]:
    """A stacked tensor's boxes per layer (each cut to that layer), in one pass."""
    out: dict[int, list[geometry.Box]] = {}
    for offs, sizes in t.boxes:
        for layer in range(offs[0], offs[0] + sizes[0]):
            out.setdefault(layer, []).append(((layer, *offs[1:]), (1, *sizes[1:])))
    return out


def stage_params(
    model: Iterable[ModelTensor],
    *,
    tp: int,
    pp: int,
    num_layers: int,
    layer_order: Sequence[str] = _LOCAL_LAYER_ORDER,
    tied: bool = False,
    layer_extra: Callable[[int, int], list[LocalParam]] | None = None,
) -> dict[int, list[LocalParam]]:
    """Each model-parallel rank's (``tp + TP * pp``) parameters in ``named_parameters()``
    order, for a GPT model with layers split evenly over the pipeline.

    ``tied``: the output layer shares the embedding; with a pipeline, the last stage keeps a
    copy of it (``output_layer.weight`` is not saved) in a bucket of its own.
    ``layer_extra(layer, tp rank)``: parameters registered after a layer's own (an MoE layer's
    experts, when they share the dense buffer).

    Raises:
        UnsupportedCheckpointError: a tensor this placement does not know (vision towers,
            a shared-expert gate...; routed experts are the caller's: ``layer_extra``) or
            layers that do not split evenly.
    """
    if num_layers % pp:
        raise UnsupportedCheckpointError(
            f"{num_layers} layers over {pp} pipeline stages is an uneven split; convert the "
            f"{WITHOUT_OPTIMIZER}"
        )
    per_stage = num_layers // pp
    rank_of = {name: i for i, name in enumerate(layer_order)}
    first: list[ModelTensor] = []
    last: list[ModelTensor] = []
    layers: dict[int, list[tuple[int, ModelTensor, bool]]] = {}
    for t in model:
        per_layer = _LAYER_INDEX.fullmatch(t.fqn)
        if t.fqn in _FIRST_STAGE:
            first.append(t)
        elif t.fqn in _LAST_STAGE or t.fqn == _OUTPUT:
            last.append(t)
        elif per_layer is not None and per_layer[2] in rank_of:
            layers.setdefault(int(per_layer[1]), []).append((rank_of[per_layer[2]], t, False))
        elif t.fqn.startswith(_LAYERS) and t.fqn[len(_LAYERS) :] in rank_of:
            if not t.shape or t.shape[0] != num_layers:
                raise UnsupportedCheckpointError(
                    f"{t.fqn}: stacked over {t.shape[:1]} layers, not {num_layers}", fqn=t.fqn
                )
            for layer in range(num_layers):
                layers.setdefault(layer, []).append((rank_of[t.fqn[len(_LAYERS) :]], t, True))
        else:
            raise UnsupportedCheckpointError(
                f"{t.fqn}: a tensor the Megatron optimizer placement does not know (vision "
                f"towers, a shared-expert gate, biases of another spec); {WITHOUT_OPTIMIZER}",
                fqn=t.fqn,
            )
    first.sort(key=lambda t: _FIRST_STAGE.index(t.fqn))
    last.sort(key=lambda t: (*_LAST_STAGE, _OUTPUT).index(t.fqn))
    out: dict[int, list[LocalParam]] = {}
    per_layer_boxes: dict[str, dict[int, list[geometry.Box]]] = {}
    for stage in range(pp):
        for rank in range(tp):
            mine: list[LocalParam] = []
            if stage == 0:
                mine += [_whole(t, rank, tp) for t in first]
            for layer in range(stage * per_stage, (stage + 1) * per_stage):
                own = sorted(layers.get(layer, ()), key=lambda x: x[0])
                # the experts follow the router (before the shared experts), else the layer
                extra_at = next(
                    (i + 1 for i, (o, _, _) in enumerate(own) if layer_order[o] == _EXTRA_AFTER),
                    len(own),
                )
                for i, (_, t, stacked) in enumerate(own):
                    if i == extra_at and layer_extra is not None:
                        mine += layer_extra(layer, rank)
                    if stacked and t.fqn not in per_layer_boxes:
                        per_layer_boxes[t.fqn] = _layer_boxes(t)
                    boxes = per_layer_boxes[t.fqn].get(layer, []) if stacked else list(t.boxes)
                    mine.append(_pick(t.fqn, boxes, rank, tp))
                if extra_at == len(own) and layer_extra is not None:
                    mine += layer_extra(layer, rank)
            if stage == pp - 1:
                mine += [_whole(t, rank, tp) for t in last]
                if tied and pp > 1:
                    emb = next((t for t in first if t.fqn == _FIRST_STAGE[0]), None)
                    if emb is not None:
                        p = _whole(emb, rank, tp)
                        mine.append(LocalParam(p.fqn, p.boxes, replica=True))
            out[rank + tp * stage] = mine
    return out


def _whole(t: ModelTensor, rank: int, tp: int) -> LocalParam:
    return _pick(t.fqn, t.boxes, rank, tp)


def _pick(fqn: str, boxes: Iterable[geometry.Box], rank: int, tp: int) -> LocalParam:
    split = _split_boxes(boxes, tp, fqn)
    return LocalParam(fqn, split[rank], replica=rank > 0 and split[0] == split[rank])
