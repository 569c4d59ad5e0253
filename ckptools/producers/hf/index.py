"""A Hugging Face index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``):
the files its ``weight_map`` names, each checked to lie inside the model directory."""

from __future__ import annotations

from typing import Any

from ckptools.errors import CorruptCheckpointError
from ckptools.io import storage


def index_files(root: str, index_path: str, weight_map: Any) -> list[str]:
    """The files a Hugging Face index's ``weight_map`` (tensor -> file) names, sorted, each
    checked to lie inside ``root`` (once per file, before any is opened or stat'ed).

    Raises:
        CorruptCheckpointError: ``weight_map`` is not a mapping of names.
        OutsideCheckpointError: a name leads outside ``root``.
    """
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(f"{index_path}: weight_map is not an object", path=index_path)
    first: dict[str, str] = {}
    for fqn, name in weight_map.items():
        if not isinstance(name, str):
            raise CorruptCheckpointError(
                f"{index_path}: weight_map puts {fqn!r} in {name!r}, not a file name",
                path=index_path,
                fqn=fqn,
            )
        first.setdefault(name, fqn)
    for name, fqn in first.items():
        storage.contained(root, name, named_by=index_path, entry=f"puts {fqn!r} in", fqn=fqn)
    return sorted(first)
