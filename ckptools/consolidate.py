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
import os
import resource
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptools import collective, tunables
from ckptools.collective import Ranks
from ckptools.core import dtypes, keys
from ckptools.core.manifest import Manifest
from ckptools.core.sizes import parse_size
from ckptools.engine.converted import to_disk_names
from ckptools.engine.executor import (
    create_files,
    execute,
)
from ckptools.errors import UsageError
from ckptools.io import storage
from ckptools.io.resume import Journal, fingerprint
from ckptools.io.staging import (
    check_writable,
    commit,
    copy_into,
    discard,
    fsync_dir,
    make_tmp_dir,
    reserve,
    resumable_staging,
    write_file_synced,
)
from ckptools.layouts import read_manifest
from ckptools.plan.conversions import KeyMap
from ckptools.plan.safetensors import INDEX_NAME, ConsolidationPlan, TensorPlan, plan_consolidation

log = logging.getLogger(__name__)

#: transformers' own default for ``save_pretrained`` and what the Hub expects.
DEFAULT_MAX_SHARD_SIZE = "5GB"
#: Files beside a checkpoint that make a loadable model directory.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)
#: Output and input embedding names whose weights models tie (``tie_word_embeddings``).
_OUTPUT_EMBEDDINGS = ("lm_head.weight", "embed_out.weight", "output.weight")
_INPUT_EMBEDDINGS = (
    "embed_tokens.weight",
    "wte.weight",
    "word_embeddings.weight",
    "tok_embeddings.weight",
    "embed_in.weight",
)
# Block size for comparing two written tensors when looking for tied weights.
_COMPARE_BLOCK_BYTES = 4 * 2**20

CastDType = Literal["bfloat16", "float16", "float32"]


@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    """What goes into a model directory and how it is cut: the options :func:`consolidate` and
    :func:`ckptools.save_pretrained` share, validated once, on construction.

    Attributes:
        max_shard_size: largest output file, e.g. ``"5GB"``, ``"300KB"``, ``"2GiB"`` or bytes.
        dtype: cast floating tensors to this dtype (other tensors are kept as stored).
        select: export this key sub-tree instead of the model (see :func:`select_tensors`).
        strip_prefix: remove this prefix from output names.
        config: a ``config.json`` file or a directory with config and tokenizer files.
        overwrite: replace an existing output directory.
        keep_in_memory_names: write the in-memory form (fused experts), not the on-disk format.
        max_shard_bytes: ``max_shard_size`` in bytes (derived).

    Raises:
        UsageError: a bad size or dtype.
    """

    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE
    dtype: CastDType | None = None
    select: str | None = None
    strip_prefix: str | None = None
    config: str | None = None
    overwrite: bool = False
    keep_in_memory_names: bool = False
    max_shard_bytes: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_shard_bytes", parse_size(self.max_shard_size))
        if self.dtype is not None and (
            not dtypes.is_dtype_name(self.dtype) or not dtypes.dtype(self.dtype).is_floating
        ):
            raise UsageError(f"--dtype {self.dtype!r}: choose bfloat16, float16 or float32")


@dataclass(frozen=True, kw_only=True)
class ConsolidateOptions(ExportOptions):
    """Every option of :func:`consolidate` (the CLI's options have the same names).

    Attributes:
        dry_run: plan only; write nothing.
        workers: copy threads as given (None: :func:`ckptools.tunables.workers`).
        memory_budget: copy buffers as given (None: :func:`ckptools.tunables.memory_budget`).
        format: force the source layout instead of detecting it.
        quiet: no progress bar.
        distributed: split the copy over the ranks of a job (:mod:`ckptools.collective`).
        worker_count: the copy threads, resolved (derived).
        memory_budget_bytes: the copy buffers' bytes, resolved (derived).
    """

    dry_run: bool = False
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
        config_files: model files copied into OUT.
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


def select_tensors(
    manifest: Manifest, select: str | None = None, strip_prefix: str | None = None
) -> dict[str, str]:
    """Output name → stored FQN of the tensors to export.

    Args:
        manifest: the checkpoint.
        select: a dotted key path of a sub-tree (``"optim"``, ``"app.model"``,
            ``"model.model.layers.0"``) whose tensors to export with that path removed; ``"*"``
            exports every tensor under its full path. Default: the model part
            (:func:`ckptools.core.keys.find_model_part`). Either way wrapper segments are removed
            as :func:`ckptools.core.keys.own_names` says.
        strip_prefix: removed from the start of every output name that has it.

    Raises:
        UsageError: nothing matches, or two stored tensors would get the same name.
    """
    out: dict[str, str] = {}
    if select is None:
        out = dict(keys.model_keys(manifest))
    else:
        sel = select.strip(".")
        chosen: dict[str, str] = {}  # stored FQN -> its key path below the selection
        for fqn in manifest.tensors:
            joined = ".".join(keys.key_path(manifest, fqn))
            if sel in ("", "*"):
                chosen[fqn] = joined
            elif joined.startswith(sel + "."):
                chosen[fqn] = joined[len(sel) + 1 :]
        for name, fqn in zip(keys.own_names(list(chosen.values())), chosen, strict=True):
            if name in out:
                raise UsageError(
                    f"--select {select!r}: {out[name]!r} and {fqn!r} would both be written as "
                    f"{name!r}; select a narrower sub-tree"
                )
            out[name] = fqn
    if strip_prefix:
        renamed: dict[str, str] = {}
        for name, fqn in out.items():
            new = name[len(strip_prefix) :] if name.startswith(strip_prefix) else name
            if not new or new in renamed:
                raise UsageError(f"--strip-prefix {strip_prefix!r} makes {name!r} collide or empty")
            renamed[new] = fqn
        out = renamed
    if not out:
        tops = sorted({keys.key_path(manifest, f)[0] for f in manifest.tensors})
        raise UsageError(
            f"{manifest.root}: no tensors selected"
            + (f" by --select {select!r}" if select is not None else "")
            + f"; top-level keys with tensors: {', '.join(tops) or '(none)'}"
        )
    return out


def _config_dir_files(directory: str) -> list[str]:
    present = storage.file_sizes(directory, MODEL_FILES)  # one listing on an object store
    return [n for n in MODEL_FILES if n in present]


def _copied_from(directory: str, names: list[str]) -> list[tuple[str, str]]:
    """``(path, name)`` of the model files ``names`` in ``directory``, each checked to lie inside
    it: a ``config.json`` that is a link to a file elsewhere would copy that file into OUT."""
    return [(storage.contained(directory, n, named_by=directory, entry="holds"), n) for n in names]


def find_model_files(src: str, config: str | None) -> list[tuple[str, str]]:
    """``(source path, name in OUT)`` of the config and tokenizer files to copy.

    ``config`` may be a ``config.json`` file (copied alone) or a directory; by default the
    checkpoint directory, then its parent, are searched, and the first holding ``config.json``
    is used. A file of a directory must lie inside it (:func:`ckptools.io.storage.contained`).

    Raises:
        UsageError: ``config`` names nothing usable.
        OutsideCheckpointError: a model file is a link leading outside its directory.
    """
    if config is not None:
        if storage.isfile(config):
            return [(config, "config.json")]
        if storage.isdir(config):
            found = _config_dir_files(config)
            if not found:
                raise UsageError(
                    f"--config {config}: directory holds none of {', '.join(MODEL_FILES[:3])}..."
                )
            return _copied_from(config, found)
        raise UsageError(f"--config {config}: no such file or directory")
    if storage.is_url(src):
        here = src.rstrip("/") if storage.isdir(src) else storage.dirname(src)
        parent = storage.dirname(here)
    else:
        here = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
        parent = os.path.dirname(os.path.abspath(here))
    for directory in (here, parent):
        found = _config_dir_files(directory)
        if "config.json" in found:
            return _copied_from(directory, found)
    return []


def model_config(files: list[tuple[str, str]]) -> dict[str, Any] | None:
    """The ``config.json`` among ``files`` (:func:`find_model_files`), read, or None."""
    for path, name in files:
        if name == "config.json":
            try:
                cfg = json.loads(storage.read_bytes(path))
            except (OSError, ValueError) as e:
                raise UsageError(f"{path}: cannot read the model config: {e}") from e
            if not isinstance(cfg, dict):
                raise UsageError(f"{path}: the model config is not a JSON object")
            return cfg
    return None


def tie_setting(files: list[tuple[str, str]]) -> bool | None:
    cfg = model_config(files)
    if cfg is None:
        return None
    value = cfg.get("tie_word_embeddings")
    if value is None and isinstance(cfg.get("text_config"), dict):
        value = cfg["text_config"].get("tie_word_embeddings")
    return None if value is None else bool(value)


def tied_candidates(names: Mapping[str, str], manifest: Manifest) -> list[tuple[str, str]]:
    """``(output embedding, input embedding)`` name pairs that a model may tie.

    Pairs must have the same dtype and shape; the output embedding comes first.
    """
    outs = [n for n in names if n.endswith(_OUTPUT_EMBEDDINGS) or n in ("output.weight",)]
    ins = [n for n in names if n.endswith(_INPUT_EMBEDDINGS)]
    pairs = []
    for o in outs:
        for i in ins:
            a, b = manifest.tensors[names[o]], manifest.tensors[names[i]]
            if a.dtype == b.dtype and a.shape == b.shape:
                pairs.append((o, i))
    return pairs


def _same_storage(manifest: Manifest, a: str, b: str) -> bool:
    ca, cb = manifest.tensors[a].chunks, manifest.tensors[b].chunks
    return len(ca) == len(cb) and all(
        (x.file, x.offset, x.encoding) == (y.file, y.offset, y.encoding)
        for x, y in zip(ca, cb, strict=True)
    )


def _same_written_bytes(out_dir: str, plan: ConsolidationPlan, a: str, b: str) -> bool:
    where: dict[str, tuple[str, TensorPlan]] = {}
    for f in plan.files:
        for t in f.tensors:
            if t.name in (a, b):
                where[t.name] = (f.name, t)
    (pa, ta), (pb, tb) = where[a], where[b]
    if ta.nbytes != tb.nbytes:
        return False
    # out_dir is a local directory, or the object-store prefix the files were uploaded to
    with storage.open_reader(out_dir) as reader:
        done = 0
        while done < ta.nbytes:
            n = min(_COMPARE_BLOCK_BYTES, ta.nbytes - done)
            if reader.read(pa, ta.begin + done, n) != reader.read(pb, tb.begin + done, n):
                return False
            done += n
    return True


@dataclass(frozen=True)
class Export:
    """What a model directory gets: the plan, and how the tensors were chosen.

    Attributes:
        names: output name → stored FQN of the tensors written.
        dropped: ``(dropped, kept)`` tied weights left out (the config ties them).
        candidates: ``(output, input)`` embedding pairs a model may tie (:func:`tied_candidates`).
        plan: the files and their tensors.
    """

    names: dict[str, str]
    dropped: tuple[tuple[str, str], ...]
    candidates: tuple[tuple[str, str], ...]
    plan: ConsolidationPlan
    manifest: Manifest | None = None  # the plan's FQNs' manifest when a conversion added entries
    keymap: KeyMap | None = None  # the conversion applied (ckptools.plan.conversions), if any


def plan_export(
    manifest: Manifest,
    options: ExportOptions,
    tie: bool | None,
    config: Mapping[str, Any] | None = None,
    *,
    boxes_only: bool = False,
) -> Export:
    """Choose the tensors to write and plan the files: the one front half of :func:`consolidate`
    and :func:`ckptools.save_pretrained`, so that both write the same directory.

    Args:
        manifest: the checkpoint (or, for ``save_pretrained``, what ``dcp.save`` would write).
        options: selection, shard size and dtype.
        tie: the config's ``tie_word_embeddings`` (:func:`tie_setting`); when true the output
            embedding is left out, as transformers re-ties it to the input embedding on load.
        config: the model's ``config.json``: names are converted to the on-disk format
            (:func:`ckptools.engine.converted.to_disk_names`) unless
            ``options.keep_in_memory_names``; ``boxes_only`` for a manifest without bytes.
    """
    names = select_tensors(manifest, options.select, options.strip_prefix)
    keymap = None
    if config is not None and not options.keep_in_memory_names:
        check = not (isinstance(options, ConsolidateOptions) and options.dry_run)
        manifest, names, keymap = to_disk_names(manifest, names, config, boxes_only=boxes_only,
                                                check=check)  # fmt: skip
    candidates = tuple(tied_candidates(names, manifest))
    dropped: list[tuple[str, str]] = []
    if tie:
        for o, i in candidates:
            if o in names:
                dropped.append((o, i))
                del names[o]
    plan = plan_consolidation(
        manifest, names, max_shard_size=options.max_shard_bytes, dtype=options.dtype
    )
    return Export(
        names=names, dropped=tuple(dropped), candidates=candidates, plan=plan,
        manifest=manifest, keymap=keymap,
    )  # fmt: skip


def write_index(directory: str, plan: ConsolidationPlan) -> None:
    """Write the index of a sharded model directory, durably (nothing for a single file).

    The index commits a sharded model directory: call it last, after every shard is written.
    """
    if plan.index is not None:
        index = (json.dumps(plan.index, indent=2) + "\n").encode()
        write_file_synced(storage.join(directory, INDEX_NAME), index)


@storage.accepts_storage_options
def consolidate(
    src: str,
    out: str,
    *,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    dtype: CastDType | None = None,
    select: str | None = None,
    strip_prefix: str | None = None,
    config: str | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    workers: int | None = None,
    memory_budget: str | int | None = None,
    format: str | None = None,
    quiet: bool = False,
    distributed: bool = True,
    keep_in_memory_names: bool = False,
    storage_options: storage.StorageOptions | None = None,
) -> ConsolidateResult:
    """Write the checkpoint at ``src`` as a Hugging Face safetensors model directory ``out``.

    Bit-exact unless ``dtype`` is given: every tensor keeps its stored dtype and bytes. Writes
    ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` files and
    ``model.safetensors.index.json`` when the model is larger than ``max_shard_size``; copies
    ``config.json`` and tokenizer files from ``config`` or from beside the checkpoint. The
    directory appears atomically: files go to ``<out>.tmp-<id>/``, the index is written last,
    then the directory is renamed; any failure (including Ctrl-C) removes the temporary directory.

    Args:
        src: a checkpoint in any layout :func:`ckptools.read_manifest` reads.
        out: the model directory to create.
        max_shard_size: largest output file, e.g. ``"5GB"``, ``"300KB"``, ``"2GiB"`` or bytes.
        dtype: cast floating tensors to this dtype (other tensors are kept as stored).
        select: export this key sub-tree instead of the model (see :func:`select_tensors`).
        strip_prefix: remove this prefix from output names.
        config: a ``config.json`` file or a directory with config and tokenizer files.
        overwrite: replace an existing ``out``.
        dry_run: plan only; write nothing.
        workers: copy threads (default ``CKPTOOLS_WORKERS``, else up to 4).
        memory_budget: bytes of copy buffers (default ``CKPTOOLS_MEMORY_BUDGET`` or 256 MiB).
        format: force the source layout instead of detecting it.
        quiet: no progress bar.
        distributed: under torchrun, or called by every rank of an initialised process group,
            split the copy over the ranks (:mod:`ckptools.collective`; every rank must call it);
            False: this process writes everything alone.
        keep_in_memory_names: keep the in-memory names, not save_pretrained's on-disk format.
        storage_options: fsspec options for URL paths (credentials, endpoint...), a mapping
            or its JSON text; see :func:`ckptools.io.storage.storage_options`.

    Returns:
        A :class:`ConsolidateResult`; ``to_dict()`` gives plain JSON-able data.

    Raises:
        UsageError: ``out`` exists (without ``overwrite``), a bad size, selection or config.
        CkptError: the checkpoint is missing, damaged, unsafe or unsupported.

    Example:
        >>> import ckptools
        >>> r = ckptools.consolidate("checkpoints/step-1000", "hf_model")  # doctest: +SKIP
        >>> r.to_dict()["files"]  # doctest: +SKIP
        [{'name': 'model.safetensors', 'bytes': 2013265992, 'tensors': 201}]
    """
    started = time.perf_counter()
    options = ConsolidateOptions(
        max_shard_size=max_shard_size, dtype=dtype, select=select, strip_prefix=strip_prefix,
        config=config, overwrite=overwrite, dry_run=dry_run, workers=workers,
        memory_budget=memory_budget, format=format, quiet=quiet, distributed=distributed,
        keep_in_memory_names=keep_in_memory_names,
    )  # fmt: skip
    out = out.rstrip("/") or out
    check_writable(out, options.overwrite, src=src, inside_src=True)  # e.g. checkpoint-N/hf
    run = _Run.planned(src, out, options, started)
    if options.dry_run:
        return run.result(0)
    ranks = collective.current(options.distributed)
    if ranks.world_size > 1:
        run.notes.append(f"written by {ranks.world_size} ranks")
        tied = _write_distributed(ranks, run)
        return run.result(run.export.plan.bytes_to_write, tied)
    written, tied = _write_resumable(run)
    return run.result(written, tied)


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
        manifest = read_manifest(src, options.format)
        model_files = find_model_files(src, options.config)
        tie = tie_setting(model_files)
        export = plan_export(manifest, options, tie, model_config(model_files))
        notes = []
        if export.keymap is not None:
            notes.append(f"on-disk format of {export.keymap.mapping}: "
                         + "; ".join(export.keymap.rules))  # fmt: skip
        if options.dtype is not None:
            notes.append(f"floating tensors cast to {options.dtype}; others kept as stored")
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
            config_files=self.copied,
            skipped_objects=len(self.manifest.objects),
            notes=tuple(self.notes) + tuple(self.manifest.notes),
        )

    def finish(self, tmp: str) -> tuple[tuple[str, str], ...]:
        """After every byte is written: tied-weight check, model files, index, rename."""
        tied: list[tuple[str, str]] = []
        names, plan = self.export.names, self.export.plan
        if not self.tie:
            for o, i in self.export.candidates:
                same = _same_storage(self.source, names[o], names[i])
                if same or _same_written_bytes(tmp, plan, o, i):
                    tied.append((o, i))
            if tied:
                self.notes.append(
                    "tied weights written twice (no config sets tie_word_embeddings): "
                    + ", ".join(f"{a} = {b}" for a, b in tied)
                )
        for path, name in self.model_files:
            copy_into(path, storage.join(tmp, name))
        write_index(tmp, plan)
        fsync_dir(tmp)
        commit(tmp, self.out, self.options.overwrite)
        return tuple(tied)


def _write_resumable(run: _Run) -> tuple[int, tuple[tuple[str, str], ...]]:
    """This process writes everything into a staging directory that an interrupted run of the
    same conversion left (its complete files are kept), or a new one; then finishes."""
    plan, options = run.export.plan, run.options
    identity = fingerprint(
        "consolidate", run.manifest,
        {"files": [(f.name, f.size) for f in plan.files], "index": plan.index, "tie": run.tie,
         "copied": run.copied, "names": run.export.names},
    )  # fmt: skip
    tmp = resumable_staging(run.out, identity)
    try:
        reserve(tmp, plan.bytes_to_write)  # before a byte is written: enough free space?
        journal = Journal.open(tmp, identity)
        sizes = {f.name: f.size for f in plan.files}
        kept = {f.name for f in plan.files if journal.is_done(f.name)}
        if kept:
            run.notes.append(
                f"resumed: {len(kept)} file(s) written by an interrupted run were kept"
            )
        stats = execute(
            plan, run.source, tmp, workers=options.worker_count,
            memory_budget=options.memory_budget_bytes, quiet=options.quiet, skip=kept,
            on_file_done=lambda name: journal.record(name, size=sizes[name]),
        )  # fmt: skip
        journal.discard()  # never part of the model directory
        tied = run.finish(tmp)
    except BaseException as e:
        discard(tmp, e)
        raise
    return stats.bytes_written, tied


def _write_distributed(ranks: Ranks, run: _Run) -> tuple[tuple[str, str], ...]:
    """Every rank copies its share of the chunks; rank 0 creates the files first and commits last.

    Called by every rank, in the same order (:mod:`ckptools.collective`): rank 0 creates the
    temporary directory and every file (headers written, final sizes) and hands out its name;
    every rank copies the chunks of its byte share (:func:`ckptools.engine.executor.share_of`) and
    fsyncs; once all have, rank 0 runs :meth:`_Run.finish` (model files, index last, rename). On
    any rank's failure rank 0 removes the temporary directory and every rank raises.
    """
    plan, options, out = run.export.plan, run.options, run.out
    if storage.is_url(out):
        # Every rank decides alike, before any collective: an object cannot take byte ranges
        # written by several processes.
        raise UsageError(
            f"{out}: under torchrun the ranks write parts of shared files, which an object store "
            "cannot hold; consolidate into a local or shared directory, or run one process"
        )

    def prepare() -> str:
        check_writable(out, options.overwrite, src=run.src, inside_src=True)
        made = make_tmp_dir(out)
        try:
            reserve(made, plan.bytes_to_write)
            create_files(plan, made)
        except BaseException:
            discard(made)
            raise
        return made

    with ranks.staged(prepare, discard, "consolidate") as tmp:
        share = (ranks.rank, ranks.world_size)
        ranks.from_all(
            lambda: execute(plan, run.source, tmp, workers=options.worker_count,
                            memory_budget=options.memory_budget_bytes,
                            quiet=options.quiet or not ranks.is_root, share=share),
            "consolidate",
        )  # fmt: skip
        return ranks.from_root(lambda: run.finish(tmp), "consolidate")
