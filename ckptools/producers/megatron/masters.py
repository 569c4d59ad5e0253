"""The distributed optimizer's state of a Megatron save, read: per kind, an entry per model FQN.

:mod:`ckptools.producers.megatron.optimizer` and :mod:`~ckptools.producers.megatron.buckets` place
the state (pure); this module gathers what it needs from a save's manifest
(:mod:`ckptools.producers.megatron.layout`) and its files:

* ``dp_reshardable``: each bucket tensor's stored chunks resolved to raw byte ranges (a DCP item
  is a ``torch.save`` archive: its directory is read, a few hundred bytes per item, the tensor
  bytes are not), and each buffer's ``per_bucket_numel(_unpadded)`` objects decoded through the
  allowlist;
* ``fully_reshardable``: the ``optimizer.state.*`` entries, renamed (an MoE run's
  ChainedOptimizer saves both its parts' there, unprefixed: :func:`~.layout.chained_parts`);
* the optimizer's ``param_groups`` (Megatron's: weight decay on matrices, none on norms and
  biases) and its ``step``, from the ``optimizer`` objects (or ``common_state``) that hold them.

The entries keep the model's Megatron FQNs and shapes (stacked layers, fused QKV and fc1), so the
same Megatron → Hugging Face mapping that converts the model converts them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ckptools.core import dtypes
from ckptools.core.keys import model_keys
from ckptools.core.manifest import Manifest, ObjectEntry, Record, TensorEntry, record_of
from ckptools.errors import CorruptCheckpointError, UnsupportedCheckpointError, UsageError
from ckptools.formats import safe_pickle, torch_archive
from ckptools.io import storage
from ckptools.io.readers import Reader
from ckptools.producers.megatron import buckets, moe_optimizer
from ckptools.producers.megatron import optimizer as mo
from ckptools.producers.megatron.layout import (
    CHAINED,
    DETAILS_KEY,
    chained_parts,
    common_parts,
    common_state,
)

#: what ``consolidate --masters`` and ``reshard`` say when a save holds no distributed optimizer
NO_OPTIMIZER = "holds no distributed-optimizer state (it was saved without the optimizer)"


@dataclass(frozen=True)
class MegatronOptimizer:
    """A Megatron save's optimizer as the verbs need it.

    Attributes:
        sharding: ``"dp_reshardable"`` or ``"fully_reshardable"``.
        state: kind (``param``, ``exp_avg``, ``exp_avg_sq``) → Megatron model FQN → entry.
        param_groups: the optimizer's param groups without ``params`` (Megatron saves none),
            in order; empty when the save does not hold them.
        step: the optimizer's step counter, when saved.
    """

    sharding: str
    state: Mapping[str, Mapping[str, TensorEntry]]
    param_groups: tuple[dict[str, Any], ...] = ()
    step: int | float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


def read_optimizer(manifest: Manifest) -> MegatronOptimizer | None:
    """The optimizer state of the Megatron save ``manifest``, None when it holds none.

    Raises:
        CorruptCheckpointError: the buckets do not add up to the model (one line, naming the
            way forward).
        UnsupportedCheckpointError: a layout this placement does not know.
    """
    common = common_state(manifest)
    chained = chained_parts(manifest, common)
    sharding = _sharding(manifest)
    prefixes = [""]
    if chained:
        kinds = set(chained)
        prefixed = any(CHAINED.match(f) for f in manifest.tensors)
        if kinds == {"dp_reshardable"}:
            sharding, prefixes = "dp_reshardable", [f"chained_{i}." for i in range(len(chained))]
        elif kinds == {"fully_reshardable"} and not prefixed and sharding == "fully_reshardable":
            # every part's state under one optimizer.state.* namespace (layout.chained_parts):
            # read as one optimizer's; the parts' groups are in common_state, one per part
            prefixes = [f"chained_{i}." for i in range(len(chained))]
        else:
            raise UnsupportedCheckpointError(
                f"{manifest.root}: the optimizer is a ChainedOptimizer of "
                f"{', '.join(f'chained_{i} {s}' for i, s in enumerate(chained))}"
                f"{' saved under chained_<i>. prefixes' if prefixed else ''}: ckptools places "
                "a ChainedOptimizer whose parts are all dp_reshardable, or all "
                "fully_reshardable as Megatron-LM saves them (unprefixed, "
                f"chained_optim_avoid_prefix); {mo.WITHOUT_OPTIMIZER}",
                path=manifest.root,
            )
    if sharding is None:
        return None
    with storage.open_reader(manifest.data_dir()) as reader:
        if sharding == "fully_reshardable":
            state = buckets.model_space_state(manifest.tensors)
        else:
            state = _bucket_state(manifest, reader, prefixes)
        groups, step = _param_groups(manifest, reader, prefixes, common, sharding)
    return MegatronOptimizer(sharding, state, groups, step)


def with_masters(manifest: Manifest, opt: MegatronOptimizer | None) -> Manifest:
    """``manifest`` with each model tensor's entry replaced by its fp32 master
    (``consolidate --masters``).

    Raises:
        UsageError: the save holds no masters, or not for every model tensor.
    """
    masters = (opt.state if opt is not None else {}).get("param")
    if not masters:
        raise UsageError(
            f"{manifest.root}: {NO_OPTIMIZER}: --masters needs the fp32 masters of a "
            "distributed optimizer; drop --masters to convert the stored weights"
        )
    model = model_keys(manifest)
    # a buffer (the router's expert bias) has no master: it is the model's as stored
    missing = [f for f in model.values() if f not in masters and not mo.is_buffer(f)]
    if missing:
        raise UsageError(
            f"{manifest.root}: the optimizer holds no master of {missing[0]!r}; drop --masters "
            "to convert the stored weights"
        )
    tensors = {f: masters.get(f, e) for f, e in manifest.tensors.items()}
    return replace(manifest, tensors=tensors)


def _sharding(manifest: Manifest) -> str | None:
    for fqn in manifest.tensors:
        if mo.parse_bucket_fqn(fqn) is not None:
            return "dp_reshardable"
        if fqn.startswith(mo.STATE_PREFIX):
            return "fully_reshardable"
    return None


def _bucket_state(
    manifest: Manifest, reader: Reader, prefixes: list[str]
) -> dict[str, dict[str, TensorEntry]]:
    """Every part's state (one part, or a ChainedOptimizer's ``chained_<i>.`` prefixed ones:
    an MoE run's dense and expert optimizers, :mod:`.moe_optimizer`), merged per kind."""
    args = manifest.details.get(DETAILS_KEY) or {}
    where = manifest.root
    tp, pp = args.get("tensor_parallel"), args.get("pipeline_parallel")
    num_layers = args.get("num_layers")
    if not (isinstance(tp, int) and isinstance(pp, int) and isinstance(num_layers, int)):
        raise CorruptCheckpointError(
            f"{where}: common_state's args do not give the run's tensor/pipeline-parallel sizes "
            f"and layers, which place the optimizer's buckets; {mo.WITHOUT_OPTIMIZER}",
            path=where,
        )
    dp = args.get("data_parallel")
    split = buckets.Parallelism(
        tp,
        pp,
        dp if isinstance(dp, int) else None,
        num_layers,
        args.get("untie_embeddings_and_output_weights") is False,
    )
    model = [
        mo.ModelTensor(f, manifest.tensors[f].shape, _boxes(manifest.tensors[f]))
        for f in model_keys(manifest).values()
        if not mo.is_buffer(f)  # in no gradient buffer
    ]
    experts = args.get("num_experts")
    if not experts:
        if prefixes != [""]:
            raise UnsupportedCheckpointError(
                f"{where}: a ChainedOptimizer of {len(prefixes)} parts in a run without MoE "
                f"experts, which ckptools does not place; {mo.WITHOUT_OPTIMIZER}",
                path=where,
            )
        parts: list[moe_optimizer.Part] = [("", model, split, None)]
    else:
        parts = moe_optimizer.parts(model, split, args, prefixes, where)
    state: dict[str, dict[str, TensorEntry]] = {}
    for prefix, tensors, part_split, stagings in parts:
        found = _part_buffers(manifest, reader, prefix)
        if found is None:
            raise CorruptCheckpointError(
                f"{where}: no {prefix}{mo.DISTRIBUTED_PREFIX}… buckets; {mo.WITHOUT_OPTIMIZER}",
                path=where,
            )
        buffers, dtype = found
        placed = buckets.bucket_state(
            tensors,
            buffers,
            part_split,
            dtype=dtype,
            itemsize=dtypes.dtype(dtype).itemsize,
            where=f"{where} {prefix}".rstrip(". "),
            stagings=stagings,
        )
        for kind, entries in placed.items():
            state.setdefault(kind, {}).update(entries)
    return state


def _part_buffers(
    manifest: Manifest, reader: Reader, prefix: str
) -> tuple[dict[int, buckets.Buckets], str] | None:
    """One distributed optimizer's saved buffers per ``dp_group_idx`` and their dtype (the
    FQNs under ``prefix``), None when it saved none."""
    where = manifest.root
    entries: dict[int, dict[tuple[int, str], TensorEntry]] = {}
    dtype = None
    for fqn, entry in manifest.tensors.items():
        name = mo.parse_bucket_fqn(fqn[len(prefix) :]) if fqn.startswith(prefix) else None
        if name is None:
            continue
        if name.gbuf != 0:
            raise UnsupportedCheckpointError(
                f"{where}: {fqn} is a second gradient buffer (virtual pipeline stages or "
                f"several dtypes), which ckptools does not place; {mo.WITHOUT_OPTIMIZER}",
                path=where,
                fqn=fqn,
            )
        entries.setdefault(name.dp_group, {})[(name.bucket, name.kind)] = entry
        dtype = entry.dtype
    if dtype is None:
        return None
    buffers = {}
    for group, found in entries.items():
        key = f"{prefix}{mo.DISTRIBUTED_PREFIX}dp_group_idx_{group}"
        unpadded = buckets.bucket_numels(
            _object(manifest, reader, f"{key}.per_bucket_numel_unpadded"),
            "per_bucket_numel_unpadded",
            where,
        )
        padded_value = _object(manifest, reader, f"{key}.per_bucket_numel", required=False)
        padded = (
            None
            if padded_value is None
            else buckets.bucket_numels(padded_value, "per_bucket_numel", where)
        )
        pieces = {bk: _pieces(reader, e) for bk, e in found.items()}
        buffers[group] = buckets.Buckets(unpadded, padded, pieces)
    return buffers, dtype


def _boxes(entry: TensorEntry) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    return tuple(sorted({(c.offsets, c.sizes) for c in entry.chunks}))


def _pieces(reader: Reader, entry: TensorEntry) -> list[mo.StoredPiece]:
    """The bucket tensor's stored chunks as raw element ranges, sorted (replicas once)."""
    out: dict[int, mo.StoredPiece] = {}
    itemsize = dtypes.dtype(entry.dtype).itemsize
    for c in entry.chunks:
        if c.offsets[0] in out:
            continue
        if c.encoding == "raw":
            at, record = c.offset, record_of(c)
        else:
            at, record = _raw_offset(reader, entry, c.file, c.offset, c.length, c.sizes, itemsize)
        out[c.offsets[0]] = mo.StoredPiece(c.offsets[0], c.sizes[0], c.file, at, c.rank, record)
    return [out[k] for k in sorted(out)]


def _raw_offset(
    reader: Reader,
    entry: TensorEntry,
    file: str,
    offset: int,
    length: int,
    sizes: tuple[int, ...],
    itemsize: int,
) -> tuple[int, Record]:
    """Where a DCP item's tensor data starts in ``file``, and the stored record holding it (its
    CRC-32 checks the parameters cut from it): its archive's directory read."""
    archive = torch_archive.read_archive(reader, file, offset, length)
    ref = torch_archive.load_pickle(reader, archive)
    where = f"{reader.root}/{file}@{offset}"
    if not isinstance(ref, safe_pickle.TensorRef) or ref.shape != sizes or not ref.is_contiguous:
        raise CorruptCheckpointError(
            f"{where}: the item of {entry.fqn!r} holds no contiguous tensor of {list(sizes)}",
            path=file,
            fqn=entry.fqn,
        )
    rec = archive.record(f"data/{ref.storage.key}")
    if (ref.storage_offset + sizes[0]) * itemsize > rec.size:
        raise CorruptCheckpointError(
            f"{where}: the item of {entry.fqn!r} reaches past its storage record",
            path=file,
            fqn=entry.fqn,
        )
    data_at = torch_archive.record_data_offset(reader, archive, rec)
    return data_at + ref.storage_offset * itemsize, Record(data_at, rec.size, rec.crc32)


def _object_entry(manifest: Manifest, key: str) -> ObjectEntry | None:
    """A ``ShardedObject``'s entry: stored under ``<key>/shard_<offsets>_<shape>``."""
    for fqn, entry in manifest.objects.items():
        if fqn == key or fqn.split("/", 1)[0] == key:
            return entry
    return None


def _object(manifest: Manifest, reader: Reader, key: str, *, required: bool = True) -> Any:
    entry = _object_entry(manifest, key)
    if entry is None or entry.file is None:
        if not required:
            return None
        raise CorruptCheckpointError(
            f"{manifest.root}: no {key} object beside the optimizer's buckets; "
            f"{mo.WITHOUT_OPTIMIZER}",
            path=manifest.root,
            fqn=key,
        )
    archive = torch_archive.read_archive(reader, entry.file, entry.offset, entry.length)
    value = torch_archive.load_pickle(reader, archive)
    # a ShardedObject is saved as torch.save([data]): the list of this rank's data
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    return value


def _param_groups(
    manifest: Manifest,
    reader: Reader,
    prefixes: list[str],
    common: Mapping[str, Any] | None,
    sharding: str,
) -> tuple[tuple[dict[str, Any], ...], int | float | None]:
    """The optimizer's param groups and step: in the ``optimizer`` object of model-parallel
    rank 0 (``dp_reshardable``), or in ``common_state`` (``fully_reshardable``: a
    ChainedOptimizer's as one entry per part, :func:`~.layout.common_parts`). A
    ChainedOptimizer's later parts' groups (an MoE run's experts) join the first part's group
    of the same settings (see :func:`_join_groups`)."""
    found: list[tuple[dict[str, Any], ...]] = []
    held = (common or {}).get("optimizer")
    parts = common_parts(held) if sharding == "fully_reshardable" else None
    for i, prefix in enumerate(prefixes):
        holders: list[Any] = []
        if parts is not None:
            holders.append(parts[i])
        else:
            key = f"{prefix}{mo.DISTRIBUTED_PREFIX}dp_group_idx_0.optimizer"
            value = _object(manifest, reader, key, required=False)
            if value is not None:
                holders.append(value)
            if prefix == "":
                holders.append(held)
        groups = next((g for h in holders for g in _find_groups(h)), None)
        if groups is not None:
            found.append(
                tuple(
                    {k: v for k, v in g.items() if k != "params"}
                    for g in groups
                    if isinstance(g, dict)
                )
            )
    if not found:
        return (), None
    plain = _join_groups(manifest.root, found)
    steps = {
        g.get("step") for part in found for g in part if isinstance(g.get("step"), int | float)
    }
    return plain, (steps.pop() if len(steps) == 1 else None)


#: what tells a ChainedOptimizer's parts' groups apart without changing how they train
_PART_KEYS = ("params", "step", "is_expert_parallel")


def _join_groups(root: str, parts: list[tuple[dict[str, Any], ...]]) -> tuple[dict[str, Any], ...]:
    """The first part's groups; each later part's group must have the settings of one of them
    (Megatron gives the expert optimizer the dense one's: ``get_megatron_optimizer``), and an
    FSDP2 job's one AdamW then holds both in that group.

    Raises:
        UnsupportedCheckpointError: an expert group trained otherwise (learning-rate or decay
            overrides for experts).
    """
    first = parts[0]

    def settings(g: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in g.items() if k not in _PART_KEYS}

    for i, part in enumerate(parts[1:], 1):
        for g in part:
            if not any(settings(g) == settings(f) for f in first):
                raise UnsupportedCheckpointError(
                    f"{root}: the ChainedOptimizer's part chained_{i} has a param group whose "
                    f"settings no group of chained_0 has ({settings(g)!r:.160}); pass "
                    "--drop-optimizer to carry the model alone",
                    path=root,
                )
    return first


def _find_groups(value: Any, depth: int = 0) -> Iterator[list[Any]]:
    if depth > 6:
        return
    if isinstance(value, dict):
        groups = value.get("param_groups")
        if isinstance(groups, list) and groups and all(isinstance(g, dict) for g in groups):
            yield groups
        for v in value.values():
            yield from _find_groups(v, depth + 1)
