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
   :func:`ckptools.verbs.consolidate.plan_export` (the front half of ``consolidate`` itself: key
   mapping, tied-weight rule, :func:`ckptools.plan.safetensors.plan_consolidation`) plans the files.
3. Rank 0 creates the files (final sizes, headers) in ``<out>.tmp-<id>/`` and the config files; each
   rank ``pwrite``\\s the bytes of its own shards at their planned offsets
   (:func:`ckptools.plan.safetensors.runs` maps a shard's box to runs of output elements); after
   every rank succeeded, rank 0 writes the index last and renames the directory into place
   (the protocol of :mod:`ckptools.outputs.protocol`: a failure anywhere removes the directory
   and raises on every rank).
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from ckptools.core import dtypes
from ckptools.core.manifest import Chunk, Manifest, TensorEntry
from ckptools.engine.collective import Ranks
from ckptools.engine.executor import create_files
from ckptools.engine.runtime import pwrite_all
from ckptools.errors import CkptError
from ckptools.io import staging, storage
from ckptools.outputs.protocol import Output, commit, staged
from ckptools.plan.conversion_entries import split_fqn
from ckptools.plan.conversions import Piece
from ckptools.plan.safetensors import runs
from ckptools.training.state import state_to_save, write_model_config
from ckptools.views import lora
from ckptools.views.export import (
    DEFAULT_MAX_SHARD_SIZE,
    CastDType,
    Export,
    ExportOptions,
    plan_export,
    tie_setting,
    write_index,
)
from ckptools.views.model_config import find_model_files, model_config

__all__ = ["SavePretrainedResult", "save_pretrained"]

log = logging.getLogger(__name__)

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


def _ranks() -> Ranks:
    """The ranks of the default process group, or this process alone when there is none (a
    group is never initialised here: the caller's training script owns it)."""
    if dist.is_available() and dist.is_initialized():
        return Ranks(rank=int(dist.get_rank()), world_size=int(dist.get_world_size()))
    return Ranks()


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
                Chunk(
                    offsets=tuple(chunk.offsets),
                    sizes=tuple(chunk.sizes),
                    file="",
                    offset=0,
                    length=0,
                    encoding="raw",
                    rank=rank,
                )
            )
    tensors: dict[str, TensorEntry] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[fqn] = TensorEntry(
                fqn=fqn,
                dtype=_dtype_name(md.properties.dtype),
                shape=tuple(md.size),
                chunks=tuple(boxes.get(fqn, ())),
            )
    planner_data: Mapping[str, Any] = metadata.planner_data or {}
    paths = {fqn: tuple(str(p) for p in planner_data.get(fqn, (fqn,))) for fqn in tensors}
    return Manifest(
        root=out,
        format="dcp",
        layout="model",
        tensors=tensors,
        objects={},
        files={},
        world_size=len(plans),
        paths=paths,
    )


def _save_plan(
    model: nn.Module, ranks: Ranks, out: str
) -> tuple[DefaultSavePlanner, list[SavePlan], Manifest]:
    """The plan ``dcp.save`` would make (same items, same order, same owner of replicated
    tensors), and the checkpoint it describes as a manifest. Collective: the ranks all-gather
    their local plans (metadata only)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_to_save(model), storage_meta=None, is_coordinator=ranks.is_root)
    all_plans = ranks.from_all(planner.create_local_plan, "save_pretrained")
    global_plans, metadata = planner.create_global_plan(all_plans)
    return planner, global_plans, _manifest(metadata, global_plans, out)


def _prepare_files(
    model: nn.Module, config: str | None, tmp: str, out: str
) -> tuple[tuple[str, ...], bool | None, dict[str, Any] | None]:
    """Rank 0: write or copy the model files into ``tmp``; returns their names, the config's
    ``tie_word_embeddings`` (None when no config says) and the config itself."""
    if config is not None:
        files = find_model_files(out, config)
        for path, name in files:
            staging.copy_into(path, os.path.join(tmp, name))
    else:
        files = [(os.path.join(tmp, n), n) for n in write_model_config(model, tmp)]
    for _, name in files:
        with open(os.path.join(tmp, name), "rb") as f:
            os.fsync(f.fileno())
    return tuple(name for _, name in files), tie_setting(files), model_config(files)


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


@dataclass(frozen=True, kw_only=True)
class PretrainedOptions(ExportOptions):
    """:class:`ExportOptions` as :func:`save_pretrained` takes them: keyword arguments, not
    flags, and no ``merge_lora`` or ``select``, so its errors name what it does take."""

    PEFT_WAYS: ClassVar[str] = (
        "pass adapter=True (and lora_alpha=) for peft's adapter directory; for the merged model "
        "call merge_and_unload() on the peft model before save_pretrained, or ckptools.save() "
        "it and ckptools.consolidate(..., merge_lora=True)"
    )
    LORA_NEEDS: ClassVar[str] = (
        "lora_alpha, adapter_config, adapter_name: need adapter=True (a merged model: "
        "merge_and_unload() on the peft model before save_pretrained)"
    )


@dataclass(frozen=True)
class _Prepared:
    """What rank 0 prepared, handed to every rank: what the config says."""

    tie: bool | None  # the config's tie_word_embeddings (None when no config says)
    config_files: tuple[str, ...]
    config: dict[str, Any] | None = None  # config.json: names the transformers conversion


def _prepare(
    model: nn.Module, manifest: Manifest, options: ExportOptions, out: str, tmp: str
) -> tuple[_Prepared, Export]:
    """Rank 0, in the staging directory ``tmp``: write the model files, plan as consolidate
    does and create the files (final sizes, headers)."""
    names, tie, config = _prepare_files(model, options.config, tmp, out)
    export = plan_export(manifest, options, tie, config, boxes_only=True)
    if export.adapter_config is not None:  # peft's adapter directory: adapter and config
        for name in names:
            os.remove(os.path.join(tmp, name))
        names = (lora.ADAPTER_CONFIG_NAME,)
        staging.write_file_synced(os.path.join(tmp, names[0]),
                                  lora.config_json(export.adapter_config))  # fmt: skip
    staging.reserve(tmp, export.plan.bytes_to_write)
    create_files(export.plan, tmp)
    return _Prepared(tie=tie, config_files=names, config=config), export


def _converted_pieces(export: Export) -> dict[str, tuple[str, Piece]]:
    """Output tensor FQN → (stored FQN, piece) of tensors that are boxes of a stored one."""
    if export.keymap is None:
        return {}
    by_disk = {p.disk: p for p in export.keymap.pieces if not p.whole}
    out = {}
    for name, fqn in export.names.items():
        p = by_disk.get(name)
        if p is not None:
            out[fqn] = (fqn.removesuffix(split_fqn("", name)), p)
    return out


def _local_boxes(
    t_fqn: str,
    mine: Mapping[str, list[WriteItem]],
    planner: DefaultSavePlanner,
    pieces: Mapping[str, tuple[str, Piece]],
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]:
    """``(offsets, sizes, local data)`` of this rank's parts of output tensor ``t_fqn``: its
    shards, or, for a converted tensor, its piece's box of the stored tensor's shards."""
    src, piece = pieces.get(t_fqn, (t_fqn, None))
    for item in mine.get(src, ()):
        assert item.tensor_data is not None
        offsets = tuple(item.tensor_data.chunk.offsets)
        sizes = tuple(item.tensor_data.chunk.sizes)
        if 0 in sizes:
            continue
        data = planner.resolve_data(item)
        assert isinstance(data, torch.Tensor)
        if tuple(data.shape) != sizes:
            raise CkptError(f"local shard has shape {list(data.shape)}, planned {list(sizes)}")
        if piece is None:
            yield offsets, sizes, data
            continue
        lo = [max(a, b) for a, b in zip(offsets, piece.offsets, strict=True)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, piece.offsets, piece.sizes,
                                                      strict=True)]  # fmt: skip
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            continue
        for d, (low, h, o) in enumerate(zip(lo, hi, offsets, strict=True)):
            data = data.narrow(d, low - o, h - low)
        keep = [d for d in range(len(lo)) if d != piece.stack_dim]
        yield (
            tuple(lo[d] - piece.offsets[d] for d in keep),
            tuple(hi[d] - lo[d] for d in keep),
            data.reshape([hi[d] - lo[d] for d in keep]),
        )


def _write_share(
    export: Export, planner: DefaultSavePlanner, items: Sequence[WriteItem], tmp: str
) -> int:
    """Write the bytes of this rank's shards (``items``) into the created files of the plan."""
    plan = export.plan
    mine: dict[str, list[WriteItem]] = {}
    for item in items:
        if item.type in _TENSOR_ITEMS and item.tensor_data is not None:
            mine.setdefault(item.index.fqn, []).append(item)
    pieces = _converted_pieces(export)
    fds: dict[str, int] = {}
    written = 0
    try:
        for f in plan.files:
            for t in f.tensors:
                for offsets, sizes, data in _local_boxes(t.fqn, mine, planner, pieces):
                    if f.name not in fds:
                        fds[f.name] = os.open(os.path.join(tmp, f.name), os.O_WRONLY)
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
    keep_in_memory_names: bool = False,
    adapter: bool = False,
    lora_alpha: float | None = None,
    adapter_config: str | None = None,
    adapter_name: str | None = None,
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
        keep_in_memory_names: write the in-memory form (e.g. fused MoE experts) instead of the
            on-disk format transformers' own ``save_pretrained`` writes
            (:mod:`ckptools.plan.conversions`, from the config written or copied).
        adapter: a PEFT LoRA model: write only its adapter, as ``PeftModel.save_pretrained``
            does (``adapter_model.safetensors`` + ``adapter_config.json``; see
            :func:`ckptools.consolidate`); ``lora_alpha`` / ``adapter_config`` give alpha,
            ``adapter_name`` the adapter. The merged model: ``ckpt consolidate --merge-lora``
            of a saved checkpoint.
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
    options = PretrainedOptions(
        max_shard_size=max_shard_size, dtype=dtype, config=config, overwrite=overwrite,
        keep_in_memory_names=keep_in_memory_names, adapter=adapter, lora_alpha=lora_alpha,
        adapter_config=adapter_config, adapter_name=adapter_name,
    )  # fmt: skip
    ranks = _ranks()
    planner, global_plans, manifest = _save_plan(model, ranks, out)

    planned: list[Export] = []  # rank 0 plans while preparing; the other ranks after

    def fill(tmp: str) -> _Prepared:
        prepared, export = _prepare(model, manifest, options, out, tmp)
        planned.append(export)
        return prepared

    # an object-store OUT: the ranks write a local spool (CKPTOOLS_SPOOL_DIR or the system
    # temporary directory, which every rank of one node shares), uploaded at the commit
    output = Output(out=out, kind="model", overwrite=options.overwrite, what="save_pretrained",
                    spool=True)  # fmt: skip
    with staged(ranks, output, fill) as stage:
        prepared = stage.prepared
        export = (
            planned[0]
            if planned
            else plan_export(manifest, options, prepared.tie, prepared.config, boxes_only=True)
        )
        items = global_plans[ranks.rank].items
        shares = ranks.from_all(
            lambda: _write_share(export, planner, items, stage.tmp), "save_pretrained"
        )
        commit(ranks, output, stage, lambda: write_index(stage.tmp, export.plan))
    written = shares[ranks.rank]
    log.info("save_pretrained wrote %s (%d bytes from rank %d)", out, written, ranks.rank)
    return _result(out, export, prepared, written, started, ranks.world_size, options.dtype)


def _result(
    out: str, export: Export, prepared: _Prepared, written: int, started: float, world_size: int,
    dtype: str | None,
) -> SavePretrainedResult:  # fmt: skip
    plan = export.plan
    return SavePretrainedResult(
        out=out,
        files=tuple(f.name for f in plan.files),
        tensors=sum(len(f.tensors) for f in plan.files),
        total_size=plan.total_size,
        bytes_written=written,
        seconds=time.perf_counter() - started,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        world_size=world_size,
        dtype=dtype,
        dropped=export.dropped,
        config_files=prepared.config_files,
    )
