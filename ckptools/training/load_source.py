"""``ckptools.load`` of a training checkpoint that ``save`` did not write.

Every source ``ckpt reshard`` accepts (verl's per-rank files, a DCP saved without global
metadata, a ``torch.save`` training checkpoint, DeepSpeed ZeRO, another producer's files) loads
straight into a job, without writing a DCP first. Every rank:

1. reads the source's torch-free manifest (:func:`ckptools.producers.read_manifest`) and names its
   entries as ``get_state_dict`` + ``dcp.save`` name them
   (:func:`ckptools.plan.training.training_layout`: ``model.<fqn>``,
   ``optim.state.<fqn>.<name>``, ``optim.param_groups.<i>.<key>``; a DCP's entries already are).
   Integer optimizer ids that do not name their parameters are placed, where the source's
   groups hold as many parameters as the job's, in the job's optimizer's order, as torch's own
   ``Optimizer.load_state_dict`` places them (shapes checked);
2. flattens its own ``get_state_dict(model, optimizer)`` the same way and checks both hold the
   same tensors, with the same shapes and dtypes, before any tensor byte is read;
3. fills its local shards from the source's chunks with ranged reads
   (:mod:`ckptools.training.fill`, as :func:`ckptools.load_pretrained` does), sets the plain
   values (``param_groups`` entries), and hands the result to ``set_state_dict``.

Nothing is gathered: each rank reads only the bytes of its own boxes, through one bounded buffer
when a piece cannot go straight into the local tensor. Entries outside ``model`` and ``optim``
(``extra``, ``epoch``...) are returned as plain values, never unpickled beyond the allowlist.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

from ckptools import _compat
from ckptools.core.keys import key_path
from ckptools.core.manifest import Manifest, TensorEntry
from ckptools.core.tensor_value import TensorValue
from ckptools.engine import collective
from ckptools.engine.reader import SourceCache, read_object
from ckptools.errors import IncompleteCheckpointError, UnsupportedCheckpointError, UsageError
from ckptools.io import storage
from ckptools.io.tunables import env_size
from ckptools.plan.training import (
    MODEL,
    OPTIM,
    find_optimizers,
    read_optimizer,
    training_layout,
)
from ckptools.producers import read_manifest
from ckptools.training.fill import (
    Box,
    Copy,
    Filler,
    Target,
    check_raw,
    check_shape,
    check_tiling,
    dtype_name,
    find_targets,
    overlaps,
    torch_dtype,
)
from ckptools.training.load_pretrained import DEFAULT_READ_BUFFER_BYTES, READ_BUFFER_ENV
from ckptools.views.export import suggested_optimizer_order
from ckptools.views.producer import views_of

if TYPE_CHECKING:
    from torch import nn

__all__ = ["load_source"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Named:
    """The source's entries as ``dcp.save`` names them: FQN → stored tensor, → plain value,
    → key path."""

    tensors: dict[str, str]
    values: dict[str, Any]
    paths: dict[str, tuple[str, ...]]


def _job_order(manifest: Manifest, flat: Mapping[str, Any]) -> list[str] | None:
    """The job's optimizer's parameters, group by group (``optim.param_groups.<i>.params`` of
    its ``get_state_dict``), when its groups hold as many as the source's: the order in which
    torch's own ``Optimizer.load_state_dict`` would place the source's integer ids."""
    job: list[list[str]] = []
    while isinstance(flat.get(f"{OPTIM}.param_groups.{len(job)}.params"), list | tuple):
        job.append([str(f) for f in flat[f"{OPTIM}.param_groups.{len(job)}.params"]])
    paths = find_optimizers(manifest)
    if not job or len(paths) != 1:
        return None
    try:
        groups = read_optimizer(manifest, paths[0]).groups
    except UnsupportedCheckpointError:
        return None  # training_layout names what is wrong with it
    if [len(g["params"]) for g in groups] != [len(g) for g in job]:
        return None
    return [fqn for g in job for fqn in g]


#: the top-level key ``dcp.save({"model": ..., "optimizer": ...})`` keeps an optimizer under
_THEIR_OPTIM = "optimizer"


def _named(
    manifest: Manifest,
    param_order: Sequence[str] | None,
    with_optimizer: bool,
    flat: Mapping[str, Any],
) -> _Named:
    if manifest.format == "dcp":  # a DCP of another producer, or without global metadata
        stored = {fqn: key_path(manifest, fqn) for fqn in [*manifest.tensors, *manifest.objects]}
        # ``dcp.save({"model": ..., "optimizer": ...})`` (accelerate, the Trainer, torch's own
        # recipe) keeps the optimizer under "optimizer", ckptools.save under "optim": the same
        # state, flattened the same way
        tops = {p[0] for p in stored.values() if p}
        theirs = _THEIR_OPTIM if with_optimizer and OPTIM not in tops else None
        job = {fqn: (OPTIM, *p[1:]) if p[:1] == (theirs,) else p for fqn, p in stored.items()}
        key = {fqn: ".".join(p) if p[:1] == (OPTIM,) and theirs else fqn for fqn, p in job.items()}
        tensors = {key[fqn]: fqn for fqn in manifest.tensors}
        values = {key[fqn]: read_object(manifest, fqn) for fqn in manifest.objects}
        return _Named(tensors, values, {key[fqn]: p for fqn, p in job.items()})
    suggested = None
    if with_optimizer and param_order is None:
        suggested = _job_order(manifest, flat) or suggested_optimizer_order(manifest)
    layout = training_layout(
        manifest,
        param_order=param_order,
        drop_optimizer=not with_optimizer,
        suggested_order=suggested,
    )
    return _Named(layout.names, layout.values, layout.paths)


def _first(keys: Sequence[str]) -> str:
    more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
    return f"{keys[0]!r}{more}"


def _check_match(root: str, target: Target, entry: TensorEntry) -> None:
    """Shape and dtype must be the model's: a resume is bit-exact or refused."""
    where = check_shape(root, target, entry, "job")
    if torch_dtype(entry.dtype) != target.dtype:
        raise UsageError(
            f"{where}: {target.fqn!r} is {entry.dtype}, the job's is "
            f"{dtype_name(target.dtype)}; a resume does not cast",
            path=where,
            fqn=target.fqn,
        )


def _check_keys(
    path: str, named: _Named, flat: Mapping[str, Any], tops: set[str], with_optimizer: bool
) -> None:
    """Refuse a source whose model / optimizer entries are not the job's (``param_groups``
    settings aside: the source's are taken where the job has the key, as ``dcp.load`` takes
    them; the job's kept where the source has none)."""
    theirs = [k for k in [*named.tensors, *named.values] if named.paths[k][0] in tops]
    if with_optimizer and not any(named.paths[k][0] == OPTIM for k in theirs):
        raise IncompleteCheckpointError(
            f"{path}: holds no optimizer state; load with optimizer=None to restore the model only",
            path=path,
        )
    settings = f"{OPTIM}.param_groups."
    missing = [k for k in flat if k not in named.tensors and k not in named.values]
    missing = [k for k in missing if not k.startswith(settings)]
    if missing:
        raise UsageError(
            f"{path}: holds no entry for the job's {_first(missing)}", path=path, fqn=missing[0]
        )
    unexpected = [k for k in theirs if k not in flat and not k.startswith(settings)]
    if unexpected:
        raise UsageError(
            f"{path}: holds {_first(unexpected)} that the job's model and optimizer do not have",
            path=path,
            fqn=unexpected[0],
        )
    for k in theirs:
        # the same parameters, in any order (FSDP.optim_state_dict lists FSDP1's FlatParameter
        # by FlatParameter; a group's settings apply to each alike)
        params = k.startswith(settings) and k.endswith(".params") and k in flat
        if params and sorted(named.values.get(k, ())) != sorted(flat[k]):
            raise UsageError(
                f"{path}: {k!r} names other parameters than the job's optimizer group "
                f"(the checkpoint's groups hold {_group_sizes(named.values, settings)} "
                f"parameters, the job's {_group_sizes(flat, settings)}: build the optimizer "
                "with the same groups, in the same order)",
                path=path,
                fqn=k,
            )


def _group_sizes(values: Mapping[str, Any], settings: str) -> list[int]:
    """How many parameters each optimizer group of ``values`` (flat keys) holds, in order."""
    sizes = {}
    for k, v in values.items():
        index = k[len(settings) : -len(".params")]
        if k.startswith(settings) and k.endswith(".params") and index.isdigit():
            sizes[int(index)] = len(v) if isinstance(v, (list, tuple)) else 0
    return [sizes[i] for i in sorted(sizes)]


def _copies(
    manifest: Manifest, named: _Named, targets: Mapping[str, Target], reader: storage.Reader
) -> list[Copy]:
    """The copies this rank makes: each stored chunk that meets one of its boxes, resolved to
    its raw bytes (a DCP item's archive header is read only by the ranks that need it)."""
    root = manifest.root
    cache = SourceCache(reader, manifest)
    copies: list[Copy] = []
    for fqn, target in targets.items():
        entry = manifest.tensors[named.tensors[fqn]]
        _check_match(root, target, entry)
        check_tiling(root, entry)
        for box in target.boxes:
            for chunk in entry.chunks:
                if not overlaps(chunk, box):
                    continue
                raw = cache.raw(entry.fqn, chunk)
                check_raw(root, fqn, raw)
                copies.append(Copy(fqn, entry.fqn, raw, box, entry.dtype))
    copies.sort(key=lambda c: (c.chunk.file, c.chunk.offset))  # sequential reads per file
    return copies


def _is_tensor(value: Any) -> bool:
    """A tensor, DTensor, or FSDP1 ``ShardedTensor`` (private class: duck-typed)."""
    return isinstance(value, torch.Tensor) or hasattr(value, "local_shards")


def _extra_target(fqn: str, entry: TensorEntry) -> Target:
    """A fresh CPU tensor for a source tensor outside the model and optimizer."""
    local = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
    box = Box((0,) * len(entry.shape), tuple(entry.shape), local)
    return Target(fqn, tuple(entry.shape), local.dtype, (box,))


def _fill(
    path: str,
    state: dict[str, Any],
    with_optimizer: bool,
    param_order: Sequence[str] | None,
    config: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], int]:
    """This rank's share of :func:`load_source`: fills ``state`` in place; returns the
    entries outside it (``extra``) and the tensor bytes read."""
    manifest = read_manifest(path)
    views = views_of(manifest)
    if views is not None:
        # a producer's own names (stacked layers, flat optimizer buckets...) as the HF model's
        # training state (what ``ckpt reshard`` writes): the job's model gives the config
        manifest = views.as_training(manifest, config, drop_optimizer=not with_optimizer)
    flat, mapping = _compat.flatten_state_dict(state)
    named = _named(manifest, param_order, with_optimizer, flat)
    _check_keys(path, named, flat, set(state), with_optimizer)
    tensors = {k: v for k, v in flat.items() if _is_tensor(v)}
    for fqn in [k for k in tensors if k not in named.tensors]:
        # a plain number where the job keeps a tensor (``step`` of an older optimizer)
        with torch.no_grad():
            tensors.pop(fqn).copy_(_as_tensor(named.values[fqn]))
    targets = find_targets(tensors)
    extra: dict[str, Any] = {}
    for fqn, stored in named.tensors.items():
        if named.paths[fqn][0] not in state:
            targets[fqn] = _extra_target(fqn, manifest.tensors[stored])
            _compat.set_element(extra, named.paths[fqn], targets[fqn].boxes[0].local)
    for fqn, value in named.values.items():
        if isinstance(value, TensorValue):
            value = _as_tensor(value)  # a step counter: what the optimizer keeps
        if named.paths[fqn][0] not in state:
            _compat.set_element(extra, named.paths[fqn], value)
        elif fqn in mapping and fqn not in tensors:
            # the job's entries only, as dcp.load fills them (a param group's ``initial_lr``
            # comes from a scheduler the job builds)
            _compat.set_element(state, mapping[fqn], value)
    filler = Filler(
        storage.open_reader(manifest.data_dir()),
        env_size(READ_BUFFER_ENV, DEFAULT_READ_BUFFER_BYTES),
    )
    with torch.no_grad(), filler.reader:
        for c in _copies(manifest, named, targets, filler.reader):
            filler.copy(c)
    return extra, filler.bytes_read


def _as_tensor(value: Any) -> torch.Tensor:
    """A saved number, or a :class:`TensorValue` (a step counter a layout holds as bytes)."""
    if isinstance(value, TensorValue):
        flat = torch.frombuffer(bytearray(value.data), dtype=torch_dtype(value.dtype))
        return flat.reshape(value.shape)
    return torch.as_tensor(value)


def _model_config(model: nn.Module) -> dict[str, Any] | None:
    """The HF ``config.json`` of a transformers model (a producer's view maps its source to
    the model's names by it), else None."""
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    return to_dict() if callable(to_dict) else None


def load_source(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    options: StateDictOptions,
    *,
    param_order: Sequence[str] | None = None,
    process_group: Any = None,
) -> dict[str, Any]:
    """Fill ``state`` (``{"model": ..., "optim"?: ...}`` from ``get_state_dict``) from the
    checkpoint at ``path`` of any layout ckptools reads, load it into ``model`` and
    ``optimizer``, and return the source's other entries. Collective over ``process_group``:
    an error on any rank raises on every rank (see the module's description)."""
    ranks = collective.of_group(process_group)
    with_optimizer = optimizer is not None
    config = _model_config(model)
    found = ranks.from_all(lambda: _fill(path, state, with_optimizer, param_order, config), "load")
    extra, bytes_read = found[ranks.rank]
    set_loaded_state(model, optimizer, state, options)
    log.info("load read %d bytes of %s on rank %d", bytes_read, path, ranks.rank)
    return extra


def set_loaded_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: Mapping[str, Any],
    options: StateDictOptions,
) -> None:
    """Put a loaded ``{"model": ..., "optim"?: ...}`` state (``get_state_dict``'s form, filled
    by ``dcp.load`` or by :func:`load_source`) into ``model`` and ``optimizer``."""
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state[MODEL], optim_state_dict={})
        return
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state[MODEL],
        optim_state_dict=state[OPTIM],
        options=options,
    )
