"""DeepSpeed ZeRO 1/2/3 checkpoints, described as a manifest without DeepSpeed (torch-free).

The fp32 master weights are the training truth (the 16-bit ``module`` in the model states is a
cast of them), so every trainable parameter's chunks point into the rank optimizer files' master
partitions; the files themselves are decoded by :mod:`ckptools.producers.deepspeed.files`,
and the parameters read from them by :mod:`ckptools.producers.deepspeed.partitions`.

**Where a parameter lies** is computed in :mod:`ckptools.core.flat_ranges`
(ZeRO's flattening and padding, and a flat range of a parameter as boxes of its shape), so
every chunk is a box of the global shape as for DCP, pointing at a byte range of a rank file.

**What else is there**, as ``zero_to_fp32`` takes it: buffers from the 16-bit module (kept in
their saved dtype, where ``zero_to_fp32`` turns them into fp32), frozen parameters from
``frozen_param_fragments`` (whole for stages 1/2, per-rank flat pieces for stage 3), tied or
shared parameters (``shared_params``: alias -> source) as a second entry on the source's
chunks. Stages 1/2 with frozen parameters DeepSpeed did not list (its bf16 stage 1) take them
from the 16-bit module, which holds them whole; ``zero_to_fp32`` leaves them out.

**The optimizer** is read into a side table in ``details["deepspeed"]`` (:class:`ZeroState`):
``exp_avg``/``exp_avg_sq`` as entries with the master's shape and chunks (the moments are
partitioned exactly as the masters), each group's ``step`` counter, torch's ``param_groups``
and what does not carry over (the loss scaler, a DeepSpeed LR scheduler); and named in the
manifest as a torch optimizer ``state_dict()`` keyed by FQN under ``optimizer``
(:mod:`ckptools.producers.deepspeed.optimizer`), which is how ``reshard`` finds it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ckptools.core.manifest import Manifest, TensorEntry
from ckptools.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
)
from ckptools.formats import safe_pickle
from ckptools.io import storage
from ckptools.io.storage import open_reader
from ckptools.producers.base import NumberedSaves, register
from ckptools.producers.deepspeed import TAG_SAVE
from ckptools.producers.deepspeed import files as dsf
from ckptools.producers.deepspeed.optimizer import ZeroState, optimizer_tree
from ckptools.producers.deepspeed.partitions import Reading, read_zero3, read_zero12
from ckptools.producers.probing import DirectoryLayout
from ckptools.producers.run_dirs import directory_names, newest_numbered

#: at most this many ranks are described one by one in the manifest's notes
_NOTED_RANKS = 16


def _stage_files(tag_dir: str, sizes: Mapping[str, int]) -> tuple[dict[int, str], dict[int, str]]:
    """Rank -> optimizer file name, rank -> stage-3 model-states file name."""
    optim: dict[int, str] = {}
    model3: dict[int, str] = {}
    for name in sorted(sizes):
        if name.startswith("layer_") and name.endswith("model_states.pt"):
            raise UnsupportedCheckpointError(
                f"{storage.join(tag_dir, name)}: a pipeline-parallel checkpoint (per-layer model "
                "states); ckptools reads data-parallel ZeRO checkpoints",
                path=tag_dir,
            )
        for pattern, found in ((dsf.OPTIM_RE, optim), (dsf.MODEL_RE, model3)):
            m = pattern.match(name)
            if m is None:
                continue
            rank, mp = int(m[1]), int(m[2])
            if mp:
                raise UnsupportedCheckpointError(
                    f"{storage.join(tag_dir, name)}: model-parallel rank {mp}: ckptools reads "
                    "data-parallel ZeRO checkpoints (mp_rank_00 only); merge tensor-parallel "
                    "shards with DeepSpeed's ds_to_universal first",
                    path=tag_dir,
                )
            if rank in found:
                raise CorruptCheckpointError(
                    f"{tag_dir}: two files for rank {rank}: {found[rank]} and {name}",
                    path=tag_dir,
                    rank=rank,
                )
            found[rank] = name
    return optim, model3


def _world_size(f: dsf.ArchiveFile) -> tuple[int, int]:
    """(stage, world size) from a rank file's ``zero_stage`` and ``partition_count``."""
    stage = f.get("optimizer_state_dict", "zero_stage")
    count = f.get("optimizer_state_dict", "partition_count")
    if type(stage) is not int or stage not in (1, 2, 3):
        raise UnsupportedCheckpointError(
            f"{f.path}: ZeRO stage {safe_pickle.short(stage)}; ckptools reads stages 1, 2 and 3",
            path=f.path,
        )
    counts = count if isinstance(count, list) else [count]
    if not counts or not all(type(c) is int and c > 0 for c in counts):
        raise CorruptCheckpointError(
            f"{f.path}: partition_count {safe_pickle.short(count)} is no world size", path=f.path
        )
    if len(set(counts)) > 1:
        raise UnsupportedCheckpointError(
            f"{f.path}: param groups partitioned over {sorted(set(counts))} ranks (expert "
            "parallelism); ckptools reads checkpoints whose groups share one data-parallel world",
            path=f.path,
        )
    return stage, counts[0]


def save_lacks(tag_dir: str) -> str | None:
    """What the save (tag directory) ``tag_dir`` lacks to be read, or None when it is whole:
    the check :func:`read_deepspeed` makes before reading any tensor (every rank's optimizer
    file for the world size its first one records, and the model states), so ``ckpt list`` and
    reading the run directory agree. Reads one rank file's pickle, no tensor data.
    """
    try:
        sizes = storage.file_sizes(tag_dir)
        optim, model3 = _stage_files(tag_dir, sizes)
        if not optim:
            return "no *_optim_states.pt rank files"
        low = min(optim)
        with open_reader(tag_dir) as reader:
            stage, world = _world_size(dsf.open_file(reader, optim[low], sizes[optim[low]]))
    except (CorruptCheckpointError, UnsupportedCheckpointError, OSError) as e:
        return f"unreadable: {e}"
    absent = [r for r in range(world) if r not in optim]
    if absent:
        return f"rank {absent[0]}'s optimizer file is missing ({world} ranks wrote it)"
    stray = sorted(r for r in optim if r >= world)
    if stray:
        return f"optimizer files of ranks {stray}, beyond its {world} ranks"
    if stage <= 2 and dsf.MODEL_STATES not in sizes:
        return f"no {dsf.MODEL_STATES}"
    absent = [r for r in range(world) if r not in model3] if stage == 3 else []
    if absent:
        return f"rank {absent[0]}'s model states file is missing"
    return None


def save_ranks(tag_dir: str) -> int | None:
    """How many ranks wrote the save ``tag_dir``, from its file names (one optimizer file a
    rank): what ``ckpt list`` shows without opening one."""
    names = directory_names(tag_dir) or ()
    count = sum(1 for n in names if dsf.OPTIM_RE.match(n))
    return count or None


def read_run(path: str) -> Manifest:
    """A run directory or tag directory (:func:`read_deepspeed`); when the save ``latest`` names
    is not whole (a rank's file missing: the job died while saving), the newest whole
    ``global_stepN`` instead, with a note saying so (what ``ckpt list`` marks latest)."""
    try:
        return read_deepspeed(path)
    except CheckpointNotFoundError as e:
        names = set(directory_names(path) or ())
        if dsf.LATEST not in names:
            raise
        tag_rel, tag, _ = dsf.find_tag(path, names)
        tag_dir = storage.join(path, tag_rel)
        lacks = save_lacks(tag_dir) if storage.isdir(tag_dir) else "no such directory"
        if lacks is None:
            raise
        try:
            found = newest_numbered(path, TAG_SAVE, lambda p: save_lacks(p) is None, lacks)
        except IncompleteCheckpointError:
            found = None
        if found is None or found.name == tag:
            raise e from None
        inner = storage.contained(path, found.name, named_by=path, entry="holds")
        manifest = found.noted(read_deepspeed(inner))
        note = f"{storage.join(path, dsf.LATEST)} names {tag}, which is not whole ({lacks})"
        return replace(manifest, notes=(*manifest.notes, note))


def read_deepspeed(path: str) -> Manifest:
    """Manifest of a ZeRO checkpoint: a run directory (``latest`` names the tag) or a tag
    directory itself (how another tag is chosen).

    Raises:
        CheckpointNotFoundError: no rank files, or a rank's file (or model states) is missing.
        CorruptCheckpointError: a file is cut short or does not add up (see the module doc).
        UnsafeCheckpointError: a pickle names a class outside the allowlist.
        UnsupportedCheckpointError: tensor/pipeline or expert parallelism, an unknown stage.
    """
    names = set(storage.listdir(path))
    tag_rel, tag, latest = dsf.find_tag(path, names)
    tag_dir = storage.join(path, tag_rel) if tag_rel else path
    if not storage.isdir(tag_dir):
        raise CheckpointNotFoundError(
            f"{storage.join(path, dsf.LATEST)}: names tag {tag!r}, but {tag_dir} is no "
            "directory (pass the directory of the tag to read instead)",
            path=tag_dir,
        )
    sizes = storage.file_sizes(tag_dir)
    optim, model3 = _stage_files(tag_dir, sizes)
    if not optim:
        raise CheckpointNotFoundError(
            f"{tag_dir}: no *_optim_states.pt files: ZeRO writes one per rank", path=tag_dir
        )
    with open_reader(path) as reader:
        rd = Reading(path, tag_rel, tag, reader)
        low = min(optim)
        first = rd.open(optim[low], sizes[optim[low]], low)
        stage, world = _world_size(first)
        absent = [r for r in range(world) if r not in optim]
        stray = sorted(r for r in optim if r >= world)
        if absent or stray:
            raise CheckpointNotFoundError(
                f"{tag_dir}: {world} ranks wrote this checkpoint (partition_count) but "
                + (
                    f"rank {absent[0]}'s optimizer file is missing"
                    if absent
                    else f"there are files of ranks {stray}"
                )
                + f" ({len(optim)} *_optim_states.pt files): a rank did not finish saving, or "
                "files of another save are mixed in",
                path=tag_dir,
                rank=(absent or stray)[0],
            )
        files = {
            r: first if r == low else rd.open(optim[r], sizes[optim[r]], r) for r in range(world)
        }
        if stage <= 2:
            if dsf.MODEL_STATES not in sizes:
                raise CheckpointNotFoundError(
                    f"{storage.join(tag_dir, dsf.MODEL_STATES)}: model states file is missing",
                    path=tag_dir,
                )
            model = rd.open(dsf.MODEL_STATES, sizes[dsf.MODEL_STATES], None)
            models = {0: model}
            entries, side = read_zero12(rd, files, model, world)
        else:
            absent = [r for r in range(world) if r not in model3]
            if absent:
                raise CheckpointNotFoundError(
                    f"{tag_dir}: rank {absent[0]}'s model states file "
                    f"(zero_pp_rank_{absent[0]}_mp_rank_00_model_states.pt) is missing",
                    path=tag_dir,
                    rank=absent[0],
                )
            models = {r: rd.open(model3[r], sizes[model3[r]], r) for r in range(world)}
            entries, side = read_zero3(rd, files, models, world)
        tensors = _assemble(rd, models[0], entries, stage)
        state = ZeroState(
            stage=stage,
            tag=tag,
            ds_version=_plain_str(first.obj.get("ds_version")),
            exp_avg=side.get("exp_avg", {}),
            exp_avg_sq=side.get("exp_avg_sq", {}),
            step=side.get("step", {}),
            group_of=side.get("group_of", {}),
            param_groups=side.get("param_groups", ()),
            not_carried=_not_carried(first, models[0]),
        )
        _describe(rd, state, files, models[0], tensors, world)
    optimizer, objects, paths = optimizer_tree(path, state)
    return Manifest(
        root=path,
        format="deepspeed",
        layout="deepspeed",
        tensors={**tensors, **optimizer},
        objects=objects,
        files=rd.files,
        world_size=world,
        paths=paths,
        markers=(dsf.LATEST,) if tag is not None else (),
        marker_digests={dsf.LATEST: dsf.content_digest(latest, rd.opened)} if tag else {},
        notes=tuple(rd.notes),
        details={"deepspeed": state},
        data_root=path,
    )


def _plain_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _assemble(
    rd: Reading, model: dsf.ArchiveFile, entries: dict[str, TensorEntry], stage: int
) -> dict[str, TensorEntry]:
    """Buffers, shared parameters and what the module alone holds, in the module's order."""
    module = rd.module(model)
    raw_buffers = model.obj.get("buffer_names")
    buffers = (
        [b for b in raw_buffers if isinstance(b, str)] if isinstance(raw_buffers, list) else []
    )
    for name in buffers:
        if name in module:
            entries[name] = rd.whole(model, name, module[name], f"module[{name!r}]")
    shared = model.obj.get("shared_params") or {}
    if isinstance(shared, dict):
        for alias, source in shared.items():
            src = entries.get(source) if isinstance(source, str) else None
            if isinstance(alias, str) and src is not None:
                entries[alias] = TensorEntry(alias, src.dtype, src.shape, src.chunks)
    from_module, unsaved = [], []
    for name, ref in module.items():
        if name in entries or not isinstance(name, str):
            continue
        if stage <= 2 and isinstance(ref, safe_pickle.TensorRef) and all(ref.shape):
            entries[name] = rd.whole(model, name, ref, f"module[{name!r}]")
            from_module.append(name)
        else:
            unsaved.append(name)
    if from_module:
        rd.notes.append(
            f"taken from the 16-bit module (not among ZeRO's trainable or frozen parameters, "
            f"so zero_to_fp32 leaves them out): {', '.join(from_module)}"
        )
    if unsaved:
        rd.notes.append(
            "in the module but saved nowhere (a ZeRO-3 parameter tied to another without "
            f"shared_params, left out as zero_to_fp32 does): {', '.join(unsaved)}"
        )
    order = [n for n in module if n in entries]
    return {n: entries[n] for n in [*order, *(n for n in entries if n not in module)]}


def _not_carried(first: dsf.ArchiveFile, model: dsf.ArchiveFile) -> tuple[str, ...]:
    out = []
    scaler = first.mapping("optimizer_state_dict").get("loss_scaler")
    if scaler is not None:
        out.append(f"loss scaler state ({safe_pickle.short(scaler)[:120]})")
    if model.obj.get("lr_scheduler") is not None:
        out.append("DeepSpeed's LR scheduler state (lr_scheduler in the model states)")
    return tuple(out)


def _describe(
    rd: Reading,
    state: ZeroState,
    files: Mapping[int, dsf.ArchiveFile],
    model: dsf.ArchiveFile,
    tensors: Mapping[str, TensorEntry],
    world: int,
) -> None:
    """Notes for ``inspect``: the run's facts, then what each rank file holds."""
    module = rd.module(model)
    module_dtypes = sorted(
        {r.dtype for r in module.values() if isinstance(r, safe_pickle.TensorRef)}
    )
    masters = sorted({tensors[n].dtype for n in state.group_of if n in tensors})
    rd.notes.insert(
        0,
        f"DeepSpeed ZeRO-{state.stage}"
        + (f", tag {state.tag}" if state.tag else "")
        + f", {world} ranks, masters {'/'.join(masters) or '-'}, module "
        f"{'/'.join(module_dtypes) or '-'}, DeepSpeed {state.ds_version or '?'}, "
        f"{len(state.group_of)} trainable parameters in {len(set(state.group_of.values()))} "
        "group(s)",
    )
    per_rank: dict[int, list[str]] = {}
    elements: dict[int, int] = {}
    for name in state.group_of:
        for c in tensors[name].chunks:
            if c.rank is not None:
                names = per_rank.setdefault(c.rank, [])
                if not names or names[-1] != name:
                    names.append(name)
                elements[c.rank] = elements.get(c.rank, 0) + math.prod(c.sizes)
    moments = ", exp_avg, exp_avg_sq" if state.exp_avg else ""
    for r in sorted(files)[:_NOTED_RANKS]:
        names = per_rank.get(r, [])
        span = f"{names[0]} .. {names[-1]}" if len(names) > 1 else (names[0] if names else "-")
        rd.notes.append(
            f"{files[r].rel}: rank {r}: {elements.get(r, 0)} master elements of "
            f"{len(names)} parameter{'' if len(names) == 1 else 's'} ({span}){moments}"
        )
    if len(files) > _NOTED_RANKS:
        rd.notes.append(f"... and {len(files) - _NOTED_RANKS} more rank files")
    for item in state.not_carried:
        rd.notes.append(f"not carried over by conversions: {item}")


def _latest(root: str, names: list[str]) -> str | None:
    try:
        return dsf.find_tag(root, set(names))[1]
    except (OSError, ValueError):  # a damaged 'latest' records nothing
        return None


class DeepSpeedLayout(DirectoryLayout):
    name = "deepspeed"
    description = "DeepSpeed ZeRO 1/2/3 checkpoint (latest + tag dir, or a tag dir)"

    def probe_names(self, path: str, names: list[str]) -> str | None:
        found = set(names)
        if dsf.LATEST in found:
            try:
                tag_rel, _, _ = dsf.find_tag(path, found, peek=True)
                found = set(storage.listdir(storage.join(path, tag_rel)))
            except UnsafeCheckpointError:
                return None  # ours, and hostile: reading it says so in one line
            except (OSError, ValueError) as e:
                return f"its 'latest' names no readable tag directory ({e})"
        if any(dsf.OPTIM_RE.match(n) for n in found):
            return None
        return "no 'latest' tag file and no *_optim_states.pt rank files"

    def numbered_saves(self) -> NumberedSaves:
        return NumberedSaves(TAG_SAVE, save_lacks, recorded=_latest, ranks=save_ranks)

    def read_manifest(self, path: str) -> Manifest:
        return read_run(path)


register(DeepSpeedLayout())
