"""Finding the model inside a checkpoint's key tree, and the model's own FQNs.

Training code saves nested state dicts (``{"model": ..., "optim": ...}``,
``{"app": {"model": ...}}``); DCP records each key's path in that tree (``planner_data``), so the
model part is found from the paths, never guessed from dotted names (an HF model's own FQNs start
with ``model.`` too).

Segments that wrappers insert into module names are not part of the model's FQNs, but only
where a wrapper can put them: ``_orig_mod`` (``torch.compile``), ``_fsdp_wrapped_module`` (FSDP1)
and ``_checkpoint_wrapped_module`` (activation checkpointing) are private names no model uses, so
they go wherever they stand; DDP's ``module`` is an ordinary attribute name (transformers' LeViT
keeps each residual block's layer in ``.module``, as do many custom models), so it is a wrapper
only as the first segment of the model part's FQNs, and only when every one of them has it (DDP
wraps the whole model). A model whose own top-level submodules are all one named ``module``
cannot be told from a DDP-wrapped model by its names; it loses that one segment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckptools.core.manifest import Manifest

#: containers that hold the model's state dict in the layouts users have
MODEL_CONTAINERS = ("model", "module", "state_dict", "model_state_dict", "model_state", "net")
#: containers that hold other training state; never the model
NON_MODEL_CONTAINERS = (
    "optim",
    "optimizer",
    "optimizer_state_dict",
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
#: segments wrappers insert wherever they wrap a module; no model names a submodule so
WRAPPER_SEGMENTS = (
    "_orig_mod",
    "_fsdp_wrapped_module",
    "_checkpoint_wrapped_module",
    "_dp_wrapped_module",
)
#: the two keys of torch's ``optimizer.state_dict()``
OPTIMIZER_STATE = "state"
OPTIMIZER_GROUPS = "param_groups"
#: DDP's attribute for the model it wraps: a wrapper only in front of every FQN of the model
DDP_SEGMENT = "module"


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
    model's FQNs at the top level beside ``optimizer``). The ``state`` of an optimizer state dict
    (:func:`optimizer_roots`) is never the model, whatever container it sits in: a file that
    holds an ``optimizer.state_dict()`` alone has no model part (no tensors).
    """
    paths = [key_path(manifest, f) for f in manifest.tensors]
    roots = optimizer_roots(manifest)
    prefix: tuple[str, ...] = ()
    while True:
        n = len(prefix)
        heads: dict[str, int] = {}
        for p in paths:
            if p[:n] == prefix and len(p) > n + 1:
                heads[p[n]] = heads.get(p[n], 0) + 1
        leaves = sum(1 for p in paths if p[:n] == prefix and len(p) == n + 1)
        other = NON_MODEL_CONTAINERS + ((OPTIMIZER_STATE,) if prefix in roots else ())
        chosen = next((c for c in MODEL_CONTAINERS if c in heads), None)
        if chosen is not None:
            prefix = (*prefix, chosen)
            continue
        if len(heads) == 1 and leaves == 0 and next(iter(heads)) not in other:
            prefix = (*prefix, next(iter(heads)))
            continue
        excluded = tuple(sorted(h for h in heads if h in other))
        return ModelPart(prefix, excluded)


def optimizer_roots(manifest: Manifest) -> set[tuple[str, ...]]:
    """The key paths of the optimizer state dicts in ``manifest``: torch's
    ``optimizer.state_dict()`` is ``{"state": {...}, "param_groups": [{...}, ...]}``, so a
    ``param_groups`` list of dicts marks one (an empty ``state`` leaves no entry, the groups
    always do)."""
    roots: set[tuple[str, ...]] = set()
    for fqn, entry in manifest.objects.items():
        path = key_path(manifest, fqn)
        if path[-1:] == (OPTIMIZER_GROUPS,) and is_param_groups(entry.value):
            roots.add(path[:-1])
    return roots


def is_param_groups(value: object) -> bool:
    """Whether ``value`` looks like an optimizer's ``param_groups``: a list of dicts."""
    return isinstance(value, list) and all(isinstance(g, dict) for g in value)


def strip_wrappers(fqn: str) -> str:
    """Remove the segments of :data:`WRAPPER_SEGMENTS` wherever they stand:
    ``_orig_mod.layers.0._checkpoint_wrapped_module.mlp.w`` → ``layers.0.mlp.w``. Keeps
    ``module`` (see :func:`own_names`)."""
    parts = [p for p in fqn.split(".") if p not in WRAPPER_SEGMENTS]
    return ".".join(parts)


def own_names(names: Sequence[str]) -> list[str]:
    """The model's own FQNs of ``names`` (FQNs inside one model, in the same order): wrapper
    segments removed, and DDP's leading ``module.`` when every name has it.

    ``["module.blocks.0.module.weight", "module.head.weight"]`` → ``["blocks.0.module.weight",
    "head.weight"]``; ``["blocks.0.module.weight", "head.weight"]`` is kept as it is.
    """
    stripped = [strip_wrappers(n) for n in names]
    lead = DDP_SEGMENT + "."
    if stripped and all(n.startswith(lead) for n in stripped):
        return [n[len(lead) :] for n in stripped]
    return stripped


def model_keys(manifest: Manifest, part: ModelPart | None = None) -> Mapping[str, str]:
    """Map each model tensor's own FQN to the stored FQN."""
    part = part if part is not None else find_model_part(manifest)
    paths = {fqn: key_path(manifest, fqn) for fqn in manifest.tensors}
    stored = [fqn for fqn, p in paths.items() if part.contains(p)]
    relative = [".".join(paths[fqn][len(part.path) :]) for fqn in stored]
    return dict(zip(own_names(relative), stored, strict=True))
