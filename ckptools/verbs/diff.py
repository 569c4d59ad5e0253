"""``ckptools.diff``: do two checkpoints hold the same model?

Both sides may be in any format ckptools reads (DCP and its wrappers, safetensors, ``torch.save``).
Tensors are matched by the model's own FQNs, found the way ``consolidate`` finds them
(:func:`ckptools.core.keys.model_keys`: the model part of the key tree, wrapper segments such as
``_orig_mod.`` stripped), so DCP's ``model.layers.0.w`` meets the safetensors ``layers.0.w`` of
its consolidation. Non-model state (optimizer, counters) is not compared.

Every record that stores a CRC-32 (a DCP item, a ``torch.save`` record) is checked against it
from the bytes read for the comparison (:class:`~ckptools.engine.checked_copy.ReadChecks`): a
damaged record is a :class:`~ckptools.errors.CorruptCheckpointError` naming the file and the
tensor, as ``consolidate`` and ``verify`` report it, not "1 element differs".

Values are compared in slabs of whole dim-0 rows read straight from each side's stored chunks
(however each side is sharded), so memory is bounded by :data:`DEFAULT_BLOCK_BYTES` per side plus
float64 temporaries of the same number of elements, never by the tensor's size: one tensor's
comparison is :mod:`ckptools.views.tensor_compare`.

Example:
    >>> import ckptools
    >>> report = ckptools.diff("checkpoints/step-1000", "hf_model")  # doctest: +SKIP
    >>> report.identical  # doctest: +SKIP
    True
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ckptools.core import keys
from ckptools.core.manifest import Manifest
from ckptools.errors import UsageError
from ckptools.formats.stream_transforms import require_decodable
from ckptools.io import storage
from ckptools.io.storage import open_reader
from ckptools.io.tunables import env_int
from ckptools.views.tensor_compare import TensorDiff, compare

# TensorDiff is read here by the CLI and verify: it stays importable from diff
__all__ = [
    "BLOCK_BYTES_ENV",
    "DEFAULT_BLOCK_BYTES",
    "DiffReport",
    "TensorDiff",
    "diff",
    "resolve_block_bytes",
]

#: Bytes of one side's slab: with both sides and float64 temporaries (up to 8/itemsize × more)
#: a comparison stays under ~200 MiB even for fp16/bf16 tensors.
DEFAULT_BLOCK_BYTES = 16 * 2**20
BLOCK_BYTES_ENV = "CKPTOOLS_DIFF_BLOCK_BYTES"


@dataclass(frozen=True)
class DiffReport:
    """The result of :func:`diff`: one :class:`TensorDiff` per model tensor on either side."""

    a: str
    b: str
    format_a: str
    format_b: str
    atol: float | None
    rtol: float | None
    tensors: tuple[TensorDiff, ...]
    bytes_compared: int = 0
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default=())

    @property
    def identical(self) -> bool:
        """Same names, dtypes and shapes, and every value equal (or within tolerance)."""
        return all(t.status in ("equal", "close") for t in self.tensors)

    @property
    def differences(self) -> list[TensorDiff]:
        return [t for t in self.tensors if t.status not in ("equal", "close")]

    def to_dict(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.status] = counts.get(t.status, 0) + 1
        return {
            "a": self.a,
            "b": self.b,
            "format_a": self.format_a,
            "format_b": self.format_b,
            "atol": self.atol,
            "rtol": self.rtol,
            "identical": self.identical,
            "counts": counts,
            "bytes_compared": self.bytes_compared,
            "seconds": round(self.seconds, 4),
            "notes": list(self.notes),
            "tensors": [t.to_dict() for t in self.tensors],
        }


def resolve_block_bytes() -> int:
    """``CKPTOOLS_DIFF_BLOCK_BYTES`` > :data:`DEFAULT_BLOCK_BYTES`."""
    return env_int(BLOCK_BYTES_ENV, DEFAULT_BLOCK_BYTES)


def _converted(
    manifest: Manifest, names: dict[str, str], cfg: dict[str, Any] | None, in_memory: bool
) -> tuple[Manifest, dict[str, str], str | None, dict[str, str]]:
    """One side's model tensors in the on-disk format (or, ``in_memory``, the in-memory form)
    of the transformers conversion ``cfg`` names, a note naming the mapping applied, and the
    dtype the model keeps some of them in (:attr:`ckptools.plan.conversions.KeyMap.kept_dtypes`:
    compared so, as ``consolidate`` writes them)."""
    from ckptools.engine.converted import to_disk_names, to_memory_names
    from ckptools.views.export import kept_note
    from ckptools.views.producer import views_of

    views = views_of(manifest)
    if views is not None:  # the producer's view as the HF model, as consolidate writes it
        hf, hf_names, mapping, _ = views.as_hf(manifest, names, cfg, check=False)
        rules = "; ".join(mapping.rules)
        note = f"compared as the HF model: {mapping.mapping}: {rules}"
        kept = {n: d for n, d in mapping.kept_dtypes.items() if n in hf_names}
        widened = kept_note(hf, hf_names, kept)
        return hf, hf_names, note + (f"; {widened}" if widened else ""), kept
    # quiet: diff has no quiet option for its --json to imply yet, so no status line while a
    # conversion is derived (the cache still spares the next run the derivation)
    if in_memory:
        manifest, out, keymap = to_memory_names(manifest, names, cfg, quiet=True)
    else:  # the values are compared next: no separate CRC pass
        manifest, out, keymap = to_disk_names(manifest, names, cfg, check=False, quiet=True)
    kind = "in-memory layout" if in_memory else "on-disk format"
    if keymap is None:
        return manifest, names, None, {}
    note = f"compared in the {kind} of {keymap.mapping}: " + "; ".join(keymap.rules)
    return manifest, out, note, {}


def _tied_aliases(
    names: Mapping[str, str],
    other: Mapping[str, str],
    manifest: Manifest,
    other_path: str,
    config: str | None,
) -> dict[str, str]:
    """``{output embedding: input embedding}`` for the output embeddings of ``names`` that the
    other side leaves out because its model ties them (``tie_word_embeddings`` in its
    ``config.json``, or in ``config``): what ``consolidate`` and ``save_pretrained`` write, and
    what ``from_pretrained`` fills from the input embedding. Empty unless such a name exists.
    """
    from ckptools.views.export import tie_setting, tied_candidates
    from ckptools.views.model_config import find_model_files

    pairs = [(o, i) for o, i in tied_candidates(names, manifest) if o not in other and i in other]
    if not pairs or not tie_setting(find_model_files(other_path, config)):
        return {}
    found: dict[str, str] = {}
    for o, i in pairs:
        found.setdefault(o, i)
    return found


def _quantized_notes(*sides: tuple[str, Manifest, Mapping[str, str]]) -> list[str]:
    """For each side (path, manifest, model names) storing weights quantized: that it is
    compared as stored, and the command that writes its plain model."""
    return [
        f"{side}: {count} weight(s) stored quantized, with their scales: compared as stored; "
        f"its plain model is `ckpt consolidate {path} OUT --dtype bfloat16`"
        for side, (path, m, names) in zip("AB", sides, strict=True)
        if (count := _quantized(m, names))
    ]


def _quantized(manifest: Manifest, names: Mapping[str, str]) -> int:
    """How many of the model's weights ``manifest`` stores quantized beside their scales (a
    layout that decodes stored forms: :func:`ckptools.producers.base.decodes_of`); 0 for
    every other checkpoint."""
    from ckptools.producers.base import decodes_of

    decodes = decodes_of(manifest)
    if decodes is None:
        return 0
    decoded = decodes.decoded(manifest, dict(names), None)
    if decoded.names == dict(names):
        return 0
    return sum(manifest.tensors[f].dtype.startswith("float8") for f in decoded.names.values())


def _lora_views(
    paths: tuple[str, str],
    manifests: tuple[Manifest, Manifest],
    names: tuple[Mapping[str, str], Mapping[str, str]],
    notes: list[str],
) -> tuple[Mapping[str, str], Mapping[str, str]]:
    """Each side's names, a PEFT-wrapped model's replaced by its adapter's when the other side
    is that adapter's export (``consolidate --adapter``, ``PeftModel.save_pretrained``); the
    note for a PEFT-wrapped side (:func:`ckptools.views.lora.diff_view`) added to ``notes``."""
    from ckptools.views import lora

    out = list(names)
    for i, side in enumerate("AB"):
        view = lora.diff_view(names[i], manifests[i], names[1 - i].keys(), paths[i])
        if view is None:
            continue
        adapter, note = view
        if adapter is not None:
            out[i] = adapter
        notes.append(f"{side}: {note}")
    return out[0], out[1]


def _compare_all(
    ma: Manifest,
    mb: Manifest,
    names_a: Mapping[str, str],
    names_b: Mapping[str, str],
    tied: tuple[dict[str, str], dict[str, str]],
    atol: float | None,
    rtol: float | None,
    kept: tuple[Mapping[str, str], Mapping[str, str]] = ({}, {}),
) -> tuple[list[TensorDiff], int]:
    """Every name of either side compared (or named missing / unexpected); ``tied``: the
    output embeddings that A, then B, leaves out as tied (:func:`_tied_aliases`), each compared
    with the input embedding it is tied to on that side; ``kept``: per side, the dtype the
    model keeps a name in (compared in it)."""
    tied_a, tied_b = tied
    kept_a, kept_b = kept
    block = resolve_block_bytes()
    out: list[TensorDiff] = []
    compared = 0
    with open_reader(ma.data_dir()) as ra, open_reader(mb.data_dir()) as rb:
        for name, fqn_a in names_a.items():
            ta = ma.tensors[fqn_a]
            fqn_b = names_b.get(name, names_b.get(tied_b.get(name, "")))
            if fqn_b is None:
                out.append(
                    TensorDiff(name, "missing", fqn_a, None, ta.dtype, None, tuple(ta.shape))
                )
                continue
            seen = (kept_a.get(name), kept_b.get(name))
            result, n = compare(name, ta, mb.tensors[fqn_b], ra, rb, atol, rtol, block, seen)
            if name in tied_b:
                result = replace(result, tied_to=tied_b[name], tied_in="B")
            out.append(result)
            compared += n
        for name, fqn_b in names_b.items():
            if name in names_a:
                continue
            tb = mb.tensors[fqn_b]
            if name in tied_a:
                ta = ma.tensors[names_a[tied_a[name]]]
                result, n = compare(name, ta, tb, ra, rb, atol, rtol, block)
                out.append(replace(result, tied_to=tied_a[name], tied_in="A"))
                compared += n
                continue
            out.append(
                TensorDiff(name, "unexpected", None, fqn_b, None, tb.dtype, None, tuple(tb.shape))
            )
    return out, compared


@storage.accepts_storage_options
def diff(
    a: str,
    b: str,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    format_a: str | None = None,
    format_b: str | None = None,
    config: str | None = None,
    keep_in_memory_names: bool = False,
    storage_options: storage.StorageOptions | None = None,
) -> DiffReport:
    """Compare the models in two checkpoints, tensor by tensor.

    Reports names only in A (``missing``) or only in B (``unexpected``), dtype and shape
    differences, and per tensor bit-exact equality; with ``atol``/``rtol`` an element is equal
    when ``|a - b| <= atol + rtol * |b|`` (NaN equals NaN), and the max absolute and relative
    differences are reported. Bounded memory (see the module docstring).

    Args:
        a: the first checkpoint (any format ckptools reads).
        b: the second checkpoint.
        atol: absolute tolerance (default: bit-exact comparison).
        rtol: relative tolerance (default: bit-exact comparison).
        format_a: force the layout of ``a``.
        format_b: force the layout of ``b``.
        config: the model's ``config.json`` (or a directory with it); default: beside each
            side. When it names a transformers conversion both sides are compared in the
            on-disk format ``save_pretrained`` writes (:mod:`ckptools.plan.conversions`), so a
            DCP of fused MoE experts meets its per-expert model directory.
        keep_in_memory_names: compare in the in-memory form (fused experts) instead.
        storage_options: fsspec options for URL paths (credentials, endpoint...), a mapping
            or its JSON text; see :func:`ckptools.io.storage.storage_options`.

    Returns:
        A :class:`DiffReport`; ``report.identical`` is True when nothing differs.

    Raises:
        CorruptCheckpointError: a record read fails its stored CRC-32 (names file and tensor).
        CkptError: either checkpoint cannot be read (e.g. a missing file); run ``ckpt verify``.

    Example:
        >>> report = diff("checkpoints/step-1000", "hf_model")  # doctest: +SKIP
        >>> [t.describe() for t in report.differences]  # doctest: +SKIP
        ["model.norm.weight: 1 element(s) differ, first at [3]: 1.0 vs 1.5; ..."]
    """
    from ckptools.producers import read_manifest

    for name, tol in (("atol", atol), ("rtol", rtol)):
        if tol is not None and (tol < 0 or not math.isfinite(tol)):
            raise UsageError(f"{name}={tol}: expected a finite number >= 0")
    t0 = time.perf_counter()
    ma, mb = read_manifest(a, format_a), read_manifest(b, format_b)
    names_a, names_b = keys.model_keys(ma), keys.model_keys(mb)
    for m, names in ((ma, names_a), (mb, names_b)):
        require_decodable(m, names.values(), objects=())  # before a byte is compared
    forms = _quantized_notes((a, ma, names_a), (b, mb, names_b))
    notes: list[str] = []
    kept_a: dict[str, str] = {}
    kept_b: dict[str, str] = {}
    if names_a.keys() != names_b.keys():
        names_a, names_b = _lora_views((a, b), (ma, mb), (names_a, names_b), notes)
    if config is not None or keep_in_memory_names or names_a.keys() != names_b.keys():
        from ckptools.views.model_config import find_model_files, model_config

        # a DCP has no config.json of its own: the other side's names the model
        cfg_a, cfg_b = (model_config(find_model_files(s, config)) for s in (a, b))
        ma, names_a, note_a, kept_a = _converted(ma, dict(names_a), cfg_a or cfg_b,
                                                 keep_in_memory_names)  # fmt: skip
        mb, names_b, note_b, kept_b = _converted(mb, dict(names_b), cfg_b or cfg_a,
                                                 keep_in_memory_names)  # fmt: skip
        notes += [f"{side}: {n}" for side, n in (("A", note_a), ("B", note_b)) if n]
    tied_b = _tied_aliases(names_a, names_b, ma, b, config)  # in A, tied (not stored) in B
    tied_a = _tied_aliases(names_b, names_a, mb, a, config)  # in B, tied (not stored) in A
    out, compared = _compare_all(ma, mb, names_a, names_b, (tied_a, tied_b), atol, rtol,
                                 (kept_a, kept_b))  # fmt: skip
    notes += [
        f"{t.name}: not stored in {t.tied_in}, whose config ties it to {t.tied_to}; "
        f"compared with that"
        for t in out
        if t.tied_to is not None
    ]
    if not names_a and not names_b:
        notes.append("neither checkpoint holds model tensors")
    if any(t.status != "equal" for t in out):
        notes += forms
    return DiffReport(
        a=a,
        b=b,
        format_a=ma.layout,
        format_b=mb.layout,
        atol=atol,
        rtol=rtol,
        tensors=tuple(out),
        bytes_compared=compared,
        seconds=time.perf_counter() - t0,
        notes=tuple(notes),
    )
