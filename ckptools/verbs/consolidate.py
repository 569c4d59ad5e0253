"""``ckptools.consolidate``: any supported checkpoint → a Hugging Face safetensors model directory.

Options validated once (:class:`ConsolidateOptions`), the manifest read once, the tensors to
export picked (the model part) and the files planned (:func:`plan_export`, shared with
:func:`ckptools.save_pretrained`); the bytes moved (:mod:`ckptools.engine.executor`) into a
temporary directory beside OUT with the config and tokenizer files, the index written last
(:func:`write_index`), the directory renamed into place. No tensor is materialised but for a
dtype cast or a strided chunk: memory stays bounded whatever the model size.
"""

from __future__ import annotations

import json
import logging
import resource
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ckptools.core.manifest import MODEL_FILES_DIR, Manifest
from ckptools.engine import collective
from ckptools.engine.collective import Ranks
from ckptools.engine.executor import block_bytes, create_files, execute, in_row_blocks
from ckptools.errors import UsageError
from ckptools.formats.stream_transforms import require_decodable
from ckptools.io import storage, tunables
from ckptools.io.out_rules import check_out
from ckptools.io.resume import fingerprint
from ckptools.io.staging import copy_into, reserve, write_file_synced
from ckptools.outputs.protocol import Output, commit, journal, staged
from ckptools.plan.safetensors import ConsolidationPlan
from ckptools.producers import read_manifest
from ckptools.producers.base import decodes_of
from ckptools.views import lora
from ckptools.views.export import (
    DEFAULT_MAX_SHARD_SIZE,
    MODEL_FILES,
    CastDType,
    Export,
    ExportOptions,
    plan_export,
    same_storage,
    same_written_bytes,
    select_tensors,
    tie_setting,
    tied_candidates,
    write_index,
)
from ckptools.views.model_config import (
    config_misfit,
    find_model_files,
    fitting_model_files,
    model_config,
    with_dtype,
)
from ckptools.views.producer import views_of

# Export planning lives in ckptools.views.export; these names stay importable from here.
__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "MODEL_FILES",
    "CastDType",
    "ConsolidateOptions",
    "ConsolidateResult",
    "Export",
    "ExportOptions",
    "consolidate",
    "find_model_files",
    "model_config",
    "plan_export",
    "select_tensors",
    "tie_setting",
    "tied_candidates",
    "write_index",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ConsolidateOptions(ExportOptions):
    """Every option of :func:`consolidate` (the CLI's options have the same names).

    Attributes:
        dry_run: plan only; write nothing.
        weights_only: write the weights alone where no config.json fits them (refused without).
        workers: copy threads as given (None: :func:`ckptools.io.tunables.workers`).
        memory_budget: copy buffers as given (None: :func:`ckptools.io.tunables.memory_budget`).
        format: force the source layout instead of detecting it.
        quiet: no progress bar.
        distributed: split the copy over the ranks of a job (:mod:`ckptools.engine.collective`).
        worker_count: the copy threads, resolved (derived).
        memory_budget_bytes: the copy buffers' bytes, resolved (derived).
    """

    dry_run: bool = False
    weights_only: bool = False
    workers: int | None = None
    memory_budget: str | int | None = None
    format: str | None = None
    quiet: bool = False
    distributed: bool = True
    worker_count: int = field(init=False, repr=False)
    memory_budget_bytes: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "worker_count", tunables.workers(self.workers))
        object.__setattr__(self, "memory_budget_bytes", tunables.memory_budget(self.memory_budget))


@dataclass(frozen=True)
class ConsolidateResult:
    """What :func:`consolidate` wrote (or, with ``dry_run``, would write).

    Attributes:
        src: the checkpoint read.
        out: the output directory.
        layout: the source layout name.
        plan: the files and their tensors.
        tensors: tensors written.
        bytes_written: bytes of all safetensors files (headers included); 0 for a dry run.
        seconds: wall time of the whole call.
        peak_rss_bytes: peak resident memory of this process so far.
        dtype: the cast asked for, or None.
        cast_tensors: how many tensors were cast.
        dropped: ``(dropped, kept)`` pairs of tied weights not written (the config ties them).
        tied: ``(a, b)`` pairs found to hold the same data and both written (no config said to
            tie them).
        config_files: the files written into OUT beside the weights: those copied, and those
            made (``config.json`` a producer's view made, ``adapter_config.json`` of ``adapter``).
        skipped_objects: non-tensor entries of the checkpoint, which safetensors cannot hold.
        notes: facts worth showing.
    """

    src: str
    out: str
    layout: str
    plan: ConsolidationPlan
    tensors: int
    bytes_written: int
    seconds: float
    peak_rss_bytes: int
    dry_run: bool = False
    dtype: str | None = None
    cast_tensors: int = 0
    workers: int = 1
    dropped: tuple[tuple[str, str], ...] = ()
    tied: tuple[tuple[str, str], ...] = ()
    config_files: tuple[str, ...] = ()
    skipped_objects: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        plan = self.plan.to_dict()
        return {
            "src": self.src,
            "out": self.out,
            "layout": self.layout,
            "dry_run": self.dry_run,
            "files": [
                {"name": f["name"], "bytes": f["bytes"], "tensors": len(f["tensors"])}
                for f in plan["files"]
            ],
            "index": plan["index"],
            "tensors": self.tensors,
            "total_size": self.plan.total_size,
            "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 4),
            "gb_per_s": round(self.bytes_written / self.seconds / 1e9, 3) if self.seconds else None,
            "peak_rss_bytes": self.peak_rss_bytes,
            "workers": self.workers,
            "dtype": self.dtype,
            "cast_tensors": self.cast_tensors,
            "dropped_tied": [list(p) for p in self.dropped],
            "tied": [list(p) for p in self.tied],
            "config_files": list(self.config_files),
            "skipped_objects": self.skipped_objects,
            "notes": list(self.notes),
            "plan": plan["files"] if self.dry_run else None,
        }


@storage.accepts_storage_options
def consolidate(
    src: str,
    out: str,
    *,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    dtype: CastDType | None = None,
    select: str | None = None,
    key: str | None = None,
    strip_prefix: str | None = None,
    config: str | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    weights_only: bool = False,
    workers: int | None = None,
    memory_budget: str | int | None = None,
    format: str | None = None,
    quiet: bool = False,
    distributed: bool = True,
    keep_in_memory_names: bool = False,
    adapter: bool = False,
    merge_lora: bool = False,
    lora_alpha: float | None = None,
    adapter_config: str | None = None,
    adapter_name: str | None = None,
    masters: bool = False,
    storage_options: storage.StorageOptions | None = None,
) -> ConsolidateResult:
    """Write the checkpoint at ``src`` as a Hugging Face safetensors model directory ``out``.

    Bit-exact unless ``dtype`` is given. Writes ``model.safetensors`` (above ``max_shard_size``,
    ``model-0000k-of-0000n.safetensors`` files and their index, written last) and copies
    ``config.json`` and tokenizer files from ``config`` or from beside the checkpoint. OUT
    appears atomically: ``<out>.tmp-<id>/`` renamed; any failure (Ctrl-C too) removes it.

    Args:
        src: a checkpoint in any layout :func:`ckptools.read_manifest` reads.
        out: the model directory to create.
        max_shard_size: largest output file, e.g. ``"5GB"``, ``"300KB"``, ``"2GiB"`` or bytes.
        dtype: cast floating tensors to this dtype (other tensors are kept as stored).
        select, key: export this key sub-tree instead of the model (:func:`select_tensors`).
        strip_prefix: remove this prefix from output names.
        config: a ``config.json`` file or a directory with config and tokenizer files.
        overwrite: replace an existing ``out``.
        dry_run: plan only; write nothing.
        weights_only: write the weights alone where no ``config.json`` fits them (refused).
        workers: copy threads (default ``CKPTOOLS_WORKERS``, else up to 4).
        memory_budget: bytes of copy buffers (default ``CKPTOOLS_MEMORY_BUDGET`` or 256 MiB).
        format: force the source layout instead of detecting it.
        quiet: no progress bar.
        distributed: under torchrun, or called by every rank of a process group, split the
            copy over the ranks (every rank must call it); False: this process writes alone.
        keep_in_memory_names: keep the in-memory names, not save_pretrained's on-disk format.
        adapter: write only the LoRA adapter, as ``PeftModel.save_pretrained`` does (peft's
            names, bit-exact, only its bytes read) with its ``adapter_config.json``.
        merge_lora: write the model with its LoRA adapter merged (``W + (B @ A) * scale``, as
            peft's ``merge_and_unload``), loadable by ``from_pretrained``.
        lora_alpha: the adapter's ``lora_alpha``, which checkpoints do not store.
        adapter_config: an ``adapter_config.json`` for alpha and the rest of the LoraConfig.
        adapter_name: the adapter to export or merge when the model holds several.
        masters: a save's distributed optimizer's fp32 masters, not its weights (a producer's
            view: :mod:`ckptools.views.producer`).
        storage_options: fsspec options for URL paths (credentials, endpoint...), a mapping
            or its JSON text; see :func:`ckptools.io.storage.storage_options`.

    Returns:
        A :class:`ConsolidateResult`; ``to_dict()`` gives plain JSON-able data.

    Raises:
        UsageError: ``out`` exists (without ``overwrite``); a bad size, selection or config.
        CkptError: the checkpoint is missing, damaged, unsafe or unsupported.

    Example:
        >>> import ckptools
        >>> r = ckptools.consolidate("checkpoints/step-1000", "hf_model")  # doctest: +SKIP
        >>> r.to_dict()["files"]  # doctest: +SKIP
        [{'name': 'model.safetensors', 'bytes': 2013265992, 'tensors': 201}]
    """
    started = time.perf_counter()
    options = ConsolidateOptions(
        max_shard_size=max_shard_size, dtype=dtype, select=select, key=key, quiet=quiet,
        strip_prefix=strip_prefix, config=config, overwrite=overwrite, dry_run=dry_run,
        weights_only=weights_only, workers=workers, memory_budget=memory_budget, format=format,
        distributed=distributed, keep_in_memory_names=keep_in_memory_names, adapter=adapter,
        merge_lora=merge_lora, lora_alpha=lora_alpha, adapter_config=adapter_config,
        adapter_name=adapter_name, masters=masters)  # fmt: skip
    out = out.rstrip("/") or out
    # a dry run plans anyway, saying that OUT exists
    exists = check_out(out, kind="model", overwrite=overwrite, dry_run=dry_run, src=src)
    if options.merge_lora and storage.is_url(out):
        raise UsageError(f"{out}: --merge-lora rewrites weights in place; write to a local dir")
    run = _Run.planned(src, out, options, started)
    if options.dry_run:
        run.notes.extend(exists)
        return run.result(0)
    ranks = collective.current(options.distributed)
    if ranks.world_size > 1:
        run.notes.append(f"written by {ranks.world_size} ranks")
        tied = _write_distributed(ranks, run)
        return run.result(run.export.plan.bytes_to_write, tied)
    return run.result(*_write_resumable(run))


def _checked_shapes(
    manifest: Manifest, options: ConsolidateOptions
) -> dict[str, tuple[int, ...]] | None:
    """The tensors (output name → shape) a config found for ``manifest`` must fit: the model
    part as :func:`plan_export` selects it. None where they are not a model's names yet (a
    producer's view as the HF model checks the config's sizes; ``--masters``) or not the model
    alone (a LoRA adapter, merged or not, or a PEFT model given without either)."""
    if (
        views_of(manifest) is not None
        or options.adapter
        or options.merge_lora
        or options.masters
        or options.select is not None
    ):
        return None
    names = select_tensors(manifest, None, options.strip_prefix)
    decodes = decodes_of(manifest)
    if decodes is not None:  # stored forms (quantized data, scales): the plain model's names
        decoded = decodes.decoded(manifest, names, None)
        if not decoded.plain_names:
            return None
        names = decoded.names
    shapes = {n: manifest.tensors[f].shape for n, f in names.items()}
    # a PEFT model's names are no config's: the export refuses it first, naming the ways out
    return None if lora.scan(shapes, shapes) is not None else shapes


def _weights_alone(
    src: str, out: str, options: ConsolidateOptions, misfit: str | None, *, has_config: bool
) -> list[str]:
    """No config for the model (none found, or ``misfit``: the one found does not fit): the
    note that OUT holds the weights only, with ``weights_only``; else the UsageError that
    from_pretrained could not load OUT, naming the ways out (a dry run plans anyway, saying so).
    """
    weights_only = "or --weights-only to write the weights alone"
    if misfit is not None:
        kept = f"{misfit} ({out} holds the weights only)"
        refused = f"{misfit}, {weights_only}"
    elif not has_config:
        kept = (
            f"no config.json beside {src} or above it: {out} holds the weights only "
            "(--weights-only), which from_pretrained cannot load"
        )
        refused = (
            f"no config.json beside {src} or above it, so from_pretrained could not load {out}: "
            f"give the model's config with --config CONFIG.json (or a directory holding it), "
            f"{weights_only}"
        )
    else:
        return []
    if options.weights_only:
        return [kept]
    if options.dry_run:
        return [f"{refused} (without --dry-run the run would stop here)"]
    raise UsageError(refused)


@dataclass(frozen=True)
class _Run:
    """One consolidation, planned: what every writing step and the result need."""

    src: str
    out: str
    options: ConsolidateOptions
    manifest: Manifest
    model_files: list[tuple[str, str]]  # (source path, name in OUT)
    tie: bool | None
    export: Export
    started: float
    notes: list[str]  # grows as the run goes (ranks, resumed files, tied weights)

    @classmethod
    def planned(cls, src: str, out: str, options: ConsolidateOptions, started: float) -> _Run:
        """Read the source once, find the model files, choose the tensors and plan the files."""
        # exporting the model (not a --select'ed sub-tree): per-rank optimizer files unread
        manifest = read_manifest(src, options.format, model_only=options.select is None)
        require_decodable(manifest, objects=())  # before a conversion or a copy reads any
        model_files, misfit = fitting_model_files(
            src, options.config, _checked_shapes(manifest, options),
            manifest.details.get(MODEL_FILES_DIR), data_dir=manifest.data_dir(),
            quiet=options.quiet,
        )  # fmt: skip
        tie = tie_setting(model_files)
        export = plan_export(manifest, options, tie, model_config(model_files),
                             check=not options.dry_run)  # fmt: skip
        notes: list[str] = []
        views = views_of(manifest)
        if views is not None and not options.adapter:
            # the config named the run's tensors: the HF model they became must be its model
            source = export.manifest or manifest
            hf = {n: source.tensors[f].shape for n, f in export.names.items()}
            needed = views.CONFIG_NEEDED
            config_misfit(model_files, src, options.config, hf, needed=needed, quiet=options.quiet)
        if options.adapter:
            model_files = []  # peft's adapter directory holds the adapter and its config only
            notes.append(f"LoRA adapter of {len(export.names) // 2} target module(s)")
        if export.merge:
            notes.append(f"LoRA merged into {len(export.merge)} weights")
        if export.keymap is not None:
            notes.append(f"on-disk format of {export.keymap.mapping}: "
                         + "; ".join(export.keymap.rules))  # fmt: skip
        has_config = any(name == "config.json" for _, name in model_files)
        if export.config is not None and not has_config:
            family = export.config["model_type"]
            notes.append(
                f"config.json made from the run's args ({family}); give the model's own with "
                "--config for everything else it sets"
            )
        if views is not None and not any(n != "config.json" for _, n in model_files):
            notes.append(views.NO_TOKENIZER)
        notes.extend(export.notes)
        if options.dtype is not None:
            notes.append(f"floating tensors cast to {options.dtype}; others kept as stored")
        # a --select'ed sub-tree is not a model; --key names the model's own state dict
        model = options.select is None or options.key is not None
        if not options.adapter and model and export.config is None:
            notes.extend(_weights_alone(src, out, options, misfit, has_config=has_config))
        return cls(
            src=src, out=out, options=options, manifest=manifest, model_files=model_files,
            tie=tie, export=export, started=started, notes=notes,
        )  # fmt: skip

    @property
    def source(self) -> Manifest:  # the manifest the plan's FQNs are in
        return self.export.manifest or self.manifest

    @property
    def copied(self) -> tuple[str, ...]:
        return tuple(name for _, name in self.model_files)

    @property
    def made(self) -> tuple[str, ...]:
        """The model files written from what the export made, not copied."""
        config = self.export.config is not None and "config.json" not in self.copied
        adapter = self.export.adapter_config is not None
        return ("config.json",) * config + (lora.ADAPTER_CONFIG_NAME,) * adapter

    def result(
        self, bytes_written: int, tied: tuple[tuple[str, str], ...] = ()
    ) -> ConsolidateResult:
        plan = self.export.plan
        return ConsolidateResult(
            src=self.src,
            out=self.out,
            layout=self.manifest.layout,
            plan=plan,
            tensors=sum(len(f.tensors) for f in plan.files),
            bytes_written=bytes_written,
            seconds=time.perf_counter() - self.started,
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            dry_run=self.options.dry_run,
            dtype=self.options.dtype,
            cast_tensors=sum(1 for t in plan.tensors if t.is_cast),
            workers=self.options.worker_count,
            dropped=self.export.dropped,
            tied=tied,
            config_files=self.copied + self.made,
            skipped_objects=len(self.manifest.objects),
            notes=tuple(self.notes) + tuple(self.manifest.notes),
        )

    def merge(self, tmp: str, name: str, merged: Collection[str] = ()) -> None:
        """Merge the LoRA adapter into the weights of the written file ``name`` (if any) that
        were not ``merged`` as they were written (:meth:`row_merges`)."""
        targets = [t for t in self.export.merge if t.name not in merged]
        if targets:
            (f,) = [f for f in self.export.plan.files if f.name == name]
            where = {t.name: t for t in f.tensors}
            lora.merge_into(storage.join(tmp, name), where, targets, self.source)

    def row_merges(self) -> dict[str, Any]:
        """The LoRA targets this process merges while writing them (each weight written once,
        already merged): those the executor writes in row blocks with this run's buffers."""
        if not self.export.merge:
            return {}
        block = block_bytes(self.options.memory_budget_bytes, self.options.worker_count)
        plans = {t.name: t for f in self.export.plan.files for t in f.tensors}
        fit = {n: p for n, p in plans.items() if in_row_blocks(p, block)}
        return lora.row_transforms(list(self.export.merge), fit, self.source)

    def finish(self, tmp: str) -> tuple[tuple[str, str], ...]:
        """After every byte is written: tied-weight check, model files, index (the marker,
        last); returns the pairs of tied weights written twice."""
        tied: list[tuple[str, str]] = []
        names, plan = self.export.names, self.export.plan
        if not self.tie:
            for o, i in self.export.candidates:
                same = same_storage(self.source, names[o], names[i])
                if same or same_written_bytes(tmp, plan, o, i):
                    tied.append((o, i))
            if tied:
                self.notes.append(
                    "tied weights written twice (no config sets tie_word_embeddings): "
                    + ", ".join(f"{a} = {b}" for a, b in tied)
                )
        dtype, drops = self.options.dtype, self.export.config_drops
        for path, name in self.model_files:
            if name == "config.json" and dtype is not None:  # the config states the new dtype
                cfg = model_config([(path, name)])
                assert cfg is not None
                # without what the decoders consumed (a quantized model's quantization_config)
                kept = {k: v for k, v in with_dtype(cfg, dtype).items() if k not in drops}
                written = (json.dumps(kept, indent=2) + "\n").encode()
                write_file_synced(storage.join(tmp, name), written)
            else:
                copy_into(path, storage.join(tmp, name))
        if self.export.config is not None and "config.json" not in self.copied:
            made_cfg = (
                self.export.config if dtype is None else with_dtype(self.export.config, dtype)
            )
            made = (json.dumps(made_cfg, indent=2) + "\n").encode()
            write_file_synced(storage.join(tmp, "config.json"), made)
        if self.export.adapter_config is not None:
            write_file_synced(storage.join(tmp, lora.ADAPTER_CONFIG_NAME),
                              lora.config_json(self.export.adapter_config))  # fmt: skip
        write_index(tmp, plan)
        return tuple(tied)

    def output(self, identity: str = "") -> Output:
        """Where this run writes (:mod:`ckptools.outputs.protocol`): OUT was checked before
        planning, on every rank."""
        overwrite = self.options.overwrite
        return Output(out=self.out, kind="model", overwrite=overwrite, what="consolidate",
                      src=self.src, identity=identity, checked=True)  # fmt: skip


def _write_resumable(run: _Run) -> tuple[int, tuple[tuple[str, str], ...]]:
    """This process writes everything into a staging directory that an interrupted run of the
    same conversion left (its complete files are kept), or a new one; then finishes."""
    plan, options, ranks = run.export.plan, run.options, Ranks()
    identity = fingerprint(
        "consolidate", run.manifest,
        {"files": [(f.name, f.size) for f in plan.files], "index": plan.index, "tie": run.tie,
         "copied": run.copied, "names": run.export.names},
    )  # fmt: skip
    output = run.output(identity)
    with staged(ranks, output, lambda tmp: reserve(tmp, plan.bytes_to_write)) as stage:
        tmp, done_files = stage.tmp, journal(ranks, output, stage)
        sizes = {f.name: f.size for f in plan.files}
        kept = {f.name for f in plan.files if done_files.is_done(f.name)}
        if kept:
            run.notes.append(
                f"resumed: {len(kept)} file(s) written by an interrupted run were kept"
            )

        transforms = run.row_merges()

        def done(name: str) -> None:  # merged before journaled: a resumed run never merges twice
            run.merge(tmp, name, merged=transforms)
            done_files.record(name, size=sizes[name])

        stats = execute(
            plan, run.source, tmp, workers=options.worker_count,
            memory_budget=options.memory_budget_bytes, quiet=options.quiet, skip=kept,
            on_file_done=done, transforms=transforms, decoders=run.export.decoders,
        )  # fmt: skip
        tied = commit(ranks, output, stage, lambda: run.finish(tmp))
    return stats.bytes_written, tied


def _write_distributed(ranks: Ranks, run: _Run) -> tuple[tuple[str, str], ...]:
    """Every rank copies its share of the chunks; rank 0 creates the files first and commits last.

    Called by every rank, in the same order (:mod:`ckptools.outputs.protocol`): rank 0 creates the
    temporary directory and every file (headers written, final sizes) and hands out its name;
    every rank copies the chunks of its byte share (:func:`ckptools.engine.executor.share_of`) and
    fsyncs; once all have, rank 0 merges LoRA weights and runs :meth:`_Run.finish` (model files,
    index last), then renames. On any rank's failure rank 0 removes the temporary directory and
    every rank raises.
    """
    plan, options, out = run.export.plan, run.options, run.out
    if storage.is_url(out):
        # Every rank decides alike, before any collective: an object cannot take byte ranges
        # written by several processes.
        raise UsageError(
            f"{out}: under torchrun the ranks write parts of shared files, which an object store "
            "cannot hold; consolidate into a local or shared directory, or run one process"
        )

    def fill(tmp: str) -> None:
        reserve(tmp, plan.bytes_to_write)
        create_files(plan, tmp)

    output = run.output()
    with staged(ranks, output, fill) as stage:
        tmp, share = stage.tmp, (ranks.rank, ranks.world_size)
        ranks.from_all(
            lambda: execute(plan, run.source, tmp, workers=options.worker_count,
                            memory_budget=options.memory_budget_bytes,
                            quiet=options.quiet or not ranks.is_root, share=share,
                            decoders=run.export.decoders),
            "consolidate",
        )  # fmt: skip

        def merge_then_finish() -> tuple[tuple[str, str], ...]:
            for f in plan.files:
                run.merge(tmp, f.name)
            return run.finish(tmp)

        return commit(ranks, output, stage, merge_then_finish)
