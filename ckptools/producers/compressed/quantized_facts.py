"""What ``inspect`` shows of a quantized model directory: its producer, scheme, block size and
which tensors are quantized (``inspect --json``'s ``"quantized"``), and the text lines.

Declared by the family's package (``FACTS``); imports nothing beyond the manifest.
"""

from __future__ import annotations

from typing import Any

from ckptools.core.manifest import Manifest
from ckptools.producers.compressed.forms import KEY as KEY

_SHOWN = 4


def facts(m: Manifest) -> dict[str, Any] | None:
    """A quantized model's form: producer, scheme, block, the quantized weights (each with its
    data, scale and block), the run-time scales, and why it is refused (None when read)."""
    found = m.details.get(KEY)
    return None if found is None else dict(found)


def lines(q: dict[str, Any]) -> list[str]:
    """``inspect``'s lines of the facts :func:`facts` gave (read back from its JSON)."""
    weights = q["weights"]
    block = "x".join(str(b) for b in q["block"]) if q.get("block") else "per weight"
    names = [w["weight"] for w in weights]
    shown = ", ".join(names[:_SHOWN]) + (
        f", ... ({len(names) - _SHOWN} more)" if names[_SHOWN:] else ""
    )
    out = [
        f"  quantized: {q['producer']} ({q['scheme']}), block {block}: {len(weights)} weight(s) "
        f"stored as float8 with scales",
    ]
    if names:
        out.append(f"  quantized weights: {shown}")
    if q.get("refused"):
        out.append(f"  not dequantized: {q['refused']} (consolidate copies it as stored)")
    else:
        out.append("  consolidate --dtype bfloat16|float32 writes the plain model (dequantized)")
    return out
