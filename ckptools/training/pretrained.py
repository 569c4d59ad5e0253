"""``ckptools.save_pretrained``: a Hugging Face model directory written straight from the shards.

At the end of training every rank writes its own shards into the safetensors files; no rank ever
gathers the whole model. The output is byte-identical to ``ckpt consolidate`` of a
:func:`ckptools.save` checkpoint of the same model, because it is planned the same way:

1. Every rank builds the save plan ``dcp.save`` would build (torch's ``DefaultSavePlanner`` over
   :func:`ckptools.training.state.state_to_save`) and the ranks all-gather those plans (metadata
   only: FQN, dtype, global shape and the box of each local shard). torch's own global planning
   then gives the checkpoint metadata ``dcp.save`` would write — the same tensor order and the same
   rank for every replicated tensor.
2. That metadata becomes a torch-free :class:`~ckptools.core.manifest.Manifest`, and
   :func:`ckptools.plan.safetensors.plan_consolidation` plans the files with consolidate's own key
   mapping (:func:`ckptools.consolidate.select_tensors`) and tied-weight rule.
3. Rank 0 creates the files (final sizes, headers) in ``<out>.tmp-<id>/`` and the config files; each
   rank ``pwrite``\\s the bytes of its own shards at their planned offsets
   (:func:`ckptools.plan.safetensors.runs` maps a shard's box to runs of output elements); after
   every rank succeeded, rank 0 writes the index last and renames the directory into place.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from ckptools.consolidate import (
    CastDType,
    find_model_files,
    select_tensors,
    tie_setting,
    tied_candidates,
)
from ckptools.core import dtypes
from ckptools.core.manifest import Chunk, Manifest, TensorEntry
from ckptools.core.sizes import parse_size
from ckptools.engine.executor import create_files
from ckptools.engine.runtime import pwrite_all
from ckptools.errors import CkptError, UsageError
from ckptools.io import storage
from ckptools.io.staging import (
    SPOOL_DIR_ENV,
    check_writable,
    commit,
    copy_into,
    fsync_dir,
    make_tmp_dir,
    upload_dir,
    write_file_synced,
)
from ckptools.plan.safetensors import INDEX_NAME, ConsolidationPlan, plan_consolidation, runs
from ckptools.training.state import state_to_save, write_model_config

if TYPE_CHECKING:
    from torch import nn

__all__ = ["SavePretrainedResult", "save_pretrained"]

log = logging.getLogger(__name__)

#: transformers' own default for ``save_pretrained`` (the same as ``ckpt consolidate``'s).
DEFAULT_MAX_SHARD_SIZE = "5GB"
_TENSOR_ITEMS = (WriteItemType.SHARD, WriteItemType.TENSOR)


@dataclass(frozen=True)
class SavePretrainedResult:
    """What :func:`save_pretrained` wrote.

    Attributes:
        out: the model directory.
        files: safetensors file names, in order.
        tensors: tensors written.
        total_size: tensor bytes over all files (the index's ``metadata.total_size``).
        bytes_written: tensor bytes this rank wrote.
        seconds: wall time of the call on this rank.
        peak_rss_bytes: peak resident memory of this process so far.
        world_size: ranks that wrote.
        dtype: the cast asked for, or None.
        dropped: ``(dropped, kept)`` tied weights not written (the config ties them).
        config_files: model files written beside the weights.
    """

    out: str
    files: tuple[str, ...]
    tensors: int
    total_size: int
    bytes_written: int
    seconds: float
    peak_rss_bytes: int
    world_size: int
    dtype: str | None = None
    dropped: tuple[tuple[str, str], ...] = ()
    config_files: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "out": self.out,
            "files": list(self.files),
            "tensors": self.tensors,
            "total_size": self.total_size,
            "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 4),
            "peak_rss_bytes": self.peak_rss_bytes,
            "world_size": self.world_size,
            "dtype": self.dtype,
            "dropped_tied": [list(p) for p in self.dropped],
            "config_files": list(self.config_files),
        }


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return 0, 1


def _dtype_name(dtype: torch.dtype) -> str:
    return dtypes.canonical(str(dtype).removeprefix("torch."))


def _torch_dtype(name: str) -> torch.dtype:
    value = getattr(torch, name)
    assert isinstance(value, torch.dtype)
    return value


def _manifest(metadata: Metadata, plans: Sequence[SavePlan], out: str) -> Manifest:
    """The checkpoint ``dcp.save`` would write, as a manifest (boxes and ranks; no bytes)."""
    boxes: dict[str, list[Chunk]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            if item.type not in _TENSOR_ITEMS or item.tensor_data is None:
                continue
            chunk = item.tensor_data.chunk
            boxes.setdefault(item.index.fqn, []).append(
                Chunk(tuple(chunk.offsets), tuple(chunk.sizes), "", 0, 0, "raw", rank)
            )
    tensors: dict[str, TensorEntry] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[fqn] = TensorEntry(
                fqn, _dtype_name(md.properties.dtype), tuple(md.size), tuple(boxes.get(fqn, ()))
            )
    planner_data: Mapping[str, Any] = metadata.planner_data or {}
    paths = {fqn: tuple(str(p) for p in planner_data.get(fqn, (fqn,))) for fqn in tensors}
    return Manifest(out, "dcp", "model", tensors, {}, {}, world_size=len(plans), paths=paths)


def _prepare_files(
    model: nn.Module, config: str | None, tmp: str, out: str
) -> tuple[tuple[str, ...], bool | None]:
    """Rank 0: write or copy the model files into ``tmp``; returns their names and the config's
    ``tie_word_embeddings`` (None when no config says)."""
    if config is not None:
        files = find_model_files(out, config)
        for path, name in files:
            copy_into(path, os.path.join(tmp, name))
    else:
        files = [(os.path.join(tmp, n), n) for n in write_model_config(model, tmp)]
    for _, name in files:
        with open(os.path.join(tmp, name), "rb") as f:
            os.fsync(f.fileno())
    return tuple(name for _, name in files), tie_setting(files)


def _plan(
    manifest: Manifest, tie: bool | None, limit: int, dtype: str | None
) -> tuple[ConsolidationPlan, tuple[tuple[str, str], ...]]:
    names = select_tensors(manifest)
    dropped: list[tuple[str, str]] = []
    if tie:
        # As consolidate: transformers re-ties the output embedding on load.
        for o, i in tied_candidates(names, manifest):
            if o in names:
                dropped.append((o, i))
                del names[o]
    return plan_consolidation(manifest, names, max_shard_size=limit, dtype=dtype), tuple(dropped)


def _local_bytes(data: torch.Tensor, sizes: tuple[int, ...], dtype: str) -> memoryview:
    tensor = data.detach()
    if tuple(tensor.shape) != sizes:
        raise CkptError(f"local shard has shape {list(tensor.shape)}, planned {list(sizes)}")
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    target = _torch_dtype(dtype)
    if tensor.dtype != target:
        tensor = tensor.to(target)
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


def _staging_dir(out: str) -> str:
    """Where the ranks write: ``<out>.tmp-<id>/`` beside a local ``out``; for an object-store
    ``out``, a fresh local directory (``CKPTOOLS_SPOOL_DIR`` or the system temporary directory,
    which every rank of one node shares), uploaded by rank 0 once every rank has written."""
    if not storage.is_url(out):
        return make_tmp_dir(out)
    import tempfile

    base = os.environ.get(SPOOL_DIR_ENV) or None
    if base:
        os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix="ckptools-pretrained-", dir=base)


def _write_share(
    plan: ConsolidationPlan, planner: DefaultSavePlanner, items: Sequence[WriteItem], tmp: str
) -> int:
    """Write the bytes of this rank's shards (``items``) into the created files of ``plan``."""
    mine: dict[str, list[WriteItem]] = {}
    for item in items:
        if item.type in _TENSOR_ITEMS and item.tensor_data is not None:
            mine.setdefault(item.index.fqn, []).append(item)
    fds: dict[str, int] = {}
    written = 0
    try:
        for f in plan.files:
            for t in f.tensors:
                for item in mine.get(t.fqn, ()):
                    assert item.tensor_data is not None
                    offsets = tuple(item.tensor_data.chunk.offsets)
                    sizes = tuple(item.tensor_data.chunk.sizes)
                    if 0 in sizes:
                        continue
                    if f.name not in fds:
                        fds[f.name] = os.open(os.path.join(tmp, f.name), os.O_WRONLY)
                    data = planner.resolve_data(item)
                    assert isinstance(data, torch.Tensor)
                    mem = _local_bytes(data, sizes, t.dtype)
                    size = dtypes.dtype(t.dtype).itemsize
                    # Coalesce runs that are adjacent in the output too (whole rows of a box).
                    pending: tuple[int, int, int] | None = None
                    for src, dst, n in runs(t.shape, offsets, sizes):
                        if pending is not None and pending[1] + pending[2] == dst:
                            pending = (pending[0], pending[1], pending[2] + n)
                            continue
                        if pending is not None:
                            s, d, k = pending
                            pwrite_all(
                                fds[f.name], mem[s * size : (s + k) * size], t.begin + d * size
                            )
                        pending = (src, dst, n)
                    if pending is not None:
                        s, d, k = pending
                        pwrite_all(fds[f.name], mem[s * size : (s + k) * size], t.begin + d * size)
                    written += len(mem)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return written


@storage.accepts_storage_options
def save_pretrained(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    config: str | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    dtype: CastDType | None = None,
    overwrite: bool = False,
    storage_options: storage.StorageOptions | None = None,
) -> SavePretrainedResult:
    """Write ``model`` as a Hugging Face safetensors model directory, from its shards.

    Collective: every rank of the default process group calls it, in the same order, with its
    own shard of the same model (FSDP2 ``fully_shard`` incl. HSDP, FSDP1 of any sharding
    strategy, DDP, ``torch.compile``, activation checkpointing, or plain); without a process
    group one process writes everything. Each rank writes the bytes of its own shards (replicated
    tensors are split over ranks as ``dcp.save`` splits them); rank 0 creates the files, writes
    the config files, and, after every rank succeeded, the index last, then renames
    ``<out_dir>.tmp-<id>/`` to ``out_dir``. A failure on any rank removes the temporary
    directory and raises on every rank. Nothing is gathered: memory is one local shard.

    The result is byte-identical to ``ckpt consolidate`` of a :func:`ckptools.save` checkpoint
    of the same model with the same options: same file names and sharding, headers, tensor order,
    ``config.json`` / ``generation_config.json`` handling and tied weights (with
    ``tie_word_embeddings: true`` the output embedding is not written).

    Args:
        model: the model, wrapped as trained.
        out_dir: the model directory to create.
        config: a ``config.json`` file or a directory with config and tokenizer files to copy;
            by default the config of a ``transformers.PreTrainedModel`` is written.
        max_shard_size: largest output file, e.g. ``"5GB"``, ``"300KB"`` or bytes.
        dtype: cast floating tensors to ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        overwrite: replace an existing ``out_dir``.
        storage_options: fsspec options for URL paths (credentials, endpoint...), a mapping
            or its JSON text; see :func:`ckptools.io.storage.storage_options`.

    Returns:
        A :class:`SavePretrainedResult` (``bytes_written`` counts this rank's bytes).

    Raises:
        UsageError: ``out_dir`` exists (without ``overwrite``), a bad size, dtype or config.
        CkptError: another rank failed, or rank 0 could not commit.

    Example:
        >>> import torch, ckptools
        >>> model = torch.nn.Linear(4, 2)
        >>> r = ckptools.save_pretrained(model, "/tmp/ckptools-doc/pretrained", overwrite=True)
        >>> r.files
        ('model.safetensors',)
    """
    started = time.perf_counter()
    out = os.fspath(out_dir).rstrip("/") or os.fspath(out_dir)
    limit = parse_size(max_shard_size)
    if dtype is not None and (
        not dtypes.is_dtype_name(dtype) or not dtypes.dtype(dtype).is_floating
    ):
        raise UsageError(f"dtype {dtype!r}: choose bfloat16, float16 or float32")
    rank, world = _rank_and_world()

    # The plan dcp.save would make: same items, same order, same owner of replicated tensors.
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_to_save(model), storage_meta=None, is_coordinator=rank == 0)
    local_plan = planner.create_local_plan()
    all_plans: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(all_plans, local_plan)
    else:
        all_plans = [local_plan]
    global_plans, metadata = planner.create_global_plan(all_plans)
    manifest = _manifest(metadata, global_plans, out)

    setup: list[Any] = [None, None, None, ()]  # tmp, tie, error, config files
    plan: ConsolidationPlan | None = None
    dropped: tuple[tuple[str, str], ...] = ()
    rank0_error: BaseException | None = None
    if rank == 0:
        tmp = None
        try:
            check_writable(out, overwrite)
            tmp = _staging_dir(out)
            names, tie = _prepare_files(model, config, tmp, out)
            plan, dropped = _plan(manifest, tie, limit, dtype)
            create_files(plan, tmp)
            setup = [tmp, tie, None, names]
        except Exception as e:  # sent to the other ranks so that none waits forever
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            rank0_error = e
            setup = [None, None, f"{type(e).__name__}: {e}", ()]
    if world > 1:
        dist.broadcast_object_list(setup, src=0)
    tmp, tie, error, config_files = setup
    if rank0_error is not None:
        raise rank0_error
    if error is not None:
        raise CkptError(f"save_pretrained: rank 0 could not prepare {out}: {error}")
    if plan is None:
        plan, dropped = _plan(manifest, tie, limit, dtype)

    failure: BaseException | None = None
    written = 0
    try:
        written = _write_share(plan, planner, global_plans[rank].items, tmp)
    except Exception as e:  # reported to the other ranks below, then re-raised
        failure = e
    if world > 1:
        flag = torch.tensor([0 if failure is None else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = bool(flag.item())
    else:
        failed = failure is not None
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if failure is not None:
            raise failure
        raise CkptError(
            f"save_pretrained failed on another rank (see its error); {out} not written"
        )

    outcome: list[Any] = [None]
    if rank == 0:
        try:
            if plan.index is not None:
                # The index commits a sharded model directory: written last, after every shard.
                index = (json.dumps(plan.index, indent=2) + "\n").encode()
                write_file_synced(os.path.join(tmp, INDEX_NAME), index)
            fsync_dir(tmp)
            if storage.is_url(out):
                upload_dir(tmp, out, overwrite)  # data files, then the index, then the commit
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                commit(tmp, out, overwrite)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if world > 1:
                dist.broadcast_object_list([f"{type(e).__name__}: {e}"], src=0)
            raise
    if world > 1:
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise CkptError(f"rank 0 could not commit {out}: {outcome[0]}")
    log.info("save_pretrained wrote %s (%d bytes from rank %d)", out, written, rank)
    return SavePretrainedResult(
        out=out,
        files=tuple(f.name for f in plan.files),
        tensors=sum(len(f.tensors) for f in plan.files),
        total_size=plan.total_size,
        bytes_written=written,
        seconds=time.perf_counter() - started,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        world_size=world,
        dtype=dtype,
        dropped=dropped,
        config_files=tuple(config_files),
    )
