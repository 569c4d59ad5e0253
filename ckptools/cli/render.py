"""Printing a command's result: one JSON object (``--json``) or human text (tables, sizes)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import click

# Re-exported: the commands render sizes through this module; the formats live with parse_size.
from ckptools.core.sizes import human_bytes as human_bytes
from ckptools.core.sizes import human_count as human_count
from ckptools.core.sizes import human_size as human_size
from ckptools.engine.collective import reports_here


class Result(Protocol):
    """What the library's verbs return: a frozen object whose ``to_dict`` is its JSON form."""

    def to_dict(self) -> dict[str, Any]: ...


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


def plural(n: int, word: str, words: str | None = None) -> str:
    """``1 rank file``, ``3 rank files`` (``words``: an irregular plural)."""
    return f"{n} {word if n == 1 else words or word + 's'}"


def shortlist(names: Sequence[str], keep: int = 6) -> str:
    """``a, b, c``, or the first ``keep`` and ``and N more``: a 405B model's 191 shard names
    are not one line of output."""
    shown = ", ".join(names[:keep])
    return shown + (f" and {len(names) - keep} more" if len(names) > keep else "")


#: below this a run's rate is mostly start-up and rounding, not throughput
_RATE_MIN_SECONDS = 0.05


def summary(
    tensors: int,
    nbytes: int,
    seconds: float | None,
    *,
    peak_rss_bytes: int | None = None,
    extra: Sequence[str] = (),
) -> str:
    """The last line of every command that writes a checkpoint, in one shape:
    ``21 tensors, 12.4 KiB in 0.26 s (47.7 KiB/s), peak memory 55 MiB; ...``. ``seconds``
    None: a dry run (nothing was written, so no time or rate)."""
    line = f"  {plural(tensors, 'tensor')}, {human_bytes(nbytes)}"
    if seconds is not None:
        line += f" in {seconds:.2f} s"
        if seconds >= _RATE_MIN_SECONDS and nbytes:
            line += f" ({human_bytes(int(nbytes / seconds))}/s)"
        if peak_rss_bytes:
            line += f", peak memory {human_bytes(peak_rss_bytes)}"
    return "".join([line, *(f"; {e}" for e in extra)])


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=False, default=str)


def emit(
    result: Result | Mapping[str, Any],
    as_json: bool,
    render_text: Callable[[dict[str, Any]], str],
) -> None:
    """Print ``result`` as every command does: ``--json`` one JSON object, else
    ``render_text`` of it; only on the process that reports (rank 0 under torchrun, where every
    rank holds the same result).

    ``render_text`` reads the same dict the JSON is made from, so the text never shows what the
    JSON lacks, and the JSON keys (a public contract) are the only names renderers depend on.
    """
    if not reports_here():
        return
    data = dict(result) if isinstance(result, Mapping) else result.to_dict()
    click.echo(dumps(data) if as_json else render_text(data))
