"""A small tensor a source holds as a value, not as bytes in a file (torch-free).

Some training state must be written as a tensor although the source keeps no tensor bytes for
it: an optimizer's ``step`` that an older torch (or DeepSpeed's own optimizers) saved as a
number, where torch's AdamW today keeps a 0-dim float32 tensor and ``dcp.load`` into
``get_state_dict``'s target expects one. A layout stores such a value as an object entry whose
``value`` is a :class:`TensorValue`; the DCP plan writes it as a tensor item from these bytes
(:func:`ckptools.plan.dcp.plan_dcp`). Only small values belong here: the data is held in memory.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from ckptools.core import dtypes

#: struct codes of the dtypes a number can be written as
_SCALAR_CODES = {"float32": "<f", "float64": "<d", "int64": "<q", "int32": "<i"}


@dataclass(frozen=True, slots=True)
class TensorValue:
    """A tensor given by its bytes: ``dtype`` (torch name), ``shape``, ``data`` (contiguous,
    little-endian, ``numel * itemsize`` bytes).

    Example:
        >>> TensorValue.scalar(2, "float32").data
        b'\\x00\\x00\\x00@'
    """

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        want = math.prod(self.shape) * dtypes.dtype(self.dtype).itemsize
        if len(self.data) != want:
            raise ValueError(
                f"a {self.dtype} tensor of shape {list(self.shape)} takes {want} bytes, "
                f"not {len(self.data)}"
            )

    def __repr__(self) -> str:
        # what inspect shows: the number for a scalar, never a dump of the bytes
        code = _SCALAR_CODES.get(self.dtype)
        if not self.shape and code is not None:
            return f"tensor({struct.unpack(code, self.data)[0]}, dtype={self.dtype})"
        return f"tensor(dtype={self.dtype}, shape={list(self.shape)}, {len(self.data)} bytes)"

    @classmethod
    def scalar(cls, value: float, dtype: str = "float32") -> TensorValue:
        """A 0-dim tensor holding ``value`` (a step counter saved as a number)."""
        code = _SCALAR_CODES.get(dtype)
        if code is None:
            raise ValueError(f"a number cannot be written as a {dtype} tensor")
        number = int(value) if code in ("<q", "<i") else float(value)
        return cls(dtype, (), struct.pack(code, number))
