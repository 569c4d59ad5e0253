"""Megatron-core ``torch_dist`` checkpoints: a run directory of ``iter_<7 digits>/`` DCP saves.

Megatron-LM (and NeMo, Megatron-Bridge, slime, verl's Megatron backend) save through
``megatron.core.dist_checkpointing`` whose default backend, ``torch_dist``, is a DCP directory:

* the run directory holds ``latest_checkpointed_iteration.txt`` (the newest iteration, or
  ``release``) and one ``iter_0000010/`` (or ``release/``) per save;
* a save holds ``.metadata`` (torch's ``Metadata`` with Megatron's ``all_local_plans`` added:
  pickled ``SavePlan`` / ``WriteItem`` records, read as data by the allowlist), one
  ``__<rank>_0.distcp`` per rank and ``metadata.json`` (``{"sharded_backend": "torch_dist"}``,
  written after the DCP commit, so it is the save's marker);
* every non-tensor value is a ``ShardedObject`` stored as the ``torch.save`` bytes of a list of
  its data, under ``<key>/shard_<offsets>_<shape>``: ``common_state`` (the run's ``args``
  namespace, the iteration, the scheduler...), ``rng_state``, the layers' ``_extra_state``.

Model tensors have no prefix; the decoder layers are stacked on a leading dim of size
``num_layers`` (or per layer, ``decoder.layers.<i>.``); the optimizer is under ``optimizer.``.
This module finds the save, reads it as DCP and decodes ``common_state`` into
``Manifest.details["megatron"]`` (:class:`RunArgs`' fields): what ``inspect`` shows and the HF
mapping (:mod:`ckptools.producers.megatron.plan`) reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from ckptools.core.manifest import Manifest
from ckptools.errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UsageError,
)
from ckptools.formats import safe_pickle, torch_archive
from ckptools.io import storage
from ckptools.producers.base import Layout, NumberedSaves, register
from ckptools.producers.dcp.layout import METADATA_FILE, read_dcp_tree
from ckptools.producers.megatron import BRIDGE_RECORD, ITER_SAVE, PARTS_KEY, TRACKER_FILE
from ckptools.producers.megatron import DETAILS_KEY as DETAILS_KEY  # the run's facts' key
from ckptools.producers.run_dirs import Chosen, directory_names

CONFIG_FILE = "metadata.json"
BACKEND = "torch_dist"
RELEASE = "release"
ITER_DIR = ITER_SAVE
COMMON_STATE = "common_state/shard_0_1"


def iteration_dir_name(iteration: int) -> str:
    """The directory Megatron-LM saves iteration ``iteration`` in (``iter_0000010``)."""
    return f"iter_{iteration:07d}"


def _backend(path: str) -> str | None:
    """The ``sharded_backend`` of ``path/metadata.json``; None without one."""
    config = storage.join(path, CONFIG_FILE)
    if not storage.isfile(config):
        return None
    try:
        data = storage.read_json(config, what=f"torch_dist {CONFIG_FILE}")
    except OSError as e:
        raise CorruptCheckpointError(f"{config}: not read ({e})", path=config) from e
    backend = data.get("sharded_backend") if isinstance(data, dict) else None
    return backend if isinstance(backend, str) else ""


def is_save(path: str) -> bool:
    return _backend(path) == BACKEND and storage.isfile(storage.join(path, METADATA_FILE))


def tracked(run: str) -> str | None:
    """The save the tracker file names (``iter_0000010`` or ``release``), None without one."""
    tracker = storage.join(run, TRACKER_FILE)
    if not storage.isfile(tracker):
        return None
    raw = storage.read_bounded(tracker, storage.TRACKER_LIMIT, what="tracker file")
    text = raw.decode(errors="replace").strip()
    if text == RELEASE:
        return RELEASE
    if not text.isdigit():
        raise CorruptCheckpointError(
            f"{tracker}: holds {text[:40]!r}, not an iteration number or 'release'", path=tracker
        )
    return iteration_dir_name(int(text))


def saves(run: str) -> list[str]:
    """The save directories of the run directory ``run`` (``iter_*`` in order, ``release``)."""
    names = directory_names(run) or []
    found = sorted((int(m.group(1)), n) for n in names if (m := ITER_DIR.match(n)))
    return [n for _, n in found] + ([RELEASE] if RELEASE in names else [])


def iteration_dir(run: str, iteration: int) -> str:
    """The save of iteration ``iteration`` in the run directory ``run`` (``--iteration``).

    Raises:
        CheckpointNotFoundError: ``run`` holds no such save (the message lists those it holds).
        UsageError: ``run`` is one save itself.
    """
    if ITER_DIR.match(storage.basename(run)) or is_save(run):
        raise UsageError(
            f"{run} is one Megatron save itself: drop --iteration {iteration}, or point at the "
            "run directory above it",
            path=run,
        )
    name = iteration_dir_name(iteration)
    path = storage.contained(run, name, named_by="--iteration", entry="names the save")
    if not storage.isdir(path):
        held = saves(run)
        listed = ", ".join(held) if held else "none"
        raise CheckpointNotFoundError(
            f"{run}: no iteration {iteration} ({name}/); the saves there: {listed}", path=path
        )
    return path


def resolve(path: str) -> tuple[str, Chosen | None]:
    """The save directory ``path`` means: itself, or in a run directory the one the tracker
    names (else the newest complete one).

    Raises:
        IncompleteCheckpointError: the save has no ``metadata.json`` / ``.metadata``.
    """
    if ITER_DIR.match(storage.basename(path)) or _backend(path) is not None:
        if not is_save(path):
            raise IncompleteCheckpointError(
                f"{path}: no {CONFIG_FILE} naming {BACKEND} with a DCP {METADATA_FILE}: the save "
                "never finished (Megatron writes metadata.json last)",
                path=path,
            )
        return path, None
    held = saves(path)
    named = tracked(path)
    complete = [n for n in held if is_save(storage.join(path, n))]
    if not complete:
        raise IncompleteCheckpointError(
            f"{path}: none of {', '.join(held) or 'its saves'} is a complete torch_dist save "
            f"({CONFIG_FILE} and {METADATA_FILE})",
            path=path,
        )
    if named in complete:
        name, why, skipped_as = named, f"the save {TRACKER_FILE} names,", "newer than that"
    else:
        name, why, skipped_as = complete[-1], "the newest complete", "incomplete"
    newer = held[held.index(name) + 1 :]
    inner = storage.contained(path, name, named_by=path, entry="holds")
    return inner, Chosen(path, name, len(held), tuple(newer), (), why, skipped_as)


@dataclass(frozen=True)
class RunArgs:
    """What a Megatron run's ``args`` say about the model and its parallel layout (None where
    the run did not record it)."""

    iteration: int | None
    tensor_parallel: int | None
    pipeline_parallel: int | None
    data_parallel: int | None
    num_layers: int | None
    hidden_size: int | None
    ffn_hidden_size: int | None
    num_attention_heads: int | None
    num_query_groups: int | None
    kv_channels: int | None
    vocab_size: int | None
    padded_vocab_size: int | None
    make_vocab_size_divisible_by: int | None
    max_position_embeddings: int | None
    norm_epsilon: float | None
    rotary_base: float | None
    normalization: str | None
    swiglu: bool | None
    add_qkv_bias: bool | None
    add_bias_linear: bool | None
    qk_layernorm: bool | None
    untie_embeddings_and_output_weights: bool | None
    num_experts: int | None
    multi_latent_attention: bool | None
    params_dtype: str | None
    optimizer_sharding: str  # "dp_reshardable", "fully_reshardable", "chained" or "none"
    # MoE (None for a dense run, or where the run did not record it)
    expert_parallel: int | None = None
    expert_tensor_parallel: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int | None = None
    moe_router_score_function: str | None = None
    moe_router_pre_softmax: bool | None = None
    moe_router_enable_expert_bias: bool | None = None
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: Any = None  # an int (every n-th layer MoE) or a list of 0/1 per layer
    moe_grouped_gemm: bool | None = None
    moe_router_group_topk: int | None = None
    # multi-latent attention (None for another attention)
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_type: str | None = None
    rotary_scaling_factor: float | None = None
    rotary_interleaved: bool | None = None
    #: a ChainedOptimizer's parts (``chained_<i>.optimizer.…``), each with its sharding
    chained_optimizers: tuple[str, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _arg(args: Any, name: str, kind: type | tuple[type, ...]) -> Any:
    """``args.<name>`` when it is a ``kind`` (a bool is no int here), else None."""
    value = getattr(args, name, None)
    if isinstance(value, bool) != (kind is bool):
        return None
    return value if isinstance(value, kind) else None


def _dtype(args: Any) -> str | None:
    if getattr(args, "bf16", False) is True:
        return "bfloat16"
    if getattr(args, "fp16", False) is True:
        return "float16"
    raw = getattr(args, "params_dtype", None)
    if isinstance(raw, safe_pickle.DTypeName):
        return str(raw)
    return "float32" if args is not None else None


#: a ChainedOptimizer's part: ``chained_<i>.optimizer.…`` (an MoE run's dense and expert
#: distributed optimizers, Megatron-core's ``ChainedOptimizer.sharded_state_dict``)
CHAINED = re.compile(r"^chained_(\d+)\.")


def _sharding_of(fqn: str) -> str | None:
    if fqn.startswith("optimizer.distributed."):
        return "dp_reshardable"
    if fqn.startswith("optimizer.state."):
        return "fully_reshardable"
    return None


def chained_parts(
    manifest: Manifest, common: Mapping[str, Any] | None = None
) -> tuple[str, ...] | None:
    """A ChainedOptimizer's parts in order, each's sharding (``dp_reshardable`` ...); None when
    the save's optimizer is not chained.

    A ``dp_reshardable`` part's entries carry its ``chained_<i>.`` prefix. Megatron-LM saves
    ``fully_reshardable`` parts without one (``_build_sharded_state_dict_metadata`` sets
    ``chained_optim_avoid_prefix``, ``training/checkpointing.py`` line 508 of 0.19.2, and
    ``ChainedOptimizer.sharded_state_dict`` then adds none: ``core/optimizer/optimizer.py``
    lines 1550-1555): every part's ``optimizer.state.<kind>.<model fqn>`` shares one namespace,
    and only ``common_state``'s ``optimizer`` (``common``), one dict per part keyed by its index,
    each with its ``param_state_sharding_type``, tells the parts apart.
    """
    found: dict[int, str] = {}
    for fqn in manifest.tensors:
        m = CHAINED.match(fqn)
        if m is not None:
            found.setdefault(int(m[1]), _sharding_of(fqn[m.end() :]) or "none")
    if found:
        return tuple(found.get(i, "none") for i in range(max(found) + 1))
    held = common_parts((common or {}).get("optimizer"))
    if held is None:
        return None
    return tuple(str(p.get("param_state_sharding_type") or "none") for p in held)


def common_parts(optimizer: Any) -> list[dict[str, Any]] | None:
    """A ChainedOptimizer's parts' ``common_state`` entries (``{0: {...}, 1: {...}}``: what each
    part's ``sharded_state_dict`` left unsharded, its ``optimizer`` param groups and its
    ``param_state_sharding_type``), in order; None for one optimizer's."""
    if not (isinstance(optimizer, dict) and len(optimizer) > 1):
        return None
    if set(optimizer) != set(range(len(optimizer))):
        return None
    parts = [optimizer[i] for i in range(len(optimizer))]
    return parts if all(isinstance(p, dict) for p in parts) else None


def optimizer_sharding(manifest: Manifest, common: Mapping[str, Any] | None = None) -> str:
    """How the distributed optimizer stored its state: by DP buckets, per parameter, in a
    ChainedOptimizer's parts (``chained``: :func:`chained_parts` says each one's), or none."""
    if common_parts((common or {}).get("optimizer")) is not None:
        return "chained"
    for fqn in manifest.tensors:
        sharding = _sharding_of(fqn)
        if sharding is not None:
            return sharding
        if CHAINED.match(fqn):
            return "chained"
    return "none"


_INT_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
    "padded_vocab_size",
    "make_vocab_size_divisible_by",
    "max_position_embeddings",
    "num_experts",
)
#: RunArgs field -> Megatron-LM arg, and the kind it must be
_MOE_ARGS: tuple[tuple[str, str, type | tuple[type, ...]], ...] = (
    ("expert_parallel", "expert_model_parallel_size", int),
    ("expert_tensor_parallel", "expert_tensor_parallel_size", int),
    ("moe_ffn_hidden_size", "moe_ffn_hidden_size", int),
    ("moe_router_topk", "moe_router_topk", int),
    ("moe_router_score_function", "moe_router_score_function", str),
    ("moe_router_pre_softmax", "moe_router_pre_softmax", bool),
    ("moe_router_enable_expert_bias", "moe_router_enable_expert_bias", bool),
    ("moe_router_topk_scaling_factor", "moe_router_topk_scaling_factor", (int, float)),
    ("moe_router_num_groups", "moe_router_num_groups", int),
    ("moe_shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", int),
    ("moe_grouped_gemm", "moe_grouped_gemm", bool),
    ("moe_router_group_topk", "moe_router_group_topk", int),
)
#: RunArgs field -> Megatron-LM arg for multi-latent attention, and the kind it must be
_MLA_ARGS: tuple[tuple[str, type | tuple[type, ...]], ...] = (
    ("q_lora_rank", int),
    ("kv_lora_rank", int),
    ("qk_head_dim", int),
    ("qk_pos_emb_head_dim", int),
    ("v_head_dim", int),
    ("rope_type", str),
    ("rotary_scaling_factor", (int, float)),
    ("rotary_interleaved", bool),
)
_BOOL_ARGS = (
    "swiglu",
    "add_qkv_bias",
    "add_bias_linear",
    "qk_layernorm",
    "untie_embeddings_and_output_weights",
    "multi_latent_attention",
)


def run_args(common: Mapping[str, Any] | None, manifest: Manifest) -> RunArgs:
    """:class:`RunArgs` of ``common_state`` (``common``) and the tensors of ``manifest``."""
    args = (common or {}).get("args")
    iteration = (common or {}).get("iteration")
    ints = {
        "tensor_parallel": "tensor_model_parallel_size",
        "pipeline_parallel": "pipeline_model_parallel_size",
        "data_parallel": "data_parallel_size",
    }
    fields: dict[str, Any] = {k: _arg(args, v, int) for k, v in ints.items()}
    for name in _INT_ARGS:
        fields[name] = _arg(args, name, int)
    # Megatron-LM's --norm-epsilon is kept as ``layernorm_epsilon`` (the TransformerConfig
    # field its arguments are made from); older releases kept ``norm_epsilon``
    for name, *kept in (("norm_epsilon", "layernorm_epsilon", "norm_epsilon"),
                        ("rotary_base", "rotary_base")):  # fmt: skip
        values = [_arg(args, arg, (int, float)) for arg in kept]
        value = next((v for v in values if v is not None), None)
        fields[name] = None if value is None else float(value)
    fields["normalization"] = _arg(args, "normalization", str)
    for name in _BOOL_ARGS:
        fields[name] = _arg(args, name, bool)
    if getattr(args, "group_query_attention", None) is False:
        fields["num_query_groups"] = fields["num_attention_heads"]
    if fields["num_experts"]:
        for name, arg, kind in _MOE_ARGS:
            fields[name] = _arg(args, arg, kind)
        freq = getattr(args, "moe_layer_freq", None)
        if isinstance(freq, int) and not isinstance(freq, bool):
            fields["moe_layer_freq"] = freq
        elif isinstance(freq, list) and all(isinstance(x, int) for x in freq):
            fields["moe_layer_freq"] = list(freq)
        elif isinstance(freq, str):
            fields["moe_layer_freq"] = freq
    if fields["multi_latent_attention"]:
        for name, kind in _MLA_ARGS:
            fields[name] = _arg(args, name, kind)
    return RunArgs(
        iteration=iteration if isinstance(iteration, int) else None,
        params_dtype=_dtype(args),
        optimizer_sharding=optimizer_sharding(manifest, common),
        chained_optimizers=chained_parts(manifest, common),
        **fields,
    )


def common_state(manifest: Manifest) -> dict[str, Any] | None:
    """The decoded ``common_state`` object (the run's ``args``, iteration...), None without one.

    Raises:
        UnsafeCheckpointError: it names a global outside the allowlist.
    """
    entry = manifest.objects.get(COMMON_STATE)
    if entry is None or entry.file is None:
        return None
    with storage.open_reader(manifest.data_dir()) as reader:
        archive = torch_archive.read_archive(reader, entry.file, entry.offset, entry.length)
        value = torch_archive.load_pickle(reader, archive)
    # a ShardedObject is saved as torch.save([data]): the list of this rank's data
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, dict):
        raise CorruptCheckpointError(
            f"{manifest.root}: {COMMON_STATE} holds {safe_pickle.short(value)}, not a dict",
            path=manifest.root,
        )
    return value


def kind_of(fqn: str) -> str:
    """What a Megatron entry is: "model", "optimizer", "rng", "common" or "extra_state"."""
    head = fqn.split("/", 1)[0]
    m = CHAINED.match(head)
    if m is not None:  # a ChainedOptimizer's part
        head = head[m.end() :]
    if head.startswith("optimizer.") or head == "optimizer":
        return "optimizer"
    if head == "rng_state":
        return "rng"
    if head in ("common_state", "content_metadata"):
        return "common"
    if head.endswith("._extra_state"):
        return "extra_state"
    return "model"


def read_save(path: str, chosen: Chosen | None = None) -> Manifest:
    """The manifest of the Megatron save directory ``path`` (a DCP directory), with the run's
    facts in ``details["megatron"]`` and a count of what is model, optimizer, RNG and common
    state in ``details["megatron_parts"]``."""
    manifest = read_dcp_tree(path, layout="megatron")
    try:
        common = common_state(manifest)
    except CkptError as e:
        manifest = replace(manifest, notes=(*manifest.notes, f"common_state not decoded: {e}"))
        common = None
    facts = run_args(common, manifest)
    counts: dict[str, int] = {}
    for fqn in manifest:
        counts[kind_of(fqn)] = counts.get(kind_of(fqn), 0) + 1
    details = {**manifest.details, DETAILS_KEY: facts.to_dict(), PARTS_KEY: counts}
    # the optimizer's flat FQNs under one container, so that the model part is the rest (a
    # ChainedOptimizer's parts under it too: "chained_0.optimizer.…" -> optimizer / chained_0.…)
    paths = {}
    for fqn in manifest.tensors:
        if fqn.startswith("optimizer."):
            paths[fqn] = ("optimizer", fqn[len("optimizer.") :])
        elif CHAINED.match(fqn) and kind_of(fqn) == "optimizer":
            paths[fqn] = ("optimizer", fqn)
    manifest = replace(manifest, details=details, paths={**manifest.paths, **paths})
    return chosen.noted(manifest) if chosen is not None else manifest


#: the iteration Megatron-LM's own Hugging Face loaders give a fresh conversion
#: (``tools/checkpoint/loader_*_hf.py``: "'0', 'release' don't work")
CONVERTED_ITERATION = 1
#: ``common_state``'s ``checkpoint_version`` in what Megatron-LM saves today
CHECKPOINT_VERSION = 3.0


#: the local spec's modules whose ``_extra_state`` Megatron saves (``None`` each, per layer)
_EXTRA_STATE_MODULES = (
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


def extra_states(layers: int) -> dict[str, list[None]]:
    """The ``_extra_state`` objects Megatron's local layer spec saves and loads for a model of
    ``layers`` layers: per module and layer, ``[None]`` (a ``ShardedObject``'s data list)
    under ``decoder.layers.<module>._extra_state/shard_<i>_<layers>``."""
    return {
        f"decoder.layers.{m}._extra_state/shard_{i}_{layers}": [None]
        for i in range(layers)
        for m in _EXTRA_STATE_MODULES
    }


def marker_files(iteration: int = CONVERTED_ITERATION) -> dict[str, bytes]:
    """The files that make a run directory of one ``torch_dist`` save (relative path -> bytes):
    the save's ``metadata.json`` and the run's tracker file."""
    config = {"sharded_backend": BACKEND, "sharded_backend_version": 1}
    return {
        f"{iteration_dir_name(iteration)}/{CONFIG_FILE}": json.dumps(config).encode(),
        TRACKER_FILE: str(iteration).encode(),
    }


def _latest(root: str, names: list[str]) -> str | None:
    try:
        return tracked(root)
    except (OSError, ValueError):  # a damaged tracker records nothing
        return None


def _save_lacks(path: str) -> str | None:
    if is_save(path):  # resolve's test
        return None
    return "no metadata.json naming torch_dist with a DCP .metadata"


def _writer(run: str) -> str:
    """Who ``ckpt list`` says reads the run directory ``run``: Megatron-Bridge's run records
    its latest save in ``latest_train_state.pt`` too (:mod:`.nemo`)."""
    if storage.isfile(storage.join(run, BRIDGE_RECORD)):
        return "megatron_bridge"
    return "megatron"


class MegatronLayout(Layout):
    name = "megatron"
    views = "megatron.views"
    description = (
        "Megatron-core torch_dist checkpoint (run directory with "
        "latest_checkpointed_iteration.txt, an iter_*/ save, or a save's metadata.json)"
    )

    def probe(self, path: str) -> str | None:
        if not storage.isdir(path):
            return "not a directory"
        backend = _backend(path)
        if backend is not None:
            if backend != BACKEND:
                return f"metadata.json names sharded_backend {backend!r}; ckptools reads torch_dist"
            return None
        if ITER_DIR.match(storage.basename(path)):
            return None  # a save without its metadata.json: read_manifest says what is missing
        # verl's trainer writes the same tracker file beside its global_step_N/: the saves decide
        held = saves(path)
        if held and (
            storage.isfile(storage.join(path, TRACKER_FILE))
            or any(is_save(storage.join(path, n)) for n in held[-1:])
        ):
            return None
        return f"no iter_*/ save (with {TRACKER_FILE}) or metadata.json naming torch_dist"

    def numbered_saves(self) -> NumberedSaves:
        from ckptools.producers.dcp.wrappers import dcp_ranks

        return NumberedSaves(
            ITER_DIR, _save_lacks, recorded=_latest, ranks=dcp_ranks, label=_writer
        )

    def read_manifest(self, path: str) -> Manifest:
        inner, chosen = resolve(path)
        return read_save(inner, chosen)


MEGATRON = register(MegatronLayout())  # the one instance
