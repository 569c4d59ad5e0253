"""Orbax checkpoints (JAX: MaxText, and any ``orbax.checkpoint`` save), recognised and listed.

What Orbax writes (orbax-checkpoint 0.12, ``fixtures/orbax/generate.py``):

* a ``CheckpointManager`` run directory: one ``<step>/`` per save, committed with
  ``_CHECKPOINT_METADATA`` (JSON: ``item_handlers``, a handler per item name, MaxText's
  ``items``; or one handler when the step is the item itself);
* an item directory (``StandardCheckpointer`` / ``PyTreeCheckpointer`` save, or a step's
  ``items/``): ``_METADATA`` (JSON: ``tree_metadata``, per array its key path and
  ``write_shape``), ``array_metadatas/``, ``_sharding``, and the arrays: an OCDBT store
  (``manifest.ocdbt``, ``ocdbt.process_N/``, Orbax's default) where each array's zarr metadata,
  its dtype included, is a compressed b-tree entry, or (``use_ocdbt=False``) one zarr directory
  per array with its JSON ``.zarray`` / ``zarr.json``.

ckptools converts PyTorch checkpoints only: every verb refuses these in one line naming Orbax,
and ``inspect`` lists each array's path and shape from ``_METADATA``, and its dtype where a
JSON zarr metadata file holds it (not from OCDBT: no tensorstore decoding).
"""

from __future__ import annotations

import re
from typing import Any

from ckptools.core.manifest import Manifest
from ckptools.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptools.io import storage
from ckptools.producers.base import Layout, register
from ckptools.producers.orbax import DETAILS_KEY
from ckptools.producers.run_dirs import Chosen, directory_names, newest_numbered

#: a committed step (``CheckpointManager``), or a save's own record of its handler
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
#: an item's tree of arrays (JSON)
TREE_METADATA = "_METADATA"
_STEP = re.compile(r"^(\d+)$")
#: the most bytes one JSON metadata file may hold before it is parsed
_JSON_MAX = 256 << 20
#: the one line every verb but inspect gives
REFUSAL = (
    "an Orbax (JAX) checkpoint: ckptools reads PyTorch checkpoints; `ckpt inspect` lists its "
    "arrays; convert it to PyTorch with the JAX side's tools (MaxText's conversion scripts, "
    "Orbax's restore) first"
)
#: zarr v2 ``dtype`` (numpy's type strings) → the name JAX and torch give it
_ZARR_DTYPES = {
    "|b1": "bool",
    "|i1": "int8",
    "|u1": "uint8",
    "<i2": "int16",
    "<u2": "uint16",
    "<i4": "int32",
    "<u4": "uint32",
    "<i8": "int64",
    "<u8": "uint64",
    "<f2": "float16",
    "<f4": "float32",
    "<f8": "float64",
    "<c8": "complex64",
    "<c16": "complex128",
}


def _json(path: str) -> Any:
    return storage.read_json(path, _JSON_MAX, what="Orbax metadata file")


def _is_step(path: str) -> bool:
    return storage.isfile(storage.join(path, CHECKPOINT_METADATA))


def _kind(path: str) -> str | None:
    """ "item", "step" or "run" when ``path`` is an Orbax directory of that kind, else None."""
    names = directory_names(path)
    if names is None:
        return None
    if TREE_METADATA in names and storage.isfile(storage.join(path, TREE_METADATA)):
        return "item"
    if CHECKPOINT_METADATA in names:
        return "step"
    steps = [n for n in names if _STEP.match(n) and storage.outside_reason(path, n) is None]
    if any(_is_step(storage.join(path, n)) for n in sorted(steps, key=int)[-3:]):
        return "run"
    return None


def _step(path: str) -> tuple[str, Chosen | None]:
    """The save ``path`` stands for: itself, or a run's newest committed step."""
    if _kind(path) != "run":
        return path, None
    chosen = newest_numbered(path, _STEP, _is_step, f"no {CHECKPOINT_METADATA}")
    assert chosen is not None  # _kind saw one
    return storage.contained(path, chosen.name, named_by=path, entry="holds"), chosen


def _items(step: str) -> list[tuple[str, str]]:
    """(item name, directory) of each item of the save ``step`` ("" when it is the item)."""
    if storage.isfile(storage.join(step, TREE_METADATA)):
        return [("", step)]
    record = _json(storage.join(step, CHECKPOINT_METADATA))
    handlers = record.get("item_handlers") if isinstance(record, dict) else None
    names = sorted(handlers) if isinstance(handlers, dict) else sorted(directory_names(step) or ())
    found = []
    for name in names:
        if not isinstance(name, str) or storage.outside_reason(step, name) is not None:
            continue
        directory = storage.join(step, name)
        if storage.isfile(storage.join(directory, TREE_METADATA)):
            found.append((name, directory))
    return found


def _zarr_dtype(item: str, name: str) -> str | None:
    """The dtype the array ``name``'s own zarr JSON records (saved without OCDBT), else None."""
    if storage.outside_reason(item, name) is not None:
        return None
    array = storage.join(item, name)
    for meta, field in ((".zarray", "dtype"), ("zarr.json", "data_type")):
        path = storage.join(array, meta)
        if storage.isfile(path):
            found = _json(path)
            value = found.get(field) if isinstance(found, dict) else None
            if isinstance(value, str):
                return _ZARR_DTYPES.get(value, value)
    return None


def _arrays(item: str) -> tuple[list[dict[str, Any]], str]:
    """Each array of the item directory ``item`` (path, shape, dtype, value type), and how it
    stores them."""
    where = storage.join(item, TREE_METADATA)
    meta = _json(where)
    tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
    if not isinstance(tree, dict):
        raise CorruptCheckpointError(f"{where}: no tree_metadata object", path=where)
    ocdbt = bool(meta.get("use_ocdbt")) or storage.isfile(storage.join(item, "manifest.ocdbt"))
    arrays = []
    for key, entry in tree.items():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        value = entry.get("value_metadata") if isinstance(entry, dict) else None
        if not isinstance(keys, list) or not isinstance(value, dict):
            raise CorruptCheckpointError(f"{where}: entry {key!r} is malformed", path=where)
        path = ".".join(str(k.get("key")) if isinstance(k, dict) else str(k) for k in keys)
        shape = value.get("write_shape")
        arrays.append(
            {
                "path": path,
                "shape": [int(d) for d in shape] if isinstance(shape, list) else [],
                "dtype": None if ocdbt else _zarr_dtype(item, path),
                "value_type": str(value.get("value_type", "")),
            }
        )
    storage_kind = (
        "OCDBT store: dtypes are kept there, not in JSON; ckptools does not decode it"
        if ocdbt
        else "one zarr array each"
    )
    return arrays, storage_kind


class OrbaxLayout(Layout):
    name = "orbax"
    description = "Orbax (JAX, MaxText) checkpoint: inspect lists its arrays; other verbs refuse it"

    def probe(self, path: str) -> str | None:
        if _kind(path) is not None:
            return None
        return f"no Orbax {TREE_METADATA} or {CHECKPOINT_METADATA}, nor <step>/ holding one"

    def read_manifest(self, path: str) -> Manifest:
        raise UnsupportedCheckpointError(f"{path}: {REFUSAL}", path=path)

    def read_listing(self, path: str) -> Manifest:
        step, chosen = _step(path)
        items = []
        for name, directory in _items(step):
            arrays, storage_kind = _arrays(directory)
            items.append({"item": name, "storage": storage_kind, "arrays": arrays})
        number = _STEP.match(storage.basename(step))
        facts = {
            "what": "a JAX checkpoint, listed from Orbax's JSON metadata; no verb converts it",
            "step": int(number.group(1)) if number else None,
            "items": items,
        }
        manifest = Manifest(
            root=path,
            format="orbax",
            layout=self.name,
            tensors={},
            objects={},
            files={},
            notes=(
                "an Orbax (JAX) checkpoint: ckptools reads PyTorch checkpoints; inspect lists "
                "its arrays, every other verb refuses it",
            ),
            details={DETAILS_KEY: facts},
        )
        return manifest if chosen is None else chosen.noted(manifest)


register(OrbaxLayout())
