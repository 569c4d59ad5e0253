"""The files of a DeepSpeed ZeRO checkpoint, decoded without DeepSpeed (torch-free).

``engine.save_checkpoint(DIR)`` writes ``DIR/latest`` (the tag) and, in ``DIR/<tag>/``, one
``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank (the fp32 master
partitions, the optimizer's partitioned moments, the paddings) beside the model states:
``mp_rank_00_model_states.pt`` for stages 1 and 2, one
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank for stage 3. Each is a ``torch.save``
archive whose pickle names a few DeepSpeed classes; they are decoded here by data-only
stand-ins (:data:`GLOBALS`), so neither DeepSpeed nor anything a checkpoint names is ever
imported. Only each archive's ``data.pkl`` and zip directory are read: tensors stay
:class:`~ckptools.formats.safe_pickle.TensorRef`, located by :meth:`ArchiveFile.locate` as
byte offsets. :func:`check_zero12_paddings` and :func:`check_slice_mappings` check that what the
files say of the stage 1/2 partitions adds up.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptools.core import dtypes
from ckptools.core.manifest import Record
from ckptools.errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    UnsupportedCheckpointError,
    UsageError,
)
from ckptools.formats import safe_pickle, torch_archive
from ckptools.io import storage
from ckptools.io.storage import Reader
from ckptools.producers.base import digest, read_marker
from ckptools.producers.deepspeed import LATEST_FILE
from ckptools.producers.run_dirs import directory_names

LATEST = LATEST_FILE
#: stages 1/2 keep one model-states file (the whole 16-bit module and the model's facts)
MODEL_STATES = "mp_rank_00_model_states.pt"
#: ``bf16_`` when DeepSpeed's bf16 optimizer wrote the file; the second number is the
#: model-parallel (tensor-parallel) rank, which ckptools does not merge
OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")


class _LossScaler(safe_pickle.Record):
    _qualname = "deepspeed.runtime.fp16.loss_scaler.LossScaler"


class _DynamicLossScaler(safe_pickle.Record):
    _qualname = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


class FragmentAddress(safe_pickle.Record):
    """``fragment_address(numel, start)``: where one parameter lies in a rank's partition."""

    _qualname = "deepspeed.utils.tensor_fragment.fragment_address"


def _zero_stage(value: Any) -> int:
    """``ZeroStageEnum(n)`` pickles as a call with its value; the stage is that value."""
    if type(value) is not int or not 0 <= value <= 3:
        raise CorruptCheckpointError(f"ZeroStageEnum({safe_pickle.short(value)}) is no stage")
    return value


class _TensorClass:
    """``torch.Tensor`` named as the type a tensor is rebuilt as; carries nothing."""


_TENSOR_CLASS = _TensorClass()
_REBUILD_TENSOR = safe_pickle.ARCHIVE_GLOBALS["torch._utils._rebuild_tensor_v2"]


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """A plain tensor saved with Python attributes (ZeRO-3 tags its flat groups with a
    ``ds_id``): rebuilt by the allowlisted ``_rebuild_tensor_v2``, the attributes dropped."""
    if func is not _REBUILD_TENSOR or new_type is not _TENSOR_CLASS or not isinstance(args, tuple):
        raise CorruptCheckpointError(
            f"_rebuild_from_type_v2 of {safe_pickle.short(new_type)} by "
            f"{safe_pickle.short(func)}: only plain tensors are read"
        )
    return func(*args)


#: what a DeepSpeed ``torch.save`` pickle may name: torch's tensors and containers, and the
#: three DeepSpeed classes it holds as data (loss scaler, ZeRO stage, fragment address)
GLOBALS: dict[str, Any] = {
    **safe_pickle.ARCHIVE_GLOBALS,
    _LossScaler._qualname: _LossScaler,
    _DynamicLossScaler._qualname: _DynamicLossScaler,
    FragmentAddress._qualname: FragmentAddress,
    "deepspeed.runtime.zero.config.ZeroStageEnum": _zero_stage,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "torch.Tensor": _TENSOR_CLASS,
}


@dataclass
class ArchiveFile:
    """One decoded ``torch.save`` file of the checkpoint: its pickle and where its records are."""

    reader: Reader
    rel: str  # relative to the checkpoint root
    size: int
    archive: torch_archive.Archive
    obj: Any
    _data_at: dict[str, int] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return storage.join(self.reader.root, self.rel)

    def locate(self, ref: Any, what: str) -> int:
        """Byte offset in this file of element 0 of the contiguous tensor ``ref``.

        Raises:
            CorruptCheckpointError: ``ref`` is not a tensor, is strided, or reaches past its
                storage record.
        """
        if not isinstance(ref, safe_pickle.TensorRef):
            raise CorruptCheckpointError(
                f"{self.path}: {what} is {safe_pickle.short(ref)}, not a tensor", path=self.path
            )
        if not ref.is_contiguous or ref.flags:
            raise UnsupportedCheckpointError(
                f"{self.path}: {what} is a strided or flagged tensor view", path=self.path
            )
        key = ref.storage.key
        rec = self.archive.record(f"data/{key}")
        at = self._data_at.get(key)
        if at is None:
            at = self._data_at[key] = torch_archive.record_data_offset(
                self.reader, self.archive, rec
            )
        itemsize = dtypes.dtype(ref.dtype).itemsize
        numel = 1
        for n in ref.shape:
            numel *= n
        start = ref.storage_offset * itemsize
        if start + numel * itemsize > rec.size:
            raise CorruptCheckpointError(
                f"{self.path}: {what} reaches past its storage record ({start + numel * itemsize}"
                f" > {rec.size} bytes)",
                path=self.path,
            )
        return at + start

    def record(self, ref: Any) -> Record:
        """The stored record holding the tensor ``ref`` (which :meth:`locate` has placed), its
        bytes' CRC-32 with it: a flat partition's parameters are parts of it."""
        rec = self.archive.record(f"data/{ref.storage.key}")
        return Record(self._data_at[ref.storage.key], rec.size, rec.crc32)

    def get(self, *keys: str | int, what: str | None = None) -> Any:
        """``obj[k0][k1]...``, or a one-line error naming the missing key path."""
        value = self.obj
        for i, k in enumerate(keys):
            try:
                value = value[k]
            except (KeyError, IndexError, TypeError) as e:
                name = what or "/".join(str(x) for x in keys[: i + 1])
                raise CorruptCheckpointError(
                    f"{self.path}: no {name} (not a DeepSpeed ZeRO checkpoint file, or damaged)",
                    path=self.path,
                ) from e
        return value

    def mapping(self, *keys: str) -> dict[Any, Any]:
        """``obj[k0][k1]...`` checked to be a dict."""
        value = self.get(*keys)
        if not isinstance(value, dict):
            raise CorruptCheckpointError(
                f"{self.path}: {'/'.join(keys)} is {safe_pickle.short(value)}, not a mapping",
                path=self.path,
            )
        return value


def open_file(reader: Reader, rel: str, size: int) -> ArchiveFile:
    """Read the zip directory and ``data.pkl`` of ``rel`` through :data:`GLOBALS`.

    A file cut short has no zip directory at its end, so a rank file that is not whole fails
    here, before any tensor byte is read.

    Raises:
        CorruptCheckpointError: not a ``torch.save`` archive, cut short, or not a dict.
        UnsafeCheckpointError: the pickle names anything outside :data:`GLOBALS`.
    """
    path = storage.join(reader.root, rel)
    if size < 22 or not torch_archive.is_zip(reader.read(rel, 0, 4)):
        raise CorruptCheckpointError(f"{path}: not a torch.save zip archive", path=path)
    archive = torch_archive.read_archive(reader, rel, 0, size)
    if archive.records.get("byteorder") is not None and (
        torch_archive.read_record(reader, archive, "byteorder") != b"little"
    ):
        raise UnsupportedCheckpointError(f"{path}: big-endian archives are not supported")
    obj = safe_pickle.restricted_loads(
        torch_archive.read_record(reader, archive, "data.pkl"),
        GLOBALS,
        source=path,
        persistent_load=safe_pickle.storage_persistent_load,
    )
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{path}: holds {safe_pickle.short(obj)}, not a dict")
    return ArchiveFile(reader, rel, size, archive, obj)


def tensor_list(f: ArchiveFile, value: Any, what: str) -> list[safe_pickle.TensorRef]:
    """``value`` checked to be a list of 1-D tensors (a rank's flat groups)."""
    if not isinstance(value, list | tuple) or not all(
        isinstance(t, safe_pickle.TensorRef) and len(t.shape) == 1 for t in value
    ):
        raise CorruptCheckpointError(f"{f.path}: {what} is not a list of flat tensors", path=f.path)
    return list(value)


def shapes_of(f: ArchiveFile, value: Any, what: str) -> dict[str, tuple[int, ...]]:
    """A ``{name: torch.Size}`` mapping checked and turned into plain tuples."""
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{f.path}: {what} is not a mapping", path=f.path)
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in value.items():
        dims = tuple(shape) if isinstance(shape, tuple | list) else None
        if (
            not isinstance(name, str)
            or dims is None
            or not all(type(d) is int and d >= 0 for d in dims)
        ):
            raise CorruptCheckpointError(
                f"{f.path}: {what} holds {safe_pickle.short(name)}: "
                f"{safe_pickle.short(shape)}, not a name and a shape",
                path=f.path,
            )
        out[name] = dims
    return out


def int_list(f: ArchiveFile, value: Any, what: str) -> list[int]:
    if not isinstance(value, list | tuple) or not all(type(v) is int and v >= 0 for v in value):
        raise CorruptCheckpointError(
            f"{f.path}: {what} is {safe_pickle.short(value)}, not a list of counts", path=f.path
        )
    return list(value)


#: a tag is a directory name; a ``latest`` longer than this is no tag file
_TAG_BYTES_MAX = 4096


def find_tag(root: str, names: set[str], *, peek: bool = False) -> tuple[str, str | None, bytes]:
    """(the tag directory relative to ``root``, the tag, ``latest``'s bytes) for a run
    directory, or ``("", None, b"")`` for a tag directory.

    ``root`` holding ``latest`` is a run directory: the tag is ``latest``'s text, checked to name
    a directory inside ``root``. Otherwise ``root`` is itself a tag directory (how a tag other
    than the latest is chosen: pass ``DIR/<tag>``). ``peek``: a probe's read, kept for the
    layout's (:func:`~ckptools.producers.base.read_marker`).
    """
    if LATEST not in names:
        return "", None, b""
    latest = storage.join(root, LATEST)
    size = storage.file_sizes(root, [LATEST]).get(LATEST, 0)
    if size > _TAG_BYTES_MAX:
        raise CorruptCheckpointError(f"{latest}: {size} bytes is no tag name", path=latest)
    raw = read_marker(latest, peek=peek)
    try:
        tag = raw.decode().strip()
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"{latest}: not a tag name", path=latest) from e
    if not tag or "\n" in tag:
        raise CorruptCheckpointError(f"{latest}: {raw[:80]!r} is not a tag name", path=latest)
    storage.contained(root, tag, named_by=latest, entry="names the tag directory")
    return tag, tag, raw


def choose_tag(root: str, tag: str) -> str:
    """The save ``tag`` inside the run directory ``root`` (``--tag``): a DeepSpeed tag other
    than the one ``latest`` names (``global_step100``), or any run directory's save by name.

    Raises:
        CheckpointNotFoundError: ``root`` is no directory, or holds no ``tag`` (the message
            lists the saves it holds).
        UsageError: ``root`` is a tag directory itself.
        OutsideCheckpointError: ``tag`` leads outside ``root``.
    """
    names = directory_names(root)
    if names is None:
        raise CheckpointNotFoundError(
            f"{root}: no such directory (--tag picks a save inside a run directory)", path=root
        )
    if any(OPTIM_RE.match(n) for n in names):
        raise UsageError(
            f"{root} is a DeepSpeed tag directory itself: drop --tag {tag}, or point at the "
            "directory above it",
            path=root,
        )
    path = storage.contained(root, tag, named_by="--tag", entry="names the save")
    if not storage.isdir(path):
        saves = sorted(
            (n for n in names if not n.startswith(".") and storage.isdir(storage.join(root, n))),
            key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)],
        )  # numbers as numbers: global_step_50 before global_step_100
        if not saves:
            raise CheckpointNotFoundError(
                f"{root}: holds no save directory for --tag {tag!r} to name; point at the "
                "checkpoint itself, without --tag",
                path=path,
            )
        try:
            named = find_tag(root, set(names))[1]
        except (CkptError, OSError):
            named = None  # a damaged 'latest' is no reason to hide the list
        latest = f" ('latest' names {named})" if named else ""
        listed = ", ".join(saves[-20:])
        raise CheckpointNotFoundError(
            f"{root}: no save {tag!r}; --tag takes one of: {listed}{latest}", path=path
        )
    return path


def content_digest(latest: bytes, files: Sequence[ArchiveFile]) -> str:
    """A digest naming this save's bytes without reading them: ``latest`` and every record's
    CRC-32 and size from the zip directories already read (the resume fingerprint)."""
    parts = [latest]
    for f in sorted(files, key=lambda f: f.rel):
        parts.append(f.rel.encode())
        for name, rec in sorted(f.archive.records.items()):
            parts.append(f"{name}:{rec.crc32}:{rec.size}".encode())
    return digest(b"\0".join(parts))


def check_zero12_paddings(
    files: Mapping[int, ArchiveFile],
    osds: Mapping[int, Any],
    saved: Sequence[Sequence[int]],
    used: Sequence[int],
) -> None:
    """Every rank's saved partition plus its ``group_paddings`` is the same partition size,
    padding only ends the group (so the saved partitions back to back are its vector), and
    the parameters with their alignment paddings fill exactly the saved elements."""
    world = len(saved)
    pads: list[list[int]] = []
    for r, f in files.items():
        raw = osds[r].get("group_paddings")
        if raw is None:  # before DeepSpeed 0.6: only the total can be checked
            pads = []
            break
        got = int_list(f, raw, "group_paddings")
        if len(got) != len(saved[r]):
            raise CorruptCheckpointError(
                f"{f.path}: group_paddings lists {len(got)} groups, not {len(saved[r])}",
                path=f.path,
                rank=r,
            )
        pads.append(got)
    for g, total in enumerate(used):
        held = sum(saved[r][g] for r in range(world))
        if total != held:
            raise CorruptCheckpointError(
                f"{files[0].path}: group {g}: param_shapes and alignment take {total} elements, "
                f"the ranks' saved partitions hold {held}: the files do not add up",
                path=files[0].path,
            )
        if not pads:
            continue
        sizes = {saved[r][g] + pads[r][g] for r in range(world)}
        padded_then_data = any(pads[r][g] and saved[r + 1][g] for r in range(world - 1))
        if len(sizes) != 1 or padded_then_data:
            raise CorruptCheckpointError(
                f"{files[0].path}: group {g}: saved partitions {[row[g] for row in saved]} with "
                f"group_paddings {[p[g] for p in pads]} are not equal partitions padded at the "
                "end: the paddings are inconsistent",
                path=files[0].path,
            )


def check_slice_mappings(
    files: Mapping[int, ArchiveFile],
    osds: Mapping[int, Any],
    groups: Sequence[Mapping[str, tuple[int, ...]]],
    saved: Sequence[Sequence[int]],
    segs: Mapping[str, Any],
) -> None:
    """Where ``param_slice_mappings`` (written by DeepSpeed 0.10+) places each parameter on each
    rank agrees with the placement computed from ``param_shapes`` and the paddings."""
    for r, f in files.items():
        maps = osds[r].get("param_slice_mappings")
        if not isinstance(maps, list):
            return
        base = 0
        for g, mapping in enumerate(maps[: len(groups)]):
            if not isinstance(mapping, dict):
                raise CorruptCheckpointError(f"{f.path}: param_slice_mappings[{g}] is no mapping")
            mine = {n: (s.local - base, s.count) for n in groups[g] for s in segs[n] if s.rank == r}
            theirs = {}
            for n, addr in mapping.items():
                fields = vars(addr) if isinstance(addr, FragmentAddress) else {}
                start, numel = fields.get("start"), fields.get("numel")
                if type(start) is not int or type(numel) is not int:
                    raise CorruptCheckpointError(
                        f"{f.path}: param_slice_mappings[{g}][{n!r}] is no fragment address",
                        path=f.path,
                    )
                if numel:
                    theirs[n] = (start, numel)
            if mine != theirs:
                bad = sorted(set(mine.items()) ^ set(theirs.items()))[0][0]
                raise CorruptCheckpointError(
                    f"{f.path}: rank {r} holds {bad!r} at (start, numel) "
                    f"{theirs.get(bad)} by its param_slice_mappings, at {mine.get(bad)} by "
                    "param_shapes and the paddings",
                    path=f.path,
                    rank=r,
                    fqn=bad,
                )
            base += saved[r][g]
