"""verl's per-rank FSDP checkpoints (``FSDPCheckpointManager.save_checkpoint``), torch-free.

Each rank ``r`` of ``W`` writes, with ``torch.save``, ``model_world_size_W_rank_r.pt`` (its
``model.state_dict()``), ``optim_world_size_W_rank_r.pt`` (its ``optimizer.state_dict()``) and
``extra_state_world_size_W_rank_r.pt`` (LR scheduler and RNG states); rank 0 adds
``fsdp_config.json`` (``{"FSDP_version", "world_size"}``) and ``huggingface/`` (the model's
config, tokenizer, generation config). verl's own loader needs the same world size; this
layout makes the directory one checkpoint that every verb reads.

FSDP2 (``FSDP_version`` 2): both files hold DTensors, read through the stand-ins of
:mod:`ckptools.formats.dtensor` (no process group, nothing of torch's or verl's imported);
each rank's local tensor is a chunk of the global tensor at the offsets its placements give
(uneven splits included), with its bytes in that rank's storage record. The optimizer keeps
``optimizer.state_dict()``'s integer ids in param-group order, named here under ``optimizer``
as a ``torch.save`` directory names its optimizer file, so :mod:`ckptools.plan.training` maps
the ids to FQNs (one group, counts and global shapes checked) for ``reshard``. A tensor that is
not a DTensor (AdamW's ``step``) and every plain value is the same on every rank and read from
rank 0.

FSDP1 (``FSDP_version`` 1, ``SHARDED_STATE_DICT``): the model file holds ShardedTensors, each
local shard at the offsets it records. The optimizer file is ``optimizer.state_dict()`` of
FlatParameters (verl's ``use_orig_params=False``): per wrapped module, 1-D shards of its
parameters concatenated and padded, without the record of which parameter lies where (FSDP
keeps it in memory only). :mod:`ckptools.layouts.fsdp1_flat` recovers it from the model's
parameters and the shards' sizes by FSDP's own rule and places each moment on its parameter
(``optimizer.state.<fqn>.<name>``, the groups' ``params`` as FQNs, as
``FSDP.optim_state_dict`` names them); where the sizes fit no wrapping, or several, the
optimizer is refused with the numbers and ``reshard`` carries it only with
``--drop-optimizer``. With ``use_orig_params=True`` the optimizer holds the original
parameters instead, each rank's state its 1-D slice of the parameter, which the ranks' slices
in rank order make whole (:mod:`ckptools.layouts.fsdp1_optim`).

A rank's missing model or optimizer file is named; the world size is ``fsdp_config.json``'s and
must agree with the file names. ``extra_state_*.pt`` and ``huggingface/`` are auxiliary files:
``consolidate`` copies ``huggingface/``; ``reshard`` notes that the per-rank RNG and scheduler
state is not carried.
"""

from __future__ import annotations

import json
import re

from ckptools.core.manifest import (
    MODEL_FILES_DIR,
    OPTIMIZER_UNREADABLE,
    FileInfo,
    Manifest,
)
from ckptools.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedCheckpointError,
)
from ckptools.formats import safe_pickle
from ckptools.io import storage
from ckptools.io.storage import open_reader
from ckptools.layouts.base import (
    Layout,
    digest,
    directory_names,
    model_only,
    read_marker,
    register,
)
from ckptools.layouts.fsdp1_optim import flat_optimizer
from ckptools.layouts.rank_pickles import OPTIMIZER, Merged

LAYOUT = "verl"
CONFIG = "fsdp_config.json"
RANK_FILE = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
#: fsdp_config.json is two numbers; anything past this is not verl's
_CONFIG_MAX_BYTES = 64 << 10


def rank_file(kind: str, world_size: int, rank: int) -> str:
    """The name verl gives rank ``rank``'s ``kind`` file (``model``, ``optim``...)."""
    return f"{kind}_world_size_{world_size}_rank_{rank}.pt"


def _config(path: str) -> tuple[int, int, bytes]:
    where = storage.join(path, CONFIG)
    if storage.size(where) > _CONFIG_MAX_BYTES:
        raise CorruptCheckpointError(f"{where}: {storage.size(where)} bytes, not verl's config")
    raw = read_marker(where)
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}: not JSON ({e})", path=where) from e
    version = config.get("FSDP_version") if isinstance(config, dict) else None
    world = config.get("world_size") if isinstance(config, dict) else None
    if type(version) is not int or type(world) is not int or world < 1:
        raise CorruptCheckpointError(
            f"{where}: expected integer FSDP_version and world_size >= 1, found "
            f"{safe_pickle.short(config)}",
            path=where,
        )
    return version, world, raw


def _rank_files(path: str, tree: dict[str, int], world: int) -> dict[str, dict[int, str]]:
    """kind -> rank -> file, checked against ``world``: a rank's missing model (or optimizer,
    when any rank saved one) file is named."""
    found: dict[str, dict[int, str]] = {}
    for rel in tree:
        m = RANK_FILE.match(rel)
        if m is None:
            continue
        kind, w, r = m.group(1), int(m.group(2)), int(m.group(3))
        if w != world or r >= world:
            raise CorruptCheckpointError(
                f"{storage.join(path, rel)}: written at world size {w} rank {r}, but {CONFIG} "
                f"says world size {world}",
                path=storage.join(path, rel),
            )
        found.setdefault(kind, {})[r] = rel
    for kind in ("model", "optim"):
        have = found.get(kind, {})
        if kind == "optim" and not have:
            continue
        if len(have) < world:
            # the first gap lies within len(have) + 1 ranks: never a walk of a huge world size
            first = next(r for r in range(len(have) + 1) if r not in have)
            name = storage.join(path, rank_file(kind, world, first))
            raise CheckpointNotFoundError(
                f"{name}: rank {first}'s {kind} file is missing ({world - len(have)} of {world} "
                "ranks' files absent); each rank's file holds its own shard",
                path=name,
                rank=first,
            )
    return found


def read_verl(path: str) -> Manifest:
    """The manifest of the verl checkpoint directory ``path`` (see the module's description).

    Raises:
        CheckpointNotFoundError: a rank's model or optimizer file is missing (named).
        UnsupportedCheckpointError: a DTensor placed other than by Shard / Replicate.
        CorruptCheckpointError: the config, the file names or the files disagree.
        UnsafeCheckpointError: a pickle names a global outside the allowlist.
    """
    version, world, raw = _config(path)
    tree = {rel.replace("\\", "/"): size for rel, size in storage.walk_files(path).items()}
    files = _rank_files(path, tree, world)
    if version not in (1, 2):
        raise UnsupportedCheckpointError(f"{path}: FSDP_version {version}: verl writes 1 or 2")
    reader = open_reader(path)
    merged = Merged(path)
    for rank in sorted(files["model"]):
        merged.add_file(reader, files["model"][rank], rank, ())
    notes = []
    unreadable = None
    read = ["model"]
    if files.get("optim") and model_only():
        # the caller exports the model: W optimizer pickles left unparsed
        notes.append(
            f"{len(files['optim'])} optimizer file(s) not read: the model alone is exported"
        )
    elif version == 2:
        for rank in sorted(files.get("optim", {})):
            merged.add_file(reader, files["optim"][rank], rank, (OPTIMIZER,))
        read.append("optim")
    elif files.get("optim"):
        try:
            flat_optimizer(merged, reader, files["optim"], world)
            read.append("optim")
        except UnsupportedCheckpointError as e:
            unreadable = str(e)
            notes.append(f"optimizer not read: {unreadable}")
    data = {rel for kind in read for rel in files.get(kind, {}).values()}
    if files.get("extra_state"):
        notes.append(
            f"{len(files['extra_state'])} extra_state file(s) (per-rank RNG and LR scheduler "
            "state) are not carried over by conversions"
        )
    return Manifest(
        root=path,
        format=LAYOUT,
        layout=f"verl_fsdp{version}",
        tensors=merged.entries(),
        objects=merged.objects,
        files={rel: FileInfo(rel, tree[rel], _rank_of(rel)) for rel in sorted(data)},
        world_size=world,
        paths=merged.paths,
        markers=(CONFIG,),
        marker_digests={CONFIG: digest(raw)},
        notes=tuple(notes),
        details={
            "verl": {"fsdp_version": version},
            MODEL_FILES_DIR: "huggingface",
            **({OPTIMIZER_UNREADABLE: unreadable} if unreadable else {}),
            "placements": merged.placements,
            **({"mesh": list(merged.mesh)} if merged.mesh is not None else {}),
        },
        data_root=path,
        aux_files=tuple(sorted(rel for rel in tree if rel not in data and rel != CONFIG)),
    )


def _rank_of(rel: str) -> int | None:
    m = RANK_FILE.match(rel)
    return int(m.group(3)) if m else None


class VerlLayout(Layout):
    # Before torch_save (25): a one-rank verl directory is also a directory of .pt files.
    priority = 22
    name = LAYOUT
    description = "verl FSDPCheckpointManager per-rank files (*_world_size_W_rank_r.pt)"

    def probe(self, path: str) -> str | None:
        listed = directory_names(path)
        if listed is None:
            return "not a directory"
        names = set(listed)
        if CONFIG not in names:
            return f"no {CONFIG}"
        if not any(RANK_FILE.match(n) for n in names):
            return "no *_world_size_W_rank_r.pt rank files"
        return None

    def read_manifest(self, path: str) -> Manifest:
        return read_verl(path)


register(VerlLayout())
