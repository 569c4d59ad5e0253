"""``ckptools.inspect``: what a checkpoint holds, from its metadata alone (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ckptools.core import keys
from ckptools.core.manifest import Manifest
from ckptools.engine.reader import read_object
from ckptools.errors import CkptError, UsageError
from ckptools.formats import safe_pickle, stream_transforms
from ckptools.io import storage
from ckptools.producers import read_manifest
from ckptools.producers.dcp.layout import sharding_summary
from ckptools.producers.optimizer_state import flat_shard_note, optimizer_alone, optimizer_states
from ckptools.producers.registry import inspected
from ckptools.views import lora


@dataclass(frozen=True)
class InspectReport:
    """The result of :func:`inspect`: the manifest, the model part, and decoded object values."""

    manifest: Manifest
    model_part: keys.ModelPart
    #: FQN → plain value (or {"error": ...}) for objects, when values were asked for
    object_values: dict[str, Any] = field(default_factory=dict)
    #: what the checkpoint is, said beside the manifest's own notes (a wrong file named as such)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        m = self.manifest
        # One pass over all chunks (there may be millions) for every per-rank/per-file total.
        chunks_per_rank: dict[int, int] = {}
        bytes_per_rank: dict[int, int] = {}
        bytes_per_file: dict[str, int] = dict.fromkeys(m.files, 0)
        tensors = []
        for t in m.tensors.values():
            itemsize = t.itemsize
            ranks = set()
            for c in t.chunks:
                nbytes = math.prod(c.sizes) * itemsize
                bytes_per_file[c.file] = bytes_per_file.get(c.file, 0) + nbytes
                if c.rank is not None:
                    ranks.add(c.rank)
                    chunks_per_rank[c.rank] = chunks_per_rank.get(c.rank, 0) + 1
                    bytes_per_rank[c.rank] = bytes_per_rank.get(c.rank, 0) + nbytes
            tensors.append(
                {
                    "fqn": t.fqn,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "bytes": t.nbytes,
                    "chunks": len(t.chunks),
                    "ranks": sorted(ranks),
                }
            )
        objects = []
        for o in m.objects.values():
            item: dict[str, Any] = {"fqn": o.fqn}
            if o.file is not None:
                item.update(file=o.file, bytes=o.length)
            if o.fqn in self.object_values:
                item["value"] = self.object_values[o.fqn]
            elif o.has_value:
                item["value"] = safe_pickle.plain(o.value)
            objects.append(item)
        model_tensors = keys.model_keys(m, self.model_part)
        model_fqns, aliases = set(model_tensors.values()), m.aliases()
        return {
            "path": m.root,
            "format": m.format,
            "layout": m.layout,
            "world_size": m.world_size,
            "notes": [*m.notes, *self.notes],
            "model_part": {
                "prefix": self.model_part.prefix,
                "excluded": list(self.model_part.excluded),
                "tensors": len(model_tensors),
                "elements": sum(m.tensors[f].numel for f in model_tensors.values()),
            },
            "sources": list(m.details.get("sources", ())),
            "step": m.details.get("step"),
            # each producer's own facts (``registry.inspected``): its key, null for the others
            **{f.KEY: f.facts(m) for f in inspected()},
            "optimizers": [o.to_dict() for o in optimizer_states(m)],
            "peft": lora.describe(m, model_tensors),
            "sharding": sharding_summary(m),
            # items stored through stream transforms (DCP extensions), and whether ckptools
            # reads them (decoding each first): the other verbs refuse those it does not, in
            # the words of ``missing`` (what to install, or that it does not decode them)
            "encodings": [
                {
                    "transforms": list(chain),
                    "items": n,
                    "decoded": stream_transforms.decodes(chain),
                    "missing": stream_transforms.missing(chain),
                }
                for chain, n in stream_transforms.encodings(m).items()
            ],
            "mesh": _mesh(m),
            "tensors": tensors,
            "objects": objects,
            "files": [{"path": f.path, "bytes": f.size, "rank": f.rank} for f in m.files.values()],
            "totals": {
                "tensors": len(m.tensors),
                "objects": len(m.objects),
                "parameters": m.total_params,
                "bytes": m.total_bytes,
                # a tied weight is the model's; optimizer entries sharing one tensor (a step
                # counter saved once for every parameter) are not tied weights
                "tied_aliases": sorted(aliases & model_fqns),
                "shared_aliases": sorted(aliases - model_fqns),
                "bytes_per_dtype": m.bytes_per_dtype(),
                "bytes_per_file": bytes_per_file,
                "bytes_per_rank": {str(k): v for k, v in sorted(bytes_per_rank.items())},
                "chunks_per_rank": {str(k): v for k, v in sorted(chunks_per_rank.items())},
            },
        }


def _mesh(m: Manifest) -> dict[str, Any] | None:
    """The device mesh a per-rank layout read from the files (its shape) and how many model
    and optimizer tensors each combination of placements holds; None when not recorded."""
    placements = m.details.get("placements") or {}
    if "mesh" not in m.details and not placements:
        return None
    counts: dict[str, int] = {}
    for names in placements.values():
        key = "(" + ", ".join(names) + ")"
        counts[key] = counts.get(key, 0) + 1
    return {"shape": m.details.get("mesh"), "placements": counts}


@storage.accepts_storage_options
def inspect(
    path: str,
    *,
    format: str | None = None,
    values: bool = False,
    key: str | None = None,
    storage_options: storage.StorageOptions | None = None,
) -> InspectReport:
    """Describe the checkpoint at ``path`` without reading tensor data or running its code.

    Args:
        path: a checkpoint directory or file in any supported layout.
        format: force a layout by name (see ``ckpt inspect --help``) instead of detecting it.
        values: also decode non-tensor entries (through the pickle allowlist); an entry that
            cannot be decoded safely is reported with its error instead of a value.
        key: the dotted key path of the container that holds the model's state dict
            (``"model_state_dict"``, ``"app.model"``); default: found as
            :func:`ckptools.core.keys.find_model_part` says.
        storage_options: fsspec options for URL paths (credentials, endpoint...), a mapping
            or its JSON text; see :func:`ckptools.io.storage.storage_options`.

    Example:
        >>> report = inspect("checkpoints/step-1000")          # doctest: +SKIP
        >>> report.to_dict()["model_part"]["prefix"]            # doctest: +SKIP
        'model.'
    """
    manifest = read_manifest(path, format, listing=True)
    decoded: dict[str, Any] = {}
    if values:
        for fqn, entry in manifest.objects.items():
            if entry.has_value:
                continue
            try:
                decoded[fqn] = safe_pickle.plain(read_object(manifest, fqn))
            except CkptError as e:
                decoded[fqn] = {"error": str(e)}
    part = keys.find_model_part(manifest) if key is None else model_part_at(manifest, key)
    model = keys.model_keys(manifest, part)
    notes = [optimizer_alone(manifest, model)]
    notes += [flat_shard_note(manifest, o, model) for o in optimizer_states(manifest)]
    return InspectReport(manifest, part, decoded, tuple(n for n in notes if n))


def model_part_at(manifest: Manifest, key: str) -> keys.ModelPart:
    """The model part named by ``key``, a dotted key path of a container of tensors.

    Raises:
        UsageError: no tensor lies under ``key``; the message lists the top-level keys that
            hold tensors.
    """
    wanted = key.strip(".")
    for fqn in manifest.tensors:
        path = keys.key_path(manifest, fqn)
        for n in range(1, len(path)):
            if ".".join(path[:n]) == wanted:
                return keys.ModelPart(path[:n])
    tops = sorted({keys.key_path(manifest, f)[0] for f in manifest.tensors})
    raise UsageError(
        f"{manifest.root}: --key {key!r} holds no tensors; top-level keys with tensors: "
        f"{', '.join(tops) or '(none)'}"
    )
