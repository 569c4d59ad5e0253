"""Human-readable rendering of result objects (tables, sizes)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

# Re-exported: the commands render sizes through this module; the formats live with parse_size.
from ckptools.core.sizes import human_bytes as human_bytes
from ckptools.core.sizes import human_count as human_count
from ckptools.core.sizes import human_size as human_size


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """Plain-text table; ``align`` holds 'l'/'r' per column (default left)."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def fmt(row: Sequence[str]) -> str:
        cells = []
        for i, cell in enumerate(row):
            right = i < len(align) and align[i] == "r"
            cells.append(cell.rjust(widths[i]) if right else cell.ljust(widths[i]))
        return "  ".join(cells).rstrip()

    lines = [fmt(headers), fmt(["-" * w for w in widths])]
    lines.extend(fmt(r) for r in rows)
    return "\n".join(lines)


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=False, default=str)
