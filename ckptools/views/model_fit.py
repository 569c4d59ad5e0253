"""Whether a model ``config.json`` fits a checkpoint's tensors: the names ``from_pretrained`` would
expect of the model it builds, against the names the checkpoint holds.

A config found beside a checkpoint (or above it,
:func:`ckptools.views.model_config.find_model_files`) may belong to another model: copied into
OUT it makes a directory whose ``from_pretrained`` builds a random model (every expected weight
"missing", every stored one "unexpected"). The expected names are those of the transformers
model the config names, built on ``meta``
(:func:`ckptools.plan.conversion_lookup.model_param_order`'s way: transformers' own classes
only): its ``state_dict`` keys, a tied alias (``lm_head.weight`` of a model tying it) optional,
and transformers' own ``_keys_to_ignore_on_load_missing`` / ``_unexpected`` patterns honoured.

Building the model imports transformers (~5 s of CPU): the names are kept in the user's cache
(:mod:`ckptools.io.user_cache`) under a digest of the config and the transformers version, so
the next checkpoint of the same run imports nothing. A config that names no transformers class
that builds (remote code, transformers not installed) cannot be checked: it is used, as before.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptools.io import user_cache
from ckptools.io.user_cache import Miss

__all__ = ["Misfit", "misfit"]


FORMAT = 2
_EXAMPLES = 2


@dataclass(frozen=True)
class Misfit:
    """How a config's model and a checkpoint's tensors differ (what ``from_pretrained`` would
    report)."""

    missing: tuple[str, ...]  # expected of the model, not among the tensors
    unexpected: tuple[str, ...]  # among the tensors, not of the model
    resized: tuple[str, ...] = ()  # "name [stored] vs [the model's]"

    def describe(self) -> str:
        """``"21 missing, 16 unexpected, e.g. missing 'a', unexpected 'b'"``."""
        examples = [f"missing {n!r}" for n in self.missing[:_EXAMPLES]]
        examples += [f"unexpected {n!r}" for n in self.unexpected[:_EXAMPLES]]
        examples += list(self.resized[:_EXAMPLES])
        counts = [f"{len(self.missing)} missing", f"{len(self.unexpected)} unexpected"]
        if self.resized:
            counts = [c for c in counts if not c.startswith("0 ")]
            counts.append(f"{len(self.resized)} of another shape")
        return ", ".join(counts) + ", e.g. " + ", ".join(examples)


@dataclass(frozen=True)
class _Expected:
    required: frozenset[str]
    optional: frozenset[str]  # tied aliases: transformers re-ties them on load
    ignore_missing: tuple[str, ...]
    ignore_unexpected: tuple[str, ...]
    shapes: Mapping[str, tuple[int, ...]]

    def compare(self, shapes: Mapping[str, tuple[int, ...]]) -> Misfit | None:
        have = set(shapes)
        allowed = self.required | self.optional
        missing = sorted(
            n for n in self.required - have
            if not any(re.search(p, n) for p in self.ignore_missing)
        )  # fmt: skip
        unexpected = sorted(
            n for n in have - allowed
            if not any(re.search(p, n) for p in self.ignore_unexpected)
        )  # fmt: skip
        resized = sorted(
            f"{n!r} {list(shapes[n])} vs {list(self.shapes[n])}"
            for n in have & allowed
            if n in self.shapes and tuple(shapes[n]) != tuple(self.shapes[n])
        )
        if missing or unexpected or resized:
            return Misfit(tuple(missing), tuple(unexpected), tuple(resized))
        return None


def _patterns(value: Any) -> tuple[str, ...]:
    if isinstance(value, (list, tuple, set, frozenset)):
        return tuple(sorted(str(p) for p in value if isinstance(p, str)))
    return ()


def _build(config: Mapping[str, Any]) -> _Expected | None:
    from ckptools.plan.conversion_lookup import _meta_model

    model = _meta_model(config)
    if model is None:
        return None
    try:
        state = model.state_dict(keep_vars=True)
    except Exception:
        return None
    seen: set[int] = set()
    required: set[str] = set()
    optional: set[str] = set()
    for name, value in state.items():
        (optional if id(value) in seen else required).add(name)
        seen.add(id(value))
    return _Expected(
        frozenset(required),
        frozenset(optional),
        _patterns(getattr(model, "_keys_to_ignore_on_load_missing", None)),
        _patterns(getattr(model, "_keys_to_ignore_on_load_unexpected", None)),
        {n: tuple(int(d) for d in v.shape) for n, v in state.items()},
    )


def _encode(key: str, expected: _Expected | None) -> bytes:
    body = None
    if expected is not None:
        body = {
            "required": sorted(expected.required),
            "optional": sorted(expected.optional),
            "ignore_missing": list(expected.ignore_missing),
            "ignore_unexpected": list(expected.ignore_unexpected),
            "shapes": {n: list(v) for n, v in expected.shapes.items()},
        }
    return json.dumps({"format": FORMAT, "key": key, "expected": body}).encode()


def _strings(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise Miss
    return tuple(value)


def _decode(raw: bytes, key: str) -> _Expected | None:
    body = user_cache.entry(raw, FORMAT, key).get("expected")
    if body is None:
        return None
    if not isinstance(body, dict):
        raise Miss
    return _Expected(
        frozenset(_strings(body.get("required"))),
        frozenset(_strings(body.get("optional"))),
        _strings(body.get("ignore_missing")),
        _strings(body.get("ignore_unexpected")),
        _shapes(body.get("shapes")),
    )


def _shapes(value: Any) -> dict[str, tuple[int, ...]]:
    if not isinstance(value, dict):
        raise Miss
    out = {}
    for name, dims in value.items():
        if not isinstance(dims, list) or not all(type(d) is int for d in dims):
            raise Miss
        out[str(name)] = tuple(dims)
    return out


def _expected(config: Mapping[str, Any], quiet: bool) -> _Expected | None:
    """The names of the model ``config`` names, from the user's cache or built (and kept)."""
    from ckptools.plan.conversion_cache import _model_class, _segment, _version

    archs = config.get("architectures")
    if not isinstance(archs, list) or not any(isinstance(a, str) for a in archs):
        return None  # nothing to build: no import
    try:
        text = json.dumps(config, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return None
    import hashlib

    version = _version()
    key = hashlib.sha256(f"ckptools-model-names/{FORMAT}\0{version}\0{text}".encode()).hexdigest()
    parts = ("model-names", _segment(version), _segment(_model_class(config)), f"{key}.json")
    return user_cache.kept(
        parts,
        lambda raw: _decode(raw, key),
        lambda: _build(config),
        lambda expected: _encode(key, expected),
        f"ckptools: checking the config's model ({_model_class(config)}) against the tensors ",
        quiet,
    )


def misfit(
    config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], *, quiet: bool = False
) -> Misfit | None:
    """How the tensors ``shapes`` (output name → shape) differ from the names and shapes of
    the model ``config`` names; None when they fit or the model cannot be built to tell.

    Names in either format fit: a model with a transformers conversion (per-expert MoE
    tensors on disk, fused in memory) is compared in memory format, the tensors converted
    first when they are stored on disk (:func:`ckptools.plan.conversion_cache.keymap_for`).
    """
    expected = _expected(config, quiet)
    if expected is None:
        return None
    found = expected.compare(shapes)
    if found is None:
        return None
    from ckptools.plan.conversion_cache import keymap_for

    try:
        keymap = keymap_for(config, dict(shapes), "memory", quiet=quiet)
    except Exception:  # a conversion that does not apply to these tensors: they do not fit
        return found
    if keymap is None:
        return found
    return None if expected.compare(keymap.memory_shapes) is None else found
