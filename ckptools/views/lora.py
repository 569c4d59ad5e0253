"""PEFT LoRA checkpoints: recognise a PEFT-wrapped model, export its adapter, merge it.

A PEFT-wrapped model's state dict names the frozen base weight of a target module
``base_model.model.<module>.base_layer.weight`` and its adapter ``<module>.lora_A.<adapter>.weight``
(``[r, in]``) and ``<module>.lora_B.<adapter>.weight`` (``[out, r]``). The checkpoint holds ``r``
(the rows of ``lora_A``) and the target modules (the names), but not ``lora_alpha``,
``use_rslora`` or the rest of the ``LoraConfig``: they come from ``--lora-alpha`` or an
``adapter_config.json`` (``--adapter-config``), never guessed.

* :func:`scan` finds the adapters in a list of names (``ckpt inspect`` shows it).
* :func:`adapter_names` maps peft's on-disk names (``...lora_A.weight``, adapter name dropped, as
  ``PeftModel.save_pretrained`` writes) to the stored FQNs: export streams only those bytes.
* :func:`merged_names` maps the names ``from_pretrained`` loads (``base_layer.`` and
  ``base_model.model.`` removed) to the stored FQNs; :func:`merge_into` then adds
  ``(B @ A) * scale`` to each target weight in the written file, one module at a time, computed
  as peft's ``LoraLayer.merge`` does on CPU.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptools.core import keys
from ckptools.core.hf_files import ADAPTER_CONFIG_NAME as ADAPTER_CONFIG_NAME
from ckptools.core.hf_files import ADAPTER_WEIGHTS_NAME as ADAPTER_WEIGHTS_NAME
from ckptools.core.manifest import Manifest
from ckptools.errors import CkptError, UsageError
from ckptools.io import storage
from ckptools.views.peft_defaults import with_peft_defaults

#: The prefix a ``PeftModel`` puts before the wrapped model's names.
PEFT_PREFIX = "base_model.model."
#: Elements of a weight merged at once: 16 Mi (64 MiB of float32 delta, and the rows' bytes),
#: so a merge's memory does not grow with the largest weight.
MERGE_BLOCK_ELEMENTS = 16 * 2**20
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$")
# Other adapter tensors peft may hold (DoRA magnitudes, embedding adapters, lora_B biases): not
# handled by this module, so refused by name rather than silently dropped.
_OTHER = re.compile(r"\.(lora_magnitude_vector|lora_embedding_[AB])\.|\.lora_B\.[^.]+\.bias$")
_BASE = ".base_layer."
#: an adapter as ``PeftModel.save_pretrained`` (and ``--adapter``) writes it: adapter name dropped
_SAVED = re.compile(r"\.lora_[AB]\.weight$")


@dataclass(frozen=True)
class LoraModule:
    """One target module of one adapter: names as given to :func:`scan`.

    Attributes:
        module: the module's name (``base_model.model.model.layers.0.self_attn.q_proj``).
        adapter: the adapter's name (``default``).
        a: the name of ``lora_A``'s weight ``[r, in]``; b: ``lora_B``'s ``[out, r]``.
        rank: ``r``, the rows of ``lora_A``.
        base: the name of the frozen base weight (``<module>.base_layer.weight``), if present.
    """

    module: str
    adapter: str
    a: str
    b: str
    rank: int
    base: str | None


@dataclass(frozen=True)
class LoraScan:
    """The LoRA adapters found in a model's names (:func:`scan`)."""

    modules: tuple[LoraModule, ...]

    @property
    def adapters(self) -> list[str]:
        return sorted({m.adapter for m in self.modules})

    def of(self, adapter: str) -> list[LoraModule]:
        return [m for m in self.modules if m.adapter == adapter]

    def target_modules(self, adapter: str) -> list[str]:
        """The last name segments of the adapter's modules (peft's ``target_modules``)."""
        return sorted({m.module.rsplit(".", 1)[-1] for m in self.of(adapter)})

    def summary(self) -> str:
        """``'default' on q_proj, v_proj`` for each adapter."""
        return ", ".join(f"{a!r} on {', '.join(self.target_modules(a))}" for a in self.adapters)

    def to_dict(self) -> dict[str, Any]:
        return {
            "adapters": {
                a: {
                    "target_modules": self.target_modules(a),
                    "modules": len(self.of(a)),
                    "ranks": sorted({m.rank for m in self.of(a)}),
                    "rank_per_module": {_peft_free(m.module): m.rank for m in self.of(a)},
                }
                for a in self.adapters
            }
        }


def scan(names: Iterable[str], shapes: Mapping[str, tuple[int, ...]]) -> LoraScan | None:
    """The LoRA adapters among ``names`` (``shapes``: name → shape), or None for a plain model.

    Raises:
        UsageError: a ``lora_A`` without its ``lora_B`` (or the reverse), or shapes that do not
            make ``B @ A`` (``[out, r] @ [r, in]``).
    """
    names = list(names)
    present = set(names)
    halves: dict[tuple[str, str], dict[str, str]] = {}
    for name in names:
        m = _LORA.match(name)
        if m:
            halves.setdefault((m["module"], m["adapter"]), {})[m["ab"]] = name
    if not halves:
        return None
    modules = []
    for (module, adapter), ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise UsageError(f"{module}: adapter {adapter!r} has lora_{''.join(ab)} only")
        (r, _), (_, rb) = shapes[ab["A"]], shapes[ab["B"]]
        if len(shapes[ab["A"]]) != 2 or len(shapes[ab["B"]]) != 2 or r != rb:
            raise UsageError(
                f"{module}: lora_A {list(shapes[ab['A']])} and lora_B {list(shapes[ab['B']])} "
                "are not [r, in] and [out, r]"
            )
        base = f"{module}{_BASE}weight"
        modules.append(
            LoraModule(module, adapter, ab["A"], ab["B"], r, base if base in present else None)
        )
    return LoraScan(tuple(sorted(modules, key=lambda m: (m.adapter, m.module))))


def describe(manifest: Manifest, names: Mapping[str, str]) -> dict[str, Any] | None:
    """What ``ckpt inspect`` shows of a PEFT-wrapped model (``names``: the model part, output
    name → stored FQN), or None: adapters, target modules, rank per module, and which
    parameters carry optimizer state (the trained ones) and which are frozen.

    A parameter carries optimizer state when an optimizer's ``state`` sub-tree has an entry
    under its name (torch's FQN-keyed ``get_state_dict`` form); without optimizer state in the
    checkpoint, peft's rule is reported: every non-adapter parameter is frozen.
    """
    found = scan(names, {n: manifest.tensors[f].shape for n, f in names.items()})
    if found is None:
        return None
    stateful = set()
    for fqn in manifest.tensors:
        path = keys.key_path(manifest, fqn)
        if len(path) >= 3 and path[-3] == "state":
            stateful.add(keys.strip_wrappers(path[-2]))
    adapters = {n for m in found.modules for n in (m.a, m.b)}
    with_state = sorted(n for n in names if keys.strip_wrappers(n) in stateful)
    frozen = (
        sorted(n for n in names if n not in with_state)
        if stateful
        else sorted(n for n in names if n not in adapters)
    )
    out = found.to_dict()
    out["frozen_parameters"] = len(frozen)
    out["frozen_bytes"] = sum(manifest.tensors[names[n]].nbytes for n in frozen)
    out["trainable_parameters"] = len(names) - len(frozen)
    out["with_optimizer_state"] = with_state
    out["optimizer_state_found"] = bool(stateful)
    return out


def refuse_peft_names(names: Mapping[str, str], manifest: Manifest, ways: str) -> None:
    """Refuse a plain export of a PEFT-wrapped model (``names``: the model part): its names
    (``base_model.model.*``, ``base_layer``, ``lora_A/B``) are peft's, which ``from_pretrained``
    loads as missing and unexpected keys, leaving the model on random weights. ``ways``: the
    ways forward, in the caller's terms (flags for ``consolidate``, arguments for
    ``save_pretrained``), ending the error.

    Raises:
        UsageError: ``names`` hold a LoRA adapter.
    """
    found = scan(names, {n: manifest.tensors[f].shape for n, f in names.items()})
    if found is None:
        return
    raise UsageError(
        f"{manifest.root}: a PEFT-wrapped model (LoRA {found.summary()}) whose names "
        f"from_pretrained cannot load: {ways}"
    )


def diff_view(
    names: Mapping[str, str], manifest: Manifest, other: Collection[str], path: str
) -> tuple[dict[str, str] | None, str] | None:
    """How ``ckpt diff`` meets a PEFT-wrapped model (``names``: its model part) whose names
    ``other`` (the other side's) do not share, or None when ``names`` hold no LoRA adapter.

    When ``other`` are exactly one adapter's names as ``PeftModel.save_pretrained`` and
    ``consolidate --adapter`` write them, the first item is that adapter under those names
    (:func:`adapter_names`), so it is compared with the export; else None. The second is the
    note to show, for the side ``names`` are (the checkpoint ``path``), in either case.
    """
    shapes = {n: manifest.tensors[f].shape for n, f in names.items()}
    try:
        found = scan(names, shapes)
    except UsageError:  # a half adapter: the names are compared as they are
        return None
    if found is None:
        return None
    for adapter in found.adapters:
        try:
            out, _, _ = adapter_names(names, manifest, adapter)
        except UsageError:
            break
        if set(out) == set(other):
            rest = len(names) - len(out)
            return out, (
                f"a PEFT-wrapped model (LoRA {found.summary()}): its adapter {adapter!r} "
                f"compared under peft's names, as `ckpt consolidate --adapter` writes it; its "
                f"{rest} other tensors (the base model) are not compared"
            )
    return None, (
        f"a PEFT-wrapped model (LoRA {found.summary()}) under peft's names, which the other "
        f"side does not use: compare its merged model (`ckpt consolidate {path} OUT "
        "--merge-lora --lora-alpha ALPHA`) or its adapter (`--adapter`) with it instead"
    )


def _peft_free(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX)


def _one_adapter(found: LoraScan, adapter: str | None, root: str) -> str:
    if adapter is None:
        if len(found.adapters) > 1:
            raise UsageError(
                f"{root}: adapters {', '.join(found.adapters)}; choose one with --adapter-name"
            )
        return found.adapters[0]
    if adapter not in found.adapters:
        raise UsageError(
            f"{root}: --adapter-name {adapter!r}: adapters are {', '.join(found.adapters)}"
        )
    return adapter


def _required(names: Mapping[str, str], manifest: Manifest) -> LoraScan:
    shapes = {n: manifest.tensors[f].shape for n, f in names.items()}
    found = scan(names, shapes)
    if found is None and any(_SAVED.search(n) for n in names):
        raise UsageError(
            f"{manifest.root}: a LoRA adapter alone, as PeftModel.save_pretrained (or "
            "--adapter) writes it, with no base weights: --adapter and --merge-lora take a "
            "checkpoint of the whole PEFT-wrapped model; merge this one with peft "
            "(PeftModel.from_pretrained(base_model, DIR).merge_and_unload())"
        )
    if found is None:
        raise UsageError(
            f"{manifest.root}: no LoRA adapter (no '<module>.lora_A.<adapter>.weight' tensor); "
            "--adapter and --merge-lora need a PEFT-wrapped model"
        )
    others = [n for n in names if _OTHER.search(n)]
    if others:
        raise UsageError(f"{manifest.root}: {others[0]}: this adapter tensor kind is unsupported")
    return found


def adapter_names(
    names: Mapping[str, str], manifest: Manifest, adapter: str | None
) -> tuple[dict[str, str], str, LoraScan]:
    """peft's on-disk name → stored FQN of one adapter's tensors, the adapter, and the scan.

    ``...q_proj.lora_A.default.weight`` becomes ``base_model.model....q_proj.lora_A.weight``,
    as ``get_peft_model_state_dict`` names it (the prefix added when the names lack it).
    """
    found = _required(names, manifest)
    chosen = _one_adapter(found, adapter, manifest.root)
    out: dict[str, str] = {}
    for m in found.of(chosen):
        module = m.module if m.module.startswith(PEFT_PREFIX) else PEFT_PREFIX + m.module
        out[f"{module}.lora_A.weight"] = names[m.a]
        out[f"{module}.lora_B.weight"] = names[m.b]
    return out, chosen, found


@dataclass(frozen=True)
class MergeTarget:
    """One weight to merge: its output name, its adapter's stored FQNs and peft's scale."""

    name: str
    a: str
    b: str
    scale: float


def merged_names(
    names: Mapping[str, str], manifest: Manifest, adapter: str | None, config: Mapping[str, Any]
) -> tuple[dict[str, str], list[MergeTarget]]:
    """``from_pretrained``'s name → stored FQN of the merged model, and the weights to merge.

    Every adapter tensor is left out; ``base_layer.`` and ``base_model.model.`` are removed from
    the rest. ``config`` is the adapter config (:func:`adapter_config`).

    Raises:
        UsageError: a target module without its base weight, or a config this cannot merge.
    """
    found = _required(names, manifest)
    chosen = _one_adapter(found, adapter, manifest.root)
    if config.get("alpha_pattern"):
        raise UsageError("--adapter-config: alpha_pattern is not supported by --merge-lora")
    adapters = {n for m in found.modules for n in (m.a, m.b)}
    out: dict[str, str] = {}
    for name, fqn in names.items():
        if name not in adapters:
            out[_peft_free(name.replace(_BASE, "."))] = fqn
    alpha, rslora = float(config["lora_alpha"]), bool(config.get("use_rslora", False))
    if config.get("fan_in_fan_out"):
        raise UsageError("--adapter-config: fan_in_fan_out (Conv1D models) is not supported")
    targets = []
    for m in found.of(chosen):
        if m.base is None:
            raise UsageError(f"{manifest.root}: {m.module}: no base_layer.weight to merge into")
        scale = alpha / math.sqrt(m.rank) if rslora else alpha / m.rank
        targets.append(MergeTarget(_peft_free(m.base.replace(_BASE, ".")), names[m.a],
                                   names[m.b], scale))  # fmt: skip
    return out, targets


def adapter_config(
    found: LoraScan,
    adapter: str,
    *,
    lora_alpha: float | None,
    config_file: str | None,
    model_config: Mapping[str, Any] | None,
    source: str = "the checkpoint",
    defaults: bool = True,
) -> dict[str, Any]:
    """The ``adapter_config.json`` peft's ``save_pretrained`` writes for this adapter
    (``defaults=False``: only what a merge reads, without importing peft for its defaults).

    From ``config_file`` (an ``adapter_config.json``, e.g. the one training wrote) when given,
    with ``lora_alpha`` overriding its alpha; else built from the checkpoint (``r``,
    ``target_modules``, ``rank_pattern`` for modules of another rank) and ``lora_alpha``, with
    the installed peft's ``LoraConfig`` defaults when peft is importable. ``task_type`` is
    ``CAUSAL_LM`` for a ``*ForCausalLM`` model config; ``base_model_name_or_path`` its
    ``_name_or_path``. ``inference_mode`` is true, as peft writes it.

    Raises:
        UsageError: no alpha (names ``source`` and ``--lora-alpha``), an unreadable config file,
            one whose ``r`` disagrees with the checkpoint, or an alpha that is not positive.
    """
    modules = found.of(adapter)
    ranks = [m.rank for m in modules]
    r = max(set(ranks), key=ranks.count)
    if config_file is not None:
        try:
            given = storage.read_json(config_file, what="adapter config")
        except (OSError, CkptError) as e:
            raise UsageError(f"--adapter-config {config_file}: cannot read it: {e}") from e
        if not isinstance(given, dict) or given.get("peft_type", "LORA") != "LORA":
            raise UsageError(f"--adapter-config {config_file}: not a LoRA adapter_config.json")
        cfg = dict(given)
        if cfg.get("r") not in (None, r) and not cfg.get("rank_pattern"):
            raise UsageError(
                f"--adapter-config {config_file}: r={cfg['r']} but lora_A has {r} rows"
            )
        if lora_alpha is not None:
            cfg["lora_alpha"] = lora_alpha
    else:
        if lora_alpha is None:
            raise UsageError(
                f"{source}: LoRA checkpoints do not store lora_alpha: give --lora-alpha A "
                "(or --adapter-config adapter_config.json)"
            )
        cfg = {"r": r, "lora_alpha": lora_alpha}
    if "lora_alpha" not in cfg:
        raise UsageError(f"--adapter-config {config_file}: no lora_alpha; give --lora-alpha A")
    alpha = cfg["lora_alpha"]
    if not (isinstance(alpha, int | float) and math.isfinite(alpha) and alpha > 0):
        raise UsageError(
            f"--adapter-config {config_file}: lora_alpha {alpha!r}: expected a positive number"
        )
    cfg["r"] = cfg.get("r") or r
    cfg.setdefault("target_modules", found.target_modules(adapter))
    if not cfg.get("rank_pattern"):
        cfg["rank_pattern"] = {_peft_free(m.module): m.rank for m in modules if m.rank != r}
    arch = (model_config or {}).get("architectures") or []
    if cfg.get("task_type") is None and any(str(a).endswith("ForCausalLM") for a in arch):
        cfg["task_type"] = "CAUSAL_LM"
    if cfg.get("base_model_name_or_path") is None and model_config:
        cfg["base_model_name_or_path"] = model_config.get("_name_or_path") or None
    cfg["peft_type"] = "LORA"
    cfg["inference_mode"] = True
    return with_peft_defaults(cfg) if config_file is None and defaults else cfg


def config_json(cfg: Mapping[str, Any]) -> bytes:
    """``cfg`` serialised as peft's ``PeftConfigMixin.save_pretrained`` does."""
    return json.dumps(dict(cfg), indent=2, sort_keys=True, default=str).encode()


class _Delta:
    """``(B @ A) * scale`` of one target, row block by row block, as peft's ``merge`` computes
    it on CPU: a bf16/fp16 adapter multiplied in float32 and cast back to its dtype, then added
    in place in the weight's dtype. ``A`` and ``B`` are read once, on first use."""

    def __init__(self, target: MergeTarget, manifest: Manifest, rows: int) -> None:
        self.target = target
        self.manifest = manifest
        self._ab: tuple[Any, Any, Any] | None = None
        self._lock = threading.Lock()
        self._rows_left = rows  # once all are added the factors are let go: at hundreds of
        # targets, keeping every adapter would grow with the model

    def _factors(self) -> tuple[Any, Any, Any]:
        with self._lock:
            if self._ab is None:
                import torch

                from ckptools.engine.reader import read_tensor

                a = read_tensor(self.manifest, self.target.a)
                b = read_tensor(self.manifest, self.target.b)
                low = b.dtype in (torch.float16, torch.bfloat16)
                self._ab = (a.float(), b.float(), b.dtype) if low else (a, b, None)
            return self._ab

    def add(self, weight: Any, first: int, stop: int) -> None:
        """Add rows ``[first, stop)`` of the delta to ``weight`` (those rows), in place.

        The same operations as ``(B @ A) * scale`` then ``+=``, into this thread's workspace
        (:func:`_workspace`): a block's delta is never a fresh allocation, which glibc would keep
        in the thread's arena after the first few (its mmap threshold rises to their size).
        """
        import torch

        a, b, low = self._factors()
        rows, cols = stop - first, a.shape[1]
        delta = _workspace("delta", rows * cols, b.dtype).view(rows, cols)
        torch.matmul(b[first:stop], a, out=delta)
        delta.mul_(self.target.scale)
        if low is not None:
            weight += _workspace("cast", rows * cols, low).view(rows, cols).copy_(delta)
        else:
            weight += delta
        with self._lock:
            self._rows_left -= rows
            if self._rows_left <= 0:
                self._ab = None


_WORKSPACES = threading.local()


def _workspace(name: str, numel: int, dtype: Any) -> Any:
    """This thread's reusable 1-D tensor ``name`` of at least ``numel`` elements of ``dtype``
    (its first ``numel``); freed with the thread, or by :func:`_free_workspaces`."""
    import torch

    have = getattr(_WORKSPACES, name, None)
    if have is None or have.dtype != dtype or have.numel() < numel:
        have = torch.empty(numel, dtype=dtype)
        setattr(_WORKSPACES, name, have)
    return have[:numel]


def _free_workspaces() -> None:
    for name in ("delta", "cast"):
        if hasattr(_WORKSPACES, name):
            delattr(_WORKSPACES, name)


def row_transforms(
    targets: list[MergeTarget], plans: Mapping[str, Any], manifest: Manifest
) -> dict[str, Callable[[int, int, memoryview], None]]:
    """Output name -> a row transform (``engine.chunk_copier.RowTransform``) merging its adapter
    while the executor writes the weight: each weight is written once, already merged.

    ``plans``: output name -> its :class:`~ckptools.plan.safetensors.TensorPlan`.
    """
    import torch

    out: dict[str, Callable[[int, int, memoryview], None]] = {}
    for t in targets:
        plan = plans.get(t.name)
        if plan is None:
            continue
        delta, dtype = _Delta(t, manifest, plan.shape[0]), getattr(torch, plan.dtype)
        cols = plan.shape[1]

        def merge(
            first: int, stop: int, rows: memoryview, delta: _Delta = delta, dtype: Any = dtype,
            cols: int = cols,
        ) -> None:  # fmt: skip
            weight = torch.frombuffer(rows, dtype=dtype).view(stop - first, cols)
            delta.add(weight, first, stop)

        out[t.name] = merge
    return out


def merge_into(path: str, tensors: Mapping[str, Any], targets: list[MergeTarget],
               manifest: Manifest) -> None:  # fmt: skip
    """Add ``(B @ A) * scale`` to each target weight written in the safetensors file ``path``
    (where :func:`row_transforms` could not merge it while it was written: ranks sharing the
    copy, a cast, a row past the copy buffer).

    ``tensors``: output name → its :class:`~ckptools.plan.safetensors.TensorPlan` in this file.
    One module at a time and, inside it, blocks of rows of the weight (at most
    :data:`MERGE_BLOCK_ELEMENTS` elements): the rows read from the written bytes, added to as
    :class:`_Delta` computes, written back over the same bytes; the file is fsynced. Memory: an
    adapter and one block, whatever the weight's size (each output row is the same dot products
    as in one whole product).
    """
    import torch

    fd = os.open(path, os.O_RDWR)
    try:
        for t in targets:
            plan = tensors.get(t.name)
            if plan is None:
                continue
            out_rows, cols = plan.shape
            delta = _Delta(t, manifest, out_rows)
            itemsize = plan.nbytes // (out_rows * cols)
            step = max(1, MERGE_BLOCK_ELEMENTS // cols)
            for r0 in range(0, out_rows, step):
                rows = min(step, out_rows - r0)
                where = plan.begin + r0 * cols * itemsize
                raw = bytearray(os.pread(fd, rows * cols * itemsize, where))
                weight = torch.frombuffer(raw, dtype=getattr(torch, plan.dtype)).view(rows, cols)
                delta.add(weight, r0, r0 + rows)
                os.pwrite(fd, memoryview(raw), where)
        os.fsync(fd)
    finally:
        _free_workspaces()
        os.close(fd)
