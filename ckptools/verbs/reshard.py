"""``ckptools.reshard`` and ``ckptools.shard``: any checkpoint → DCP laid out for N ranks.

``reshard`` rewrites a DCP checkpoint (and the DCP directories inside accelerate / Trainer /
Lightning / torchtitan layouts) as if FSDP2 ``fully_shard`` on N ranks had saved it: model,
optimizer state and every other entry, in one process, with bounded memory. A training
checkpoint that is not DCP (``torch.save`` files, DeepSpeed ZeRO checkpoints) becomes the DCP
that ``get_state_dict`` + ``dcp.save`` would have written, model and optimizer keyed by FQN
(:mod:`ckptools.plan.training`). ``shard`` is the way
back from a published model: a safetensors directory or ``torch.save`` file becomes a DCP
checkpoint whose keys sit under ``--prefix`` (``model.``, what ``dcp.save({"model": ...})``
writes), so training starts from it without any rank loading the whole model.

Per-rank state that cannot be split (RNG state files ``rng_state_<r>.pth`` /
``random_states_<r>.pkl``, torchtitan's ``dataloader.dp_rank_<r>`` entries) follows the
``rank_state`` policy: ``keep`` carries it over unchanged (ranks that did not exist before have
none, and the result lists what was kept), ``drop`` leaves it out. Either way it is reported.

The source is read once: its manifest gives each DCP directory as a part (with its own
manifest) and the files beside the data (``aux_files``), found in the layout's one walk; the
options are validated once (:class:`ReshardOptions`). Under torchrun it is read once per job,
by rank 0, which hands every other rank what writing its files needs (:func:`.carry_out`;
the writing: :mod:`ckptools.verbs.dcp_output`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from importlib import import_module
from typing import Any

from ckptools.core.keys import model_keys
from ckptools.core.manifest import MODEL_FILES_DIR, Manifest, Part
from ckptools.engine.converted import to_memory_names
from ckptools.errors import UsageError
from ckptools.formats.stream_transforms import require_decodable
from ckptools.io import storage
from ckptools.io.out_rules import check_out
from ckptools.io.staging import IN_PROGRESS
from ckptools.plan.dcp import Archived, DcpPlan, plan_dcp
from ckptools.plan.training import training_layout
from ckptools.producers import read_manifest
from ckptools.producers.base import layout_of
from ckptools.producers.optimizer_state import optimizer_alone
from ckptools.producers.registry import WRITE_TARGETS, write_targets
from ckptools.verbs.dcp_run import RankState, ReshardOptions, Run, carry_out
from ckptools.verbs.dcp_run import ReshardResult as ReshardResult
from ckptools.verify.checksums import CHECKSUM_FILE
from ckptools.views.export import select_tensors, suggested_optimizer_order, untied_head
from ckptools.views.model_config import config_misfit, fitting_model_files, model_config
from ckptools.views.producer import views_of

#: files a framework writes once per rank, which no resharding can split
RANK_STATE_FILES = re.compile(
    r"^((rng_state|random_states)_\d+\.(pth|pkl|pt)|extra_state_world_size_\d+_rank_\d+\.pt)$"
)  # verl's extra_state: each rank's RNG and LR scheduler state
#: object entries keyed by rank (torchtitan's dataloader state)
RANK_STATE_OBJECTS = re.compile(r"(^|\.)dp_rank_\d+$")
#: files that describe the source's own bytes (checksums, the training manager's commit marker)
#: formats that hold a model and nothing else: ``reshard`` (training state) sends them to
#: ``shard``; every other layout's format is a training checkpoint ``reshard`` takes, so a new
#: layout needs no change here
MODEL_ONLY_FORMATS = frozenset({"safetensors"})
#: what a model is published as: ``shard`` takes these
PUBLISHED_FORMATS = frozenset({"safetensors", "torch_save"})
_OWN_RECORDS = frozenset({CHECKSUM_FILE, ".ckptools-complete", IN_PROGRESS})


@storage.accepts_storage_options
def reshard(
    src: str,
    out: str,
    *,
    world_size: int,
    rank_state: RankState = "keep",
    overwrite: bool = False,
    dry_run: bool = False,
    workers: int | None = None,
    quiet: bool = False,
    format: str | None = None,
    distributed: bool = True,
    param_order: Sequence[str] | None = None,
    drop_optimizer: bool = False,
    config: str | None = None,
    storage_options: storage.StorageOptions | None = None,
) -> ReshardResult:
    """Rewrite the training checkpoint ``src`` into ``out`` as a DCP checkpoint laid out for
    ``world_size`` FSDP2 ranks.

    Args:
        src: a DCP directory, or the outer directory of accelerate / Trainer / Lightning /
            torchtitan layouts (each DCP directory inside is resharded, other files copied); or
            a producer's run or save whose names are not the model's, read as the Hugging Face
            model's training state by that producer's views (``as_training``:
            :mod:`ckptools.views.producer`; ``config`` gives the HF ``config.json``); a training
            checkpoint saved with ``torch.save`` (model and optimizer state dicts) or a
            DeepSpeed ZeRO checkpoint (fp32 masters and Adam moments; what FSDP2 has no place
            for, its loss scaler and LR scheduler, is named in the notes), written as
            ``get_state_dict`` + ``dcp.save`` lay them out (:mod:`ckptools.plan.training`).
        out: the new checkpoint directory (refused if it exists, unless ``overwrite``).
        world_size: ranks of the target layout.
        rank_state: ``"keep"`` or ``"drop"`` per-rank state that cannot be split (see module).
        param_order: for a ``torch.save`` optimizer keyed by integer ids that neither names its
            parameters nor has one group matching the model's: their FQNs, in optimizer order.
        drop_optimizer: write the model (and other values) without the optimizer state.
        config: the model's ``config.json`` (file or directory; default: the checkpoint's
            own): for an optimizer keyed by integer ids beside a ``model.safetensors`` (sorted
            by name) or a Trainer's two groups, the model it builds on ``meta`` gives the order.
        dry_run: plan only; write nothing.
        distributed: under torchrun, or called by every rank of an initialised process group,
            rank 0 alone reads ``src`` and plans, and the output files are split over the
            ranks (:func:`.carry_out`; every rank must call it); False: this process reads and
            writes everything alone.
        storage_options: fsspec options for URL paths (credentials, endpoint...), a mapping
            or its JSON text; see :func:`ckptools.io.storage.storage_options`.

    Example:
        >>> ckptools.reshard("ckpt/step-100", "ckpt16/step-100", world_size=16)  # doctest: +SKIP
    """
    options = ReshardOptions(
        world_size=world_size, rank_state=rank_state, overwrite=overwrite, dry_run=dry_run,
        workers=workers, quiet=quiet, format=format, distributed=distributed,
        param_order=None if param_order is None else tuple(param_order),
        drop_optimizer=drop_optimizer, config=config,
    )  # fmt: skip
    return carry_out("reshard", options, lambda: _planned_reshard(src, out, options))


def _planned_reshard(src: str, out: str, options: ReshardOptions) -> Run:
    """:func:`reshard`'s reading and planning (one process does it: see :func:`.carry_out`)."""
    manifest = _read_source(
        src, out, options, lambda format: format not in MODEL_ONLY_FORMATS,
        "is not a training checkpoint; use `ckpt shard` to make a DCP checkpoint from it",
    )  # fmt: skip
    views = views_of(manifest)
    if views is not None:
        # the HF model an FSDP2 job trains, as the producer's view gives it (masters, optimizer
        # state and groups under HF FQNs); the one rule consolidate finds its config by, and
        # the HF model the run became must be its model
        files, _ = fitting_model_files(
            src, options.config, None, manifest.details.get(MODEL_FILES_DIR),
            data_dir=manifest.data_dir(), quiet=options.quiet,
        )  # fmt: skip
        cfg = model_config(files)
        manifest = views.as_training(manifest, cfg, drop_optimizer=options.drop_optimizer)
        if cfg is not None:
            hf = {n: manifest.tensors[f].shape for n, f in select_tensors(manifest).items()}
            needed = views.CONFIG_NEEDED
            config_misfit(files, src, options.config, hf, needed=needed, quiet=options.quiet)
        return _planned_training_state(src, out, manifest, options)
    if manifest.format != "dcp":
        return _planned_training_state(src, out, manifest, options)
    plans, rank_items = _plan_parts(manifest, options)
    copied = tuple(_carried_files(manifest, options, rank_items))
    notes = list(manifest.notes)
    _note_rank_state(notes, manifest, options, rank_items)
    return Run(
        kind="reshard", src=src, out=out, options=options, parts=plans,
        source=manifest, source_root=manifest.root, copied=copied,
        rank_items=tuple(rank_items), notes=notes,
        # The source was protected by a checksum manifest: so is the result.
        checksums=CHECKSUM_FILE in manifest.aux_files,
        fingerprint_options={"rank_state": options.rank_state, "copied": copied},
    )  # fmt: skip


def _carried_files(manifest: Manifest, options: ReshardOptions, rank_items: list[str]) -> list[str]:
    """The files beside the data that a reshard copies into OUT, the same for every layout:
    each of the manifest's ``aux_files`` (scheduler, trainer state, config...) but ckptools'
    own records; per-rank state files (``random_states_<r>.pkl``) are added to ``rank_items``
    and copied only under ``rank_state="keep"``."""
    copied = []
    for name in manifest.aux_files:
        base = os.path.basename(name)
        if base in _OWN_RECORDS:
            continue  # ckptools' own records describe the source's bytes; rewritten, not copied
        if RANK_STATE_FILES.match(base):
            rank_items.append(name)
            if options.rank_state == "drop":
                continue
        copied.append(name)
    return copied


def _note_rank_state(
    notes: list[str], manifest: Manifest, options: ReshardOptions, rank_items: Sequence[str]
) -> None:
    if rank_items:
        ranks = f" written by {manifest.world_size} ranks" if manifest.world_size else ""
        notes.append(
            f"{len(rank_items)} per-rank state item(s){ranks} were "
            + ("kept unchanged" if options.rank_state == "keep" else "dropped")
            + " (--rank-state)"
        )


def _note_not_carried(notes: list[str], manifest: Manifest) -> None:
    """Name the files below a directory source that its layout neither read nor listed beside
    the data (DeepSpeed's zero_to_fp32.py, its other tags, a Trainer's files beside a ZeRO
    tag): nothing is left behind without a word. Its markers are replaced by OUT's own."""
    if not storage.isdir(manifest.root):
        return  # one file: a walk of the directory it sits in would name strangers
    known = {*manifest.files, *manifest.markers, *manifest.aux_files}
    left = sorted(
        rel
        for rel in (r.replace(os.sep, "/") for r in storage.walk_files(manifest.data_dir()))
        if rel not in known and not any(d.startswith(".") for d in rel.split("/")[:-1])
    )
    if left:
        shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        notes.append(f"{len(left)} file(s) of the source were not carried over: {shown}")


def _planned_training_state(src: str, out: str, manifest: Manifest, options: ReshardOptions) -> Run:
    """:func:`reshard`'s plan of a source that is not DCP: one DCP named as ``get_state_dict`` +
    ``dcp.save`` name it, from :func:`ckptools.plan.training.training_layout`."""
    suggested = (
        None
        if options.param_order or options.drop_optimizer
        else suggested_optimizer_order(manifest, options.config)
    )
    layout = training_layout(
        manifest,
        param_order=options.param_order,
        drop_optimizer=options.drop_optimizer,
        suggested_order=suggested,
    )
    plan = plan_dcp(
        manifest, options.world_size, layout.names, layout.paths, objects=[], values=layout.values
    )
    rank_items: list[str] = []
    copied = tuple(_carried_files(manifest, options, rank_items))
    notes = [*manifest.notes, *layout.notes]
    _note_rank_state(notes, manifest, options, rank_items)
    _note_not_carried(notes, manifest)
    return Run(
        kind="reshard", src=src, out=out, options=options, parts={"": (manifest, plan)},
        source=manifest, source_root=manifest.data_dir(), copied=copied,
        rank_items=tuple(rank_items), notes=notes,
        fingerprint_options={
            "param_order": list(options.param_order or ()),
            "drop_optimizer": options.drop_optimizer, "rank_state": options.rank_state,
            "copied": copied,
        },
    )  # fmt: skip


def _read_source(
    src: str, out: str, options: ReshardOptions, accepts: Callable[[str], bool], otherwise: str
) -> Manifest:
    """OUT checked (before anything is read), then the source's manifest (read once), refused
    unless its format ``accepts``."""
    # a dry run plans anyway, saying that OUT exists
    exists = check_out(
        out, kind="dcp", overwrite=options.overwrite, dry_run=options.dry_run, src=src
    )
    manifest = read_manifest(src, options.format)
    if not accepts(manifest.format):
        raise UsageError(f"{src}: a {manifest.format} checkpoint {otherwise}")
    layout = layout_of(manifest)
    if layout is not None and layout.decodes is not None:  # stored forms that are not tensors
        raise UsageError(
            f"{src}: a {layout.description}: an FSDP2 job's model holds plain tensors; write "
            f"the plain model first with `ckpt consolidate {src} plain_model --dtype bfloat16`"
            ", then shard that"
        )
    model = model_keys(manifest)
    placeholders = manifest.placeholders_only(model.values())
    if placeholders is not None:
        raise UsageError(placeholders)
    alone = optimizer_alone(manifest, model)  # no model to shard or to resume
    if alone is not None:
        raise UsageError(f"{manifest.root}: {alone}")
    return replace(manifest, notes=(*manifest.notes, *exists)) if exists else manifest


def _plan_parts(
    manifest: Manifest, options: ReshardOptions
) -> tuple[dict[str, tuple[Manifest, DcpPlan]], list[str]]:
    """Each DCP directory's manifest (read once, by the layout) and plan; and the per-rank
    object entries found (left out of the plans when ``rank_state`` is ``drop``)."""
    plans: dict[str, tuple[Manifest, DcpPlan]] = {}
    rank_items: list[str] = []
    for part in manifest.parts or (Part(subdir="", manifest=manifest),):
        sub, source = part.subdir, part.manifest
        objects = []
        for fqn in source.objects:
            if RANK_STATE_OBJECTS.search(fqn):
                rank_items.append(f"{sub + '/' if sub else ''}{fqn}")
                if options.rank_state == "drop":
                    continue
            objects.append(fqn)
        require_decodable(source, objects=objects)  # before any output exists
        decoded = _decoded_objects(source, objects)  # written as plain items
        plain = [fqn for fqn in objects if fqn not in decoded]
        paths = {fqn: source.paths.get(fqn, (fqn,)) for fqn in decoded}
        plan = plan_dcp(source, options.world_size, objects=plain, values=decoded, paths=paths)
        plans[sub] = (source, plan)
    return plans, rank_items


def _decoded_objects(source: Manifest, objects: Sequence[str]) -> dict[str, Archived]:
    """The non-tensor items of ``objects`` stored through stream transforms, decoded (bounded,
    :func:`ckptools.engine.reader.decoded_object`) and their records' CRCs checked: the output
    stores them plain, as it stores every tensor (small: step counters, RNG states)."""
    from ckptools.engine.checked_copy import check_object_item
    from ckptools.engine.reader import decoded_object
    from ckptools.engine.runtime import BLOCK_BYTES

    wanted = [fqn for fqn in objects if source.objects[fqn].transforms]
    if not wanted:
        return {}
    out: dict[str, Archived] = {}
    with storage.open_reader(source.data_dir()) as reader:
        for fqn in wanted:
            name, size = decoded_object(reader, source.objects[fqn])
            check_object_item(reader, name, 0, size, fqn, BLOCK_BYTES)
            out[fqn] = Archived(reader.read(name, 0, size))
    return out


@storage.accepts_storage_options
def shard(
    src: str,
    out: str,
    *,
    world_size: int,
    prefix: str = "model.",
    config: str | None = None,
    keep_stored_names: bool = False,
    overwrite: bool = False,
    dry_run: bool = False,
    workers: int | None = None,
    quiet: bool = False,
    format: str | None = None,
    distributed: bool = True,
    to: str = "dcp",
    make_vocab_size_divisible_by: int = 128,
    storage_options: storage.StorageOptions | None = None,
) -> ReshardResult:
    """Make a DCP checkpoint for ``world_size`` ranks from a full model.

    ``src`` is a Hugging Face safetensors directory or file, or a ``torch.save`` full state
    dict; each tensor ``name`` is stored as ``prefix + name`` (key path ``("model", name)`` for
    the default prefix), which is what ``dcp.load({"model": model_state_dict})`` reads.
    When the model's ``config.json`` (``config``, else beside ``src``) names a transformers
    conversion, the tensors are laid out as transformers holds them in memory (per-expert MoE
    tensors fused: :mod:`ckptools.plan.conversions`); ``keep_stored_names`` keeps ``src``'s
    names and shapes.
    Under torchrun the output files are split over the ranks, as :func:`reshard` does.

    ``to``: ``"dcp"``, or the name of a producer's layout instead (one of
    :func:`ckptools.producers.registry.write_targets`, planned by its writer:
    :func:`_planned_target`), which may pad the vocabulary to a multiple of
    ``make_vocab_size_divisible_by``.

    Example:
        >>> ckptools.shard("Llama-3-8B/", "ckpt/step-0", world_size=8)  # doctest: +SKIP
    """
    segments = prefix.split(".")
    if segments[-1] or not all(segments[:-1]):
        # each name is stored as prefix + name: "model" would write "modelmodel.embed...", which
        # no dcp.load({"model": sd}) finds
        raise UsageError(
            f"--prefix {prefix!r}: give a key path ending in '.' ('model.' is what "
            "dcp.save({'model': sd}) writes, 'app.model.' a nested one) or '' for none"
        )
    options = ReshardOptions(
        world_size=world_size, prefix=prefix, overwrite=overwrite, dry_run=dry_run,
        workers=workers, quiet=quiet, format=format, distributed=distributed,
    )  # fmt: skip
    if to not in write_targets():
        raise UsageError(f"--to {to!r}: choose {' or '.join(write_targets())}")
    if to not in WRITE_TARGETS:  # dcp: ckptools' own writer; the others are producers'
        return carry_out(
            "shard", options, lambda: _planned_shard(src, out, options, config, keep_stored_names)
        )
    writer = import_module(f"ckptools.producers.{WRITE_TARGETS[to]}")
    writer.check_options(make_vocab_size_divisible_by)
    return carry_out(
        "shard", options,
        lambda: _planned_target(writer, src, out, options, config, make_vocab_size_divisible_by),
    )  # fmt: skip


def _planned_shard(
    src: str, out: str, options: ReshardOptions, config: str | None, keep_stored_names: bool
) -> Run:
    """:func:`shard`'s reading and planning (one process does it: see :func:`.carry_out`)."""
    manifest = _read_source(
        src, out, options, lambda format: format in PUBLISHED_FORMATS,
        "is already sharded; use `ckpt reshard`",
    )  # fmt: skip
    prefix = options.prefix
    path = tuple(p for p in prefix.split(".") if p)
    # the model part: a torch.save training checkpoint's model only (`ckpt reshard` keeps the
    # rest); every tensor of a model directory, whose names are flat
    tensors = dict(model_keys(manifest))
    left = len(manifest.tensors) - len(tensors)
    source, keymap = manifest, None
    notes = list(manifest.notes)
    shapes = {n: manifest.tensors[f].shape for n, f in tensors.items()}
    cfg, misfit = _shard_config(src, config, shapes, manifest, quiet=options.quiet)
    notes += [misfit] if misfit is not None else []
    if not keep_stored_names:
        source, tensors, keymap = to_memory_names(manifest, tensors, cfg, quiet=options.quiet)
    head = untied_head(tensors, cfg)
    if head is not None:
        # the FSDP2 model's get_model_state_dict holds the tied head (one storage, two names):
        # dcp.load needs it, so it is written as the embedding's bytes under its own name
        tensors = {**tensors, head[0]: tensors[head[1]]}
    names = {f"{prefix}{name}": fqn for name, fqn in tensors.items()}
    paths = {f"{prefix}{name}": (*path, name) for name in tensors}
    plan = plan_dcp(source, options.world_size, names, paths, objects=[])
    if left:
        notes.append(
            f"{left} tensor(s) outside the model (optimizer state...) were not carried over; "
            "`ckpt reshard` keeps them"
        )
    if keymap is not None:
        notes.append(f"in-memory layout of {keymap.mapping}: " + "; ".join(keymap.rules))
    if head is not None:
        notes.append(
            f"{head[0]}: not stored in {src}, whose config ties it to {head[1]}: written as a "
            "copy of it, as the model's get_model_state_dict holds it"
        )
    if manifest.objects:
        notes.append(
            f"{len(manifest.objects)} non-tensor value(s) of the source were not carried over "
            f"(e.g. {next(iter(manifest.objects))!r})"
        )
    return Run(
        kind="shard", src=src, out=out, options=options, parts={"": (source, plan)},
        source=manifest, source_root=manifest.data_dir(), notes=notes,
        fingerprint_options={"prefix": prefix, "in_memory": keymap is not None},
    )  # fmt: skip


def _planned_target(
    writer: Any, src: str, out: str, options: ReshardOptions, config: str | None, divisor: int
) -> Run:
    """``shard --to NAME``'s reading and planning for a producer's writer (one process: see
    :func:`.carry_out`): the whole model at ``src``, its config found by the one rule, planned
    as the producer saves it (``writer.planned``), committed as one rename."""
    manifest = _read_source(
        src, out, options, lambda format: format in PUBLISHED_FORMATS, writer.REFUSED
    )
    tensors = dict(model_keys(manifest))
    shapes = {n: manifest.tensors[f].shape for n, f in tensors.items()}
    needed = writer.CONFIG_NEEDED
    files, _ = fitting_model_files(
        src, config, shapes, manifest.details.get(MODEL_FILES_DIR),
        data_dir=manifest.data_dir(), needed=needed, quiet=options.quiet,
    )  # fmt: skip
    cfg = model_config(files)
    if cfg is None:
        raise UsageError(
            f"{src}: no config.json beside it or above it: give the model's config with "
            f"--config ({needed})"
        )
    planned = writer.planned(manifest, tensors, cfg, src, options.world_size, divisor)
    return Run(
        kind="shard", src=src, out=out, options=options,
        parts={planned.sub: (planned.source, planned.plan)},
        source=manifest, source_root=manifest.data_dir(), notes=planned.notes,
        # the HF model's config (and tokenizer) in the run directory: what reads the run back
        # (consolidate, diff, reshard) finds the model it is by the one rule, as from the HF model
        made={**planned.made, **{n: storage.read_bounded(p, what="model file") for p, n in files}},
        fingerprint_options=planned.fingerprint_options,
    )  # fmt: skip


def _shard_config(
    src: str,
    config: str | None,
    shapes: Mapping[str, tuple[int, ...]] | None,
    manifest: Manifest,
    *,
    quiet: bool = False,
) -> tuple[dict[str, Any] | None, str | None]:
    """The model's config.json by the one rule every verb uses
    (:func:`ckptools.views.model_config.fitting_model_files`: ``config``, else beside ``src``
    then up to its run directory; used only where it fits ``shapes``), and the note of one that
    does not."""
    files, misfit = fitting_model_files(
        src, config, shapes, manifest.details.get(MODEL_FILES_DIR),
        data_dir=manifest.data_dir(), quiet=quiet,
    )  # fmt: skip
    return model_config(files), misfit
