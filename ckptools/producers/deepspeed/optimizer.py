"""A ZeRO checkpoint's optimizer, named as a torch optimizer ``state_dict()`` keyed by FQN
(torch-free).

:mod:`ckptools.plan.training` finds an optimizer in any manifest by its key paths: ``state/<key>/
<name>`` entries beside a ``param_groups`` value (a list of dicts). DeepSpeed keeps one flat
state per param group instead; :func:`optimizer_tree` turns the side table (:class:`ZeroState`,
filled by :mod:`ckptools.producers.deepspeed.layout`) into that shape under :data:`OPTIMIZER`, so
resharding needs no DeepSpeed knowledge:

* ``optimizer/state/<fqn>/exp_avg`` and ``exp_avg_sq``: the moments' entries, with the
  parameter's full shape and chunks in the rank files (partitioned exactly as the masters);
* ``optimizer/state/<fqn>/step``: the group's counter, given to every parameter of the group as
  torch's AdamW keeps it (a 0-dim entry on rank 0's bytes, or a
  :class:`ckptools.core.tensor_value.TensorValue` where the counter was saved as a number);
* ``optimizer/param_groups``: the client optimizer's groups with ``params`` the group's FQNs
  (DeepSpeed's groups list its flat partition, ``[0]``, instead).

``optimizer`` is one of :data:`ckptools.core.keys.NON_MODEL_CONTAINERS`, so ``consolidate``,
``verify``'s model checks, ``inspect`` and ``diff`` still take the model alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptools.core.manifest import ObjectEntry, TensorEntry
from ckptools.core.tensor_value import TensorValue
from ckptools.errors import CorruptCheckpointError

#: the key path under which the optimizer is named
OPTIMIZER = "optimizer"
#: the moments a ZeRO optimizer file holds per parameter (torch's Adam names)
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class ZeroState:
    """What a ZeRO checkpoint holds beyond the model, for conversions that carry the optimizer.

    Attributes:
        stage: 1, 2 or 3.
        tag: the tag directory read (None when the path was the tag directory itself).
        exp_avg, exp_avg_sq: FQN -> entry of the Adam moment, with the parameter's shape and
            chunks in the rank files (empty when the optimizer keeps none).
        step: flat group index -> rank 0's step counter (a 0-dim tensor entry, or the number
            an older torch saved).
        group_of: FQN -> its optimizer param group.
        param_groups: the client optimizer's param groups (hyperparameters, plain values).
        not_carried: what a conversion cannot carry over, said plainly.
    """

    stage: int
    tag: str | None
    ds_version: str | None
    exp_avg: Mapping[str, TensorEntry] = field(default_factory=dict)
    exp_avg_sq: Mapping[str, TensorEntry] = field(default_factory=dict)
    step: Mapping[int, TensorEntry | float] = field(default_factory=dict)
    group_of: Mapping[str, int] = field(default_factory=dict)
    param_groups: tuple[Any, ...] = ()
    not_carried: tuple[str, ...] = ()


def optimizer_tree(
    root: str, state: ZeroState
) -> tuple[dict[str, TensorEntry], dict[str, ObjectEntry], dict[str, tuple[str, ...]]]:
    """The optimizer's entries (see the module), their objects and key paths; empty when the
    rank files hold no Adam moments (the layout's notes say so).

    Raises:
        CorruptCheckpointError: the client optimizer's groups do not match ZeRO's flat groups.
    """
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, ObjectEntry] = {}
    paths: dict[str, tuple[str, ...]] = {}
    if not state.exp_avg or not state.group_of:
        return tensors, objects, paths
    members: dict[int, list[str]] = {}
    for fqn, g in state.group_of.items():
        members.setdefault(g, []).append(fqn)
    if len(state.param_groups) != len(members) or set(members) != set(range(len(members))):
        raise CorruptCheckpointError(
            f"{root}: the optimizer saved {len(state.param_groups)} param group(s) but ZeRO "
            f"flattened {len(members)}",
            path=root,
        )

    def put(path: tuple[str, ...], entry: TensorEntry | None = None, value: Any = None) -> str:
        fqn = ".".join(path)
        paths[fqn] = path
        if entry is not None:
            tensors[fqn] = TensorEntry(fqn, entry.dtype, entry.shape, entry.chunks)
        else:
            objects[fqn] = ObjectEntry(fqn, value=value, has_value=True)
        return fqn

    for g, fqns in sorted(members.items()):
        step = state.step.get(g)
        for fqn in fqns:
            here = (OPTIMIZER, "state", fqn)
            if isinstance(step, TensorEntry):
                put((*here, "step"), step)
            elif isinstance(step, int | float):
                put((*here, "step"), value=TensorValue.scalar(step))
            for kind, table in zip(MOMENTS, (state.exp_avg, state.exp_avg_sq), strict=True):
                if fqn in table:
                    put((*here, kind), table[fqn])
    groups = []
    for i, group in enumerate(state.param_groups):
        if not isinstance(group, dict):
            raise CorruptCheckpointError(
                f"{root}: the optimizer's param group {i} is not a dict", path=root
            )
        groups.append({**group, "params": list(members[i])})
    put((OPTIMIZER, "param_groups"), value=groups)
    return tensors, objects, paths
