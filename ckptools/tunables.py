"""Reading ``CKPTOOLS_*`` overrides of tunables: argument > environment variable > default.

Each tunable is a named constant with its unit and reason in the module that uses it; this is
the one place that parses the environment, so every override fails the same clear way.
"""

from __future__ import annotations

import os

from ckptools.errors import UsageError

#: threads for I/O in consolidate, verify and checksum
WORKERS_ENV = "CKPTOOLS_WORKERS"


def env_int(name: str, default: int) -> int:
    """The positive integer in environment variable ``name``, or ``default`` when unset/empty.

    Raises:
        UsageError: the variable holds anything but a positive integer.
    """
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError as e:
        raise UsageError(f"{name}={raw!r}: expected a positive integer") from e
    if value < 1:
        raise UsageError(f"{name}={raw!r}: expected a positive integer")
    return value


def env_size(name: str, default: int) -> int:
    """The byte size in environment variable ``name`` (``"50GB"``, ``"300KB"``, ``1024``), or
    ``default`` when unset/empty.

    Raises:
        UsageError: the variable holds anything but a positive size.
    """
    from ckptools.core.sizes import parse_size

    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        return parse_size(raw)
    except UsageError as e:
        raise UsageError(f"{name}={raw!r}: {e}") from e
