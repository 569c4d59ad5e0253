"""CRC-32 (zlib's polynomial): :func:`crc32` fast, and :func:`crc32_combine` of a concatenation.

:func:`crc32` is ISA-L's (the ``isal`` package: carry-less multiply folding, ~20 GB/s per core,
GIL released) and falls back to :func:`zlib.crc32` (~4 GB/s with zlib 1.2) where ``isal`` is not
installed; both give the same value and both continue from a running CRC.

zlib has it in C but Python's ``zlib`` module does not expose it. Appending ``n`` zero bytes to a
message is a linear map on its CRC register; the maps for ``2**k`` bytes are 32x32 bit matrices,
computed once by squaring, so combining costs at most 64 matrix-vector products (tens of
microseconds) whatever the lengths. Writers use it to give a piece made of whole source records
its CRC without reading a byte of it.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from typing import Any

crc32: Callable[[Any, int], int]
"""CRC-32 of a bytes-like ``data``, continuing from ``value`` (``zlib.crc32``'s signature)."""
try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal has wheels for the platforms we test on
    crc32 = zlib.crc32

_POLY = 0xEDB88320  # CRC-32 (IEEE 802.3), reflected, as zlib computes it


def _times(matrix: tuple[int, ...], vector: int) -> int:
    out = 0
    i = 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(matrix, row) for row in matrix)


@functools.lru_cache(maxsize=1)
def _zero_byte_operators() -> tuple[tuple[int, ...], ...]:
    """Operator k appends 2**k zero bytes to the CRC register."""
    one_bit = (_POLY, *(1 << n for n in range(31)))  # one zero bit
    op = _square(_square(_square(one_bit)))  # 8 zero bits: one zero byte
    ops = [op]
    for _ in range(63):
        op = _square(op)
        ops.append(op)
    return tuple(ops)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)``.

    Example:
        >>> import zlib
        >>> a, b = b"hello ", b"world"
        >>> crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
        True
    """
    ops = _zero_byte_operators()
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(ops[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2
