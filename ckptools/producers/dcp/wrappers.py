"""Directories that training frameworks build around DCP checkpoints.

Users point at the outer directory they have; these layouts find the DCP directories inside and
merge their manifests (file paths stay relative to the outer directory):

* accelerate ``save_state`` with FSDP ``SHARDED_STATE_DICT``: ``pytorch_model_fsdp_<i>/`` (keys
  ``model.*``) and ``optimizer_<i>/`` (keys ``optimizer.*``);
* transformers Trainer ``checkpoint-N/``: the accelerate directories plus ``trainer_state.json``;
  an ``output_dir`` holding several ``checkpoint-N`` resolves to the newest complete one;
* Lightning ``FSDPStrategy`` sharded checkpoints: a DCP directory plus ``meta.pt`` (the rest of
  the Lightning checkpoint, read as plain values under ``meta.``);
* torchtitan ``step-N/`` DCP directories; a ``checkpoint/`` folder of them resolves to the newest.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

from ckptools.core.manifest import Manifest
from ckptools.errors import CkptError
from ckptools.io import storage
from ckptools.producers.base import Layout, NumberedSaves, detect, read_marker, register
from ckptools.producers.dcp import ACCELERATE_SAVE, LIGHTNING_SAVE, STEP_SAVE, TRAINER_SAVE
from ckptools.producers.dcp.layout import METADATA_FILE, dcp_lacks, rank_of, read_dcp_tree
from ckptools.producers.run_dirs import directory_names, newest_numbered

_ACCEL_MODEL = re.compile(r"^pytorch_model_fsdp_\d+$")
_ACCEL_OPTIM = re.compile(r"^optimizer_\d+$")
TRAINER_STATE = "trainer_state.json"
LIGHTNING_META = "meta.pt"


def dcp_ranks(path: str) -> int | None:
    """Ranks that wrote the DCP directory ``path`` (or a Trainer save's first accelerate
    directory): one ``__<rank>_<n>.distcp`` file name or more each (what ``ckpt list`` shows)."""
    names = directory_names(path) or []
    parts = sorted(n for n in names if n.startswith("pytorch_model_fsdp_"))
    if parts and not any(n.endswith(".distcp") for n in names):
        names = directory_names(storage.join(path, parts[0])) or []
    ranks = {rank_of(n) for n in names if n.endswith(".distcp")}
    ranks.discard(None)
    return len(ranks) or None


def _steps_label(root: str) -> str:
    """Who reads a run directory of ``step-N/`` saves: torchtitan's layout when they are its,
    else the layout of the save reading the directory takes (a ``dcp.save`` per step)."""
    try:
        return detect(root).name
    except CkptError:
        return "dcp"


def _listdir(path: str) -> list[str]:
    try:
        return sorted(storage.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _is_dcp(path: str) -> bool:
    return storage.isfile(storage.join(path, METADATA_FILE))


def _is_titan_step(path: str) -> bool:
    # ``step-N`` alone is a common name (ckptools' own manager uses it); torchtitan's training
    # state always includes its ``train_state`` Stateful, whose key is found in the metadata
    # bytes without unpickling them.
    if storage.outside_reason(path, METADATA_FILE) is not None:
        return False  # never peeked at; the DCP layout refuses it with the reason
    try:
        # peek: the layout that reads this checkpoint parses the same bytes, not read again
        return b"train_state" in read_marker(storage.join(path, METADATA_FILE), peek=True)
    except (FileNotFoundError, NotADirectoryError):
        return False


def _accelerate_parts(path: str) -> list[str]:
    return [
        n
        for n in _listdir(path)
        if (_ACCEL_MODEL.match(n) or _ACCEL_OPTIM.match(n)) and storage.isdir(storage.join(path, n))
    ]


def _is_whole_dcp(path: str) -> bool:
    return dcp_lacks(path) is None


def trainer_lacks(path: str) -> str | None:
    """What the Trainer ``checkpoint-N`` directory ``path`` lacks, or None when it is whole:
    each accelerate DCP directory whole (:func:`dcp_lacks`), or a full-state model file."""
    parts = _accelerate_parts(path)
    for part in parts:
        lacks = dcp_lacks(storage.join(path, part))
        if lacks is not None:
            return f"{part}: {lacks}"
    if parts:
        return None
    # a full-state checkpoint (model.safetensors or pytorch_model*.bin, optimizer.pt)
    from ckptools.producers.hf.torch_save import directory_reason  # see TrainerLayout.read_manifest

    if directory_reason(set(_listdir(path)), path) is None:
        return None
    return "no DCP .metadata, no model file"


def accelerate_lacks(path: str) -> str | None:
    """What the accelerate ``save_state`` directory ``path`` lacks, or None when each of its
    DCP directories is whole."""
    parts = _accelerate_parts(path)
    if not parts:
        return "no pytorch_model_fsdp_*/ or optimizer_*/ inside"
    for part in parts:
        lacks = dcp_lacks(storage.join(path, part))
        if lacks is not None:
            return f"{part}: {lacks}"
    return None


def _is_lightning(path: str) -> bool:
    return _is_dcp(path) and storage.isfile(storage.join(path, LIGHTNING_META))


def lightning_lacks(path: str) -> str | None:
    """What Lightning's sharded checkpoint folder ``path`` lacks, or None when it is whole."""
    if not storage.isfile(storage.join(path, LIGHTNING_META)):
        return f"no {LIGHTNING_META}"
    return dcp_lacks(path)


def _trainer_checkpoint_complete(path: str) -> bool:
    return trainer_lacks(path) is None


class TrainerLayout(Layout):
    name = "trainer"
    groups_follow_the_model = True
    description = "transformers Trainer checkpoint-N/ (FSDP sharded), or its output_dir"

    def probe(self, path: str) -> str | None:
        if _accelerate_parts(path) and storage.isfile(storage.join(path, TRAINER_STATE)):
            return None
        if any(TRAINER_SAVE.match(n) for n in _listdir(path)):
            return None
        return "no trainer_state.json beside pytorch_model_fsdp_*/, and no checkpoint-N/ inside"

    def numbered_saves(self) -> NumberedSaves:
        return NumberedSaves(TRAINER_SAVE, trainer_lacks, ranks=dcp_ranks)

    def read_manifest(self, path: str) -> Manifest:
        parts = _accelerate_parts(path)
        if parts:
            return read_dcp_tree(path, parts, layout=self.name)
        found = newest_numbered(
            path, TRAINER_SAVE, _trainer_checkpoint_complete, "no whole DCP save, no model file"
        )
        assert found is not None
        inner = storage.contained(path, found.name, named_by=path, entry="holds")
        parts = _accelerate_parts(inner)
        # imported here: the probes (run on every DCP directory detected) need no torch.save
        # reader, nor does a sharded save
        from ckptools.producers.hf.torch_save import read_torch_save

        return found.noted(
            read_dcp_tree(inner, parts, layout=self.name) if parts else read_torch_save(inner)
        )


class _SaveOrRun(Layout):
    """A layout that reads one save, or its producer's run directory of numbered saves
    (``pattern``) as the newest whole one; the layouts differ only in what they are given."""

    def __init__(
        self,
        name: str,
        description: str,
        pattern: re.Pattern[str],
        neither: str,
        *,
        is_save: Callable[[str], bool],
        lacks: Callable[[str], str | None],
        read_save: Callable[[str], Manifest],
    ) -> None:
        self.name, self.description, self.pattern = name, description, pattern
        self.neither = neither  # what the probe says of a directory that is neither
        self._is_save, self._lacks, self._read_save = is_save, lacks, read_save

    def lacks(self, path: str) -> str | None:
        return self._lacks(path)

    def probe(self, path: str) -> str | None:
        if self._is_save(path):
            return None
        saves = [n for n in _listdir(path) if self.pattern.match(n)]
        if any(self._is_save(storage.join(path, n)) for n in saves):
            return None  # the producer's run directory
        return self.neither

    def numbered_saves(self) -> NumberedSaves:
        return NumberedSaves(self.pattern, self.lacks, ranks=dcp_ranks)

    def read_manifest(self, path: str) -> Manifest:
        if self._is_save(path):
            return self._read_save(path)
        found = newest_numbered(
            path, self.pattern, lambda p: self.lacks(p) is None, f"no whole {self.name} save"
        )
        assert found is not None
        inner = storage.contained(path, found.name, named_by=path, entry="holds")
        return found.noted(self._read_save(inner))


def _read_accelerate(path: str) -> Manifest:
    return read_dcp_tree(path, _accelerate_parts(path), layout="accelerate")


def _read_lightning(path: str) -> Manifest:
    # the DCP part alone is what a conversion rewrites; meta.pt is copied (an aux file)
    manifest = read_dcp_tree(path, layout="lightning")
    # meta.pt is among the aux files, which read_dcp_tree checked to lie inside
    from ckptools.producers.hf.torch_save import read_torch_save_file  # see TrainerLayout

    with storage.open_reader(path) as reader:
        tensors, objects, paths, info = read_torch_save_file(reader, LIGHTNING_META)
    # meta.pt holds the rest of the Lightning checkpoint (epoch, global_step, loops, hparams).
    extra_objects = {f"meta.{o.fqn}": replace(o, fqn=f"meta.{o.fqn}") for o in objects}
    extra_tensors = {f"meta.{t.fqn}": replace(t, fqn=f"meta.{t.fqn}") for t in tensors}
    return replace(
        manifest,
        tensors={**manifest.tensors, **extra_tensors},
        objects={**manifest.objects, **extra_objects},
        files={**manifest.files, LIGHTNING_META: info},
        paths={
            **manifest.paths,
            **{f"meta.{k}": ("meta", *v) for k, v in paths.items()},
        },
    )


class TorchtitanLayout(Layout):
    name = "torchtitan"
    description = "torchtitan step-N/ DCP checkpoint, or the checkpoint folder holding them"

    def probe(self, path: str) -> str | None:
        base = storage.basename(path)
        if STEP_SAVE.match(base):
            if _is_titan_step(path):
                return None
            return "a step-N/ directory without torchtitan's train_state entry"
        steps = [n for n in _listdir(path) if STEP_SAVE.match(n)]
        if steps and any(_is_titan_step(storage.join(path, n)) for n in steps):
            return None
        return "not a torchtitan step-N/ directory and holds none"

    def numbered_saves(self) -> NumberedSaves:
        # torchtitan's, or a script's dcp.save per step: labelled by who reads the directory
        return NumberedSaves(STEP_SAVE, dcp_lacks, ranks=dcp_ranks, label=_steps_label)

    def read_manifest(self, path: str) -> Manifest:
        base = storage.basename(path)
        if STEP_SAVE.match(base):
            return read_dcp_tree(path, layout=self.name)
        found = newest_numbered(path, STEP_SAVE, _is_whole_dcp, "no whole DCP save")
        assert found is not None
        inner = storage.contained(path, found.name, named_by=path, entry="holds")
        return found.noted(read_dcp_tree(inner, layout=self.name))


register(TrainerLayout())
register(
    _SaveOrRun(
        "accelerate",
        "accelerate save_state with FSDP sharded state (pytorch_model_fsdp_0/, optimizer_0/), "
        "or automatic_checkpoint_naming's checkpoints/ of checkpoint_N/ saves",
        ACCELERATE_SAVE,
        "no pytorch_model_fsdp_*/ or optimizer_*/ inside, no checkpoint_N/ holding them",
        is_save=lambda p: bool(_accelerate_parts(p)),
        lacks=accelerate_lacks,
        read_save=_read_accelerate,
    )
)
register(
    _SaveOrRun(
        "lightning",
        "Lightning FSDPStrategy sharded checkpoint (DCP files + meta.pt), or ModelCheckpoint's "
        "checkpoints/ of epoch=E-step=N.ckpt/ saves",
        LIGHTNING_SAVE,
        "no DCP .metadata with a meta.pt beside it, no epoch=E-step=N.ckpt/ holding them",
        is_save=_is_lightning,
        lacks=lightning_lacks,
        read_save=_read_lightning,
    )
)
register(TorchtitanLayout())
