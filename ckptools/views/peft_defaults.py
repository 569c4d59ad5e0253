"""peft's ``LoraConfig`` defaults, for the ``adapter_config.json`` an export writes.

peft imports torch and transformers (~4 s of CPU, ~350 MiB), so its defaults are read once and
kept in the user's cache (:mod:`ckptools.io.user_cache`), keyed by peft's version and the
sources that define ``LoraConfig``: :func:`with_peft_defaults` imports peft only where they are
not kept yet.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ckptools.errors import UsageError


def with_peft_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` completed as the installed peft's ``LoraConfig(**cfg).to_dict()`` would (every
    field, defaults included); unchanged without peft, whose loader fills the defaults itself.

    The fields this module builds (:func:`ckptools.views.lora.adapter_config` without a
    config file) are plain
    values that ``LoraConfig.__post_init__`` keeps (``target_modules`` aside: a set, written
    sorted), so the result is peft's defaults with them laid over: the defaults are read from
    the user's cache (:func:`_peft_defaults`), and peft, which imports torch and transformers
    (~4 s of CPU, ~350 MiB), is imported only where they are not kept yet.
    """
    fields = {k: v for k, v in cfg.items() if k != "peft_type"}
    defaults = _peft_defaults() if set(fields) <= _PLAIN_FIELDS else None
    if defaults is not None and set(fields) <= set(defaults):
        full = {**defaults, **fields}
        if isinstance(full.get("target_modules"), list | tuple | set):
            full["target_modules"] = sorted(set(full["target_modules"]))
        return full
    try:
        from peft import LoraConfig
    except ImportError:
        return cfg
    try:
        done: dict[str, Any] = LoraConfig(**fields).to_dict()  # type: ignore[no-untyped-call]
    except (TypeError, ValueError) as e:
        raise UsageError(f"peft's LoraConfig refuses this adapter config: {e}") from e
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in done.items()}


#: The fields :func:`ckptools.views.lora.adapter_config` builds, which ``LoraConfig`` keeps as given
_PLAIN_FIELDS = frozenset(
    {"r", "lora_alpha", "target_modules", "rank_pattern", "task_type",
     "base_model_name_or_path", "inference_mode"}
)  # fmt: skip
#: The cache entry's format; one of another format is derived again
_DEFAULTS_FORMAT = 1
#: peft's sources that decide ``LoraConfig()``'s fields and defaults (read, not imported)
_PEFT_SOURCES = ("config.py", "tuners/lora/config.py")


def _peft_defaults() -> dict[str, Any] | None:
    """The installed peft's ``LoraConfig().to_dict()``, JSON values (None without peft): kept
    in the user's cache (:mod:`ckptools.io.user_cache`) under a digest of peft's version and
    of the sources that define ``LoraConfig``, so an upgraded or edited peft is asked again."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("peft")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    import hashlib
    from importlib import metadata

    from ckptools.io import user_cache

    h = hashlib.sha256(f"ckptools-peft-defaults/{_DEFAULTS_FORMAT}\0".encode())
    try:
        h.update(metadata.version("peft").encode())
        root = next(iter(spec.submodule_search_locations))
        for name in _PEFT_SOURCES:
            with open(os.path.join(root, name), "rb") as f:
                h.update(b"\0" + f.read())
    except (OSError, metadata.PackageNotFoundError):
        return _derive_peft_defaults()  # not keyed: asked each time
    key = h.hexdigest()

    def decode(raw: bytes) -> dict[str, Any] | None:
        defaults = user_cache.entry(raw, _DEFAULTS_FORMAT, key).get("defaults")
        if not isinstance(defaults, dict):
            raise user_cache.Miss
        return defaults

    def encode(defaults: dict[str, Any] | None) -> bytes:
        entry = {"format": _DEFAULTS_FORMAT, "key": key, "defaults": defaults}
        return json.dumps(entry, default=str).encode()

    return user_cache.kept(
        ("peft-defaults", f"{key}.json"), decode, _derive_peft_defaults, encode,
        "reading peft's LoraConfig defaults ", quiet=True,
    )  # fmt: skip


def _derive_peft_defaults() -> dict[str, Any] | None:
    try:
        from peft import LoraConfig
    except ImportError:
        return None
    full: dict[str, Any] = LoraConfig().to_dict()  # type: ignore[no-untyped-call]
    # as JSON keeps them: what config_json writes of them
    loaded: dict[str, Any] = json.loads(json.dumps(full, default=str))
    return loaded
