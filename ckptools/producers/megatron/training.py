"""A Megatron save as the training checkpoint an FSDP2 job of the Hugging Face model resumes from.

``ckpt reshard MEGATRON_RUN OUT`` writes what ``get_state_dict(model, optimizer)`` + ``dcp.save``
would have written for the HF model (``LlamaForCausalLM`` and kin) trained by ``AdamW``:

* the model: the distributed optimizer's fp32 masters where it holds them (the model weights as
  stored otherwise), under HF FQNs, through the same Megatron → HF mapping that
  ``consolidate`` uses (:mod:`.plan`: layers unstacked, QKV split per query group, fc1 split
  into gate and up, vocabulary padding dropped); an MoE run's router and experts as
  transformers holds them in memory (its conversion of the ``save_pretrained`` names: Mixtral's
  and Qwen3-MoE's experts fused, ``mlp.experts.gate_up_proj`` ``[E, 2F, H]`` and ``down_proj``),
  their masters and moments from the ChainedOptimizer's expert part
  (:mod:`.moe_optimizer`);
* per parameter, AdamW's ``exp_avg`` and ``exp_avg_sq`` mapped by the same rules (so the QKV
  and fc1 moments are split exactly as the weights), and ``step``, the optimizer's counter;
* Megatron's parameter groups kept as groups: Megatron-LM gives weight decay to matrices and none
  to norms and biases (its ``no_weight_decay_cond``: 1-D or ``.bias``); the saved groups' settings
  (lr, betas, eps, weight_decay...) are kept, their ``params`` the HF FQNs of that kind.

The result is a torch-free :class:`Manifest` shaped as DeepSpeed's is
(:mod:`ckptools.producers.deepspeed.optimizer`): the model at the top, the optimizer under
``optimizer/state/<fqn>/<name>`` and ``optimizer/param_groups``, so that
:func:`ckptools.plan.training.training_layout` names it and the DCP writer copies its byte runs.
What an FSDP2 job has no place for (Megatron's RNG state, ``common_state``, the scheduler, the
layers' ``_extra_state``) is named in the notes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ckptools.core.keys import model_keys
from ckptools.core.manifest import Manifest, ObjectEntry, TensorEntry
from ckptools.core.tensor_value import TensorValue
from ckptools.engine.converted import to_memory_names
from ckptools.errors import UnsupportedCheckpointError
from ckptools.producers.megatron.converted import as_hf
from ckptools.producers.megatron.hf_config import PADDING_KEPT
from ckptools.producers.megatron.layout import CONFIG_FILE, DETAILS_KEY
from ckptools.producers.megatron.masters import MegatronOptimizer, read_optimizer
from ckptools.producers.megatron.optimizer import is_buffer

OPTIMIZER = "optimizer"
#: a save whose distributed optimizer state is gathered per DP group (NeMo 2's
#: ``dp_zero_gather_scatter``): recognised, not read
GATHERED = "dp_zero_gather_scatter"
MOMENTS = ("exp_avg", "exp_avg_sq")


def training_manifest(
    manifest: Manifest, config: Mapping[str, Any] | None, *, drop_optimizer: bool = False
) -> Manifest:
    """The Megatron save ``manifest`` as a training manifest of the HF model (see the module).

    ``config``: the HF ``config.json`` (else made from the run's args).

    Raises:
        CorruptCheckpointError: the optimizer's buckets do not add up to the model.
        UnsupportedCheckpointError: a model or optimizer layout ckptools does not place.
    """
    sharding = (manifest.details.get(DETAILS_KEY) or {}).get("optimizer_sharding")
    if sharding == GATHERED and not drop_optimizer:  # resuming without it would lose it
        raise UnsupportedCheckpointError(
            f"{manifest.root}: the distributed optimizer's state is stored gathered ({GATHERED}:"
            " one pickled object per DP group), which ckptools does not read; pass "
            "--drop-optimizer (ckptools.load: no optimizer) to carry the model alone",
            path=manifest.root,
        )
    opt = None if drop_optimizer else read_optimizer(manifest)
    names = dict(model_keys(manifest))
    notes = list(manifest.notes)
    model_kind = "param" if opt is not None and opt.state.get("param") else None
    model, paths, kept_padding = _as_hf(manifest, names, config, opt, model_kind)
    tensors: dict[str, TensorEntry] = dict(model)
    objects: dict[str, ObjectEntry] = {}
    if drop_optimizer:
        notes.append("the model is the weights as stored (--drop-optimizer: no fp32 masters)")
    elif model_kind is None:
        notes.append("the model is the weights as stored (the save holds no fp32 masters)")
    else:
        notes.append(f"the model is the optimizer's fp32 masters ({opt.sharding if opt else ''})")
    if (manifest.details.get(DETAILS_KEY) or {}).get("num_experts"):
        fused = sorted({hf.rsplit(".", 1)[-1] for hf in model if ".experts." in hf})
        notes.append(
            f"the experts as transformers holds them in memory (fused: {', '.join(fused)})"
        )
    if opt is not None:
        # a buffer (the router's expert bias, transformers' ``e_score_correction_bias``) is the
        # model's as stored: no moments, in no param group
        params = {k: f for k, f in names.items() if not is_buffer(f)}
        moments = {k: _as_hf(manifest, params, config, opt, k)[0] for k in MOMENTS}
        trained = {hf: e for hf, e in model.items() if hf in moments[MOMENTS[0]]}
        _put_optimizer(manifest, opt, trained, moments, tensors, objects, paths)
    _tie_head(manifest, model, tensors, paths, notes)
    if kept_padding and EMBEDDING in model:
        rows = model[EMBEDDING].shape[0]
        notes.append(
            f"vocab padding kept: the embedding and head have Megatron's {rows} padded rows (the "
            f"run's args lack the tokenizer's true size): build the job's model with vocab_size "
            f"{rows}, or give --config with the model's config.json to drop the padding"
        )
    notes.append(
        "not carried (an FSDP2 job has no place for them): Megatron's RNG state, "
        "common_state (args, scheduler), the layers' _extra_state"
    )
    # the same save's files, ranks and details, holding the HF model and its optimizer: not
    # the DCP parts it was read through, nor their files beside the data
    return replace(
        manifest,
        format="megatron-training",
        layout="megatron",
        tensors=tensors,
        objects=objects,
        paths=paths,
        # metadata.json commits a Megatron save: a marker, not a file left behind
        markers=tuple(dict.fromkeys((*manifest.markers, CONFIG_FILE))),
        notes=tuple(notes),
        parts=(),
        aux_files=(),
    )


#: the HF names of the input embedding and the output layer of the Llama family
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _tie_head(
    manifest: Manifest,
    model: Mapping[str, TensorEntry],
    tensors: dict[str, TensorEntry],
    paths: dict[str, tuple[str, ...]],
    notes: list[str],
) -> None:
    """A tied output layer under its own name too: ``get_state_dict`` of a tied HF model lists
    ``lm_head.weight`` beside the embedding, and ``dcp.load`` needs every key it lists (the
    optimizer keeps one state, under the embedding's name)."""
    args = manifest.details.get("megatron") or {}
    if EMBEDDING in model and HEAD not in model:
        if args.get("untie_embeddings_and_output_weights") is not False:
            return
        e = model[EMBEDDING]
        tensors[HEAD] = TensorEntry(HEAD, e.dtype, e.shape, e.chunks)
        paths[HEAD] = (HEAD,)
        notes.append(f"{HEAD} is {EMBEDDING} (tied embeddings)")


def _as_hf(
    manifest: Manifest,
    names: Mapping[str, str],
    config: Mapping[str, Any] | None,
    opt: MegatronOptimizer | None,
    kind: str | None,
) -> tuple[dict[str, TensorEntry], dict[str, tuple[str, ...]], bool]:
    """HF FQN → entry of the model (``kind`` None) or of one optimizer state, mapped, and
    whether the mapping kept Megatron's vocabulary padding (:data:`.hf_config.PADDING_KEPT`:
    the true size was nowhere)."""
    source = manifest
    if kind is not None and opt is not None:
        state = opt.state.get(kind) or {}
        missing = [f for f in names.values() if f not in state and not is_buffer(f)]
        if missing:
            raise UnsupportedCheckpointError(
                f"{manifest.root}: the optimizer holds no {kind} of {missing[0]!r}; pass "
                "--drop-optimizer to carry the model alone",
                fqn=missing[0],
            )
        source = replace(manifest, tensors={**manifest.tensors, **state})
    derived, out, keymap, made = as_hf(source, dict(names), config)
    if (manifest.details.get(DETAILS_KEY) or {}).get("num_experts"):
        # an FSDP2 job's state dict names the model as transformers holds it in memory: an MoE
        # family's experts fused (``mlp.experts.gate_up_proj`` [E, 2F, H], ``down_proj``), by the
        # installed transformers' own conversion of what save_pretrained writes
        derived, out, _ = to_memory_names(derived, out, made, quiet=True)
    entries = {}
    for hf, fqn in out.items():
        e = derived.tensors[fqn]
        entries[hf] = TensorEntry(hf, e.dtype, e.shape, e.chunks)
    return entries, {hf: (hf,) for hf in entries}, PADDING_KEPT in keymap.rules


def _put_optimizer(
    manifest: Manifest,
    opt: MegatronOptimizer,
    model: Mapping[str, TensorEntry],
    moments: Mapping[str, Mapping[str, TensorEntry]],
    tensors: dict[str, TensorEntry],
    objects: dict[str, ObjectEntry],
    paths: dict[str, tuple[str, ...]],
) -> None:
    for hf in model:
        here = (OPTIMIZER, "state", hf)
        for kind in MOMENTS:
            e = moments[kind][hf]
            fqn = ".".join((*here, kind))
            tensors[fqn] = TensorEntry(fqn, e.dtype, e.shape, e.chunks)
            paths[fqn] = (*here, kind)
        if opt.step is not None:
            fqn = ".".join((*here, "step"))
            # torch's AdamW keeps ``step`` as a float32 0-dim tensor
            objects[fqn] = ObjectEntry(
                fqn, value=TensorValue.scalar(float(opt.step)), has_value=True
            )
            paths[fqn] = (*here, "step")
    groups = param_groups(manifest.root, opt, model)
    fqn = f"{OPTIMIZER}.param_groups"
    objects[fqn] = ObjectEntry(fqn, value=groups, has_value=True)
    paths[fqn] = (OPTIMIZER, "param_groups")


def param_groups(
    root: str, opt: MegatronOptimizer, model: Mapping[str, TensorEntry]
) -> list[dict[str, Any]]:
    """Megatron's saved groups with ``params`` the HF FQNs of each: the decay group (matrices)
    and the no-decay group (1-D: norms and biases), told apart by ``wd_mult`` (else by order:
    Megatron puts the default, decaying, group first).

    Raises:
        UnsupportedCheckpointError: groups other than those two.
    """
    saved = list(opt.param_groups)
    matrices = [f for f, e in model.items() if len(e.shape) >= 2 and not f.endswith(".bias")]
    flat = [f for f in model if f not in set(matrices)]
    if not saved:
        return [{"params": list(model)}]
    if len(saved) == 1:
        return [{**_settings(saved[0]), "params": list(model)}]
    if len(saved) != 2:
        raise UnsupportedCheckpointError(
            f"{root}: the optimizer has {len(saved)} param groups (learning-rate or decay "
            "overrides beyond Megatron-LM's two); pass --drop-optimizer to carry the model alone"
        )
    mults = [g.get("wd_mult") for g in saved]
    no_decay = mults.index(0.0) if 0.0 in mults and mults.count(0.0) == 1 else 1
    out: list[dict[str, Any]] = []
    for i, g in enumerate(saved):
        out.append({**_settings(g), "params": flat if i == no_decay else matrices})
    return out


def _settings(group: Mapping[str, Any]) -> dict[str, Any]:
    """A saved group's settings as AdamW keeps them (``step`` lives in each parameter's state)."""
    return {k: v for k, v in group.items() if k not in ("params", "step")}
