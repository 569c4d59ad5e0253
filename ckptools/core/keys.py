"""Finding the model inside a checkpoint's key tree, and the model's own FQNs.

Training code saves nested state dicts (``{"model": ..., "optim": ...}``,
``{"app": {"model": ...}}``); DCP records each key's path in that tree (``planner_data``), so the
model part is found from the paths, never guessed from dotted names (an HF model's own FQNs start
with ``model.`` too). Wrapper segments that torch inserts into module names (``_orig_mod.`` from
``torch.compile``, ``module.`` from DDP, FSDP1's ``_fsdp_wrapped_module.`` and activation
checkpointing's ``_checkpoint_wrapped_module.``) are not part of the model's FQNs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ckptools.core.manifest import Manifest

#: containers that hold the model's state dict in the layouts users have
MODEL_CONTAINERS = ("model", "module", "state_dict", "model_state_dict", "model_state")
#: containers that hold other training state; never the model
NON_MODEL_CONTAINERS = (
    "optim",
    "optimizer",
    "optimizers",
    "optimizer_states",
    "lr_scheduler",
    "lr_schedulers",
    "scheduler",
    "dataloader",
    "train_state",
    "meta",
    "extra",
    "rng",
)
WRAPPER_SEGMENTS = (
    "_orig_mod",
    "module",
    "_fsdp_wrapped_module",
    "_checkpoint_wrapped_module",
    "_dp_wrapped_module",
)


@dataclass(frozen=True)
class ModelPart:
    """Where the model's tensors are: under ``path`` (a key path), minus ``excluded`` top keys."""

    path: tuple[str, ...]
    excluded: tuple[str, ...] = ()

    @property
    def prefix(self) -> str:
        return "".join(f"{p}." for p in self.path)

    def contains(self, key_path: tuple[str, ...]) -> bool:
        n = len(self.path)
        if key_path[:n] != self.path or len(key_path) <= n:
            return False
        return key_path[n] not in self.excluded


def key_path(manifest: Manifest, fqn: str) -> tuple[str, ...]:
    return manifest.paths.get(fqn, (fqn,))


def find_model_part(manifest: Manifest) -> ModelPart:
    """The sub-tree holding the model's tensors.

    Descends through containers: a known model container (``model``...) is taken; a single
    container that holds all tensors (``app``) is entered; when tensors sit at several top keys,
    those that name other training state (``optimizer``...) are excluded (torchtitan keeps the
    model's FQNs at the top level beside ``optimizer``).
    """
    paths = [key_path(manifest, f) for f in manifest.tensors]
    prefix: tuple[str, ...] = ()
    while True:
        n = len(prefix)
        heads: dict[str, int] = {}
        for p in paths:
            if p[:n] == prefix and len(p) > n + 1:
                heads[p[n]] = heads.get(p[n], 0) + 1
        leaves = sum(1 for p in paths if p[:n] == prefix and len(p) == n + 1)
        chosen = next((c for c in MODEL_CONTAINERS if c in heads), None)
        if chosen is not None:
            prefix = (*prefix, chosen)
            continue
        if len(heads) == 1 and leaves == 0 and next(iter(heads)) not in NON_MODEL_CONTAINERS:
            prefix = (*prefix, next(iter(heads)))
            continue
        excluded = tuple(sorted(h for h in heads if h in NON_MODEL_CONTAINERS))
        return ModelPart(prefix, excluded)


def strip_wrappers(fqn: str) -> str:
    """Remove wrapper segments: ``_orig_mod.module.layers.0.w`` → ``layers.0.w``."""
    parts = [p for p in fqn.split(".") if p not in WRAPPER_SEGMENTS]
    return ".".join(parts)


def model_keys(manifest: Manifest, part: ModelPart | None = None) -> Mapping[str, str]:
    """Map each model tensor's own FQN to the stored FQN."""
    part = part if part is not None else find_model_part(manifest)
    out: dict[str, str] = {}
    for fqn in manifest.tensors:
        p = key_path(manifest, fqn)
        if part.contains(p):
            out[strip_wrappers(".".join(p[len(part.path) :]))] = fqn
    return out
