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
float64 temporaries of the same number of elements, never by the tensor's size. Exceptions: one
row wider than the block is read whole, and a chunk stored with non-contiguous strides (a
transposed view saved as is) is read whole once per tensor.

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
from typing import TYPE_CHECKING, Any, Literal

from ckptools.core import dtypes, keys
from ckptools.core.manifest import Chunk, Manifest, TensorEntry
from ckptools.engine.checked_copy import ReadChecks
from ckptools.engine.reader import RowBytes, resolve_chunk
from ckptools.errors import UsageError
from ckptools.formats.stream_transforms import require_decodable
from ckptools.io import storage
from ckptools.io.storage import Reader, open_reader
from ckptools.io.tunables import env_int

if TYPE_CHECKING:
    import torch

#: Bytes of one side's slab: with both sides and float64 temporaries (up to 8/itemsize × more)
#: a comparison stays under ~200 MiB even for fp16/bf16 tensors.
DEFAULT_BLOCK_BYTES = 16 * 2**20
BLOCK_BYTES_ENV = "CKPTOOLS_DIFF_BLOCK_BYTES"

DiffStatus = Literal["equal", "close", "different", "dtype", "shape", "missing", "unexpected"]


@dataclass(frozen=True)
class TensorDiff:
    """How one tensor compares.

    ``status``: ``equal`` (bit-exact), ``close`` (within ``atol``/``rtol``, not bit-exact),
    ``different``, ``dtype`` / ``shape`` (metadata differs), ``missing`` (only in A),
    ``unexpected`` (only in B). ``mismatched`` counts elements not equal (or not close);
    ``first_index`` is the first such element with its two values. ``tied_to``: side
    ``tied_in`` does not store this output embedding but ties it (its ``config.json`` sets
    ``tie_word_embeddings``: ``from_pretrained`` fills it from the input embedding ``tied_to``),
    so the other side's value was compared with that input embedding.
    """

    name: str
    status: DiffStatus
    fqn_a: str | None = None
    fqn_b: str | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    mismatched: int = 0
    max_abs: float | None = None
    max_rel: float | None = None
    first_index: tuple[int, ...] | None = None
    value_a: Any = None
    value_b: Any = None
    tied_to: str | None = None
    tied_in: Literal["A", "B"] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "fqn_a": self.fqn_a,
            "fqn_b": self.fqn_b,
            "dtype_a": self.dtype_a,
            "dtype_b": self.dtype_b,
            "shape_a": list(self.shape_a) if self.shape_a is not None else None,
            "shape_b": list(self.shape_b) if self.shape_b is not None else None,
            "mismatched": self.mismatched,
            "max_abs": _json_float(self.max_abs),
            "max_rel": _json_float(self.max_rel),
            "first_index": list(self.first_index) if self.first_index is not None else None,
            "value_a": _json_value(self.value_a),
            "value_b": _json_value(self.value_b),
            "tied_to": self.tied_to,
            "tied_in": self.tied_in,
        }

    def describe(self) -> str:
        """One line naming the tensor and what differs."""
        if self.status == "missing":
            return f"{self.name}: only in A ({self.fqn_a})"
        if self.status == "unexpected":
            return f"{self.name}: only in B ({self.fqn_b})"
        if self.status == "shape":
            return f"{self.name}: shape {list(self.shape_a or ())} vs {list(self.shape_b or ())}"
        text = f"{self.name}: "
        if self.tied_to is not None:
            text += f"tied to {self.tied_in}'s {self.tied_to} (not stored in {self.tied_in}); "
        if self.status == "dtype":
            text += f"dtype {self.dtype_a} vs {self.dtype_b}"
            if self.max_abs is None:
                return text
            text += "; "
        if self.mismatched == 0:
            return text + ("bit-exact" if self.status == "equal" else "within tolerance")
        text += f"{self.mismatched} element(s) differ"
        if self.first_index is not None:
            text += f", first at {list(self.first_index)}: {self.value_a!r} vs {self.value_b!r}"
        if self.max_abs is not None:
            text += f"; max abs diff {self.max_abs:.6g}"
        if self.max_rel is not None:
            text += f", max rel diff {self.max_rel:.6g}"
        return text


def _json_float(x: float | None) -> float | str | None:
    if x is None or math.isfinite(x):
        return x
    return str(x)  # JSON has no inf/nan


def _json_value(v: Any) -> Any:
    if isinstance(v, float):
        return _json_float(v)
    if isinstance(v, complex):
        return str(v)
    return v


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


class _SlabReader:
    """Reads rows ``[r0, r1)`` of one tensor from its stored chunks (replicas read once)."""

    def __init__(self, reader: Reader, tensor: TensorEntry, checks: ReadChecks) -> None:
        import torch

        self.reader = reader
        self.tensor = tensor
        self.checks = checks
        self.torch_dtype = getattr(torch, tensor.dtype)
        self.itemsize = tensor.itemsize
        seen: dict[tuple[tuple[int, ...], tuple[int, ...]], Chunk] = {}
        for c in tensor.chunks:
            if c.numel:
                seen.setdefault((c.offsets, c.sizes), c)
        # resolve_chunk reads a DCP item's archive directory and pickle (never its data).
        self.chunks = [resolve_chunk(reader, tensor, c) for c in seen.values()]
        self._strided: dict[int, torch.Tensor] = {}

    def read(self, r0: int, r1: int) -> torch.Tensor:
        import torch

        shape = self.tensor.shape
        if not shape:
            out = torch.empty((), dtype=self.torch_dtype)
            for c in self.chunks:
                out.copy_(self._piece(c, 0, 1))
            return out
        out = torch.empty((r1 - r0, *shape[1:]), dtype=self.torch_dtype)
        for i, c in enumerate(self.chunks):
            lo, hi = max(r0, c.offsets[0]), min(r1, c.offsets[0] + c.sizes[0])
            if lo >= hi:
                continue
            if c.strides is not None:
                whole = self._strided.get(i)
                if whole is None:
                    whole = self._strided[i] = self._whole(c)
                piece = whole[lo - c.offsets[0] : hi - c.offsets[0]]
            else:
                piece = self._piece(c, lo - c.offsets[0], hi - c.offsets[0])
            view = out.narrow(0, lo - r0, hi - lo)
            for d in range(1, len(shape)):
                view = view.narrow(d, c.offsets[d], c.sizes[d])
            view.copy_(piece)
        return out

    def _piece(self, c: Chunk, row0: int, row1: int) -> torch.Tensor:
        import torch

        row_elems = math.prod(c.sizes[1:])
        start = c.offset + row0 * row_elems * self.itemsize
        data = bytearray(self.reader.read(c.file, start, (row1 - row0) * row_elems * self.itemsize))
        self.checks.add(c, start - c.offset, data)
        flat = torch.frombuffer(data, dtype=self.torch_dtype) if data else torch.empty(0)
        return flat.view((row1 - row0, *c.sizes[1:]) if c.sizes else ())

    def _whole(self, c: Chunk) -> torch.Tensor:
        import torch

        assert c.strides is not None
        data = bytearray(self.reader.read(c.file, c.offset, c.length))
        self.checks.add(c, 0, data)
        flat = torch.frombuffer(data, dtype=self.torch_dtype)
        return flat.as_strided(c.sizes, c.strides).contiguous()


#: What a diff's CRC mismatch says after "the file is damaged".
_DAMAGED_THEN = "(`ckpt verify` on it lists every damaged record); the comparison stopped there"


def _checks(reader: Reader, tensor: TensorEntry) -> ReadChecks:
    """The stored CRC-32 of each record of ``tensor`` checked as its bytes are read, as
    ``consolidate`` and ``verify`` check them: a damaged record is an error naming its file
    and tensor, not a difference of a few elements."""
    return ReadChecks(reader, tensor.fqn, _DAMAGED_THEN)


def _bytes_equal(
    base: TensorDiff, ta: TensorEntry, tb: TensorEntry, ra: Reader, rb: Reader, block: int
) -> tuple[TensorDiff, int] | None:
    """``base`` as bit-exact and the bytes compared when two tensors of one dtype and shape
    are bit-identical, read in slabs of whole rows without torch; None when they differ (or a
    side stores a strided chunk): torch then finds which elements differ and by how much."""
    sa, sb = RowBytes(ra, ta, _checks(ra, ta)), RowBytes(rb, tb, _checks(rb, tb))
    if not (sa.contiguous and sb.contiguous):
        return None
    rows_total = ta.shape[0] if ta.shape else 1
    rows = max(1, block // max(1, math.prod(ta.shape[1:]) * ta.itemsize))
    for r0 in range(0, rows_total, rows):
        r1 = min(rows_total, r0 + rows)
        if sa.read(r0, r1) != sb.read(r0, r1):
            return None
    zero = 0.0 if _is_floatlike(ta.dtype) else None
    return replace(base, max_abs=zero, max_rel=zero), 2 * ta.numel * ta.itemsize


def _is_floatlike(dtype: str) -> bool:
    return dtypes.dtype(dtype).is_floating or dtype.startswith("complex")


def _scalar(t: torch.Tensor) -> Any:
    import torch

    if t.dtype.is_floating_point and t.dtype not in (torch.float32, torch.float64):
        t = t.float()
    return t.item()


def _compare(
    name: str,
    ta: TensorEntry,
    tb: TensorEntry,
    ra: Reader,
    rb: Reader,
    atol: float | None,
    rtol: float | None,
    block: int,
) -> tuple[TensorDiff, int]:
    base = TensorDiff(
        name, "equal", ta.fqn, tb.fqn, ta.dtype, tb.dtype, tuple(ta.shape), tuple(tb.shape)
    )
    if ta.shape != tb.shape:
        return replace(base, status="shape"), 0
    tolerant = atol is not None or rtol is not None
    same_dtype = ta.dtype == tb.dtype
    if not same_dtype and not tolerant:
        return replace(base, status="dtype"), 0
    if ta.numel == 0:
        return replace(base, status="equal" if same_dtype else "dtype"), 0
    if same_dtype and (equal := _bytes_equal(base, ta, tb, ra, rb, block)) is not None:
        return equal
    import torch

    sa, sb = _SlabReader(ra, ta, _checks(ra, ta)), _SlabReader(rb, tb, _checks(rb, tb))
    shape = ta.shape
    row_elems = math.prod(shape[1:]) if shape else 1
    rows_total = shape[0] if shape else 1
    row_bytes = row_elems * max(ta.itemsize, tb.itemsize)
    rows = max(1, block // max(1, row_bytes))
    a_tol = atol or 0.0
    r_tol = rtol or 0.0
    mismatched = 0
    max_abs: float | None = None
    max_rel: float | None = None
    first: tuple[int, ...] | None = None
    va = vb = None
    bitwise_equal = same_dtype
    compared = 0
    for r0 in range(0, rows_total, rows):
        r1 = min(rows_total, r0 + rows)
        a = sa.read(r0, r1).reshape(-1)
        b = sb.read(r0, r1).reshape(-1)
        compared += a.numel() * ta.itemsize + b.numel() * tb.itemsize
        if same_dtype:
            k = ta.itemsize
            neq = (a.view(torch.uint8).view(-1, k) != b.view(torch.uint8).view(-1, k)).any(dim=1)
            if not bool(neq.any()):
                continue
            bitwise_equal = False
        else:
            neq = torch.ones(a.numel(), dtype=torch.bool)
        if _is_floatlike(ta.dtype) or _is_floatlike(tb.dtype) or tolerant:
            idx = neq.nonzero().view(-1)
            wide = torch.complex128 if (a.is_complex() or b.is_complex()) else torch.float64
            da, db = a[idx].to(wide), b[idx].to(wide)
            both_nan = torch.isnan(da) & torch.isnan(db)
            same = (da == db) | both_nan  # inf == inf, and NaNs with other payloads
            diff = (da - db).abs().to(torch.float64)
            diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
            diff = torch.where(same, torch.zeros_like(diff), diff)
            mag = db.abs().to(torch.float64)
            rel = torch.where(mag > 0, diff / mag, torch.where(diff > 0, math.inf, 0.0))
            bad = ~same & ~(diff <= a_tol + r_tol * mag) if tolerant else torch.ones_like(same)
            if diff.numel():
                m_abs, m_rel = float(diff.max()), float(rel.max())
                max_abs = m_abs if max_abs is None else max(max_abs, m_abs)
                max_rel = m_rel if max_rel is None else max(max_rel, m_rel)
            bad_idx = idx[bad]
        else:
            bad_idx = neq.nonzero().view(-1)
        if bad_idx.numel():
            mismatched += int(bad_idx.numel())
            if first is None:
                j = int(bad_idx[0])
                flat = r0 * row_elems + j
                first = _unravel(flat, shape)
                va, vb = _scalar(a[j]), _scalar(b[j])
    if not same_dtype:
        status: DiffStatus = "dtype"
    elif bitwise_equal:
        status = "equal"
    elif mismatched == 0:
        status = "close"
    else:
        status = "different"
    return (
        replace(
            base,
            status=status,
            mismatched=mismatched,
            max_abs=max_abs if max_abs is not None else (0.0 if _is_floatlike(ta.dtype) else None),
            max_rel=max_rel if max_rel is not None else (0.0 if _is_floatlike(ta.dtype) else None),
            first_index=first,
            value_a=va,
            value_b=vb,
        ),
        compared,
    )


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for d in reversed(shape):
        out.append(flat % d)
        flat //= d
    return tuple(reversed(out))


def _converted(
    manifest: Manifest, names: dict[str, str], cfg: dict[str, Any] | None, in_memory: bool
) -> tuple[Manifest, dict[str, str], str | None]:
    """One side's model tensors in the on-disk format (or, ``in_memory``, the in-memory form)
    of the transformers conversion ``cfg`` names, and a note naming the mapping applied."""
    from ckptools.engine.converted import to_disk_names, to_memory_names
    from ckptools.views.producer import views_of

    views = views_of(manifest)
    if views is not None:  # the producer's view as the HF model, as consolidate writes it
        hf, hf_names, mapping, _ = views.as_hf(manifest, names, cfg, check=False)
        rules = "; ".join(mapping.rules)
        return hf, hf_names, f"compared as the HF model: {mapping.mapping}: {rules}"
    # quiet: diff has no quiet option for its --json to imply yet, so no status line while a
    # conversion is derived (the cache still spares the next run the derivation)
    if in_memory:
        manifest, out, keymap = to_memory_names(manifest, names, cfg, quiet=True)
    else:  # the values are compared next: no separate CRC pass
        manifest, out, keymap = to_disk_names(manifest, names, cfg, check=False, quiet=True)
    kind = "in-memory layout" if in_memory else "on-disk format"
    if keymap is None:
        return manifest, names, None
    return manifest, out, f"compared in the {kind} of {keymap.mapping}: " + "; ".join(keymap.rules)


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
    from ckptools.views.export import find_model_files, tie_setting, tied_candidates

    pairs = [(o, i) for o, i in tied_candidates(names, manifest) if o not in other and i in other]
    if not pairs or not tie_setting(find_model_files(other_path, config)):
        return {}
    found: dict[str, str] = {}
    for o, i in pairs:
        found.setdefault(o, i)
    return found


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
) -> tuple[list[TensorDiff], int]:
    """Every name of either side compared (or named missing / unexpected); ``tied``: the
    output embeddings that A, then B, leaves out as tied (:func:`_tied_aliases`), each compared
    with the input embedding it is tied to on that side."""
    tied_a, tied_b = tied
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
            result, n = _compare(name, ta, mb.tensors[fqn_b], ra, rb, atol, rtol, block)
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
                result, n = _compare(name, ta, tb, ra, rb, atol, rtol, block)
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
    notes: list[str] = []
    if names_a.keys() != names_b.keys():
        names_a, names_b = _lora_views((a, b), (ma, mb), (names_a, names_b), notes)
    if config is not None or keep_in_memory_names or names_a.keys() != names_b.keys():
        from ckptools.verbs.consolidate import find_model_files, model_config

        # a DCP has no config.json of its own: the other side's names the model
        cfg_a, cfg_b = (model_config(find_model_files(s, config)) for s in (a, b))
        ma, names_a, note_a = _converted(ma, dict(names_a), cfg_a or cfg_b, keep_in_memory_names)
        mb, names_b, note_b = _converted(mb, dict(names_b), cfg_b or cfg_a, keep_in_memory_names)
        notes += [f"{side}: {n}" for side, n in (("A", note_a), ("B", note_b)) if n]
    tied_b = _tied_aliases(names_a, names_b, ma, b, config)  # in A, tied (not stored) in B
    tied_a = _tied_aliases(names_b, names_a, mb, a, config)  # in B, tied (not stored) in A
    out, compared = _compare_all(ma, mb, names_a, names_b, (tied_a, tied_b), atol, rtol)
    notes += [
        f"{t.name}: not stored in {t.tied_in}, whose config ties it to {t.tied_to}; "
        f"compared with that"
        for t in out
        if t.tied_to is not None
    ]
    if not names_a and not names_b:
        notes.append("neither checkpoint holds model tensors")
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
