"""How one tensor of :func:`ckptools.diff` compares (:class:`TensorDiff`), and the comparison.

Values are compared in slabs of whole dim-0 rows read straight from each side's stored chunks
(however each side is sharded), so memory is bounded by the block size per side plus float64
temporaries of the same number of elements, never by the tensor's size. Exceptions: one row
wider than the block is read whole, and a chunk stored with non-contiguous strides (a
transposed view saved as is) is read whole once per tensor. Every record that stores a CRC-32
is checked from the bytes read for the comparison
(:class:`~ckptools.engine.checked_copy.ReadChecks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from ckptools.core import dtypes
from ckptools.core.manifest import Chunk, TensorEntry
from ckptools.engine.checked_copy import ReadChecks
from ckptools.engine.reader import RowBytes, resolve_chunk
from ckptools.io.storage import Reader

if TYPE_CHECKING:
    import torch

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


class _SlabReader:
    """Reads rows ``[r0, r1)`` of one tensor from its stored chunks (replicas read once), as
    ``seen_as`` (a dtype its values are cast to) when given."""

    def __init__(
        self, reader: Reader, tensor: TensorEntry, checks: ReadChecks, seen_as: str | None = None
    ) -> None:
        import torch

        self.reader = reader
        self.tensor = tensor
        self.checks = checks
        self.torch_dtype = getattr(torch, tensor.dtype)
        self.out_dtype = getattr(torch, seen_as or tensor.dtype)
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
            out = torch.empty((), dtype=self.out_dtype)
            for c in self.chunks:
                out.copy_(self._piece(c, 0, 1))
            return out
        out = torch.empty((r1 - r0, *shape[1:]), dtype=self.out_dtype)
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


def compare(
    name: str,
    ta: TensorEntry,
    tb: TensorEntry,
    ra: Reader,
    rb: Reader,
    atol: float | None,
    rtol: float | None,
    block: int,
    seen_as: tuple[str | None, str | None] = (None, None),
) -> tuple[TensorDiff, int]:
    """``ta`` (A) against ``tb`` (B), in slabs of about ``block`` bytes a side; bytes read.
    ``seen_as``: per side, a dtype its values are cast to as read (``KeyMap.kept_dtypes``)."""
    wa, wb = seen_as[0] or ta.dtype, seen_as[1] or tb.dtype
    base = TensorDiff(name, "equal", ta.fqn, tb.fqn, wa, wb, tuple(ta.shape), tuple(tb.shape))
    if ta.shape != tb.shape:
        return replace(base, status="shape"), 0
    tolerant, same_dtype = atol is not None or rtol is not None, wa == wb
    if not same_dtype and not tolerant:
        return replace(base, status="dtype"), 0
    if ta.numel == 0:
        return replace(base, status="equal" if same_dtype else "dtype"), 0
    plain = (wa, wb) == (ta.dtype, tb.dtype)
    if same_dtype and plain and (equal := _bytes_equal(base, ta, tb, ra, rb, block)):
        return equal
    import torch

    sa, sb = (_SlabReader(r, t, _checks(r, t), s) for r, t, s in ((ra, ta, wa), (rb, tb, wb)))
    shape = ta.shape
    row_elems = math.prod(shape[1:]) if shape else 1
    rows_total = shape[0] if shape else 1
    k = dtypes.dtype(wa).itemsize  # the compared elements' size (A's, as seen)
    rows = max(1, block // max(1, row_elems * max(ta.itemsize, tb.itemsize, k)))
    a_tol, r_tol = atol or 0.0, rtol or 0.0
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
                first = _unravel(r0 * row_elems + j, shape)
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
