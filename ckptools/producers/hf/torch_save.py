"""Checkpoints saved with ``torch.save``: a state dict file, or the directory a trainer wrote.

The archive's ``data.pkl`` is unpickled through the allowlist ``torch.load(weights_only=True)``
uses (:data:`~ckptools.formats.safe_pickle.WEIGHTS_ONLY_GLOBALS`), without torch and without
reading tensor bytes: each tensor becomes a raw chunk pointing into its storage record. Nested
dicts are flattened to dotted FQNs the way DCP flattens them, keeping each key path; tensors
that share a storage (tied weights) point at the same bytes.

What users have, and where the model is found (:func:`ckptools.core.keys.find_model_part`
picks the container; ``--key`` names it):

* a file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``): a bare state dict, or a dict holding one under
  ``model``, ``model_state_dict``, ``state_dict``, ``module`` or ``net`` beside the optimizer,
  step, epoch... (the FSDP1 tutorial's ``checkpoint.pth``, DDP scripts, Lightning ``.ckpt``);
* a directory: accelerate ``save_state`` with ``FULL_STATE_DICT`` (``pytorch_model_fsdp.bin`` +
  ``optimizer.bin``), the Trainer's ``checkpoint-N`` (``pytorch_model.bin`` or
  ``model.safetensors``, + ``optimizer.pt``), accelerate without FSDP (``model.safetensors`` +
  ``optimizer.bin``), an HF ``pytorch_model*.bin`` directory, or a directory holding one
  ``torch.save`` file. The model file's entries keep their own key paths; an optimizer file's
  go under ``optimizer`` (a second one under ``optimizers.<i>``), so the optimizer stays in the
  manifest, with its key paths, as non-model entries.

``Manifest.details["sources"]`` says which file holds what (its role, its top-level keys, the
key they went under), and ``details["step"]`` the training step when a file or
``trainer_state.json`` records it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from ckptools.core import dtypes
from ckptools.core.manifest import (
    Chunk,
    FileInfo,
    Manifest,
    ObjectEntry,
    Record,
    TensorEntry,
    stored_in,
)
from ckptools.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnknownFormatError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
    UsageError,
)
from ckptools.formats import safe_pickle, torch_archive
from ckptools.io import storage
from ckptools.io.storage import Reader, open_reader
from ckptools.producers.base import Layout, digest, read_marker, register
from ckptools.producers.hf.index import index_files
from ckptools.producers.hf.safetensors import INDEX_SUFFIX, read_safetensors

SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
BIN_INDEX = "pytorch_model.bin.index.json"
SAFETENSORS_MODEL = "model.safetensors"
TRAINER_STATE = "trainer_state.json"
#: accelerate ``save_state`` with FULL_STATE_DICT: model i is ``pytorch_model_fsdp[_i].bin``
_FSDP_MODEL = re.compile(r"^pytorch_model_fsdp(?:_(\d+))?\.bin$")
#: accelerate's ``optimizer[_i].bin``, the Trainer's ``optimizer.pt``
_OPTIMIZER = re.compile(r"^optimizer(?:_(\d+))?\.(?:bin|pt)$")
#: torch.save files a trainer writes beside the model that are not a model
_NOT_A_MODEL = re.compile(
    r"^(?:rng_state.*\.pth|scheduler.*\.(?:pt|bin)|training_args\.bin|random_states_\d+\.pkl|"
    r"optimizer.*|meta\.pt)$"
)
#: top-level entries that record the training step
_STEP_KEYS = ("step", "global_step", "iteration", "iter")
#: a Trainer's trainer_state.json grows with its log history (~1 KB per logged step); 64 MiB is
#: far past any real one, and bounds what reading the step may cost on a hostile directory
_TRAINER_STATE_MAX_BYTES = 64 << 20


def flatten(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Yield (key path, leaf) like DCP's ``flatten_state_dict``: dicts always, sequences only
    when they hold tensors; everything else is a leaf.

    ``value`` comes from :func:`~ckptools.formats.torch_archive.load_pickle`, whose walk
    bounded its size as a tree and its depth; whether a sequence holds a tensor is remembered
    per object, so nested sequences are searched once, not once per level.
    """
    holds: dict[int, bool] = {}

    def contains_tensor(v: Any) -> bool:
        found = holds.get(id(v))
        if found is None:
            if isinstance(v, dict):
                found = any(contains_tensor(x) for x in v.values())
            elif isinstance(v, list | tuple):
                found = any(contains_tensor(x) for x in v)
            else:
                found = isinstance(v, safe_pickle.TensorRef)
            holds[id(v)] = found
        return found

    def walk(v: Any, at: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
        if isinstance(v, dict) and v:
            for k, x in v.items():
                yield from walk(x, (*at, str(k)))
        elif isinstance(v, list | tuple) and v and contains_tensor(v):
            for i, x in enumerate(v):
                yield from walk(x, (*at, str(i)))
        else:
            yield at, v

    return walk(value, path)


#: classes whose pickled instances are one rank's piece of a tensor sharded across ranks
_SHARDED_CLASSES = (
    "torch.distributed.tensor.",
    "torch.distributed._tensor.",
    "torch.distributed._shard.",
)


def _one_rank(path: str, global_name: str) -> UsageError:
    """The error for a ``torch.save`` file of DTensors / ShardedTensors read as a whole model:
    it is one rank's file of a checkpoint every rank saved (FSDP2's or FSDP1's sharded state
    dict, verl's ``*_world_size_W_rank_r.pt``), readable only with the others."""
    from ckptools.producers.part_files import missing_siblings, part_of

    cls = global_name.rsplit(".", 1)[-1]
    part = part_of(path)
    _, missing = missing_siblings(path)
    if part is not None and not missing:
        where = f"point at {part[1]}, the directory that holds every rank's files, without --format"
    elif part is not None:
        where = f"{part[1]} lacks {', '.join(missing[:3])}: point at the directory that holds them"
    else:
        where = "point at the directory that holds every rank's files"
    return UsageError(
        f"{path}: holds {cls} pieces, one rank's part of a checkpoint that every rank saved, "
        f"not a whole model; {where}",
        path=path,
    )


def read_torch_save_file(
    reader: Reader, rel: str, allowed: Mapping[str, Any] = safe_pickle.WEIGHTS_ONLY_GLOBALS
) -> tuple[list[TensorEntry], list[ObjectEntry], dict[str, tuple[str, ...]], FileInfo]:
    """Tensors (as raw chunks), plain values and key paths of one ``torch.save`` file.

    ``allowed``: the globals its pickle may name; by default what
    ``torch.load(weights_only=True)`` admits.

    Raises:
        UnsafeCheckpointError: the pickle names a global outside ``allowed``.
        UnsupportedCheckpointError: not a zip archive, or a tensor that is not one dense byte
            range (sparse, quantized, nested, meta...), named with its FQN.
        CorruptCheckpointError: a tensor's bytes reach past its storage record.
    """
    path = storage.join(reader.root, rel)
    size = reader.size(rel)
    head = reader.read(rel, 0, min(4, size))
    if not torch_archive.is_zip(head):
        raise UnsupportedCheckpointError(
            f"{path}: not a zip-format torch.save file (the legacy pre-1.6 format, or not a "
            "torch file at all); re-save it with a current torch",
            path=path,
        )
    archive = torch_archive.read_archive(reader, rel, 0, size)
    try:
        obj = torch_archive.load_pickle(reader, archive, allowed)
    except UnsafeCheckpointError as e:
        if not e.global_name.startswith(_SHARDED_CLASSES):
            raise
        raise _one_rank(path, e.global_name) from e
    data_offsets: dict[str, int] = {}
    tensors: list[TensorEntry] = []
    objects: list[ObjectEntry] = []
    paths: dict[str, tuple[str, ...]] = {}
    for key_path, leaf in flatten(obj):
        fqn = ".".join(key_path)
        paths[fqn] = key_path
        if isinstance(leaf, safe_pickle.OtherTensor):
            raise UnsupportedCheckpointError(
                f"{path}: {fqn!r} is {leaf.describe()}, not a dense tensor stored as one byte "
                "range, which is what ckptools copies; convert it with torch (e.g. "
                "t.to_dense(), t.dequantize()) and save it again",
                path=path,
                fqn=fqn,
            )
        if isinstance(leaf, safe_pickle.TensorRef):
            if leaf.flags:
                raise UnsupportedCheckpointError(
                    f"{path}: tensor {fqn!r} carries {leaf.flags} bits; save it resolved "
                    "(e.g. t.resolve_conj())",
                    path=path,
                    fqn=fqn,
                )
            key = leaf.storage.key
            if key not in data_offsets:
                rec = archive.record(f"data/{key}")
                data_offsets[key] = torch_archive.record_data_offset(reader, archive, rec)
            storage_bytes = archive.record(f"data/{key}").size
            itemsize = dtypes.dtype(leaf.dtype).itemsize
            start = leaf.storage_offset * itemsize
            span = leaf.span_bytes(itemsize)
            problem = leaf.expansion_problem(itemsize)
            if problem:
                raise CorruptCheckpointError(
                    f"{path}: tensor {fqn!r} {problem}", path=path, fqn=fqn
                )
            if start + span > storage_bytes:
                raise CorruptCheckpointError(
                    f"{path}: tensor {fqn!r} (bytes {start}..{start + span} of its storage) "
                    f"reaches past its storage record data/{key} ({storage_bytes} bytes)",
                    path=path,
                    fqn=fqn,
                )
            stored = archive.record(f"data/{key}")
            record = Record(data_offsets[key], stored.size, stored.crc32)
            chunk = Chunk(
                offsets=(0,) * len(leaf.shape),
                sizes=leaf.shape,
                file=rel,
                offset=data_offsets[key] + start,
                length=span,
                encoding="raw",
                strides=None if leaf.is_contiguous else leaf.strides,
                # the record's zip CRC is the bytes' of a tensor that is all of it (checked while
                # copied), else the record is checked whole before a view of it is read
                **stored_in(record, data_offsets[key] + start, span, leaf.is_contiguous),
            )
            tensors.append(TensorEntry(fqn, leaf.dtype, leaf.shape, (chunk,)))
        else:
            value = safe_pickle.unwrap(leaf)
            objects.append(ObjectEntry(fqn, value=value, has_value=True, encoding="raw"))
    return tensors, objects, paths, FileInfo(rel, size)


class _Collected:
    """Entries of the files read so far, each file's under its own key (``optimizer``...)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.tensors: dict[str, TensorEntry] = {}
        self.objects: dict[str, ObjectEntry] = {}
        self.paths: dict[str, tuple[str, ...]] = {}
        self.infos: dict[str, FileInfo] = {}
        self.sources: list[dict[str, Any]] = []

    def add_file(self, reader: Reader, rel: str, role: str, under: tuple[str, ...] = ()) -> None:
        tensors, objects, paths, info = read_torch_save_file(reader, rel)
        prefix = "".join(f"{k}." for k in under)
        for t in tensors:
            self._put(self.tensors, replace_fqn(t, prefix + t.fqn), rel)
        for o in objects:
            self._put(self.objects, replace_fqn(o, prefix + o.fqn), rel)
        self.paths.update((prefix + fqn, (*under, *p)) for fqn, p in paths.items())
        self.infos[rel] = info
        tops = list(dict.fromkeys(p[0] for p in paths.values() if p))
        self.sources.append(
            {"file": rel, "role": role, "under": ".".join(under), "keys": _shown_keys(tops)}
        )

    def _put(self, into: dict[str, Any], entry: Any, rel: str) -> None:
        if entry.fqn in into or entry.fqn in self.tensors or entry.fqn in self.objects:
            raise CorruptCheckpointError(
                f"{storage.join(self.root, rel)}: {entry.fqn!r} is also in another file of "
                "the checkpoint",
                path=storage.join(self.root, rel),
                fqn=entry.fqn,
            )
        into[entry.fqn] = entry

    def step(self, root: str, names: set[str]) -> int | None:
        for key in _STEP_KEYS:
            entry = self.objects.get(key)
            if entry is not None and type(entry.value) is int:
                return int(entry.value)
        if TRAINER_STATE not in names or storage.outside_reason(root, TRAINER_STATE) is not None:
            return None  # a link out of the checkpoint is never followed
        size = storage.file_sizes(root, [TRAINER_STATE]).get(TRAINER_STATE)
        if size is None or size > _TRAINER_STATE_MAX_BYTES:
            return None  # the step is a nicety: never worth reading a huge file for
        try:
            state = json.loads(read_marker(storage.join(root, TRAINER_STATE)))
            step = state.get("global_step") if isinstance(state, dict) else None
        except (OSError, ValueError, RecursionError):
            return None  # trainer_state.json is the Trainer's, not ours to validate
        return step if type(step) is int else None


def replace_fqn(entry: Any, fqn: str) -> Any:
    return entry if entry.fqn == fqn else replace(entry, fqn=fqn)


def _shown_keys(tops: list[str]) -> list[str]:
    # A bare state dict's top-level keys are its tensors (hundreds); name a few.
    return tops if len(tops) <= 12 else [*tops[:10], f"... {len(tops) - 10} more"]


def _plan_directory(path: str, names: set[str]) -> tuple[list[str], str | None, list[str]]:
    """(torch.save model files, a safetensors model marker or None, optimizer files) of a
    training directory; empty model lists when it is not one."""
    fsdp = sorted((n for n in names if _FSDP_MODEL.match(n)), key=_index_of)
    optim = sorted((n for n in names if _OPTIMIZER.match(n)), key=_index_of)
    if fsdp:
        return fsdp[:1], None, optim
    if optim and (SAFETENSORS_MODEL in names or SAFETENSORS_MODEL + ".index.json" in names):
        return [], SAFETENSORS_MODEL, optim
    if BIN_INDEX in names or "pytorch_model.bin" in names:
        return [BIN_INDEX if BIN_INDEX in names else "pytorch_model.bin"], None, optim
    return [], None, optim


def _index_of(name: str) -> int:
    m = _FSDP_MODEL.match(name) or _OPTIMIZER.match(name)
    return int(m.group(1)) if m and m.group(1) else 0


def _single_file(names: set[str], path: str) -> list[str]:
    """The entries of the directory ``path`` (listing ``names``) that may be its one torch.save
    file: a folder named like one is not (Lightning's sharded checkpoint ``epoch=0-step=2.ckpt/``
    in its ``checkpoints/``: detection then names it as the checkpoint inside)."""
    return sorted(
        n
        for n in names
        if n.endswith(SUFFIXES)
        and not _NOT_A_MODEL.match(n)
        and not storage.isdir(storage.join(path, n))
    )


def _producer(names: set[str], model_files: list[str], objects: Mapping[str, Any]) -> str:
    if TRAINER_STATE in names:
        return "trainer"
    if any(_FSDP_MODEL.match(n) for n in model_files):
        return "accelerate"
    if "pytorch-lightning_version" in objects:
        return "lightning"
    return "torch_save"


def read_torch_save(path: str) -> Manifest:
    """Manifest of a ``torch.save`` file, or of a directory of them (see the module docstring).

    Raises:
        CheckpointNotFoundError: a file the directory's index names is missing.
        UnknownFormatError: a directory without a model file this layout reads.
    """
    found = _Collected(storage.dirname(path) if storage.isfile(path) else path)
    notes: list[str] = []
    marker: tuple[str, ...] = ()
    digests: dict[str, str] = {}
    names: set[str] = set()
    extra: list[str] = []  # a directory's other accelerate models, named in a note
    base: Manifest | None = None
    if storage.isfile(path):
        root, model_files = storage.dirname(path), [storage.basename(path)]
        optim: list[str] = []
    else:
        root = path
        names = set(storage.listdir(path))
        model_files, safetensors_model, optim = _plan_directory(path, names)
        if safetensors_model is not None:
            base = read_safetensors(path)
        elif not model_files:
            model_files = _single_file(names, path)
            if len(model_files) != 1:
                raise UnknownFormatError(directory_reason(names, path) or f"{path}: no model file")
        if model_files == [BIN_INDEX]:
            model_files, marker, digests = _bin_index(path)
        extra = sorted(n for n in names if _FSDP_MODEL.match(n) and n not in model_files)
        if extra:
            notes.append(
                f"{path}: read {model_files[0]}; {', '.join(extra)} hold other models "
                "(point at a file to read it)"
            )
    for rel in [*model_files, *optim]:
        storage.contained(root, rel, named_by=path, entry="holds")
    present = storage.file_sizes(root, [*model_files, *optim])
    with open_reader(root) as reader:
        for rel in [*model_files, *optim]:
            if rel not in present:
                raise CheckpointNotFoundError(
                    f"{storage.join(root, rel)}: file is missing", path=storage.join(root, rel)
                )
        for rel in model_files:
            found.add_file(reader, rel, "model")
        for i, rel in enumerate(optim):
            found.add_file(
                reader, rel, "optimizer", ("optimizer",) if i == 0 else ("optimizers", str(i))
            )
    aux: tuple[str, ...] = ()
    if names:  # a directory: the files beside the model, carried over by a reshard
        used = {*model_files, *optim, *marker, *extra}
        if base is not None:
            used.update((*base.files, *base.markers))
        aux, outside = _aux_files(path, used)
        if outside:
            notes.append(
                f"{path}: {', '.join(outside[:4])} lead(s) outside the checkpoint: never read, "
                "and not carried over by conversions"
            )
    if base is not None:
        return _with_safetensors_model(base, found, path, names, aux, tuple(notes))
    details = {"sources": found.sources, "step": found.step(root, names)}
    return Manifest(
        root=path,
        format="torch_save",
        layout=_producer(names, model_files, found.objects),
        tensors=found.tensors,
        objects=found.objects,
        files=found.infos,
        paths=found.paths,
        markers=marker,
        notes=tuple(notes),
        details=details,
        data_root=root,
        aux_files=aux,
        marker_digests=digests,
    )


def _aux_files(root: str, used: set[str]) -> tuple[tuple[str, ...], list[str]]:
    """The files below ``root`` that are not the model or optimizer files read (scheduler.bin,
    random_states_<r>.pkl, trainer_state.json, config.json...), not in a hidden directory, as a
    DCP directory's are found; and those that lead outside ``root`` (never carried over)."""
    aux: list[str] = []
    outside: list[str] = []
    for rel in storage.walk_files(root):
        rel = rel.replace("\\", "/")
        rel_dir = rel.rpartition("/")[0]
        if rel in used or any(d.startswith(".") for d in rel_dir.split("/") if d):
            continue
        (outside if storage.outside_reason(root, rel) else aux).append(rel)
    return tuple(sorted(aux)), sorted(outside)


def _bin_index(path: str) -> tuple[list[str], tuple[str, ...], dict[str, str]]:
    index_path = storage.contained(path, BIN_INDEX, named_by=path, entry="holds")
    try:
        raw = read_marker(index_path, limit=storage.SMALL_FILE_LIMIT)
        weight_map = json.loads(raw)["weight_map"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"{index_path}: not a valid index ({e})", path=index_path
        ) from e
    return index_files(path, index_path, weight_map), (BIN_INDEX,), {BIN_INDEX: digest(raw)}


def _with_safetensors_model(
    model: Manifest,
    found: _Collected,
    path: str,
    names: set[str],
    aux: tuple[str, ...],
    notes: tuple[str, ...],
) -> Manifest:
    """The safetensors model of an accelerate/Trainer directory with its optimizer files."""
    sources = [
        {"file": f, "role": "model", "under": "", "keys": _shown_keys(list(model.tensors))}
        for f in model.files
    ]
    clash = set(model.tensors) & (set(found.tensors) | set(found.objects))
    if clash:
        first = sorted(clash)[0]
        raise CorruptCheckpointError(
            f"{path}: {first!r} is in the model and the optimizer files", path=path, fqn=first
        )
    return Manifest(
        root=path,
        format="torch_save",
        layout="trainer" if TRAINER_STATE in names else "accelerate",
        tensors={**model.tensors, **found.tensors},
        objects=found.objects,
        files={**model.files, **found.infos},
        paths={**{f: (f,) for f in model.tensors}, **found.paths},
        markers=model.markers,
        details={
            **model.details,
            "sources": [*sources, *found.sources],
            "step": found.step(path, names),
        },
        notes=notes,
        data_root=path,
        aux_files=aux,
        marker_digests=model.marker_digests,
    )


def directory_reason(names: set[str], path: str) -> str | None:
    """None when the directory ``path``, listing ``names``, is this layout's, else why not."""
    model, safetensors_model, _ = _plan_directory("", names)
    if safetensors_model is not None:
        return None
    if model:
        if model[0] in (BIN_INDEX, "pytorch_model.bin") and any(
            n.endswith((".safetensors", INDEX_SUFFIX)) for n in names
        ):
            return "its safetensors weights are the safetensors layout's"
        return None
    if any(n.endswith((".safetensors", INDEX_SUFFIX)) for n in names):
        return "safetensors weights without a torch.save optimizer beside them"
    single = _single_file(names, path)
    if len(single) == 1:
        return None
    if single:
        return f"holds several torch.save files ({', '.join(single[:4])}); point at one"
    return (
        "no pytorch_model_fsdp*.bin, pytorch_model.bin (or its index), optimizer beside a "
        "model.safetensors, or a single .pt/.pth/.ckpt file"
    )


class TorchSaveLayout(Layout):
    name = "torch_save"
    model_directory = True
    description = (
        "torch.save checkpoint (.pt/.pth/.bin/.ckpt), or a directory of them: accelerate "
        "FULL_STATE_DICT, Trainer checkpoint-N, HF pytorch_model*.bin"
    )

    def probe(self, path: str) -> str | None:
        if storage.isfile(path):
            if path.endswith(SUFFIXES):
                return None
            if torch_archive.is_zip(storage.read_range(path, 0, 4)):
                return None
            return f"file is not a zip archive and its name does not end in {SUFFIXES}"
        if storage.isdir(path):
            return directory_reason(set(storage.listdir(path)), path)
        return "not a file or directory"

    def read_manifest(self, path: str) -> Manifest:
        return read_torch_save(path)


register(TorchSaveLayout())
