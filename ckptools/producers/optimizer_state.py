"""What optimizer state a checkpoint holds, read from its manifest's key paths (pure, torch-free).

An ``optimizer.state_dict()`` is ``{"state": {id: {name: value}}, "param_groups": [{...,
"params": [id, ...]}]}``: ids are integers in param-group order for a plain optimizer, FQNs
for ``FSDP.optim_state_dict`` and ``get_optimizer_state_dict`` (accelerate, torch's
distributed state dict); torch >= 2.5 may add each group's ``param_names``. Which ids map to
which parameters is not in the file unless ``param_names`` or FQN keys say so, so this module
only describes what is there (how it is keyed, how many entries and elements, the groups),
for ``inspect`` and for the step that maps optimizer state to FQNs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptools.core import keys
from ckptools.core.manifest import Manifest

_GROUP_KEYS = ("params", "param_names")


@dataclass(frozen=True)
class OptimizerState:
    """One optimizer state dict inside a checkpoint.

    Attributes:
        key: dotted key path of the state dict (``"optimizer_state_dict"``,
            ``"optimizer_states.0"``, ``"optimizer"``).
        keyed: ``"integer"`` (ids in param-group order), ``"fqn"`` (parameter names), or
            ``"empty"`` (no per-parameter state yet).
        entries: parameters with state.
        state: the per-parameter state names (``exp_avg``, ``exp_avg_sq``, ``step``).
        elements: per state name, tensor elements summed over entries.
        param_groups: number of param groups.
        params: ids (or FQNs) the groups list, over all groups.
        param_names: whether every group lists ``param_names``.
        hyperparameters: the groups' other keys (``lr``, ``betas``, ``weight_decay``...).
    """

    key: str
    keyed: Literal["integer", "fqn", "empty"]
    entries: int
    state: tuple[str, ...]
    elements: Mapping[str, int] = field(default_factory=dict)
    param_groups: int = 0
    params: int = 0
    param_names: bool = False
    hyperparameters: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "keyed": self.keyed,
            "entries": self.entries,
            "state": list(self.state),
            "elements": dict(self.elements),
            "param_groups": self.param_groups,
            "params": self.params,
            "param_names": self.param_names,
            "hyperparameters": list(self.hyperparameters),
        }


def optimizer_states(manifest: Manifest) -> list[OptimizerState]:
    """Every optimizer state dict of ``manifest``: a ``param_groups`` list of dicts beside a
    ``state`` sub-tree (or an empty ``state``), in key-path order."""
    roots: dict[tuple[str, ...], list[Any]] = {}
    for fqn, entry in manifest.objects.items():
        path = keys.key_path(manifest, fqn)
        if path[-1:] == (keys.OPTIMIZER_GROUPS,) and keys.is_param_groups(entry.value):
            roots[path[:-1]] = entry.value
    if not roots:
        return []
    found: dict[tuple[str, ...], dict[str, dict[str, int]]] = {r: {} for r in roots}
    for fqn in [*manifest.tensors, *manifest.objects]:
        path = keys.key_path(manifest, fqn)
        if len(path) >= 3 and path[-3] == "state" and path[:-3] in found:
            tensor = manifest.tensors.get(fqn)
            per_entry = found[path[:-3]].setdefault(path[-2], {})
            per_entry[path[-1]] = tensor.numel if tensor is not None else 0
    return [_describe(root, found[root], roots[root]) for root in sorted(roots)]


def _describe(
    root: tuple[str, ...], state: Mapping[str, Mapping[str, int]], groups: Sequence[Any]
) -> OptimizerState:
    names: dict[str, int] = {}
    for per_entry in state.values():
        for name, numel in per_entry.items():
            names[name] = names.get(name, 0) + numel
    params = [p for g in groups for p in (g.get("params") or [])]
    ids = [*state, *(str(p) for p in params)]
    keyed: Literal["integer", "fqn", "empty"] = "empty"
    if ids:
        keyed = "integer" if all(i.isdigit() for i in ids) else "fqn"
    hyper = sorted({str(k) for g in groups for k in g if k not in _GROUP_KEYS})
    return OptimizerState(
        key=".".join(root),
        keyed=keyed,
        entries=len(state),
        state=tuple(names),
        elements={k: v for k, v in names.items() if v},
        param_groups=len(groups),
        params=len(params),
        param_names=bool(groups) and all("param_names" in g for g in groups),
        hyperparameters=tuple(hyper),
    )


def flat_shard_note(
    manifest: Manifest, opt: OptimizerState, model: Mapping[str, str]
) -> str | None:
    """What to say of an integer-keyed optimizer state whose every tensor is 1-D and which covers
    fewer elements than the ``model`` tensors beside it (none when the file holds the optimizer
    alone): one rank's FSDP1 flat-parameter shard, FlatParameters' ``optimizer.state_dict()``,
    which places nothing on its own (alone, it may also be a plain optimizer of a model whose
    parameters are all 1-D: the note says how it looks). None for any other optimizer state.
    """
    if opt.keyed != "integer" or not opt.entries:
        return None
    root = tuple(opt.key.split(".")) if opt.key else ()
    shapes = [
        tensor.shape
        for fqn, tensor in manifest.tensors.items()
        if _under_state(keys.key_path(manifest, fqn), root)
    ]
    if not any(shapes) or any(len(s) > 1 for s in shapes):
        return None
    per_state = max(opt.elements.values())
    # a model part the user named inside the optimizer (inspect --key state): not counted
    own = [f for f in model.values() if not _under_state(keys.key_path(manifest, f), root)]
    model_elems = sum(manifest.tensors[f].numel for f in own)
    if own and model_elems <= per_state:
        return None
    where = f"optimizer state {opt.key!r}" if opt.key else "the optimizer state at the top level"
    text = (
        f"{where} holds {opt.entries} flat entries / {per_state:,} elements per state, 1-D and "
        "keyed by integers, "
    )
    if own:
        return text + (
            f"and the model beside it has {len(own)} parameters / {model_elems:,} elements: one "
            "rank's FSDP1 flat-parameter shard, not a full optimizer (save "
            "FSDP.optim_state_dict(model, optimizer) for one); reshard keeps the model alone "
            "with --drop-optimizer"
        )
    return text + (
        "with no model beside it, which is how one rank's FSDP1 flat-parameter shard looks "
        "(not a full optimizer); read the directory that holds every rank's files (verl: its "
        "actor/), or save FSDP.optim_state_dict(model, optimizer) for a full one"
    )


def _under_state(path: tuple[str, ...], root: tuple[str, ...]) -> bool:
    """Whether ``path`` is a state tensor (``<root>.state.<id>.<name>``) of the optimizer."""
    return len(path) == len(root) + 3 and path[: len(root) + 1] == (*root, "state")


def optimizer_alone(manifest: Manifest, model: Mapping[str, str]) -> str | None:
    """What ``manifest`` is when it holds optimizer state and no ``model`` tensor (its model
    part, :func:`ckptools.core.keys.model_keys`), in words that end with where to point
    instead; None when there is a model, or no optimizer either.

    An ``optimizer.state_dict()`` saved alone (verl's ``optim_world_size_*_rank_*.pt``, a
    Trainer's ``optimizer.pt``, accelerate's ``optimizer.bin``) holds tensors, but none of them
    is a weight: exported as a model it would write optimizer moments under parameter-like
    names.
    """
    if model:
        return None
    found = optimizer_states(manifest)
    if not found:
        return None
    opt = found[0]
    where = f"under {opt.key!r}" if opt.key else "at the top level"
    return (
        f"this is an optimizer state dict (torch's optimizer.state_dict(): 'state' and "
        f"'param_groups' {where}, {opt.entries} entries), not a model; point at the model's "
        "file, or at the checkpoint directory that holds the model and the optimizer"
    )
