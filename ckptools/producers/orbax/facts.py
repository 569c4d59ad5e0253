"""What ``inspect`` shows of an Orbax checkpoint (``inspect --json``'s ``"orbax"``): each item's
arrays, path, shape and dtype, as Orbax's JSON metadata records them, and their text lines.

Declared by the family's package (``FACTS``); imports nothing beyond the manifest.
"""

from __future__ import annotations

from typing import Any

from ckptools.core.manifest import Manifest
from ckptools.producers.orbax import DETAILS_KEY

KEY = DETAILS_KEY


def facts(m: Manifest) -> dict[str, Any] | None:
    """An Orbax checkpoint's items and arrays; None for any other checkpoint."""
    found = m.details.get(KEY)
    return dict(found) if isinstance(found, dict) else None


def lines(facts: dict[str, Any]) -> list[str]:
    """``inspect``'s lines of the facts :func:`facts` gave (read back from its JSON)."""
    step = "" if facts.get("step") is None else f"step {facts['step']}: "
    out = [f"  orbax: {step}{facts['what']}"]
    for item in facts["items"]:
        arrays = item["arrays"]
        named = f"item {item['item']!r}" if item["item"] else "the checkpoint"
        out.append(f"  {named}: {len(arrays)} arrays ({item['storage']})")
        rows = [
            (a["path"], a["dtype"] or "?", "[" + ", ".join(map(str, a["shape"])) + "]")
            for a in arrays
        ]
        widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(_HEAD)]
        for row in (_HEAD, *rows):
            out.append(
                "    " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            )
    return out


_HEAD = ("array", "dtype", "shape")
