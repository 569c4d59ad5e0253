"""``ckptools.save`` / ``ckptools.load``: one call for every way a model is wrapped.

Both are thin wrappers over torch's own APIs: ``torch.distributed.checkpoint.state_dict``
(``get_state_dict`` / ``set_state_dict``) turns the model and optimizer into FQN-keyed, sharded
state whatever the wrapping — FSDP2 ``fully_shard`` (HSDP and TP meshes too), FSDP1 (its
``state_dict_type`` setting is overridden for the call), DDP, ``torch.compile``, activation
checkpointing, plain modules — and ``dcp.save`` / ``dcp.load`` write and read it in parallel. The
saved layout is::

    {"model": {fqn: tensor}, "optim": {"state": {fqn: {...}}, "param_groups": [...]},
     "extra": {...}}

so optimizer state is keyed by parameter FQN (loads at any world size), wrapper segments
(``module.``, ``_orig_mod.``, ``_checkpoint_wrapped_module.``, ``_fsdp_wrapped_module.``) never
reach the keys, and ckptools' own ``inspect`` / ``consolidate`` find the model at prefix
``model.``.

``extra`` holds everything else: step counters, scheduler, dataloader, RNG, a user dict. Values
with ``state_dict()`` / ``load_state_dict()`` (torch's ``Stateful``: schedulers, stateful
dataloaders) are saved through ``state_dict()`` and restored in place when passed to ``load``.
Each non-tensor ``extra`` value is stored as one ``torch.save`` blob: DCP would otherwise flatten
nested dicts and silently drop empty containers (a ``LambdaLR`` state holds ``[{}]``). Like every
non-sharded entry of a DCP checkpoint, ``extra`` is treated as the same on every rank (rank 0's
copy is written); key per-rank state by rank (``{"rng": {f"rank{r}": ...}}``).

Object storage: a ``path`` with a scheme (``s3://``, ``gs://``, ``memory://``) is written and read
through torch's ``FsspecWriter`` / ``FsspecReader`` with the storage options in force
(:func:`ckptools.io.storage.storage_options`; credentials from the environment otherwise). Remote
writers have shipped data-losing bugs (a stream never flushed leaves a short object), so after a
remote save every rank checks that each file the metadata names exists and is long enough
(:func:`check_saved`) and raises if not.

Trust: ``load`` unpickles non-tensor entries (optimizer ``param_groups``, ``extra``) with
``torch.load(weights_only=True)``, which admits tensors and plain containers only; objects beyond
that need ``trust_objects=True`` (torch's own ``dcp.load`` always unpickles without limits).
"""

from __future__ import annotations

import io
import logging
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

from ckptools import _compat
from ckptools.errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    UsageError,
)
from ckptools.io import storage
from ckptools.producers.base import read_by_producer, step_run
from ckptools.producers.dcp.layout import RANK_METADATA_FILE
from ckptools.training.load_source import load_source, set_loaded_state

if TYPE_CHECKING:
    from torch import nn

__all__ = ["load", "save", "state_to_save", "write_model_config"]

log = logging.getLogger(__name__)

MODEL_KEY = "model"
OPTIM_KEY = "optim"
EXTRA_KEY = "extra"
#: Stands in for a non-tensor entry until ``dcp.load`` replaces it with the stored value.
_OBJECT_PLACEHOLDER = "<ckptools: not loaded>"


#: what torch warns when DCP runs without a process group ("assuming the intent is to ...
#: in a single process"): with ``no_dist`` that is the intent
NO_DIST_WARNING = "torch.distributed is disabled"


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextmanager
def no_dist_warning_silenced() -> Iterator[None]:
    """Within the block, :data:`NO_DIST_WARNING` alone is not shown (the filter is undone on
    exit): ``dcp.save``/``dcp.load`` called on this thread without a process group."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NO_DIST_WARNING)
        yield


def _options() -> StateDictOptions:
    # Sharded state (full_state_dict=False): each rank saves only its shards, nothing is gathered.
    # Full gathering of FSDP1 with cpu_offload also segfaults on CPU in torch 2.13.
    return StateDictOptions(full_state_dict=False, cpu_offload=False)


def _plain_extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise UsageError(f"extra must be a mapping of names to values, got {type(extra).__name__}")
    out: dict[str, Any] = {}
    for key, value in extra.items():
        if not isinstance(key, str):
            raise UsageError(f"extra keys must be strings, got {key!r}")
        if isinstance(value, Stateful):
            value = value.state_dict()
        if isinstance(value, torch.Tensor):
            out[key] = value
        else:
            buffer = io.BytesIO()
            torch.save(value, buffer)
            buffer.seek(0)
            out[key] = buffer
    return out


class _ObjectLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that unpickles non-tensor entries with ``weights_only=True``
    unless the caller trusts the checkpoint."""

    def __init__(self, path: str, trust_objects: bool) -> None:
        super().__init__()
        self._path = path
        self._trust = trust_objects

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        key_path = self.mappings[fqn]
        try:
            obj = self._unpickle(value)
            # ``extra`` objects were wrapped in a BytesIO by ``save`` (see module docstring).
            if key_path[0] == EXTRA_KEY and len(key_path) == 2 and isinstance(obj, io.BytesIO):
                obj = self._unpickle(obj)
        except UnsafeCheckpointError:
            raise
        except Exception as e:
            raise UnsafeCheckpointError(
                f"{self._path}: entry {fqn!r} holds an object beyond tensors and plain "
                f"containers ({str(e).splitlines()[0]}); pass trust_objects=True if you wrote "
                "this checkpoint",
                global_name=str(fqn),
                path=self._path,
            ) from e
        _compat.set_element(self.original_state_dict, key_path, obj)

    def _unpickle(self, value: io.BytesIO) -> Any:
        if self._trust:
            return torch.load(value, weights_only=False)
        # io.BytesIO only restores bytes; DCP itself pickles BytesIO entries whole.
        with torch.serialization.safe_globals([io.BytesIO]):
            return torch.load(value, weights_only=True)


def state_to_save(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The state dict :func:`save` writes (``{"model", "optim"?, "extra"}``). Collective for
    FSDP1 (every rank calls it, in the same order); tensors are views of the live parameters."""
    return {**_state_of(model, optimizer), EXTRA_KEY: _plain_extra(extra)}


def storage_writer(path: str) -> Any:
    """The DCP storage writer for ``path``: None locally (``dcp.save`` picks its own), torch's
    ``FsspecWriter`` with the storage options in force for a URL.

    Pass it with ``checkpoint_id`` left out (:func:`checkpoint_id`): given both, torch resets
    the writer to the id and rebuilds its filesystem *without* the storage options (torch
    2.13 ``FileSystemWriter.reset``), so an endpoint or credentials given as options would be
    lost for the data files.
    """
    if not storage.is_url(path):
        return None
    return _compat.fsspec_writer(path, **storage.options_for(storage.protocol_of(path)))


def checkpoint_id(path: str) -> str | None:
    """``checkpoint_id`` for ``dcp.save``/``dcp.load`` beside :func:`storage_writer` /
    :func:`storage_reader`: the path locally, None for a URL (its writer already holds it)."""
    return None if storage.is_url(path) else path


def storage_reader(path: str) -> Any:
    """The DCP storage reader for ``path``: None locally, ``FsspecReader`` for a URL."""
    if not storage.is_url(path):
        return None
    return _compat.fsspec_reader(path, **storage.options_for(storage.protocol_of(path)))


def check_saved(path: str) -> None:
    """Raise unless every file the DCP metadata at ``path`` names exists and holds every byte
    range recorded for it (a listing and the metadata; no tensor data is read).

    This catches the silent data loss of remote writers (an unflushed stream uploads a short or
    empty object while the save reports success) before anything commits the checkpoint.

    Raises:
        IncompleteCheckpointError: a file is missing or shorter than the metadata says.
    """
    from ckptools.errors import CkptError
    from ckptools.producers.dcp.layout import read_dcp

    try:
        read_dcp(path, check_files=True)
    except CkptError as e:
        raise IncompleteCheckpointError(
            f"{path}: the save reported success but its data is not all there: {e.message}",
            path=path,
        ) from e


def _check_save_path(path: str) -> None:
    """Refuse, on every rank before the collective save, a local ``path`` that is a file or
    lies below one: torch's writers fail there with a ``CheckpointException`` carrying every
    rank's traceback."""
    if not path:
        raise UsageError("ckptools.save: the path is empty; name the checkpoint directory")
    if storage.is_url(path):
        return
    local = os.path.abspath(storage.local_path(path))
    at = local
    while not os.path.lexists(at):
        at = os.path.dirname(at)
    if not os.path.isdir(at):
        what = "is a file" if at == local else f"lies below the file {at}"
        raise UsageError(f"{path}: {what}, not a checkpoint directory; choose another path")


@storage.accepts_storage_options
def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    storage_options: storage.StorageOptions | None = None,
) -> None:
    """Save model, optimizer and ``extra`` as a DCP checkpoint at ``path``.

    Collective: every rank of the process group calls it with its own shard of the same model;
    each rank writes its own files and rank 0 writes ``.metadata`` last. Without an initialised
    process group it saves from this process alone. ``path`` is written in place (no atomic
    commit): use :class:`~ckptools.CheckpointManager` for crash-safe saves.

    Args:
        path: the checkpoint directory (created).
        model: the model, wrapped in any of FSDP2, FSDP1, DDP, ``torch.compile``, activation
            checkpointing, or plain.
        optimizer: its optimizer; state is saved keyed by parameter FQN.
        extra: other state (step, scheduler, dataloader, RNG, a dict); ``Stateful`` values are
            saved through ``state_dict()``.
        process_group: the group to save over (default: the default group).
        storage_options: fsspec options for URL paths (credentials, endpoint...), a mapping
            or its JSON text; see :func:`ckptools.io.storage.storage_options`.

    Example:
        >>> import torch, ckptools
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> ckptools.save("/tmp/ckptools-doc/save", model, opt, extra={"step": 3})
        >>> ckptools.load("/tmp/ckptools-doc/save", model, opt)["step"]
        3
    """
    _check_save_path(os.fspath(path))
    state = state_to_save(model, optimizer, extra)
    with no_dist_warning_silenced():
        dcp_save(
            state,
            checkpoint_id=checkpoint_id(os.fspath(path)),
            storage_writer=storage_writer(os.fspath(path)),
            process_group=process_group,
            no_dist=_no_dist(),
        )
    if storage.is_url(os.fspath(path)):
        check_saved(os.fspath(path))  # every rank: each one raises, none waits on another


def _read_metadata(path: str) -> Any:
    if not storage.isdir(path):
        raise CheckpointNotFoundError(f"{path}: no such checkpoint directory", path=path)
    try:
        return (storage_reader(path) or FileSystemReader(path)).read_metadata()
    except FileNotFoundError as e:
        raise IncompleteCheckpointError(
            f"{path}: no DCP .metadata (the save never finished); use the previous checkpoint",
            path=path,
        ) from e


def _written_by_dcp(path: str) -> bool:
    """Whether ``path`` is read by ``dcp.load``: a DCP with its global ``.metadata``, or one
    that lost it (no per-rank ``__r.metadata`` either: refused as unfinished), or no
    checkpoint at all (refused as missing). Anything else is another layout's."""
    if not storage.exists(path):
        return True
    if storage.isdir(path) and read_by_producer(path) is not None:
        # a producer's own names (its views read it), or what a family refuses by name: its
        # .metadata is not the job's
        return False
    if storage.exists(storage.join(path, ".metadata")):
        return True
    if not storage.isdir(path):
        return False  # a torch.save file
    names = storage.listdir(path)
    rank_local = any(RANK_METADATA_FILE.match(n) for n in names)
    return not rank_local and any(n.endswith(".distcp") for n in names)


def _written_by(path: str) -> str:
    """``"a <layout> checkpoint"``, as detection names ``path``."""
    from ckptools.errors import CkptError
    from ckptools.producers.base import detect

    try:
        return f"a {detect(path).name} checkpoint"
    except CkptError:
        return "a checkpoint"


def _check_tops(path: str, tops: set[str], with_optimizer: bool) -> None:
    """Refuse a DCP without a ``model`` entry, or without ``optim`` when one is asked for."""
    if MODEL_KEY not in tops:
        shown = sorted(tops)
        listed = ", ".join(shown[:8]) + (f", ... ({len(shown)} in all)" if len(shown) > 8 else "")
        raise IncompleteCheckpointError(
            f"{path}: holds no 'model' entry (top-level keys: {listed}); it is {_written_by(path)}"
            ", not written by ckptools.save: `ckpt consolidate` reads its model",
            path=path,
        )
    if with_optimizer and OPTIM_KEY not in tops:
        raise IncompleteCheckpointError(
            f"{path}: holds no optimizer state; load with optimizer=None to restore the model only",
            path=path,
        )


def _state_of(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``{"model", "optim"?}`` as ``get_state_dict`` gives them (sharded, the live tensors)."""
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
        return {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd}
    model_sd, _ = get_state_dict(model, [], options=_options())
    return {MODEL_KEY: model_sd}


def _extra_template(metadata: Any) -> tuple[dict[str, Any], set[str]]:
    """A nested dict shaped like the saved ``extra`` (empty tensors, placeholders), and the
    top-level keys the checkpoint holds."""
    template: dict[str, Any] = {}
    tops: set[str] = set()
    planner_data: Mapping[str, Any] = metadata.planner_data or {}
    for fqn, meta in metadata.state_dict_metadata.items():
        key_path = tuple(planner_data.get(fqn, (fqn,)))
        tops.add(str(key_path[0]))
        if key_path[0] != EXTRA_KEY:
            continue
        if isinstance(meta, TensorStorageMetadata):
            value: Any = torch.empty(meta.size, dtype=meta.properties.dtype)
        else:
            value = _OBJECT_PLACEHOLDER
        _compat.set_element(template, key_path, value)
    return template.get(EXTRA_KEY, {}), tops


@storage.accepts_storage_options
def load(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    trust_objects: bool = False,
    param_order: Sequence[str] | None = None,
    storage_options: storage.StorageOptions | None = None,
) -> dict[str, Any]:
    """Load a training checkpoint (at any world size) into ``model`` and ``optimizer`` in
    place, and return its ``extra``.

    Collective: every rank calls it with its freshly built (wrapped, sharded) model and optimizer;
    each rank reads only the bytes of its own shards. Without a process group it loads in this
    process alone.

    Sources: a checkpoint :func:`save` wrote (a DCP with global ``.metadata``) is read by
    ``dcp.load``. Every other training checkpoint ``ckpt reshard`` accepts is read directly,
    without writing a DCP first (:mod:`ckptools.training.load_source`): verl's per-rank files,
    a DCP saved without global metadata (``use_collectives=False``), a ``torch.save`` training
    checkpoint, DeepSpeed ZeRO, another producer's run or save whose names are not the
    model's (read as the HF model's training state by that producer's views, mapped as ``ckpt
    reshard`` maps them, the model's ``config`` naming the HF layout). Its entries are named as
    ``get_state_dict`` names them; the model's and optimizer's tensors must be exactly the
    job's (names, shapes, dtypes: a resume does not cast), and each rank reads the byte ranges
    of its shards straight into them. Its other entries are returned as ``extra``.

    Args:
        path: a checkpoint directory written by :func:`save` or a manager's ``step-<n>``, or
            any training checkpoint ``ckpt reshard`` accepts.
        model: the model, wrapped as it will be trained (may differ from how it was saved).
        optimizer: the optimizer to restore (a fresh one is fine); None skips optimizer state.
        extra: objects to restore in place: for each key that is ``Stateful`` (scheduler,
            dataloader), ``load_state_dict`` is called with the saved value.
        process_group: the group to load over (default: the default group).
        trust_objects: unpickle non-tensor entries without limits (only for checkpoints you
            wrote that hold custom classes in ``extra``).
        param_order: for a source whose optimizer state is keyed by integer ids with nothing
            saying which parameter each is: the parameters' FQNs in the order the optimizer was
            given them (as ``ckpt reshard --param-order``).
        storage_options: fsspec options for URL paths (credentials, endpoint...), a mapping
            or its JSON text; see :func:`ckptools.io.storage.storage_options`.

    Returns:
        The saved ``extra`` dict, with ``Stateful`` entries as their saved ``state_dict()``.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist; a rank file of another source is gone.
        IncompleteCheckpointError: a DCP with no ``.metadata``, or ``optimizer`` given and no
            optimizer state saved.
        UsageError: another source's model or optimizer entries, shapes or dtypes are not the
            job's (the file and FQN named).
        UnsafeCheckpointError: an entry needs more than ``weights_only`` unpickling.

    Example:
        >>> import torch, ckptools
        >>> model = torch.nn.Linear(4, 2)
        >>> ckptools.save("/tmp/ckptools-doc/load", model, extra={"epoch": 1})
        >>> ckptools.load("/tmp/ckptools-doc/load", torch.nn.Linear(4, 2))
        {'epoch': 1}
    """
    path = os.fspath(path)
    run = (
        step_run(path)
        if storage.isdir(path) and not storage.exists(storage.join(path, ".metadata"))
        else None
    )
    if run is not None:  # a CheckpointManager root: its newest whole save, as restore() reads
        log.info("%s", run.chosen.note())
        path = run.save
    if not _written_by_dcp(path):
        return load_source(
            path, model, optimizer, _state_of(model, optimizer), _options(),
            param_order=param_order, process_group=process_group,
        )  # fmt: skip
    metadata = _read_metadata(path)
    extra_template, tops = _extra_template(metadata)
    _check_tops(path, tops, optimizer is not None)
    state = _state_of(model, optimizer)
    state[EXTRA_KEY] = extra_template
    with no_dist_warning_silenced():
        dcp_load(
            state,
            checkpoint_id=checkpoint_id(path),
            storage_reader=storage_reader(path),
            planner=_ObjectLoadPlanner(path, trust_objects),
            process_group=process_group,
            no_dist=_no_dist(),
        )
    set_loaded_state(model, optimizer, state, _options())
    loaded: dict[str, Any] = state[EXTRA_KEY]
    for key, target in (extra or {}).items():
        if isinstance(target, Stateful) and key in loaded:
            target.load_state_dict(loaded[key])
    return loaded


def write_model_config(model: nn.Module, directory: str) -> list[str]:
    """Write ``config.json`` (and ``generation_config.json``) when the unwrapped model is a
    ``transformers.PreTrainedModel``, so ``ckpt consolidate`` makes a loadable model directory.
    One rank calls it. Returns the file names written.
    """
    inner = _compat.unwrap_model(model)
    config = getattr(inner, "config", None)
    if config is None or not hasattr(config, "to_json_file"):
        return []
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return []
    if not isinstance(inner, PreTrainedModel):
        return []
    if storage.is_url(directory):
        # transformers writes local files: write them in a spool and upload them.
        from ckptools.io.spool import spool_dir

        with spool_dir() as spool:
            names = write_model_config(model, spool)
            for name in names:
                storage.put_file(os.path.join(spool, name), storage.join(directory, name))
        return names
    written = ["config.json"]
    config.to_json_file(os.path.join(directory, "config.json"))
    generation = getattr(inner, "generation_config", None)
    if generation is not None and hasattr(generation, "to_json_file"):
        try:
            generation.to_json_file(os.path.join(directory, "generation_config.json"))
            written.append("generation_config.json")
        except (TypeError, ValueError) as e:  # an unusual generation config must not fail a save
            log.warning("could not write generation_config.json: %s", e)
    return written
