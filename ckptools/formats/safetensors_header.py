"""The safetensors header, read and written in one place, validated as the library validates it.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of UTF-8 JSON (an
object: an optional ``"__metadata__"`` map of str to str, and for every tensor its ``dtype``,
``shape`` and ``data_offsets`` relative to the end of the header), then the raw row-major bytes.

The rules :func:`parse_header` applies are those of safetensors' own loader
(``safetensors/src/tensor.rs``: ``SafeTensors::read_metadata`` and ``Metadata::validate``), so a
file ckptools accepts is one ``safetensors.safe_open`` opens and the other way round: ``n`` at
most 100,000,000 and inside the file; tensors sorted by ``data_offsets`` cover the data buffer
exactly once, in order, with no hole or overlap (``begin`` of each equals ``end`` of the one
before, the first begins at 0); ``end - begin`` equals ``prod(shape) * itemsize``; the buffer ends
where the file ends. Integers must be JSON integers (not floats or booleans) in ``[0, 2**64)``,
as a Rust ``usize`` must. A header that breaks a rule is a :class:`CorruptCheckpointError` naming
the file and the tensor, never a silently wrong read (a negative ``data_offsets`` once made
consolidate copy the wrong bytes and exit 0). These checks are on the header only: a few
microseconds per tensor, no tensor byte is read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckptools.core import dtypes
from ckptools.errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    UnsupportedCheckpointError,
)
from ckptools.io import storage

#: safetensors' own limit (``MAX_HEADER_SIZE`` in tensor.rs, decimal, not MiB).
MAX_HEADER_BYTES = 100_000_000
#: Every dtype code the safetensors format defines; a code outside it is damage, a code inside it
#: that ckptools has no dtype for (F4, F6_*, the FNUZ float8s) is a feature ckptools lacks.
SPEC_DTYPES = frozenset(
    {
        *("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0"),
        *("F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32"),
        *("C64", "F64", "I64", "U64"),
    }
)
_USIZE_LIMIT = 1 << 64
#: First read of a safetensors file on an object store: headers of models with a few hundred
#: tensors fit, so one round trip suffices; at most this is fetched beyond the header.
_REMOTE_FIRST_READ_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class HeaderTensor:
    """One tensor of a header; ``begin``/``end`` are offsets in the data (after the header)."""

    name: str
    dtype: str  # torch's name
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class Header:
    """A validated header: tensors in the header's order, ``__metadata__``, the data start."""

    tensors: tuple[HeaderTensor, ...]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def _usize(value: Any) -> bool:
    return type(value) is int and 0 <= value < _USIZE_LIMIT


def header_length(prefix: bytes, size: int, path: str) -> int:
    """The header length the first 8 bytes of a ``size``-byte file announce, checked to fit."""
    if len(prefix) < 8 or size < 8:
        raise CorruptCheckpointError(f"{path}: too short for a safetensors file", path=path)
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise CorruptCheckpointError(
            f"{path}: safetensors header length {n} does not fit a {size}-byte file "
            f"(at most {MAX_HEADER_BYTES}; truncated or not safetensors)",
            path=path,
        )
    return n


def _tensor(path: str, name: str, info: Any) -> HeaderTensor:
    """One header entry, checked. The common case is one pass of cheap type tests: a header of
    100k tensors parses in ~0.9 s here, of which ``json.loads`` is ~0.65 s and these checks
    with the sort ~0.2 s (2 us a tensor); only a bad entry pays for :func:`_entry_error` to say
    what is wrong."""
    if type(info) is dict:
        code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        dt = dtypes.BY_SAFETENSORS.get(code) if type(code) is str else None
        if dt is not None and type(shape) is list and type(offsets) is list and len(offsets) == 2:
            begin, end = offsets
            numel = 1
            ok = type(begin) is int and type(end) is int and begin >= 0 and end < _USIZE_LIMIT
            for s in shape:
                if type(s) is not int or s < 0:
                    ok = False
                    break
                numel *= s
                ok = ok and numel < _USIZE_LIMIT  # safetensors' checked_mul, dim by dim
            if ok and end - begin == numel * dt.itemsize:
                return HeaderTensor(name, dt.name, tuple(shape), begin, end)
    raise _entry_error(path, name, info)


def _entry_error(path: str, name: str, info: Any) -> CkptError:
    """What is wrong with the entry :func:`_tensor` refused."""

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{path}: safetensors header entry {name!r} {why}", path=path, fqn=name
        )

    if not isinstance(info, dict):
        return bad("is not an object")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(code, str):
        return bad(f"has dtype {code!r}, not a string")
    if not isinstance(shape, list) or not all(_usize(s) for s in shape):
        return bad(f"has shape {shape!r}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_usize(o) for o in offsets):
        return bad(f"has data_offsets {offsets!r}, not two non-negative integers")
    dt = dtypes.BY_SAFETENSORS.get(code)
    if dt is None:
        if code in SPEC_DTYPES:
            return UnsupportedCheckpointError(
                f"{path}: tensor {name!r} has dtype {code!r}, unknown to ckptools",
                path=path,
                fqn=name,
            )
        return bad(f"has dtype {code!r}, which safetensors does not define")
    numel = 1
    for s in shape:
        numel *= s
        if numel >= _USIZE_LIMIT:
            return bad(f"has shape {shape}, too large to address")
    begin, end = offsets
    return bad(
        f"has data_offsets {offsets} ({end - begin} bytes), but dtype {code} and shape "
        f"{shape} need {numel * dt.itemsize} bytes"
    )


def parse_header(raw: bytes, *, path: str, file_size: int) -> Header:
    """Validate the ``len(raw)``-byte JSON header of a ``file_size``-byte file (see module doc)."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CorruptCheckpointError(
            f"{path}: safetensors header is not UTF-8 JSON ({e})", path=path
        ) from e
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path}: safetensors header is not an object", path=path)
    meta = doc.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError(
            f"{path}: safetensors __metadata__ is not a map of strings to strings", path=path
        )
    tensors = tuple(_tensor(path, name, info) for name, info in doc.items())
    pos = 0
    for t in sorted(tensors, key=lambda t: (t.begin, t.end)):  # as safetensors sorts them
        if t.begin != pos:
            raise CorruptCheckpointError(
                f"{path}: tensor {t.name!r} data_offsets [{t.begin}, {t.end}] "
                + (
                    f"overlap the tensor before (which ends at {pos})"
                    if t.begin < pos
                    else f"leave a hole after byte {pos}"
                )
                + "; safetensors requires the tensors to cover the data exactly once",
                path=path,
                fqn=t.name,
            )
        pos = t.end
    data_start = 8 + len(raw)
    if data_start + pos != file_size:
        state = "truncated" if data_start + pos > file_size else "has trailing bytes"
        raise CorruptCheckpointError(
            f"{path}: file is {file_size} bytes, but its safetensors header describes "
            f"{data_start + pos} ({state})",
            path=path,
        )
    return Header(tensors, dict(meta), data_start, file_size)


def read_header(path: str) -> Header:
    """The validated header of the safetensors file at ``path`` (reads only the header)."""
    try:
        if storage.is_url(path):
            # One ranged GET usually holds the header too; a second fetches the rest if not.
            size = storage.size(path)
            head = storage.read_range(path, 0, min(size, _REMOTE_FIRST_READ_BYTES))
        else:
            with open(path, "rb") as f:
                head = f.read(8)
                size = os.fstat(f.fileno()).st_size
        n = header_length(head, size, path)
        if len(head) >= 8 + n:
            raw = head[8 : 8 + n]
        elif storage.is_url(path):
            raw = head[8:] + storage.read_range(path, len(head), 8 + n - len(head))
        else:
            with open(path, "rb") as f:
                raw = os.pread(f.fileno(), n, 8)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"{path}: file is missing", path=path) from e
    if len(raw) != n:  # the file shrank between the stat and the read
        raise CorruptCheckpointError(f"{path}: safetensors header is cut short", path=path)
    return parse_header(raw, path=path, file_size=size)


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


def safetensors_code(dtype: str, *, fqn: str) -> str:
    """The header code of torch dtype ``dtype``; refused when safetensors cannot store it."""
    code = dtypes.dtype(dtype).safetensors
    if code is None:
        raise UnsupportedCheckpointError(
            f"{fqn!r} has dtype {dtype}, which safetensors cannot store; cast it with "
            "--dtype (floating types) or leave it out with --select",
            fqn=fqn,
        )
    return code


def header_bytes(entries: Sequence[tuple[str, str, tuple[int, ...], int, int]]) -> bytes:
    """The safetensors header for ``(name, dtype, shape, begin, end)`` entries (data offsets).

    Padded with spaces so that the data starts at a multiple of 8, as safetensors itself writes
    it (readers may then map tensors aligned).
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for name, dtype, shape, begin, end in entries:
        header[name] = {
            "dtype": safetensors_code(dtype, fqn=name),
            "shape": list(shape),
            "data_offsets": [begin, end],
        }
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    return len(body).to_bytes(8, "little") + body
