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
local shard at the offsets it records, or, when FSDP1 was given a ``device_mesh`` (as verl's
FSDP engine wraps it), DTensors placed ``Shard(0)``, read as FSDP2's are (with
``HYBRID_SHARD`` on verl's ``("ddp", "fsdp")`` mesh, ``(Replicate(), Shard(0))``, and the
optimizer read from the first replica group, :func:`_shard_group`). The optimizer file is
``optimizer.state_dict()`` of FlatParameters (verl's ``use_orig_params=False``): per wrapped
module, 1-D shards of its parameters concatenated and padded, without the record of which
parameter lies where (FSDP keeps it in memory only). :mod:`ckptools.producers.fsdp1.flat`
recovers it from the model's parameters and the shards' sizes by FSDP's own rule and places
each moment on its parameter (``optimizer.state.<fqn>.<name>``, the groups' ``params`` as FQNs,
as ``FSDP.optim_state_dict`` names them); where the sizes fit no wrapping, or several, the
optimizer is refused with the numbers and ``reshard`` carries it only with
``--drop-optimizer``. With ``use_orig_params=True`` the optimizer holds the original parameters
instead, each rank's state its 1-D slice of the parameter, which the ranks' slices in rank
order make whole (:mod:`ckptools.producers.fsdp1.optim`).

verl's trainers save each step as ``<default_local_dir>/global_step_N/actor/`` (and ``critic/``
for PPO's value model), recording the last completed save's ``N`` in
``latest_checkpointed_iteration.txt``: a ``global_step_N`` directory reads as its ``actor/``
(the policy; a note names the ``critic/`` beside it), and the outer directory as the
``global_step_N`` that file records, else the newest complete one.

A rank's missing model or optimizer file is named; the world size is ``fsdp_config.json``'s and
must agree with the file names. ``extra_state_*.pt`` and ``huggingface/`` are auxiliary files:
``consolidate`` copies ``huggingface/``; ``reshard`` copies both, the per-rank RNG and scheduler
state as its ``--rank-state`` policy says.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

from ckptools.core.manifest import (
    MODEL_FILES_DIR,
    OPTIMIZER_UNREADABLE,
    FileInfo,
    Manifest,
)
from ckptools.errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    UnsupportedCheckpointError,
)
from ckptools.formats import safe_pickle
from ckptools.io import storage
from ckptools.io.storage import open_reader
from ckptools.producers.base import NumberedSaves, digest, model_only, read_marker, register
from ckptools.producers.fsdp1 import VERL_SAVE, VERL_TRACKER
from ckptools.producers.fsdp1.optim import flat_optimizer
from ckptools.producers.fsdp1.rank_pickles import OPTIMIZER, Merged
from ckptools.producers.probing import NOT_A_DIRECTORY, DirectoryLayout
from ckptools.producers.run_dirs import directory_names, newest_numbered

LAYOUT = "verl"
CONFIG = "fsdp_config.json"
RANK_FILE = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
#: fsdp_config.json is two numbers; anything past this is not verl's
_CONFIG_MAX_BYTES = 64 << 10
STEP_DIR = VERL_SAVE
#: the roles a verl trainer saves under global_step_N/, the one read first
ROLES = ("actor", "critic")
LATEST = VERL_TRACKER


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
    except (ValueError, RecursionError) as e:
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
            shard_files, shard_world = _shard_group(path, merged, files["optim"], world)
            flat_optimizer(merged, reader, shard_files, shard_world)
            read.append("optim")
        except UnsupportedCheckpointError as e:
            unreadable = str(e)
            notes.append(f"optimizer not read: {unreadable}")
    data = {rel for kind in read for rel in files.get(kind, {}).values()}
    if files.get("extra_state"):
        notes.append(
            f"{len(files['extra_state'])} extra_state file(s) (per-rank RNG and LR scheduler "
            "state): consolidate leaves them out, reshard copies them unchanged or drops them "
            "(--rank-state)"
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


def _shard_group(
    path: str, merged: Merged, optim: dict[int, str], world: int
) -> tuple[dict[int, str], int]:
    """The optimizer files of FSDP1's one shard group and its size: every rank's at
    ``FULL_SHARD``; with ``HYBRID_SHARD`` (FSDP1 given verl's ``("ddp", "fsdp")`` mesh) the
    first replica group's, ranks ``0..S-1`` of mesh ``R x S``, the ranks that hold the model's
    DTensor shards (the other groups hold the same FlatParameter shards, all-reduced alike).

    Raises:
        UnsupportedCheckpointError: a 2-D mesh whose first replica group is not ranks 0..S-1.
    """
    mesh = merged.mesh
    if mesh is None or len(mesh) < 2:
        return optim, world
    size = mesh[-1]
    holders = {c.rank or 0 for fqn in merged.sharded for c in merged.chunks[fqn]}
    if len(mesh) != 2 or holders != set(range(size)):
        raise UnsupportedCheckpointError(
            f"{path}: FSDP1 on a {' x '.join(map(str, mesh))} mesh whose model shards are held "
            f"by ranks {sorted(holders)}, not the first replica group 0..{size - 1}; to carry "
            "the model alone pass --drop-optimizer (ckptools.load: optimizer=None)"
        )
    return {r: optim[r] for r in range(size)}, size


def _rank_of(rel: str) -> int | None:
    m = RANK_FILE.match(rel)
    return int(m.group(3)) if m else None


def _reason(path: str) -> str | None:
    """Why ``path`` is not one verl checkpoint directory (None when it is)."""
    names = directory_names(path)
    return NOT_A_DIRECTORY if names is None else _names_reason(names)


def _names_reason(names: list[str]) -> str | None:
    """Why a directory holding ``names`` is not one verl checkpoint directory."""
    if CONFIG not in names:
        return f"no {CONFIG}"
    if not any(RANK_FILE.match(n) for n in names):
        return "no *_world_size_W_rank_r.pt rank files"
    return None


def _roles(step_dir: str) -> list[str]:
    """The roles (``actor``, ``critic``) saved under ``step_dir`` as verl checkpoints."""
    return [
        r
        for r in ROLES
        if storage.outside_reason(step_dir, r) is None
        and _reason(storage.join(step_dir, r)) is None
    ]


def _recorded_step(path: str) -> tuple[str, str] | None:
    """``global_step_N`` as ``latest_checkpointed_iteration.txt`` in ``path`` records it."""
    where = storage.join(path, LATEST)
    if storage.outside_reason(path, LATEST) is not None or not storage.isfile(where):
        return None
    if storage.size(where) > _CONFIG_MAX_BYTES:
        return None
    text = storage.read_bytes(where).decode("ascii", "replace").strip()
    return (f"global_step_{int(text)}", LATEST) if text.isdigit() else None


def _resolve(path: str) -> tuple[str, list[str]]:
    """The verl checkpoint directory ``path`` stands for (itself, its ``actor/``, or that of the
    ``global_step_N`` it holds) and the notes saying which was chosen."""
    if _reason(path) is None:
        return path, []
    notes = []
    step_dir = path
    found = newest_numbered(
        path,
        STEP_DIR,
        lambda p: _save_lacks(p) is None,
        _INCOMPLETE,
        prefer=_recorded_step(path),
    )
    if found is not None:
        step_dir = storage.contained(path, found.name, named_by=path, entry="holds")
        notes.append(found.note())
    roles = _roles(step_dir)
    role = roles[0]
    if len(roles) > 1:
        notes.append(
            f"{step_dir}: reading {role}/ ({', '.join(r + '/' for r in roles[1:])} beside it: "
            "pass that directory to read it)"
        )
    return storage.contained(step_dir, role, named_by=step_dir, entry="holds"), notes


#: what a global_step_N that no reading takes lacks
_INCOMPLETE = "no actor/ or critic/ holding fsdp_config.json and every rank's files"


def _role_lacks(path: str) -> str | None:
    """What the verl checkpoint directory ``path`` lacks to be read, or None when it is whole:
    the check :func:`read_verl` makes before reading any tensor (its config, and every rank's
    model file, and optimizer file when any rank saved one). Reads names and the config only."""
    try:
        _, world, _ = _config(path)
        _rank_files(path, {name: 0 for name in directory_names(path) or ()}, world)
    except CkptError as e:
        return str(e)
    return None


def _save_lacks(path: str) -> str | None:
    """What the save ``global_step_N`` lacks: a role, or a rank file of any role it holds
    (a cut-off save is not whole, so ``ckpt list`` and reading the run directory skip it)."""
    roles = _roles(path)
    if not roles:
        return _INCOMPLETE
    for role in roles:
        lacks = _role_lacks(storage.join(path, role))
        if lacks is not None:  # named from the save: the listing's row names the save
            return lacks.removeprefix(path).lstrip("/")
    return None


def _latest(root: str, names: list[str]) -> str | None:
    recorded = _recorded_step(root)
    return recorded[0] if recorded else None


_RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_\d+\.pt$")


def _save_ranks(path: str) -> int | None:
    for role in ROLES:
        for name in directory_names(storage.join(path, role)) or ():
            m = _RANK_FILE.match(name)
            if m:
                return int(m.group(1))
    return None


class VerlLayout(DirectoryLayout):
    name = LAYOUT
    description = (
        "verl FSDPCheckpointManager per-rank files (*_world_size_W_rank_r.pt), or the "
        "global_step_N/ (actor/, critic/) and the run directory holding them"
    )

    def probe_names(self, path: str, names: list[str]) -> str | None:
        reason = _names_reason(names)
        if reason is None or _roles(path):
            return None
        if any(STEP_DIR.match(n) for n in names):
            return None  # reading it says which global_step_N is complete
        return f"{reason}, no actor/ holding one, no global_step_N/"

    def numbered_saves(self) -> NumberedSaves:
        return NumberedSaves(STEP_DIR, _save_lacks, recorded=_latest, ranks=_save_ranks)

    def read_manifest(self, path: str) -> Manifest:
        inner, notes = _resolve(path)
        manifest = read_verl(inner)
        return replace(manifest, notes=(*notes, *manifest.notes)) if notes else manifest


register(VerlLayout())
