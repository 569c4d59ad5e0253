"""transformers' distributed safetensors: ``save_pretrained(..., distributed_checkpoint=True)``.

transformers (5.x) saves a tensor-parallel (or FSDP) model by ``dcp.save`` through torch's
``HuggingFaceStorageWriter(save_distributed=True)``: no global metadata and no index; rank ``r``
writes ``shard-<r+1>-model-00001-of-00001.safetensors`` (five digits each), an ordinary
safetensors file whose tensors carry their full names but hold only that rank's slice, and whose
header ``__metadata__`` holds ``DCP_SHARDING_INFO``, the JSON ``{name: {"saved_offsets":
[...]}}`` placing each slice in the global tensor (and ``DCP_VERSION``). Replicated tensors (the
norms of a TP model) are written once, by the rank DCP's deduplication picks. rank 0 writes
``config.json`` and ``generation_config.json`` beside.

Read as plain safetensors these files are a wrong model; this layout reads every file's header
(through :mod:`ckptools.formats.safetensors_header`, which validates it as safetensors' own
loader does) and describes the ranks' slices as the chunks of one manifest. The files record no
global shape and no world size, so, as torch's ``HuggingFaceStorageReader`` does, a tensor's
shape is the extent of its slices, and the world size is the highest shard number. Hence the
checks before anything is read:

* a shard number below the highest without its file is named (a rank deleted or never written);
* a lone ``shard-00001`` is refused: transformers never saves a distributed checkpoint from one
  rank (it requires ``tp_size`` or ``dp_size`` above 1), so the other ranks' files are gone;
* every tensor's slices must cover its shape exactly once (a gap names the rows no file holds);
* every tensor of a header has its offsets, and the offsets name no tensor the file lacks.

What the headers cannot tell: a trailing rank deleted from a run of 3 or more ranks leaves the
others consistent (each tensor just ends earlier); nothing recorded differs, and ckptools cannot
name it. transformers' own loader is blind to it too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ckptools.core.geometry import tiling_problems
from ckptools.core.manifest import Chunk, FileInfo, Manifest, TensorEntry
from ckptools.errors import CkptError, CorruptCheckpointError, IncompleteCheckpointError
from ckptools.formats import safetensors_header
from ckptools.io import storage
from ckptools.producers.base import digest, register
from ckptools.producers.probing import DirectoryLayout

LAYOUT = "transformers_distributed"
#: the header metadata key torch's writer puts the slices' offsets under
SHARDING_KEY = "DCP_SHARDING_INFO"
#: ``shard-<rank + 1>-model-<k>-of-<n>.safetensors``, as torch's ``_gen_file_name`` pads them
SHARD_FILE = re.compile(r"^shard-(\d{5,})-model-(\d{5,})-of-(\d{5,})\.safetensors$")
#: a rank's number beyond this is damage, not a run: the world size must stay a small integer
_MAX_SHARD_NUMBER = 1 << 24
#: missing ranks named one by one, at most (the count is always given)
MISSING_RANKS_NAMED = 16


@dataclass(frozen=True)
class _Shards:
    """The shard files of the directory by rank, and the files beside them."""

    by_rank: dict[int, list[str]]
    sizes: dict[str, int]
    aux: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return max(self.by_rank) + 1 if self.by_rank else 0

    def missing(self) -> tuple[list[int], int]:
        """The first :data:`MISSING_RANKS_NAMED` ranks below the world size without a file, and
        how many there are (linear in the files, whatever number a name gives)."""
        named: list[int] = []
        expected = 0
        for r in [*self.by_rank, self.world_size]:  # by_rank is sorted
            named.extend(range(expected, min(r, expected + MISSING_RANKS_NAMED - len(named))))
            expected = r + 1
            if len(named) >= MISSING_RANKS_NAMED:
                break
        return named, self.world_size - len(self.by_rank)


def shard_name(rank: int, like: str | None = None) -> str:
    """The file rank ``rank`` writes (the ``model-k-of-n`` part as in ``like``, a present one)."""
    m = SHARD_FILE.match(like) if like is not None else None
    tail = f"model-{m.group(2)}-of-{m.group(3)}" if m else "model-00001-of-00001"
    return f"shard-{rank + 1:05d}-{tail}.safetensors"


def _list_shards(root: str) -> _Shards:
    """One walk of ``root``: its top-level shard files by rank (checked to lie inside it)."""
    tree = {rel.replace("\\", "/"): size for rel, size in storage.walk_files(root).items()}
    by_rank: dict[int, list[str]] = {}
    aux = []
    for rel in tree:
        m = SHARD_FILE.match(rel)
        if m is None or int(m.group(1)) > _MAX_SHARD_NUMBER:
            if "/" not in rel and not rel.startswith("."):
                aux.append(rel)
            continue
        number = int(m.group(1))
        if number == 0:
            path = storage.join(root, rel)
            raise CorruptCheckpointError(
                f"{path}: shard number 00000: torch numbers the ranks' files from 00001; the "
                "file was renamed or does not belong to this save",
                path=path,
            )
        storage.contained(root, rel, named_by=root, entry="holds")
        by_rank.setdefault(number - 1, []).append(rel)
    sizes = {rel: tree[rel] for names in by_rank.values() for rel in names}
    return _Shards({r: sorted(n) for r, n in sorted(by_rank.items())}, sizes, tuple(sorted(aux)))


def _offsets(path: str, header: safetensors_header.Header) -> dict[str, tuple[int, ...]]:
    """Each header tensor's offsets in the global tensor, from ``DCP_SHARDING_INFO``, checked:
    an object naming exactly the header's tensors, each with one non-negative integer offset per
    dimension."""

    def bad(why: str, fqn: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{path}: {SHARDING_KEY} in the safetensors header {why}; the file is damaged or "
            "was not written by torch's HuggingFaceStorageWriter",
            path=path,
            fqn=fqn,
        )

    raw = header.metadata.get(SHARDING_KEY)
    if raw is None:
        raise bad("is missing (every rank's file records where its slices lie)")
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad(f"is not JSON ({type(e).__name__})") from e
    if not isinstance(info, dict):
        raise bad("is not a JSON object")
    out: dict[str, tuple[int, ...]] = {}
    for t in header.tensors:
        entry = info.get(t.name)
        if not isinstance(entry, dict):
            raise bad(f"gives no offsets for tensor {t.name!r}, which the file holds", t.name)
        offsets = entry.get("saved_offsets")
        if (
            not isinstance(offsets, list)
            or len(offsets) != len(t.shape)
            or not all(type(o) is int and 0 <= o < (1 << 62) for o in offsets)
        ):
            raise bad(
                f"gives {t.name!r} (shape {list(t.shape)}) saved_offsets {_short(offsets)}, "
                f"not {len(t.shape)} non-negative integer(s)",
                t.name,
            )
        out[t.name] = tuple(offsets)
    extra = [name for name in info if name not in out]
    if extra:
        raise bad(f"places {extra[0]!r}, which the file does not hold", extra[0])
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Tensors:
    """The ranks' slices merged into one entry per tensor, in the order they first appear."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.dtype: dict[str, str] = {}
        self.shape: dict[str, list[int]] = {}
        self.chunks: dict[str, list[Chunk]] = {}
        self.first: dict[str, str] = {}  # FQN -> the file that first held it

    def add(self, rel: str, rank: int, header: safetensors_header.Header) -> None:
        offsets = _offsets(storage.join(self.root, rel), header)
        for t in header.tensors:
            start = offsets[t.name]
            chunk = Chunk(
                offsets=start,
                sizes=t.shape,
                file=rel,
                offset=header.data_start + t.begin,
                length=t.end - t.begin,
                encoding="raw",
                rank=rank,
            )
            shape = self.shape.get(t.name)
            if shape is None:
                self.dtype[t.name] = t.dtype
                self.shape[t.name] = [o + s for o, s in zip(start, t.shape, strict=True)]
                self.chunks[t.name] = [chunk]
                self.first[t.name] = rel
                continue
            if self.dtype[t.name] != t.dtype or len(shape) != len(t.shape):
                first = storage.join(self.root, self.first[t.name])
                path = storage.join(self.root, rel)
                raise CorruptCheckpointError(
                    f"{first} and {path} hold slices of {t.name!r} of different kinds "
                    f"({self.dtype[t.name]} in {len(shape)} dim(s), {t.dtype} in "
                    f"{len(t.shape)}): the files come from different saves",
                    path=path,
                    fqn=t.name,
                )
            for d, (o, s) in enumerate(zip(start, t.shape, strict=True)):
                shape[d] = max(shape[d], o + s)
            self.chunks[t.name].append(chunk)

    def entries(self) -> dict[str, TensorEntry]:
        out = {}
        for fqn, chunks in self.chunks.items():
            entry = TensorEntry(fqn, self.dtype[fqn], tuple(self.shape[fqn]), tuple(chunks))
            _check_tiling(self.root, entry)
            out[fqn] = entry
        return out


def _check_tiling(root: str, t: TensorEntry) -> None:
    """Refuse a tensor whose slices do not cover its shape exactly once, saying what is wrong."""
    problems = tiling_problems(t.shape, ((c.offsets, c.sizes) for c in t.chunks))
    if not problems:
        return
    p = problems[0]
    files = sorted({c.file for c in t.chunks})
    raise CorruptCheckpointError(
        f"{root}: the shard headers do not place every element of {t.fqn!r} (shape "
        f"{list(t.shape)}, slices in {', '.join(files)}): {p.describe()}; a rank's file is "
        "missing or a header is damaged",
        path=root,
        fqn=t.fqn,
    )


def _missing_error(root: str, shards: _Shards) -> IncompleteCheckpointError | None:
    """The error naming the first missing rank file, or None when every rank's file is there."""
    like = next(iter(shards.by_rank.values()))[0]
    world = shards.world_size
    missing, count = shards.missing()
    if world == 1:
        # transformers refuses distributed_checkpoint=True unless tp_size or dp_size > 1
        name = shard_name(1, like)
        path = storage.join(root, name)
        return IncompleteCheckpointError(
            f"{path}: missing: only {like} is here, but a distributed checkpoint is written by "
            "2 or more ranks (one file each), so the other ranks' files (from this one on) "
            "were deleted or never written; restore them or use another checkpoint",
            path=path,
            rank=1,
        )
    if not missing:
        return None
    r = missing[0]
    path = storage.join(root, shard_name(r, like))
    others = ", ".join(str(m) for m in missing[1:MISSING_RANKS_NAMED])
    more = f" (also rank(s) {others}{', ...' if count > len(missing) else ''})"
    return IncompleteCheckpointError(
        f"{path}: missing: rank {r} of at least {world} wrote no file here, so its slices of "
        f"the model are gone{more if others else ''}; {count} rank file(s) missing: "
        "restore them or use another checkpoint",
        path=path,
        rank=r,
    )


def read_hf_distributed(root: str) -> Manifest:
    """The manifest of a directory written by ``save_pretrained(..., distributed_checkpoint=True)``.

    Reads each rank file's header only. Tensors keep the order of the files (rank 0 first).

    Raises:
        IncompleteCheckpointError: a rank's file is missing (the file and rank named).
        CorruptCheckpointError: a damaged header or ``DCP_SHARDING_INFO``, slices that do not
            cover a tensor exactly once, or files that describe a tensor differently.

    Example:
        >>> m = read_hf_distributed("tp-out/")  # doctest: +SKIP
        >>> m.world_size, m.bytes_per_rank()  # doctest: +SKIP
        (2, {0: 50176, 1: 51968})
    """
    shards = _list_shards(root)
    if not shards.by_rank:
        raise IncompleteCheckpointError(
            f"{root}: holds no shard-<rank>-model-*.safetensors files", path=root
        )
    error = _missing_error(root, shards)
    if error is not None:
        raise error
    merged = _Tensors(root)
    files: dict[str, FileInfo] = {}
    digests: dict[str, str] = {}
    versions: set[str] = set()
    for rank, names in shards.by_rank.items():
        for rel in names:
            header = safetensors_header.read_header(storage.join(root, rel))
            merged.add(rel, rank, header)
            files[rel] = FileInfo(rel, header.file_size, rank)
            digests[rel] = digest(header.metadata.get(SHARDING_KEY, "").encode())
            versions.add(header.metadata.get("DCP_VERSION", "?"))
    tensors = merged.entries()
    world = shards.world_size
    return Manifest(
        root=root,
        format="safetensors",
        layout=LAYOUT,
        tensors=tensors,
        objects={},
        files=files,
        world_size=world,
        notes=(
            f"transformers save_pretrained(distributed_checkpoint=True): {world} rank files, "
            "each tensor's slices placed by the DCP_SHARDING_INFO of their headers (global "
            "shapes are the slices' extent: the files record none)",
        ),
        details={
            "dcp_version": ",".join(sorted(versions)),
            "files_per_rank": {r: names for r, names in shards.by_rank.items()},
        },
        data_root=root,
        aux_files=shards.aux,
        marker_digests=digests,
    )


def _first_shard(names: list[str]) -> str | None:
    """Rank 0's file (the lowest shard number from 00001 on), which every rank's save names."""
    shards = sorted(n for n in names if (m := SHARD_FILE.match(n)) and int(m.group(1)) >= 1)
    return shards[0] if shards else None


class HfDistributedLayout(DirectoryLayout):
    name = LAYOUT
    description = (
        "transformers save_pretrained(distributed_checkpoint=True): "
        "shard-<rank>-model-*.safetensors with DCP_SHARDING_INFO"
    )

    def probe_names(self, path: str, names: list[str]) -> str | None:
        first = _first_shard(names)
        if first is None:
            return "no shard-<rank>-model-*.safetensors files"
        try:
            # the first file's header alone: a few KB, one read
            header = safetensors_header.read_header(storage.join(path, first))
        except CkptError:
            return None  # a shard named so, damaged: reading it says what is wrong
        if SHARDING_KEY not in header.metadata:
            return f"{first} has no {SHARDING_KEY} in its safetensors header"
        return None

    def read_manifest(self, path: str) -> Manifest:
        return read_hf_distributed(path)


register(HfDistributedLayout())
