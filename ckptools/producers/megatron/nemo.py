"""NeMo 2 and Megatron-Bridge saves: Megatron-core ``torch_dist`` saves inside their own
directories, with the model's config and tokenizer beside them.

* **NeMo 2** (``nemo.lightning``): a checkpoint directory ``<run>/checkpoints/<name>--...-step=N
  ...`` (``-last`` appended to the newest) holding ``weights/`` (the torch_dist save:
  ``.metadata``, ``__<rank>_0.distcp``, ``metadata.json``; older Megatron-core also a
  ``common.pt``) and ``context/`` (``io.json``, ``model.yaml``: the model's config, and the
  tokenizer's files, ``nemo_tokenizer/`` for an HF tokenizer). Every model key is prefixed
  ``module.`` (``MegatronParallel.sharded_state_dict``), and the save records no Megatron-LM
  ``args``: the sizes come from ``model.yaml``.
* **Megatron-Bridge**: a Megatron-LM run directory (``latest_checkpointed_iteration.txt``,
  ``iter_0000010/``) whose saves also hold ``run_config.yaml`` (the ``ConfigContainer``; its
  ``model:`` is the GPT provider's config), ``train_state.pt`` and ``tokenizer/``, with
  ``latest_train_state.pt`` beside them; no ``args`` in the save either.

Both are read as Megatron saves (:mod:`.layout`) whose run facts (``details["megatron"]``) are
filled from the YAML, the ``module.`` prefix dropped from every name, and the tokenizer's
directory named as the model files' (``MODEL_FILES_DIR``), so that ``consolidate`` writes a
config made from the YAML and copies the tokenizer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ckptools.core.manifest import MODEL_FILES_DIR, Manifest
from ckptools.errors import CkptError, CorruptCheckpointError
from ckptools.io import storage
from ckptools.producers.base import Layout, NumberedSaves, read_marker, register
from ckptools.producers.megatron import BRIDGE_RECORD as LATEST_TRAIN_STATE
from ckptools.producers.megatron import NEMO_SAVE
from ckptools.producers.megatron.layout import (
    DETAILS_KEY,
    ITER_DIR,
    common_state,
    is_save,
    read_save,
    resolve,
    saves,
)
from ckptools.producers.run_dirs import Chosen, directory_names

WEIGHTS, CONTEXT = "weights", "context"
MODEL_YAML = "model.yaml"
IO_JSON = "io.json"
#: NeMo's checkpoint name: ``...-step=<N>...`` (ModelCheckpoint's ``{step}``)
#: Megatron-Bridge's files (``training/utils/checkpoint_utils.py``)
RUN_CONFIG = "run_config.yaml"
TRAIN_STATE = "train_state.pt"
BRIDGE_TOKENIZER = "tokenizer"
PREFIX = "module."
#: what a reshard of such a save carries (masters.read_optimizer places bucket / per-parameter
#: state only)
GATHERED_NOTE = (
    "the distributed optimizer's state is stored gathered (dp_zero_gather_scatter: one pickled "
    "object per DP group), which ckptools does not read: only the model is carried"
)
_GATHERED = re.compile(r"^optimizer\.distributed\.dp_group_idx_\d+\.param_state/")
#: the writer each layout names in ``details["megatron"]["writer"]``
NEMO2, BRIDGE = "NeMo 2", "Megatron-Bridge"


# ---------------------------------------------------------------------------------------------
# the model's config: NeMo's model.yaml ``config:``, Bridge's run_config.yaml ``model:``
# ---------------------------------------------------------------------------------------------

#: RunArgs field <- the config's field (mcore ``TransformerConfig`` / NeMo ``GPTConfig`` /
#: Bridge ``GPTModelProvider``)
_FROM_CONFIG = (
    ("num_layers", "num_layers"),
    ("hidden_size", "hidden_size"),
    ("ffn_hidden_size", "ffn_hidden_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("num_query_groups", "num_query_groups"),
    ("kv_channels", "kv_channels"),
    ("vocab_size", "vocab_size"),
    ("make_vocab_size_divisible_by", "make_vocab_size_divisible_by"),
    ("max_position_embeddings", "seq_length"),
    ("norm_epsilon", "layernorm_epsilon"),
    ("rotary_base", "rotary_base"),
    ("normalization", "normalization"),
    ("swiglu", "gated_linear_unit"),
    ("add_qkv_bias", "add_qkv_bias"),
    ("add_bias_linear", "add_bias_linear"),
    ("qk_layernorm", "qk_layernorm"),
    ("num_experts", "num_moe_experts"),
    ("multi_latent_attention", "multi_latent_attention"),
    ("tensor_parallel", "tensor_model_parallel_size"),
    ("pipeline_parallel", "pipeline_model_parallel_size"),
)


def _yaml(path: str) -> dict[str, Any]:
    """The YAML file ``path`` (safe loader: plain data only).

    Raises:
        CorruptCheckpointError: not YAML, or not a mapping.
    """
    import yaml  # transformers' own dependency

    try:
        data = yaml.safe_load(storage.read_bounded(path, what="YAML file"))
    except (OSError, yaml.YAMLError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"{path}: not YAML ({str(e).splitlines()[0]})", path=path
        ) from e
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"{path}: holds no mapping", path=path)
    return data


def config_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """``RunArgs`` fields of a model config (NeMo's ``GPTConfig``, Bridge's provider)."""
    out: dict[str, Any] = {}
    for field, key in _FROM_CONFIG:
        value = config.get(key)
        if isinstance(value, (bool, int, float, str)):
            out[field] = value
    if "rotary_base" in out or "norm_epsilon" in out:
        for k in ("rotary_base", "norm_epsilon"):
            if isinstance(out.get(k), (int, float)) and not isinstance(out[k], bool):
                out[k] = float(out[k])
    tied = config.get("share_embeddings_and_output_weights")
    if isinstance(tied, bool):
        out["untie_embeddings_and_output_weights"] = not tied
    if config.get("bf16") is True:
        out["params_dtype"] = "bfloat16"
    elif config.get("fp16") is True:
        out["params_dtype"] = "float16"
    elif config.get("bf16") is False and config.get("fp16") is False:
        out["params_dtype"] = "float32"
    if out.get("num_experts") == 0:
        out["num_experts"] = None
    return out


def tokenizer_vocab(directory: str) -> int | None:
    """The size of the HF tokenizer in ``directory`` (``tokenizer.json``'s vocabulary and added
    tokens), None without one: what NeMo pads when its config gives no ``vocab_size``."""
    path = storage.join(directory, "tokenizer.json")
    if not storage.isfile(path):
        return None
    try:
        data = storage.read_json(path, what="tokenizer")
    except (OSError, CkptError):
        return None
    vocab = (data.get("model") or {}).get("vocab") if isinstance(data, dict) else None
    ids: set[int] = set()
    if isinstance(vocab, dict):
        ids.update(v for v in vocab.values() if isinstance(v, int))
    elif isinstance(vocab, list):
        ids.update(range(len(vocab)))
    for added in data.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("id"), int):
            ids.add(added["id"])
    return max(ids) + 1 if ids else None


def _with_facts(manifest: Manifest, writer: str, config: Mapping[str, Any]) -> Manifest:
    """``manifest`` with the run facts the save lacks filled from the model ``config`` and the
    writer named."""
    facts = dict(manifest.details.get(DETAILS_KEY) or {})
    for key, value in config_args(config).items():
        if facts.get(key) is None:
            facts[key] = value
    embedding = manifest.tensors.get("embedding.word_embeddings.weight")
    if facts.get("padded_vocab_size") is None and embedding is not None:
        facts["padded_vocab_size"] = embedding.shape[0]
    if facts.get("optimizer_sharding") == "none" and any(
        _GATHERED.match(k) for k in manifest.objects
    ):  # the DistributedOptimizer's state gathered per DP group into one pickled object
        facts["optimizer_sharding"] = "dp_zero_gather_scatter"
    if facts.get("iteration") is None and writer == NEMO2:
        try:  # Lightning's checkpoint dict, in the save's common state
            step = (common_state(manifest) or {}).get("global_step")
        except CkptError:
            step = None
        facts["iteration"] = step if isinstance(step, int) and not isinstance(step, bool) else None
    facts["writer"] = writer
    notes = manifest.notes
    if facts.get("optimizer_sharding") == "dp_zero_gather_scatter":
        notes = (*notes, GATHERED_NOTE)
    return replace(manifest, details={**manifest.details, DETAILS_KEY: facts}, notes=notes)


def _unprefixed(manifest: Manifest) -> Manifest:
    """``manifest`` with NeMo's ``module.`` dropped from every model entry's name (the bytes
    stay where they are: entries are found by their chunks' files and offsets)."""

    def bare(fqn: str) -> str:
        return fqn[len(PREFIX) :] if fqn.startswith(PREFIX) else fqn

    tensors = {bare(k): replace(v, fqn=bare(k)) for k, v in manifest.tensors.items()}
    objects = {bare(k): replace(v, fqn=bare(k)) for k, v in manifest.objects.items()}
    paths = {bare(k): v for k, v in manifest.paths.items()}
    for fqn in list(paths):
        if fqn in tensors and paths[fqn][:1] != ("optimizer",):
            paths[fqn] = (fqn,)
    return replace(manifest, tensors=tensors, objects=objects, paths=paths)


# ---------------------------------------------------------------------------------------------
# NeMo 2
# ---------------------------------------------------------------------------------------------


def nemo_checkpoint(path: str) -> tuple[str, str] | None:
    """``(checkpoint directory, its weights/)`` that ``path`` names (the checkpoint directory or
    its ``weights/``), None when it is neither."""
    if storage.basename(path.rstrip("/")) == WEIGHTS and is_save(path):
        return storage.dirname(path.rstrip("/")), path
    weights = storage.join(path, WEIGHTS)
    if storage.isdir(storage.join(path, CONTEXT)) and storage.isdir(weights):
        return path, weights
    return None


def _context_tokenizer(context: str, model: Mapping[str, Any]) -> str | None:
    """The directory in ``context/`` holding the tokenizer's files (``model.yaml``'s
    ``tokenizer.pretrained_model_name`` when it is a directory there, else the first one
    holding a ``tokenizer_config.json``), relative to ``context``; None without one."""
    tokenizer = model.get("tokenizer")
    name = tokenizer.get("pretrained_model_name") if isinstance(tokenizer, dict) else None
    candidates = [name] if isinstance(name, str) and "/" not in name.strip("/") else []
    candidates += sorted(n for n in directory_names(context) or [] if n not in candidates)
    for n in candidates:
        inner = storage.contained(context, n.strip("/"), named_by=context, entry="names")
        if storage.isfile(storage.join(inner, "tokenizer_config.json")):
            return n.strip("/")
    return None


def read_nemo(path: str, chosen: Chosen | None = None, below: str = "") -> Manifest:
    """The manifest of a NeMo 2 checkpoint (its directory or its ``weights/``); ``below``: the
    checkpoint's directory relative to the path the user gave (a run's ``checkpoints/``)."""
    found = nemo_checkpoint(path)
    assert found is not None  # probe's test
    ckpt, weights = found
    inner, _ = resolve(weights)
    manifest = _unprefixed(read_save(inner, chosen))
    manifest = replace(manifest, layout="nemo2")
    context = storage.join(ckpt, CONTEXT)
    model_yaml = storage.join(context, MODEL_YAML)
    if not storage.isfile(model_yaml):  # a weights/ alone: the sizes come from --config
        return _with_facts(manifest, NEMO2, {})
    model = _yaml(model_yaml)
    config = model.get("config")
    out = _with_facts(manifest, NEMO2, config if isinstance(config, dict) else {})
    tokenizer = _context_tokenizer(context, model)
    if tokenizer is None:
        return out
    facts = dict(out.details[DETAILS_KEY])
    if facts.get("vocab_size") is None:  # NeMo pads the tokenizer's size then
        facts["vocab_size"] = tokenizer_vocab(storage.join(context, tokenizer))
    details = {**out.details, DETAILS_KEY: facts}
    if found[1] != path:  # the checkpoint directory given: its context/ is inside it
        details[MODEL_FILES_DIR] = f"{below}{CONTEXT}/{tokenizer}"
    return replace(out, details=details)


def _nemo_latest(root: str, names: list[str]) -> str | None:
    """NeMo's newest checkpoint: the one ``-last`` ends (ModelCheckpoint's ``save_last``)."""
    last = [n for n in names if n.endswith("-last") and NEMO_SAVE.match(n)]
    return last[-1] if last else None


def _nemo_lacks(path: str) -> str | None:
    weights = storage.join(path, WEIGHTS)
    if not is_save(weights):
        return "no weights/ with metadata.json naming torch_dist and a DCP .metadata"
    if not storage.isdir(storage.join(path, CONTEXT)):
        return "no context/ (the model's config and tokenizer)"
    return None


def _nemo_saves(path: str) -> list[str]:
    return sorted(
        (n for n in directory_names(path) or [] if NEMO_SAVE.match(n)),
        key=lambda n: (int(NEMO_SAVE.match(n)[1]), n.endswith("-last")),  # type: ignore[index]
    )


class Nemo2Layout(Layout):
    name = "nemo2"
    views = "megatron.views"
    description = (
        "NeMo 2 checkpoint (a checkpoints/<name>--...-step=N/ directory with weights/, the "
        "torch_dist save with module.-prefixed keys, and context/ with model.yaml and the "
        "tokenizer; or its weights/)"
    )

    def probe(self, path: str) -> str | None:
        if not storage.isdir(path):
            return "not a directory"
        found = nemo_checkpoint(path)
        if found is not None:
            if storage.basename(path.rstrip("/")) == WEIGHTS:
                # a weights/ alone is a NeMo save when its keys say so (or context/ is beside)
                if storage.isdir(storage.join(found[0], CONTEXT)) or _prefixed(path):
                    return None
                return "a torch_dist save without NeMo's module. prefix or context/"
            return None
        held = _nemo_saves(path)
        if held and _nemo_lacks(storage.join(path, held[-1])) is None:
            return None
        return "no weights/ + context/ (a NeMo 2 checkpoint) nor checkpoints named ...step=N"

    def numbered_saves(self) -> NumberedSaves:
        from ckptools.producers.dcp.wrappers import dcp_ranks

        return NumberedSaves(
            NEMO_SAVE, _nemo_lacks, recorded=_nemo_latest,
            ranks=lambda p: dcp_ranks(storage.join(p, WEIGHTS)),
        )  # fmt: skip

    def read_manifest(self, path: str) -> Manifest:
        if nemo_checkpoint(path) is not None:
            return read_nemo(path)
        held = _nemo_saves(path)
        complete = [n for n in held if _nemo_lacks(storage.join(path, n)) is None]
        name = complete[-1]
        newer = held[held.index(name) + 1 :]
        chosen = Chosen(path, name, len(held), tuple(newer), (), "the newest complete",
                        "incomplete")  # fmt: skip
        inner = storage.contained(path, name, named_by=path, entry="holds")
        return read_nemo(inner, chosen, below=f"{name}/")


def _prefixed(weights: str) -> bool:
    """A torch_dist save whose model keys carry NeMo's ``module.`` (its DCP ``.metadata``'s
    bytes name it: a cheap test, no unpickling)."""
    try:
        head = read_marker(storage.join(weights, ".metadata"), peek=True)
    except OSError:
        return False
    return b"module.decoder." in head or b"module.embedding." in head


# ---------------------------------------------------------------------------------------------
# Megatron-Bridge
# ---------------------------------------------------------------------------------------------


def _bridge_save(path: str) -> bool:
    return storage.isfile(storage.join(path, RUN_CONFIG))


def read_bridge(path: str) -> Manifest:
    """The manifest of a Megatron-Bridge run directory or one of its ``iter_*/`` saves."""
    inner, chosen = resolve(path)
    manifest = replace(read_save(inner, chosen), layout="megatron_bridge")
    config = _yaml(storage.join(inner, RUN_CONFIG)) if _bridge_save(inner) else {}
    model = config.get("model")
    tokenizer = storage.join(inner, BRIDGE_TOKENIZER)
    has_tokenizer = storage.isdir(tokenizer)
    out = _with_facts(manifest, BRIDGE, model if isinstance(model, dict) else {})
    facts = dict(out.details[DETAILS_KEY])
    if facts.get("vocab_size") is None and has_tokenizer:
        facts["vocab_size"] = tokenizer_vocab(tokenizer)
    details = {**out.details, DETAILS_KEY: facts}
    if has_tokenizer:
        details[MODEL_FILES_DIR] = BRIDGE_TOKENIZER
    return replace(out, details=details)


class BridgeLayout(Layout):
    name = "megatron_bridge"
    views = "megatron.views"
    description = (
        "Megatron-Bridge run directory (latest_train_state.pt, latest_checkpointed_iteration.txt,"
        " iter_*/ saves with run_config.yaml, train_state.pt and tokenizer/) or one iter_*/ save"
    )

    def probe(self, path: str) -> str | None:
        if not storage.isdir(path):
            return "not a directory"
        if _bridge_save(path) and (is_save(path) or ITER_DIR.match(storage.basename(path))):
            return None
        held = saves(path)
        if held and (
            storage.isfile(storage.join(path, LATEST_TRAIN_STATE))
            or _bridge_save(storage.join(path, held[-1]))
        ):
            return None
        return f"no iter_*/ save with {RUN_CONFIG} (nor {LATEST_TRAIN_STATE})"

    # its run's iter_*/ saves are listed by the "megatron" layout, which names the run's writer
    # (``label``): one listing of one run directory

    def read_manifest(self, path: str) -> Manifest:
        return read_bridge(path)


NEMO2_LAYOUT = register(Nemo2Layout())
BRIDGE_LAYOUT = register(BridgeLayout())
__all__ = ["BRIDGE_LAYOUT", "NEMO2_LAYOUT"]
