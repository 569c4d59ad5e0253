"""A training checkpoint that is not DCP, named as ``get_state_dict`` + ``dcp.save`` name it.

An FSDP2 job resumes with ``dcp.load({"model": ..., "optim": ...})`` and ``set_state_dict`` on
the dicts ``get_state_dict(model, optimizer)`` gives: the model's FQNs under ``model.``, the
optimizer keyed by FQN, ``optim.state.<fqn>.<name>`` (``step``, ``exp_avg``, ``exp_avg_sq``)
and ``optim.param_groups.<i>.<key>`` with ``params`` the group's FQNs. Checkpoints written with
``torch.save`` (and the other producers' files) hold instead a model state dict somewhere in
their key tree (:func:`ckptools.core.keys.find_model_part`) and an optimizer ``state_dict()``:
``state`` keyed by integer ids in param-group order, or already by FQN (accelerate's
``optimizer.bin``, ``FSDP.optim_state_dict``), and ``param_groups``.

:func:`training_layout` maps one onto the other: tensors by name (their bytes move as they are),
the rest as plain values. Integer ids become FQNs only where the checkpoint says which is which
(:func:`map_state_keys`): the groups' ``param_names`` (torch >= 2.5 with named parameters),
an order the user gives, or the model's parameter order when there is one group whose ids,
counts and shapes all match the model's parameters (the stored order, where it is the model's:
not a safetensors file's, sorted by name, where ``layer.10`` comes before ``layer.2`` with the
same shapes), or an order the producer's own rule gives (``suggested``: a transformers
``Trainer``'s two groups, from :func:`ckptools.plan.conversion_lookup.trainer_param_order`, or
the ``named_parameters()`` of the model of the checkpoint's ``config.json``) when counts and
shapes match it;
otherwise the answer would be a guess, and
guessing puts moments on the wrong parameters, so it is refused with the numbers. The commonest
wrong file, an FSDP1 ``optimizer.state_dict()`` saved beside a FULL_STATE_DICT model (one rank's
flat-parameter shard: 1-D state of a fraction of the model's elements), is named as such.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptools.core.keys import find_model_part, key_path, model_keys, own_names
from ckptools.core.manifest import MODEL_ORDER_UNKNOWN, OPTIMIZER_UNREADABLE, Manifest
from ckptools.errors import UnsupportedCheckpointError, UsageError
from ckptools.producers.optimizer_state import optimizer_alone, optimizer_states

MODEL = "model"
OPTIM = "optim"


@dataclass(frozen=True)
class OptimizerState:
    """An optimizer ``state_dict()`` as the source stores it.

    Attributes:
        path: its key path in the source's tree (``("optimizer_state_dict",)``; ``()`` for a
            file that is one).
        state: state key as stored (an integer id as a string, or an FQN) → state name →
            the source entry's FQN (a tensor, or an object holding a value).
        groups: ``param_groups`` as stored (``params``: ids or FQNs).
    """

    path: tuple[str, ...]
    state: dict[str, dict[str, str]]
    groups: list[dict[str, Any]]

    @property
    def label(self) -> str:
        return ".".join(self.path) or "the optimizer state dict"


@dataclass(frozen=True)
class TrainingLayout:
    """What :func:`ckptools.plan.dcp.plan_dcp` needs to write the DCP: output FQN → source
    tensor (``names``), → key path (``paths``), → plain value (``values``); and notes."""

    names: dict[str, str] = field(default_factory=dict)
    paths: dict[str, tuple[str, ...]] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def find_optimizers(manifest: Manifest) -> list[tuple[str, ...]]:
    """Key paths of the optimizer state dicts in ``manifest``
    (:func:`ckptools.producers.optimizer_state.optimizer_states` finds them)."""
    return [tuple(o.key.split(".")) if o.key else () for o in optimizer_states(manifest)]


def read_optimizer(manifest: Manifest, path: tuple[str, ...]) -> OptimizerState:
    """The optimizer state dict at ``path`` (see :func:`find_optimizers`).

    Raises:
        UnsupportedCheckpointError: its state or groups are not those of a torch optimizer.
    """
    n = len(path)
    where = f"{manifest.root}: {'.'.join(path) or 'optimizer'}"
    state: dict[str, dict[str, str]] = {}
    groups: dict[int, dict[str, Any]] = {}
    for fqn in [*manifest.tensors, *manifest.objects]:
        p = key_path(manifest, fqn)
        if p[:n] != path or len(p) <= n:
            continue
        rest = p[n:]
        if rest[0] == "state" and len(rest) == 3:
            state.setdefault(rest[1], {})[rest[2]] = fqn
        elif rest[0] == "param_groups":
            value = _value(manifest, fqn, where)
            if len(rest) == 1 and isinstance(value, list | tuple):
                # a torch.save file: the whole list is one value
                for i, group in enumerate(value):
                    if not isinstance(group, dict):
                        raise UnsupportedCheckpointError(f"{where}: param group {i} is not a dict")
                    groups.setdefault(i, {}).update(group)
            elif len(rest) == 3 and rest[1].isdigit():
                groups.setdefault(int(rest[1]), {})[rest[2]] = value  # DCP-style flattening
            else:
                raise UnsupportedCheckpointError(f"{where}: unexpected entry {fqn!r}", fqn=fqn)
        elif rest[0] == "state" and len(rest) != 3:
            raise UnsupportedCheckpointError(
                f"{where}: optimizer state entry {fqn!r} is not <id>.<name> (nested state is not "
                "a torch optimizer's)",
                fqn=fqn,
            )
    ordered = [groups[i] for i in sorted(groups)]
    for i, group in enumerate(ordered):
        if not isinstance(group.get("params"), list | tuple):
            raise UnsupportedCheckpointError(f"{where}: param group {i} has no 'params' list")
    return OptimizerState(path, state, ordered)


def _value(manifest: Manifest, fqn: str, where: str) -> Any:
    entry = manifest.objects.get(fqn)
    if entry is None or not entry.has_value:
        raise UnsupportedCheckpointError(
            f"{where}: {fqn!r} is not a plain value (a tensor where the optimizer keeps settings)",
            fqn=fqn,
        )
    return entry.value


@dataclass(frozen=True)
class _Param:
    fqn: str
    shape: tuple[int, ...]


def model_parameters(manifest: Manifest, model: Mapping[str, str]) -> list[_Param]:
    """The model's tensors in stored order, a tied tensor (one storage under two names) once,
    under its first name: what ``model.parameters()`` yields, buffers aside (a state dict
    does not say which tensors are buffers; counts and shapes are checked instead)."""
    seen: set[tuple[str, int, int]] = set()
    out = []
    for own, stored in model.items():
        tensor = manifest.tensors[stored]
        where = {(c.file, c.offset, c.length) for c in tensor.chunks}
        if len(where) == 1 and tensor.chunks[0].length:
            key = next(iter(where))
            if key in seen:
                continue
            seen.add(key)
        out.append(_Param(own, tensor.shape))
    return out


def map_state_keys(
    manifest: Manifest,
    opt: OptimizerState,
    params: Sequence[_Param],
    param_order: Sequence[str] | None = None,
    suggested: Sequence[str] | None = None,
) -> dict[str, str]:
    """Each parameter key of ``opt`` (the groups' ``params`` and the state's keys, as strings)
    → the model FQN it stands for (see the module's description).

    Raises:
        UnsupportedCheckpointError: the state cannot be placed; the message says why, with the
            numbers, and how to supply the order (``--param-order``).
    """
    where = f"{manifest.root}: {opt.label}"
    by_name = {p.fqn: p for p in params}
    ids = [str(x) for g in opt.groups for x in g["params"]]
    stray = [k for k in opt.state if k not in set(ids)]
    if stray:
        raise UnsupportedCheckpointError(
            f"{where}: state {stray[0]!r} belongs to no parameter of the param groups"
        )
    if not all(k.isdigit() for k in ids):
        # keyed by FQN already (accelerate, FSDP.optim_state_dict)
        return _named(where, dict(zip(ids, own_names(ids), strict=True)), by_name)
    names = [g.get("param_names") for g in opt.groups]
    if all(isinstance(n, list | tuple) and len(n) == len(g["params"])
           for n, g in zip(names, opt.groups, strict=True)):  # fmt: skip
        flat = [str(x) for n in names for x in (n or ())]
        return _named(where, dict(zip(ids, own_names(flat), strict=True)), by_name)
    if param_order is not None:
        if len(param_order) != len(ids):
            raise UsageError(
                f"{where}: --param-order names {len(param_order)} parameters; the optimizer's "
                f"groups hold {len(ids)}"
            )
        named = _named(where, dict(zip(ids, param_order, strict=True)), by_name)
        misplaced = _misplaced(manifest, opt, named, by_name)
        if misplaced is not None:
            raise UnsupportedCheckpointError(f"{where}: {misplaced}")
        return named
    if len(opt.groups) == 1 and len(ids) == len(params) and not unordered(manifest):
        named = {i: p.fqn for i, p in zip(ids, params, strict=True)}
        if _misplaced(manifest, opt, named, by_name) is None:
            return named
    if suggested is not None and len(suggested) == len(ids):
        try:
            named = _named(where, dict(zip(ids, suggested, strict=True)), by_name)
        except UnsupportedCheckpointError:
            named = {}
        if named and _misplaced(manifest, opt, named, by_name) is None:
            return named
    raise UnsupportedCheckpointError(_why_unplaceable(manifest, where, opt, params))


def unordered(manifest: Manifest) -> bool:
    """Whether the manifest's model tensors are stored out of the model's order (safetensors
    sorts them by name), so that their order says nothing of ``model.parameters()``'s."""
    return bool(manifest.details.get(MODEL_ORDER_UNKNOWN))


def _named(where: str, mapping: Mapping[str, str], by_name: Mapping[str, _Param]) -> dict[str, str]:
    unknown = [v for v in mapping.values() if v not in by_name]
    if unknown:
        raise UnsupportedCheckpointError(
            f"{where}: optimizer state for {len(unknown)} parameter(s) the model does not have "
            f"(e.g. {unknown[0]!r})"
        )
    return dict(mapping)


def _state_shapes(manifest: Manifest, opt: OptimizerState, key: str) -> list[tuple[int, ...]]:
    """Shapes of the non-scalar tensors in one parameter's state (``step`` is 0-dim)."""
    out = []
    for fqn in opt.state.get(key, {}).values():
        tensor = manifest.tensors.get(fqn)
        if tensor is not None and tensor.shape:
            out.append(tensor.shape)
    return out


def _misplaced(
    manifest: Manifest, opt: OptimizerState, named: Mapping[str, str], by_name: Mapping[str, _Param]
) -> str | None:
    """The first state whose shape is not that of the parameter ``named`` places it on, said;
    None when every one fits."""
    for key in opt.state:
        fqn = named[key]
        for shape in _state_shapes(manifest, opt, key):
            if shape != by_name[fqn].shape:
                return (
                    f"state {key} has shape {list(shape)} but is placed on {fqn!r} "
                    f"of shape {list(by_name[fqn].shape)}"
                )
    return None


def _why_unplaceable(
    manifest: Manifest, where: str, opt: OptimizerState, params: Sequence[_Param]
) -> str:
    model_elems = sum(math.prod(p.shape) for p in params)
    entries = [k for k in opt.state if _state_shapes(manifest, opt, k)]
    shapes = [_state_shapes(manifest, opt, k) for k in entries]
    flat = bool(entries) and all(len(s) == 1 for shape in shapes for s in shape)
    if flat:
        per_state = sum(math.prod(s[0]) for s in shapes)
        return (
            f"{where} holds {len(entries)} flat entries / {per_state:,} elements per state; the "
            f"model has {len(params)} parameters / {model_elems:,} elements: this is one rank's "
            "FSDP1 flat-parameter shard, not a full optimizer (save FSDP.optim_state_dict(model, "
            "optimizer) for one); pass --drop-optimizer for a checkpoint of the model alone"
        )
    ids = sum(len(g["params"]) for g in opt.groups)
    if len(opt.groups) > 1:
        why = "; with several groups the order is not the model's"
    elif unordered(manifest):
        why = (
            "; the model's safetensors file keeps its tensors sorted by name, not in the "
            "model's order, and no config.json beside it builds the model to give that order "
            "(pass it with --config)"
        )
    else:
        why = ""
    return (
        f"{where} is keyed by integer ids ({ids} in {len(opt.groups)} param group(s)) with no "
        f"param_names, and the model has {len(params)} parameters"
        + why
        + ": which state belongs to which parameter cannot be known; pass --param-order FILE "
        "(the parameters' FQNs, one per line, in the order the optimizer was given them), or "
        "--drop-optimizer"
    )


def _terminal(value: Any) -> bool:
    """Whether DCP's ``flatten_state_dict`` keeps ``value`` as one entry: anything but a dict,
    or a list none of whose elements it would split (a dict, or a list it splits)."""
    if isinstance(value, dict):
        return False
    if isinstance(value, list):
        return all(_terminal(v) for v in value)
    return True


def _leaves(path: tuple[str, ...], value: Any) -> list[tuple[tuple[str, ...], Any]]:
    """``value`` split into entries as DCP's ``flatten_state_dict`` splits it."""
    if _terminal(value):
        return [(path, value)]
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return [leaf for k, v in items for leaf in _leaves((*path, str(k)), v)]


def training_layout(
    manifest: Manifest,
    *,
    param_order: Sequence[str] | None = None,
    drop_optimizer: bool = False,
    suggested_order: Sequence[str] | None = None,
) -> TrainingLayout:
    """Name ``manifest``'s model, optimizer and other values as ``get_state_dict`` +
    ``dcp.save`` would (see the module's description). ``suggested_order``: the order the
    producer's own rule gives the optimizer its parameters, used only where counts and shapes
    match it (see :func:`map_state_keys`).

    Raises:
        UnsupportedCheckpointError: the optimizer cannot be placed, or its layout could not
            read it (``OPTIMIZER_UNREADABLE`` in the manifest's details), and
            ``drop_optimizer`` is False; or there are several optimizers.
    """
    out = TrainingLayout()
    part = find_model_part(manifest)
    model = model_keys(manifest, part)
    alone = optimizer_alone(manifest, model)
    if alone is not None:
        raise UsageError(f"{manifest.root}: {alone}")
    for own, stored in model.items():
        _tensor(out, (MODEL, own), stored)
    optimizers = find_optimizers(manifest)
    unreadable = manifest.details.get(OPTIMIZER_UNREADABLE)
    if unreadable and not optimizers and not drop_optimizer:
        # the source has an optimizer its layout cannot place: a model alone would look whole
        raise UnsupportedCheckpointError(
            f"{manifest.root}: {unreadable}; to carry the model alone pass --drop-optimizer "
            "(ckptools.load: optimizer=None)"
        )
    if len(optimizers) > 1:
        labels = ", ".join(".".join(p) or "(top)" for p in optimizers)
        raise UnsupportedCheckpointError(
            f"{manifest.root}: holds {len(optimizers)} optimizers ({labels}); an FSDP2 "
            "checkpoint holds one"
        )
    taken = set(model.values())
    if optimizers:
        opt = read_optimizer(manifest, optimizers[0])
        taken |= _optimizer_fqns(manifest, opt.path)
        if drop_optimizer:
            out.notes.append(f"the optimizer ({opt.label}) was left out (--drop-optimizer)")
        else:
            params = model_parameters(manifest, model)
            _optimizer(out, manifest, opt, params, param_order, suggested_order)
    elif not drop_optimizer:
        out.notes.append("the source holds no optimizer state: the checkpoint has the model only")
    _others(out, manifest, taken)
    return out


def _tensor(out: TrainingLayout, path: tuple[str, ...], stored: str) -> None:
    fqn = ".".join(path)
    out.names[fqn] = stored
    out.paths[fqn] = path


def _put_value(out: TrainingLayout, path: tuple[str, ...], value: Any) -> None:
    for leaf_path, leaf in _leaves(path, value):
        fqn = ".".join(leaf_path)
        out.values[fqn] = leaf
        out.paths[fqn] = leaf_path


def _optimizer_fqns(manifest: Manifest, path: tuple[str, ...]) -> set[str]:
    n = len(path)
    return {
        fqn
        for fqn in [*manifest.tensors, *manifest.objects]
        if key_path(manifest, fqn)[:n] == path and len(key_path(manifest, fqn)) > n
    }


def _optimizer(
    out: TrainingLayout,
    manifest: Manifest,
    opt: OptimizerState,
    params: Sequence[_Param],
    param_order: Sequence[str] | None,
    suggested: Sequence[str] | None,
) -> None:
    placed = map_state_keys(manifest, opt, params, param_order, suggested)
    for key, names in opt.state.items():
        for name, src in names.items():
            path = (OPTIM, "state", placed[key], name)
            if src in manifest.tensors:
                _tensor(out, path, src)
            else:
                _put_value(out, path, _value(manifest, src, opt.label))
    for i, group in enumerate(opt.groups):
        fqns = [placed[str(x)] for x in group["params"]]
        for k, v in group.items():
            # the parameters by FQN, as get_state_dict gives them (param_names too: the source's
            # may carry wrapper prefixes, such as DDP's ``module.``)
            value = fqns if k in ("params", "param_names") else v
            _put_value(out, (OPTIM, "param_groups", str(i), k), value)


def _others(out: TrainingLayout, manifest: Manifest, taken: set[str]) -> None:
    """Everything else (``step``, ``epoch``, schedulers...) kept under its own key path."""
    for fqn in manifest.tensors:
        if fqn not in taken:
            _tensor(out, key_path(manifest, fqn), fqn)
    for fqn, entry in manifest.objects.items():
        if fqn in taken:
            continue
        path = key_path(manifest, fqn)
        if not entry.has_value:
            out.notes.append(f"{fqn!r} was left out (not a plain value)")
            continue
        _put_value(out, path, entry.value)
