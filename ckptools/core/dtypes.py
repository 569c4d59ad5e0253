"""Dtype names and sizes, without importing torch.

ckptools names dtypes the way torch does (``"bfloat16"``, ``"float8_e4m3fn"``), because that is
what users see in their code. This table is the single place that maps between torch's names,
the legacy ``*Storage`` class names found inside ``torch.save`` archives, and safetensors' codes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptools.errors import UnsupportedCheckpointError


@dataclass(frozen=True, slots=True)
class DType:
    name: str  # torch's name, e.g. "bfloat16"
    itemsize: int  # bytes per element
    storage: str | None  # legacy storage class name used in torch.save pickles
    safetensors: str | None  # safetensors header code
    is_floating: bool


_TABLE: tuple[DType, ...] = (
    DType("float64", 8, "DoubleStorage", "F64", True),
    DType("float32", 4, "FloatStorage", "F32", True),
    DType("float16", 2, "HalfStorage", "F16", True),
    DType("bfloat16", 2, "BFloat16Storage", "BF16", True),
    DType("float8_e4m3fn", 1, "Float8_e4m3fnStorage", "F8_E4M3", True),
    DType("float8_e5m2", 1, "Float8_e5m2Storage", "F8_E5M2", True),
    DType("float8_e4m3fnuz", 1, "Float8_e4m3fnuzStorage", None, True),
    DType("float8_e5m2fnuz", 1, "Float8_e5m2fnuzStorage", None, True),
    DType("float8_e8m0fnu", 1, "Float8_e8m0fnuStorage", "F8_E8M0", True),
    DType("complex128", 16, "ComplexDoubleStorage", "C128", False),
    DType("complex64", 8, "ComplexFloatStorage", "C64", False),
    DType("complex32", 4, "ComplexHalfStorage", None, False),
    DType("int64", 8, "LongStorage", "I64", False),
    DType("int32", 4, "IntStorage", "I32", False),
    DType("int16", 2, "ShortStorage", "I16", False),
    DType("int8", 1, "CharStorage", "I8", False),
    DType("uint64", 8, "UInt64Storage", "U64", False),
    DType("uint32", 4, "UInt32Storage", "U32", False),
    DType("uint16", 2, "UInt16Storage", "U16", False),
    DType("uint8", 1, "ByteStorage", "U8", False),
    DType("bool", 1, "BoolStorage", "BOOL", False),
    DType("qint8", 1, "QInt8Storage", None, False),
    DType("quint8", 1, "QUInt8Storage", None, False),
    DType("qint32", 4, "QInt32Storage", None, False),
)

BY_NAME: dict[str, DType] = {d.name: d for d in _TABLE}
BY_STORAGE: dict[str, DType] = {d.storage: d for d in _TABLE if d.storage}
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _TABLE if d.safetensors}
# torch's aliases that may appear as ``torch.<alias>`` globals in pickles.
_ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "cfloat": "complex64",
    "cdouble": "complex128",
    "chalf": "complex32",
}


def dtype(name: str) -> DType:
    """Look up a dtype by torch name (or alias), e.g. ``dtype("bfloat16").itemsize == 2``."""
    found = BY_NAME.get(_ALIASES.get(name, name))
    if found is None:
        raise UnsupportedCheckpointError(f"unknown dtype {name!r}")
    return found


def is_dtype_name(name: str) -> bool:
    return _ALIASES.get(name, name) in BY_NAME


def canonical(name: str) -> str:
    return dtype(name).name
