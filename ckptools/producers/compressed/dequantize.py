"""A quantized model directory read as the plain model: the ``decodes`` of
:class:`~ckptools.producers.compressed.quantized.QuantizedSafetensorsLayout`
(:mod:`ckptools.producers.decoding`).

Each quantized weight is written as ``dtype(f32(q) * f32(scale))``, the scale being that of
the block holding the element (partial blocks at the edges included), rounded first to the
producer's product dtype where the producer's own reading does (compressed-tensors multiplies
in the scale's dtype). The scales, the run-time activation scales and ``quantization_config``
are left out; every other tensor is written as the export writes it (copied, or cast).

Computed with numpy, a block of whole rows at a time (the engine's row blocks): a float8 byte
becomes float32 through a 256-entry table (exact), the product is IEEE float32 as torch's, and
float32 → bfloat16 rounds to nearest even as torch does (``c10::BFloat16``), so the result is
the producers' own, bit for bit, without importing torch (~200 MiB) or the quantization
library.
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any

from ckptools.core.manifest import Manifest, TensorEntry
from ckptools.errors import UnsupportedCheckpointError
from ckptools.io import storage
from ckptools.producers.compressed.forms import KEY, Form, Quantized
from ckptools.producers.decoding import Decoded, RowDecoder

if TYPE_CHECKING:
    import numpy as np

#: what ``consolidate --dtype`` of a form this module does not read tells the user to do
_COPY = "consolidate without --dtype copies it as stored"


def form(manifest: Manifest) -> Form | None:
    """The quantized form the layout read into ``manifest``, None for a plain model."""
    raw = manifest.details.get(KEY)
    return Form.from_dict(raw) if raw else None


def _renamed(out: str, w: Quantized) -> str:
    """The output name of ``w``'s data (``m._weight_qdata`` → ``m.weight``; the same name for
    a weight stored under its own name)."""
    module = w.weight.rpartition(".")[0]
    stored, plain = w.data[len(module) :], w.weight[len(module) :]
    return out[: -len(stored)] + plain if stored != plain and out.endswith(stored) else out


def decoded(manifest: Manifest, names: dict[str, str], dtype: str | None) -> Decoded:
    """``names`` (output name → stored FQN) as the plain model's: each quantized weight under
    its plain name, its scales and run-time scales left out; with ``dtype``, a decoder for each.

    Raises:
        UnsupportedCheckpointError: ``dtype`` is given and the form is one this module does
            not read (named), or a float8 tensor has no scale it understands.
    """
    found = form(manifest)
    if found is None:
        return Decoded(names=dict(names))
    weights = {w.data: w for w in found.weights}
    consumed = {w.scale for w in found.weights} | set(found.dropped)
    plain = {
        (_renamed(out, weights[fqn]) if fqn in weights else out): fqn
        for out, fqn in names.items()
        if fqn not in consumed
    }
    if dtype is None:  # a copy; for a form not read, which stored tensors are the model's
        kept = (  # is not known
            f"{len(found.weights)} weight(s) kept quantized as stored ({found.producer}, "
            f"{found.scheme}), with their scales and quantization_config; --dtype bfloat16 "
            "or float32 writes the plain model"
            if found.refused is None
            else f"kept as stored: {found.refused} (ckptools does not dequantize this form)"
        )
        return Decoded(names=plain, plain_names=found.refused is None, notes=(kept,))
    if found.refused is not None:
        raise UnsupportedCheckpointError(
            f"{manifest.root}: {found.refused}: ckptools does not dequantize this form; {_COPY}"
        )
    for fqn in plain.values():
        entry = manifest.tensors[fqn]
        if fqn not in weights and entry.dtype.startswith("float8"):
            raise UnsupportedCheckpointError(
                f"{manifest.root}: tensor {fqn!r} is {entry.dtype} with no scale "
                f"{found.producer} names: ckptools would not know its values; {_COPY}"
            )
    root = manifest.data_dir()
    decoders: dict[str, RowDecoder] = {
        out: _Dequantize(root, manifest.tensors[fqn], manifest.tensors[weights[fqn].scale],
                         weights[fqn], dtype)
        for out, fqn in plain.items()
        if fqn in weights
    }  # fmt: skip
    dropped = len(found.weights) + len(found.dropped)
    block = f"blocks {found.block[0]}x{found.block[1]}" if found.block else "its blocks"
    note = (
        f"dequantized {len(decoders)} weight(s) of {found.producer} ({found.scheme}, {block}) "
        f"to {dtype}; {dropped} scale tensor(s) and quantization_config left out"
    )
    return Decoded(names=plain, decoders=decoders, config_drops=("quantization_config",),
                   notes=(note,))  # fmt: skip


def _float8_table(name: str) -> Any:
    """The float32 value of each of the 256 bytes of float8 ``name`` (OCP FP8: e4m3fn has no
    infinities and one NaN per sign; e5m2 is IEEE-like), exact."""
    import numpy as np

    mantissa_bits, bias = (3, 7) if name == "float8_e4m3fn" else (2, 15)
    top = (1 << (7 - mantissa_bits)) - 1
    values = []
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> mantissa_bits) & top, b & ((1 << mantissa_bits) - 1)
        if name == "float8_e4m3fn" and e == top and m == (1 << mantissa_bits) - 1:
            values.append(math.nan)
        elif name == "float8_e5m2" and e == top:
            values.append(sign * math.inf if m == 0 else math.nan)
        elif e == 0:
            values.append(sign * m / (1 << mantissa_bits) * 2.0 ** (1 - bias))
        else:
            values.append(sign * (1 + m / (1 << mantissa_bits)) * 2.0 ** (e - bias))
    return np.array(values, dtype=np.float32)


_TABLES: dict[str, Any] = {}


def _table(name: str) -> Any:
    if name not in _TABLES:
        _TABLES[name] = _float8_table(name)
    return _TABLES[name]


def _as_float32(raw: Any, dtype: str) -> np.ndarray:
    """Little-endian ``raw`` bytes of ``dtype`` (float32, bfloat16, float16) as float32."""
    import numpy as np

    if dtype == "float32":
        return np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if dtype == "float16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float32)
    return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)


def bfloat16_bits(f: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bits, rounded to nearest even as torch's ``c10::BFloat16`` (NaN:
    0x7FC0). Works in place on ``f``'s bits."""
    import numpy as np

    u = f.view(np.uint32)
    nan = np.isnan(f)
    bias = (u >> 16) & 1
    bias += 0x7FFF
    u += bias
    u >>= 16
    bits = u.astype(np.uint16)
    bits[nan] = 0x7FC0
    return bits


def _rounded(f: np.ndarray, dtype: str) -> np.ndarray:
    """``f`` (float32) rounded to ``dtype``, as float32 again."""
    import numpy as np

    if dtype == "float32":
        return f
    if dtype == "float16":
        return f.astype(np.float16).astype(np.float32)
    return (bfloat16_bits(f).astype(np.uint32) << 16).view(np.float32)


#: Elements of the table indices made at a time per thread (8 bytes each: 2 MiB, within a
#: core's cache): the gathers run on the engine's worker threads (numpy lets the GIL go).
_INDEX_ELEMENTS = 2**18
_THREAD = threading.local()


def _scratch(n: int) -> np.ndarray:
    """This thread's index buffer, of at least ``n`` elements (kept for its next block)."""
    import numpy as np

    buf = getattr(_THREAD, "index", None)
    if buf is None or len(buf) < n:
        buf = _THREAD.index = np.empty(max(n, _INDEX_ELEMENTS), dtype=np.intp)
    return buf  # type: ignore[no-any-return]


class _Dequantize:
    """The :data:`~ckptools.producers.decoding.RowDecoder` of one quantized weight. Its scales
    are read once, on first use, and let go once every row is written."""

    def __init__(
        self, root: str, data: TensorEntry, scale: TensorEntry, w: Quantized, dtype: str
    ) -> None:
        self.root, self.data, self.scale_entry, self.w, self.dtype = root, data, scale, w, dtype
        self.rows, self.cols = data.shape
        self._scales: Any = None
        self._done = 0
        self._lock = threading.Lock()

    def _read_scales(self) -> np.ndarray:
        with self._lock:
            if self._scales is None:
                (chunk,) = self.scale_entry.chunks
                with storage.open_reader(self.root) as reader:
                    raw = reader.read(chunk.file, chunk.offset, chunk.length)
                br, bc = self.w.block
                shape = (math.ceil(self.rows / br), math.ceil(self.cols / bc))
                self._scales = _as_float32(raw, self.scale_entry.dtype).reshape(shape)
            return self._scales  # type: ignore[no-any-return]

    def _tables(self, scales: np.ndarray) -> np.ndarray:
        """For each block's scale, the output of each of the 256 stored bytes: one row of
        ``cols_blocks * 256`` values per row of blocks. Each value is the producer's product
        ``f32(q) * f32(scale)`` (rounded to its product dtype) in the output dtype: the same
        arithmetic, done once per (scale, byte) rather than per element."""
        import numpy as np

        values = scales.reshape(-1, 1) * _table(self.data.dtype)[None, :]
        values = _rounded(values, self.w.product)
        if self.dtype == "float32":
            out = values
        elif self.dtype == "float16":
            out = values.astype(np.float16)
        else:
            out = bfloat16_bits(values)
        return out.reshape(scales.shape[0], -1)  # type: ignore[no-any-return]

    def __call__(self, first: int, stop: int, stored: memoryview, out: memoryview) -> None:
        import numpy as np

        n, cols = stop - first, self.cols
        br, bc = self.w.block
        q = np.frombuffer(stored, dtype=np.uint8).reshape(n, cols)
        scales = self._read_scales()
        k0, k1 = first // br, (stop - 1) // br + 1
        tables = self._tables(scales[k0:k1])
        kind = {"float32": np.float32, "float16": np.float16}.get(self.dtype, np.uint16)
        written = np.frombuffer(out, dtype=kind).reshape(n, cols)
        # each element's place in its block row's table: its block of columns, then its byte;
        # made in place in this thread's scratch, a few rows at a time (cache-sized)
        columns = (np.arange(cols, dtype=np.intp) // bc) * 256
        step = max(1, _INDEX_ELEMENTS // cols)
        scratch = _scratch(step * cols)
        for k in range(k0, k1):
            a, b = max(first, k * br) - first, min(stop, (k + 1) * br) - first
            for s in range(a, b, step):
                e = min(b, s + step)
                index = scratch[: (e - s) * cols].reshape(e - s, cols)
                np.add(columns, q[s:e], out=index, casting="unsafe")
                # mode "clip": every index is in its table by construction, and "raise"
                # would check each and buffer ``out`` (twice the time, measured)
                np.take(tables[k - k0], index, out=written[s:e], mode="clip")
        with self._lock:
            self._done += n
            if self._done >= self.rows:
                self._scales = None
