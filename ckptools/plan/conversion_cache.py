"""transformers' conversion of a checkpoint's names, derived once and kept in the user's cache.

Deriving the conversion (:func:`~ckptools.plan.conversions.rules_for`) imports transformers and
builds the model on ``meta``: on a Qwen3-MoE ``consolidate`` that is ~6 s of CPU against 0.4 s
for the rest of the run (``--keep-in-memory-names``), ~10 s of wall time on a busy machine. What
the rules make of one set of tensors is a :class:`~ckptools.plan.conversions.KeyMap`: names and
boxes, plain data. :func:`keymap_for` keeps it under the user's cache directory
(:mod:`ckptools.io.user_cache`) as
``conversions/<transformers version>/<model class>/<digest>.json``, the digest of everything
the derivation reads: the direction, the installed transformers' mapping source, the config,
and the tensors' names and shapes in order. So the next run of the same model (the next
checkpoint of a training run) reads one small file and imports no transformers; the first run
shows a status line while it derives.

The cache is only a memo: an entry that does not parse, is of another format, names another
digest or whose content does not match its own SHA-256 is derived again and rewritten; one that
cannot be written is skipped. Errors (a rule that is not a byte re-arrangement...) are never
cached: they are raised each time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from ckptools.io import installed, user_cache
from ckptools.io.user_cache import Miss
from ckptools.plan.conversion_lookup import lookup_names, mapping_source, mentioned
from ckptools.plan.conversions import KeyMap, Piece, Shapes, rules_for

__all__ = ["FORMAT", "keymap_for"]


#: The entry format; an entry of another format is derived again.
FORMAT = 1

Direction = Literal["disk", "memory"]


def _version() -> str:
    """The installed transformers' version (:func:`ckptools.io.installed.version`: no
    ``importlib.metadata`` import, ~60-90 ms of start-up, where its directory names it)."""
    return installed.version("transformers") or "unknown"


def _model_class(config: Mapping[str, Any]) -> str:
    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    model_type = config.get("model_type")
    return archs[0] if archs else model_type if isinstance(model_type, str) else "unknown"


def _segment(text: str) -> str:
    """``text`` as one safe path segment (a config names it: never a path of its own)."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", text)[:100].lstrip(".") or "_"


def _digest(
    direction: Direction, source: str, config: Mapping[str, Any], shapes: Shapes
) -> str | None:
    """The entry's name; None for a config JSON cannot order (keys of mixed types)."""
    try:
        text = json.dumps(config, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return None
    import hashlib  # loads OpenSSL: only where a cache entry is named

    h = hashlib.sha256()
    for part in (
        f"ckptools-conversion/{FORMAT}/{direction}",
        source,
        text,
        json.dumps([[name, list(shape)] for name, shape in shapes.items()]),
    ):
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def _row(p: Piece) -> list[Any]:
    return [p.disk, p.memory, list(p.offsets), list(p.sizes), p.stack_dim, p.rule,
            list(p.fused_shape)]  # fmt: skip


def _encode(key: str, keymap: KeyMap | None) -> bytes:
    body: dict[str, Any] | None = None
    if keymap is not None:
        body = {
            "mapping": keymap.mapping,
            "memory_shapes": {k: list(v) for k, v in keymap.memory_shapes.items()},
            "pieces": [_row(p) for p in keymap.pieces],
        }
    entry = {"format": FORMAT, "key": key, "sha256": _body_digest(body), "keymap": body}
    return json.dumps(entry).encode()


def _body_digest(body: Any) -> str:
    """A digest of an entry's content: a damaged byte that still parses is caught too."""
    import hashlib

    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise Miss
    return tuple(value)


def _decode(raw: bytes, key: str) -> KeyMap | None:
    entry = user_cache.entry(raw, FORMAT, key)
    body = entry.get("keymap")
    if entry.get("sha256") != _body_digest(body):
        raise Miss
    if body is None:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("mapping"), str):
        raise Miss
    shapes, rows = body.get("memory_shapes"), body.get("pieces")
    if not isinstance(shapes, dict) or not isinstance(rows, list):
        raise Miss
    pieces = []
    for row in rows:
        if not isinstance(row, list) or len(row) != 7:
            raise Miss
        disk, memory, offsets, sizes, stack_dim, rule, fused = row
        if not (isinstance(disk, str) and isinstance(memory, str) and isinstance(rule, str)):
            raise Miss
        if stack_dim is not None and type(stack_dim) is not int:
            raise Miss
        pieces.append(Piece(disk, memory, _ints(offsets), _ints(sizes), stack_dim, rule,
                            _ints(fused)))  # fmt: skip
    memory_shapes = {str(k): _ints(v) for k, v in shapes.items()}
    return KeyMap(tuple(pieces), memory_shapes, body["mapping"])


def _derive(config: Mapping[str, Any], shapes: Shapes, direction: Direction) -> KeyMap | None:
    rules = rules_for(config)
    if rules is None:
        return None
    keymap = rules.to_disk(shapes) if direction == "disk" else rules.to_memory(shapes)
    return keymap if keymap.converted else None


def keymap_for(
    config: Mapping[str, Any] | None,
    shapes: Shapes,
    direction: Direction,
    *,
    quiet: bool = False,
) -> KeyMap | None:
    """What the installed transformers' conversion for the model ``config`` names makes of
    tensors ``shapes`` (name → shape, in order): ``"disk"`` from in-memory names to
    ``save_pretrained``'s (:meth:`~ckptools.plan.conversions.Rules.to_disk`), ``"memory"`` the
    other way (:meth:`~ckptools.plan.conversions.Rules.to_memory`). None when no conversion
    applies. Read from the user's cache when an earlier run derived it; else derived (a status
    line on stderr unless ``quiet``) and kept.

    Raises:
        UnsupportedCheckpointError / CorruptCheckpointError: as the rules raise them.
    """
    if not config:
        return None
    source = mapping_source()
    if source is None or not mentioned(lookup_names(config), source):
        return None  # transformers cannot convert it: no import, nothing to keep
    version, model_class = _version(), _model_class(config)
    key = _digest(direction, source, config, shapes)
    if key is None:
        return _derive(config, shapes, direction)
    parts = ("conversions", _segment(version), _segment(model_class), f"{key}.json")
    return user_cache.kept(
        parts,
        lambda raw: _decode(raw, key),
        lambda: _derive(config, shapes, direction),
        lambda keymap: _encode(key, keymap),
        f"ckptools: reading transformers {version}'s conversion rules for {model_class} ",
        quiet,
    )
