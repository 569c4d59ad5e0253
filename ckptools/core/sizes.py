"""Byte sizes, read the way users write them (``"5GB"``, ``"300KB"``, ``"2GiB"``, ``1024``) and
written back for people (``"5.0 GB"``, ``"1.5 GiB"``, ``"1.24B"`` parameters).

Decimal units (KB, MB, GB, TB) are powers of 1000 and binary units (KiB, MiB, GiB, TiB) powers of
1024, as in ``transformers``' ``max_shard_size``, so ``"5GB"`` here splits where
``save_pretrained(max_shard_size="5GB")`` would.
"""

from __future__ import annotations

import re

from ckptools.errors import UsageError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: str | int, name: str | None = None) -> int:
    """Parse a byte size.

    Args:
        value: an int (bytes) or a string such as ``"5GB"``, ``"300KB"``, ``"2GiB"``, ``"1.5MB"``.
        name: the parameter ``value`` was given as, named by the error.

    Returns:
        The size in bytes (rounded down to a whole byte).

    Raises:
        UsageError: the string is not a size, or the size is not positive.

    Example:
        >>> parse_size("300KB"), parse_size("2GiB"), parse_size(512)
        (300000, 2147483648, 512)
    """
    said = f"{value!r}" if name is None else f"{name}={value!r}"
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(value)
        unit = m.group(2).upper() if m else ""
        if m is None or unit not in _UNITS:
            raise UsageError(
                f"{said} is not a size; write a number with an optional unit, e.g. 5GB, "
                "300KB, 2GiB (KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024)"
            )
        number = m.group(1)
        # integers stay exact (no float rounding of "5000000000123"); "1.5MB" goes through float
        n = int(float(number) * _UNITS[unit]) if "." in number else int(number) * _UNITS[unit]
    if n <= 0:
        raise UsageError(
            f"{said} must be positive" if name else f"size must be positive, got {said}"
        )
    return n


def _scaled(n: int, units: tuple[str, ...]) -> tuple[float, str] | None:
    """``n`` in the largest of ``units`` (largest first) that it reaches, or None below them."""
    for unit in units:
        div = _UNITS[unit.upper()]
        if n >= div:
            return n / div, unit
    return None


def human_size(n: int) -> str:
    """``n`` bytes in decimal units, as the Hub states its limits and ``--max-shard-size`` reads
    them (``"50.0 GB"``).

    Example:
        >>> human_size(50 * 10**9), human_size(999)
        ('50.0 GB', '999 B')
    """
    scaled = _scaled(n, ("TB", "GB", "MB", "KB"))
    return f"{scaled[0]:.1f} {scaled[1]}" if scaled else f"{n} B"


def human_bytes(n: int | None) -> str:
    """``n`` bytes in binary units, as the CLI reports what it read and wrote (``"1.5 GiB"``);
    ``"-"`` for an unknown size.

    Example:
        >>> human_bytes(3 * 2**29), human_bytes(1023), human_bytes(None)
        ('1.5 GiB', '1023 B', '-')
    """
    if n is None:
        return "-"
    scaled = _scaled(n, ("TiB", "GiB", "MiB", "KiB"))
    return f"{scaled[0]:.1f} {scaled[1]}" if scaled else f"{n} B"


def human_count(n: int) -> str:
    """A count (of parameters) with K/M/B suffixes (``"1.24B"``).

    Example:
        >>> human_count(1_235_814_400), human_count(512)
        ('1.24B', '512')
    """
    for unit, div in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)
