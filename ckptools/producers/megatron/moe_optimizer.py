"""An MoE run's distributed optimizer: where Megatron-core 0.19.2 puts the experts' state (pure).

:mod:`ckptools.producers.megatron.optimizer` replays a dense GPT model's gradient buffer; an MoE
layer adds its router (a dense parameter, registered first by ``MoELayer``, placed there) and its
experts, whose buffer depends on how the run split them (``megatron/core`` of 0.19.2):

* an expert's linear layers mark their weights ``allreduce = not use_expert_pgs`` with
  ``use_expert_pgs = is_expert and (expert_parallel or expert_tensor_parallel_size !=
  tensor_model_parallel_size)`` (``tensor_parallel/layers.py`` lines 961-963, 1017, 1379-1383);
* DDP groups the parameters by ``(param_dtype, grad_dtype, is_expert_parallel)`` with
  ``is_expert_parallel = not param.allreduce`` (``distributed/param_and_grad_buffer.py``
  ``group_params_for_buffers``, line 918) and lays out each group in the reverse of its
  ``named_parameters()`` order (``distributed/distributed_data_parallel.py`` lines 114-148);
  the expert group's bucket ends are padded for the **expert** data-parallel size
  (``optimizer/distrib_optimizer.py`` ``compute_full_param_layout``, lines 617-628);
* ``get_megatron_optimizer`` builds one distributed optimizer over the dense groups and, when
  any group ``is_expert_parallel`` (``optimizer/__init__.py`` line 348), a second over the
  expert groups, chained in that order (``ChainedOptimizer``: saved as ``chained_0.…`` dense and
  ``chained_1.…`` experts). The dense one's ``data_parallel_group_idx`` is the rank in the
  TP×PP group (line 1072); the expert one's is the rank in the expert TP×EP×PP group
  (``expt_model_parallel_rank``, lines 1196-1198), whose order is tp-ep-dp-pp
  (``parallel_state.py`` lines 886-893): ``expert_tp + ETP * (ep + EP * pp)``; its data-parallel
  group is the expert-data-parallel group, ``world / (ETP * EP * PP)`` ranks.

So at EP 1 with the experts' TP the dense one, there is one optimizer and each layer's experts
follow its router in the dense buffer; otherwise the expert buffer holds, per layer of the
rank's stage, its local experts ``[ep * E / EP, (ep + 1) * E / EP)``, each split over the expert
TP ranks as a dense ``linear_fc1`` / ``linear_fc2`` is over TP. The local spec's
``SequentialMLP`` registers expert by expert (``local_experts.<e>.linear_fc1`` then
``linear_fc2``), Transformer Engine's ``TEGroupedMLP`` every ``linear_fc1.weight<e>`` then every
``linear_fc2.weight<e>``: both orders are candidates, proved against the stored chunks.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptools.core import geometry
from ckptools.errors import UnsupportedCheckpointError
from ckptools.producers.megatron.buckets import Parallelism, dense_staging
from ckptools.producers.megatron.optimizer import (
    LAYER_ORDERS,
    WITHOUT_OPTIMIZER,
    LocalParam,
    ModelTensor,
)

_LAYERS = "decoder.layers."
#: the experts' tensors as Megatron-core saves them, stacked ``[L, E, ...]`` or per layer
#: ``decoder.layers.<i>.…`` ``[E, ...]`` (:mod:`ckptools.producers.megatron.moe`)
_FC1, _FC2 = "mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc2.weight"
_EXPERT = re.compile(r"decoder\.layers\.(?:(\d+)\.)?(mlp\.experts\.experts\.linear_fc[12]\.weight)")
#: how a layer's experts register their parameters: ``SequentialMLP`` expert by expert,
#: ``TEGroupedMLP`` every fc1 then every fc2
EXPERT_ORDERS = ("sequential", "grouped")


@dataclass(frozen=True, slots=True)
class MoeSplit:
    """How an MoE run split its model: the dense TP, PP, DP sizes and the experts' EP and TP."""

    tp: int
    pp: int
    dp: int | None
    ep: int
    etp: int
    experts: int
    num_layers: int

    @property
    def separate(self) -> bool:
        """The experts lie in a distributed optimizer of their own (``chained_1``)."""
        return self.ep > 1 or self.etp != self.tp

    @property
    def expert_dp(self) -> int | None:
        """The expert-data-parallel size (``world / (ETP * EP * PP)``), None when DP is not
        recorded."""
        if self.dp is None:
            return None
        return self.tp * self.pp * self.dp // (self.etp * self.ep * self.pp)

    @property
    def expert_groups(self) -> int:
        """The expert optimizer's ``dp_group_idx`` count: the expert TP×EP×PP ranks."""
        return self.etp * self.ep * self.pp


def is_expert(fqn: str) -> bool:
    """``fqn`` is an expert tensor (stacked or per layer)."""
    return _EXPERT.fullmatch(fqn) is not None


def _per_expert(experts: Iterable[ModelTensor]) -> dict[tuple[int, int, int], list[geometry.Box]]:
    """``(layer, expert, 1 or 2)`` → the stored boxes of that expert's ``linear_fc<1|2>`` (in the
    saved tensor's coordinates), from stacked or per-layer expert tensors."""
    out: dict[tuple[int, int, int], list[geometry.Box]] = {}
    for t in experts:
        m = _EXPERT.fullmatch(t.fqn)
        assert m is not None
        fc = 1 if m[2] == _FC1 else 2
        for offs, sizes in t.boxes:
            lead = 2 if m[1] is None else 1
            if any(s != 1 for s in sizes[:lead]):
                raise UnsupportedCheckpointError(
                    f"{t.fqn}: a stored piece spans several experts or layers ({list(sizes)}), "
                    f"not one expert's; {WITHOUT_OPTIMIZER}",
                    fqn=t.fqn,
                )
            layer, expert = (offs[0], offs[1]) if m[1] is None else (int(m[1]), offs[0])
            out.setdefault((layer, expert, fc), []).append((offs, sizes))
    return out


def _split(
    boxes: list[geometry.Box], etp: int, fc: int, fqn: str
) -> list[tuple[geometry.Box, ...]]:
    """Each expert-TP rank's boxes of one expert's fc1/fc2: whole, one per rank, or (fc1: its
    gate rows then its up rows, each split over the expert TP) a gate box and an up box."""
    distinct = sorted(set(boxes))
    if len(distinct) == 1:
        return [(distinct[0],)] * etp
    if len(distinct) == etp:
        return [(b,) for b in distinct]
    if fc == 1 and len(distinct) == 2 * etp:
        return list(zip(distinct[:etp], distinct[etp:], strict=True))
    raise UnsupportedCheckpointError(
        f"{fqn}: an expert stored as {len(distinct)} pieces, neither whole nor one per expert "
        f"tensor-parallel rank ({etp}); {WITHOUT_OPTIMIZER}",
        fqn=fqn,
    )


class _Experts:
    """The experts of a run, each expert-TP rank's boxes of each, in a layer's register order."""

    def __init__(self, experts: Sequence[ModelTensor], split: MoeSplit, order: str) -> None:
        self.names = {}
        for t in experts:
            m = _EXPERT.fullmatch(t.fqn)
            assert m is not None
            self.names[(None if m[1] is None else int(m[1]), 1 if m[2] == _FC1 else 2)] = t.fqn
        self.boxes = _per_expert(experts)
        self.split = split
        self.order = order

    def _fqn(self, layer: int, fc: int) -> str:
        return self.names.get((None, fc)) or self.names[(layer, fc)]

    def layer(self, layer: int, ep: int, etp: int) -> list[LocalParam]:
        """EP rank ``ep``'s, expert-TP rank ``etp``'s expert parameters of ``layer`` (none for a
        dense layer of a run whose layers differ: DeepSeek's first layers)."""
        if not any(k in self.names for k in ((None, 1), (layer, 1), (layer, 2))):
            return []
        per_rank = self.split.experts // self.split.ep
        local = range(ep * per_rank, (ep + 1) * per_rank)
        if self.order == "sequential":
            seq = [(e, fc) for e in local for fc in (1, 2)]
        else:
            seq = [(e, fc) for fc in (1, 2) for e in local]
        out = []
        for e, fc in seq:
            fqn = self._fqn(layer, fc)
            boxes = self.boxes.get((layer, e, fc))
            if not boxes:
                raise UnsupportedCheckpointError(
                    f"{fqn}: expert {e} of layer {layer} is not stored; {WITHOUT_OPTIMIZER}",
                    fqn=fqn,
                )
            mine = _split(boxes, self.split.etp, fc, fqn)
            # an expert is never replicated over expert TP: each rank's boxes are its own
            out.append(LocalParam(fqn, mine[etp], replica=etp > 0 and mine[0] == mine[etp]))
        return out


def dense_layer_experts(
    experts: Sequence[ModelTensor], split: MoeSplit, order: str
) -> Callable[[int, int], list[LocalParam]]:
    """For :func:`ckptools.producers.megatron.optimizer.stage_params` (``layer_extra``) when the
    experts share the dense buffer (EP 1, expert TP = TP): a layer's experts after its router."""
    found = _Experts(experts, split, order)
    return lambda layer, tp_rank: found.layer(layer, 0, tp_rank)


def expert_stage_params(
    experts: Sequence[ModelTensor], split: MoeSplit, order: str
) -> dict[int, list[LocalParam]]:
    """Each expert model-parallel rank's (``etp + ETP * (ep + EP * pp)``, the expert optimizer's
    ``dp_group_idx``) expert parameters in ``named_parameters()`` order.

    Raises:
        UnsupportedCheckpointError: layers that do not split evenly over the pipeline, experts
            that do not split evenly over EP, or pieces that are not one per expert-TP rank.
    """
    if split.num_layers % split.pp or split.experts % split.ep:
        raise UnsupportedCheckpointError(
            f"{split.num_layers} layers over {split.pp} pipeline stages, {split.experts} experts "
            f"over {split.ep} expert-parallel ranks: an uneven split; {WITHOUT_OPTIMIZER}"
        )
    found = _Experts(experts, split, order)
    per_stage = split.num_layers // split.pp
    out: dict[int, list[LocalParam]] = {}
    for stage in range(split.pp):
        for ep in range(split.ep):
            for etp in range(split.etp):
                mine: list[LocalParam] = []
                for layer in range(stage * per_stage, (stage + 1) * per_stage):
                    mine += found.layer(layer, ep, etp)
                out[etp + split.etp * (ep + split.ep * stage)] = mine
    return out


#: one distributed optimizer to place: its FQN prefix, the model tensors it holds, its split
#: (``tp * pp``: its ``dp_group_idx`` count; ``dp``: its data-parallel size) and the candidate
#: placements of each group's parameters
Part = tuple[
    str,
    list[ModelTensor],
    Parallelism,
    list[Callable[[], Mapping[int, Sequence[LocalParam]]]] | None,
]


def parts(
    model: Sequence[ModelTensor],
    split: Parallelism,
    args: Mapping[str, Any],
    prefixes: Sequence[str],
    where: str,
) -> list[Part]:
    """The distributed optimizers of an MoE run (see the module) and what each holds.

    Raises:
        UnsupportedCheckpointError: the save holds another number of optimizers than the run's
            expert split makes.
    """
    ep = args.get("expert_parallel") or 1
    etp = args.get("expert_tensor_parallel") or split.tp
    experts = args.get("num_experts")
    assert isinstance(experts, int)
    moe = MoeSplit(split.tp, split.pp, split.dp, ep, etp, experts, split.num_layers)
    mine = [t for t in model if is_expert(t.fqn)]
    dense = [t for t in model if not is_expert(t.fqn)]
    want = 2 if moe.separate else 1
    if len(prefixes) != want:
        raise UnsupportedCheckpointError(
            f"{where}: at EP {ep} with expert TP {etp} (TP {split.tp}) Megatron keeps the experts "
            f"in {'an optimizer of their own' if moe.separate else 'the dense optimizer'}, but "
            f"the save holds {len(prefixes)} distributed optimizer(s); {WITHOUT_OPTIMIZER}",
            path=where,
        )

    if not moe.separate:
        stagings = [
            dense_staging(dense, split, order, dense_layer_experts(mine, moe, eorder))
            for order in LAYER_ORDERS
            for eorder in EXPERT_ORDERS
        ]
        return [(prefixes[0], list(model), split, stagings)]
    expert_split = Parallelism(
        moe.etp * moe.ep, split.pp, moe.expert_dp, split.num_layers, tied=False
    )
    expert_stagings: list[Callable[[], Mapping[int, Sequence[LocalParam]]]] = [
        functools.partial(expert_stage_params, mine, moe, o) for o in EXPERT_ORDERS
    ]
    return [
        (prefixes[0], dense, split, [dense_staging(dense, split, order) for order in LAYER_ORDERS]),
        (prefixes[1], mine, expert_split, expert_stagings),
    ]
