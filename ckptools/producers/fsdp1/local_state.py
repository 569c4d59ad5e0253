"""FSDP1 ``LOCAL_STATE_DICT`` saves, recognised to be refused by name.

Under ``FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT)`` each rank's
``model.state_dict()`` holds its shard of every FlatParameter (``<module>._flat_param``: the
padded, flattened concatenation of that module's parameters) and, with
``use_orig_params=True``, rank-local fragments under the parameters' names. What parameters
a flat parameter holds, in which order and with which shapes is not stored: it lives in the
wrapped model. Read as it is, the checkpoint would be "converted" into a model of
``_flat_param`` tensors, so every verb refuses it in one line, whether the ranks saved it with
``torch.save`` (one file per rank, or a directory of them) or with ``dcp.save``.

Recognised by a tensor key whose last part is FSDP's ``_flat_param``, found first as bytes in
the ``.metadata`` / ``data.pkl`` pickle (nothing more is read for any other checkpoint), then
confirmed among the pickle's keys.
"""

from __future__ import annotations

from contextlib import suppress
from typing import Any

from ckptools.core.manifest import Manifest
from ckptools.errors import CkptError, UnsupportedCheckpointError
from ckptools.io import storage
from ckptools.producers.base import Layout, read_marker, register
from ckptools.producers.run_dirs import directory_names

#: FSDP1's name for a FlatParameter in its module (``torch.distributed.fsdp._flat_param``)
FLAT_PARAM = "_flat_param"
#: the refusal every verb gives
REFUSAL = (
    "flat-parameter shards of FSDP1 LOCAL_STATE_DICT: no parameter names or shapes are "
    "stored; save with SHARDED_STATE_DICT"
)
_METADATA = ".metadata"
#: the names a rank's ``torch.save`` of its state dict is given
_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
#: the torch.save files of a directory looked into: every rank's file holds flat parameters
_FILES_LOOKED_AT = 4
#: how deep the keys of a torch.save'd state dict are looked for (a nested ``{"model": ...}``)
_DEPTH = 4


def _is_flat(key: str) -> bool:
    return key.rpartition(".")[2] == FLAT_PARAM


def _flat_keys(value: Any, prefix: str = "", depth: int = 0) -> list[str]:
    """The dotted keys of ``value``'s nested dicts whose last part is ``_flat_param``."""
    if not isinstance(value, dict) or depth > _DEPTH:
        return []
    found = []
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(key, str) and _is_flat(name) and not isinstance(item, dict):
            found.append(name)
        elif isinstance(key, str | int):
            found.extend(_flat_keys(item, f"{name}.", depth + 1))
    return found


def _dcp_flat_keys(path: str) -> list[str]:
    if storage.outside_reason(path, _METADATA) is not None:
        return []  # never peeked at; the DCP layout refuses it with the reason
    meta = storage.join(path, _METADATA)
    # peek: the DCP layout parses the same bytes when this is not a LOCAL_STATE_DICT save
    data = read_marker(meta, peek=True)
    if FLAT_PARAM.encode() not in data:
        return []
    from ckptools.producers.dcp.layout import parse_metadata

    return [k for k in parse_metadata(data, meta).state_dict_metadata if _is_flat(str(k))]


def _file_flat_keys(root: str, rel: str) -> list[str]:
    from ckptools.formats import dtensor, torch_archive

    with storage.open_reader(root) as reader:
        if not torch_archive.is_zip(reader.read(rel, 0, 4)):
            return []
        archive = torch_archive.read_archive(reader, rel, 0, reader.size(rel))
        if FLAT_PARAM.encode() not in torch_archive.read_record(reader, archive, "data.pkl"):
            return []
        return _flat_keys(torch_archive.load_pickle(reader, archive, dtensor.GLOBALS))


def flat_keys(path: str) -> tuple[str, list[str]]:
    """(the file that holds them, the flat parameters' keys) of the save at ``path``: a DCP
    directory, a ``torch.save`` file or a directory of them; no keys when it holds none (or
    cannot be read: the layout that reads it says why)."""
    names = directory_names(path)
    with suppress(CkptError, OSError):
        if names is None:
            if storage.isfile(path):
                parent, rel = storage.dirname(path), storage.basename(path)
                return path, _file_flat_keys(parent, rel)
            return path, []
        if _METADATA in names:
            return storage.join(path, _METADATA), _dcp_flat_keys(path)
        files = sorted(n for n in names if n.endswith(_SUFFIXES) and not n.startswith("."))
        for name in files[:_FILES_LOOKED_AT]:
            if storage.outside_reason(path, name) is None and storage.isfile(
                storage.join(path, name)
            ):
                found = _file_flat_keys(path, name)
                if found:
                    return storage.join(path, name), found
    return path, []


class LocalStateDictLayout(Layout):
    name = "fsdp1_local"
    description = "FSDP1 LOCAL_STATE_DICT flat-parameter shards (recognised, refused by name)"

    def probe(self, path: str) -> str | None:
        return None if flat_keys(path)[1] else f"no {FLAT_PARAM} tensor (FSDP1 LOCAL_STATE_DICT)"

    def read_manifest(self, path: str) -> Manifest:
        where, keys = flat_keys(path)
        more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
        first = keys[0] if keys else FLAT_PARAM
        raise UnsupportedCheckpointError(
            f"{where}: {first!r}{more} are {REFUSAL}", path=where, fqn=first
        )


register(LocalStateDictLayout())
