"""Export planning: which tensors a model directory gets and how its files are cut.

The front half that :func:`ckptools.consolidate` and :func:`ckptools.save_pretrained` share:
options validated once (:class:`ExportOptions`), the tensors picked (:func:`select_tensors`, the
model part by default), the config and tokenizer files found beside the checkpoint
(:func:`find_model_files`), tied embeddings handled as the config says, names converted to the
on-disk format and the files planned (:func:`plan_export`); the index written last
(:func:`write_index`). Split out of :mod:`ckptools.consolidate`, which re-exports these names.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from ckptools.core import dtypes, keys
from ckptools.core.hf_files import MODEL_FILES as MODEL_FILES
from ckptools.core.manifest import Manifest
from ckptools.core.sizes import parse_size
from ckptools.errors import UsageError
from ckptools.io import storage
from ckptools.io.staging import write_file_synced
from ckptools.plan.safetensors import INDEX_NAME, ConsolidationPlan, TensorPlan, plan_consolidation
from ckptools.producers.base import decodes_of, layout_of
from ckptools.producers.registry import declared
from ckptools.views import lora
from ckptools.views.model_config import find_model_files, model_config
from ckptools.views.producer import views_of

if TYPE_CHECKING:
    from ckptools.plan.conversions import KeyMap
    from ckptools.producers.decoding import RowDecoder

#: transformers' own default for ``save_pretrained`` and what the Hub expects.
DEFAULT_MAX_SHARD_SIZE = "5GB"
#: Output and input embedding names whose weights models tie (``tie_word_embeddings``).
_OUTPUT_EMBEDDINGS = ("lm_head.weight", "embed_out.weight", "output.weight")
_INPUT_EMBEDDINGS = (
    "embed_tokens.weight",
    "wte.weight",
    "word_embeddings.weight",
    "tok_embeddings.weight",
    "embed_in.weight",
)
# Block size for comparing two written tensors when looking for tied weights.
_COMPARE_BLOCK_BYTES = 4 * 2**20

CastDType = Literal["bfloat16", "float16", "float32"]


@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    """What goes into a model directory and how it is cut: the options :func:`consolidate` and
    :func:`ckptools.save_pretrained` share, validated once, on construction.

    Attributes:
        max_shard_size: largest output file, e.g. ``"5GB"``, ``"300KB"``, ``"2GiB"`` or bytes.
        dtype: cast floating tensors to this dtype (other tensors are kept as stored).
        select: export this key sub-tree instead of the model (see :func:`select_tensors`).
        key: the container holding the model's state dict (``model_state_dict``): ``select``
            under the name ``torch.save`` users know; errors about it name ``--key``.
        strip_prefix: remove this prefix from output names.
        config: a ``config.json`` file or a directory with config and tokenizer files.
        overwrite: replace an existing output directory.
        keep_in_memory_names: write the in-memory form (fused experts), not the on-disk format.
        adapter: write only the LoRA adapter, as ``PeftModel.save_pretrained`` does
            (:mod:`ckptools.views.lora`).
        merge_lora: write the model with the LoRA adapter merged into its weights.
        lora_alpha: the adapter's ``lora_alpha`` (the checkpoint does not store it).
        adapter_config: an ``adapter_config.json`` giving alpha and the rest of the LoraConfig.
        adapter_name: the adapter to export or merge, when the model holds several.
        masters: the producer's distributed optimizer's fp32 masters instead of the stored
            model weights (its views' ``with_masters``: :mod:`ckptools.views.producer`).
        max_shard_bytes: ``max_shard_size`` in bytes (derived).

    Raises:
        UsageError: a bad size or dtype, both ``key`` and ``select``, or a ``lora_alpha`` that
            is not a positive number (alpha 0 would merge nothing; a negative one subtracts).
    """

    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE
    dtype: CastDType | None = None
    select: str | None = None
    key: str | None = None
    strip_prefix: str | None = None
    config: str | None = None
    overwrite: bool = False
    keep_in_memory_names: bool = False
    adapter: bool = False
    merge_lora: bool = False
    lora_alpha: float | None = None
    adapter_config: str | None = None
    adapter_name: str | None = None
    masters: bool = False
    max_shard_bytes: int = field(init=False, repr=False)

    #: what a refusal of a PEFT-wrapped model's plain export names as the ways forward
    #: (``{select}``: the selection that keeps peft's names), in the caller's own terms: here
    #: :func:`consolidate`'s, whose options are the CLI's flags
    PEFT_WAYS: ClassVar[str] = (
        "use --merge-lora for the merged model or --adapter for peft's adapter directory "
        "(--select {select} keeps peft's names as stored)"
    )
    #: what LoRA options given without a LoRA export need
    LORA_NEEDS: ClassVar[str] = (
        "--lora-alpha, --adapter-config, --adapter-name: need --adapter or --merge-lora"
    )

    @property
    def select_flag(self) -> str:
        """The option that chose ``select``, as errors about the selection name it."""
        return "--key" if self.key is not None else "--select"

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "max_shard_bytes", parse_size(self.max_shard_size, "max_shard_size")
        )
        if self.key is not None:
            if self.select is not None:
                raise UsageError("--key and --select both choose what to export; give one")
            object.__setattr__(self, "select", self.key)
        if self.dtype is not None and (
            not dtypes.is_dtype_name(self.dtype) or not dtypes.dtype(self.dtype).is_floating
        ):
            raise UsageError(f"--dtype {self.dtype!r}: choose bfloat16, float16 or float32")
        if self.adapter and self.merge_lora:
            raise UsageError("--adapter and --merge-lora: choose one")
        lora_option = self.lora_alpha is not None or self.adapter_config or self.adapter_name
        if lora_option and not (self.adapter or self.merge_lora):
            raise UsageError(self.LORA_NEEDS)
        if self.lora_alpha is not None and not (
            math.isfinite(self.lora_alpha) and self.lora_alpha > 0
        ):
            raise UsageError(
                f"--lora-alpha {self.lora_alpha:g}: expected a positive number (the adapter's "
                "lora_alpha from its LoraConfig or adapter_config.json)"
            )
        if self.merge_lora and self.dtype is not None:
            raise UsageError("--merge-lora merges in the weights' dtype: drop --dtype")
        if self.masters and (self.adapter or self.merge_lora or self.select is not None):
            raise UsageError(
                f"--masters exports {' or '.join(declared('MASTERS_MODEL'))}: drop --adapter, "
                "--merge-lora and --select"
            )


def select_tensors(
    manifest: Manifest,
    select: str | None = None,
    strip_prefix: str | None = None,
    *,
    flag: str = "--select",
) -> dict[str, str]:
    """Output name → stored FQN of the tensors to export.

    Args:
        manifest: the checkpoint.
        select: a dotted key path of a sub-tree (``"optim"``, ``"app.model"``,
            ``"model.model.layers.0"``) whose tensors to export with that path removed; ``"*"``
            exports every tensor under its full path. Default: the model part
            (:func:`ckptools.core.keys.find_model_part`). Either way wrapper segments are removed
            as :func:`ckptools.core.keys.own_names` says.
        strip_prefix: removed from the start of every output name that has it.
        flag: the option that gave ``select``, as errors name it (``--key`` or ``--select``).

    Raises:
        UsageError: nothing matches, or two stored tensors would get the same name.
    """
    out: dict[str, str] = {}
    if select is None:
        out = dict(keys.model_keys(manifest))
    else:
        sel = select.strip(".")
        chosen: dict[str, str] = {}  # stored FQN -> its key path below the selection
        for fqn in manifest.tensors:
            joined = ".".join(keys.key_path(manifest, fqn))
            if sel in ("", "*"):
                chosen[fqn] = joined
            elif joined.startswith(sel + "."):
                chosen[fqn] = joined[len(sel) + 1 :]
        for name, fqn in zip(keys.own_names(list(chosen.values())), chosen, strict=True):
            if name in out:
                raise UsageError(
                    f"{flag} {select!r}: {out[name]!r} and {fqn!r} would both be written as "
                    f"{name!r}; select a narrower sub-tree"
                )
            out[name] = fqn
    if strip_prefix:
        renamed: dict[str, str] = {}
        for name, fqn in out.items():
            new = name[len(strip_prefix) :] if name.startswith(strip_prefix) else name
            if not new or new in renamed:
                raise UsageError(f"--strip-prefix {strip_prefix!r} makes {name!r} collide or empty")
            renamed[new] = fqn
        out = renamed
    if not out:
        from ckptools.producers.optimizer_state import optimizer_alone

        alone = optimizer_alone(manifest, out) if select is None else None
        if alone is not None:
            raise UsageError(f"{manifest.root}: {alone}")
        tops = sorted({keys.key_path(manifest, f)[0] for f in manifest.tensors})
        raise UsageError(
            f"{manifest.root}: no tensors selected"
            + (f" by {flag} {select!r}" if select is not None else "")
            + f"; top-level keys with tensors: {', '.join(tops) or '(none)'}"
        )
    return out


def suggested_optimizer_order(manifest: Manifest, config: str | None = None) -> list[str] | None:
    """The order the producer gave the optimizer the parameters of the model of its
    ``config.json``, where the checkpoint's integer-keyed ``optimizer.state_dict()`` (no
    ``param_names``) cannot be placed by its own stored order:

    * a transformers ``Trainer`` checkpoint's several unnamed groups (weight decay / none):
      the Trainer's own rule (:func:`ckptools.plan.conversion_lookup.trainer_param_order`);
    * one group beside a model stored out of its order (``model.safetensors``, sorted by
      name): the model's ``named_parameters()`` order.

    ``config``: the user's ``config.json`` (file or directory) instead of the checkpoint's own.
    None for any other source, or without a config that builds on ``meta``. Only a suggestion:
    it is used where the groups' counts and every state's shape match it.

    Raises:
        UsageError: ``config`` is given and names nothing usable.
    """
    from ckptools.core.manifest import MODEL_FILES_DIR, MODEL_ORDER_UNKNOWN
    from ckptools.producers.optimizer_state import optimizer_states

    unnamed = [o for o in optimizer_states(manifest) if o.keyed == "integer" and not o.param_names]
    layout = layout_of(manifest)
    follows = layout is not None and layout.groups_follow_the_model
    trainer = follows and any(o.param_groups > 1 for o in unnamed)
    unordered = bool(manifest.details.get(MODEL_ORDER_UNKNOWN)) and bool(unnamed)
    if not (trainer or unordered):
        return None
    if config is not None:  # the user's: a bad one is an error, not a silent refusal later
        cfg = model_config(find_model_files(manifest.data_dir(), config))
    else:
        try:
            inside = manifest.details.get(MODEL_FILES_DIR)
            cfg = model_config(find_model_files(manifest.data_dir(), None, inside))
        except UsageError:
            return None
    if cfg is None:
        return None
    from ckptools.plan.conversion_lookup import model_param_order, trainer_param_order

    return trainer_param_order(cfg) if trainer else model_param_order(cfg)


def tie_setting(files: list[tuple[str, str]]) -> bool | None:
    return config_ties(model_config(files))


def config_ties(cfg: Mapping[str, Any] | None) -> bool | None:
    """The model config's ``tie_word_embeddings`` (or its ``text_config``'s), None if unset."""
    if cfg is None:
        return None
    value = cfg.get("tie_word_embeddings")
    if value is None and isinstance(cfg.get("text_config"), dict):
        value = cfg["text_config"].get("tie_word_embeddings")
    return None if value is None else bool(value)


#: The output embedding a transformers language model ties to its input embedding: every
#: ``*ForCausalLM`` / ``*LMHeadModel`` / ``*ForConditionalGeneration`` holds it at the top.
TIED_HEAD = "lm_head.weight"
_HEADED = ("CausalLM", "LMHead", "ConditionalGeneration")


def untied_head(names: Mapping[str, str], cfg: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """``(output embedding, input embedding)`` when ``names`` (a full model) leave out the
    output embedding that ``cfg`` ties (``save_pretrained`` drops it; ``from_pretrained`` and
    the live model, whose ``state_dict`` has it, share the input embedding's storage): the one
    input embedding stored, no output embedding, a config that ties and a language-model
    head among its ``architectures`` (if it names them). Else None."""
    if not config_ties(cfg):
        return None
    arch = (cfg or {}).get("architectures") or []
    if arch and not any(h in str(a) for a in arch for h in _HEADED):
        return None
    if any(n.endswith(_OUTPUT_EMBEDDINGS) for n in names):
        return None
    ins = [n for n in names if n.endswith(_INPUT_EMBEDDINGS)]
    return (TIED_HEAD, ins[0]) if len(ins) == 1 else None


def tied_candidates(names: Mapping[str, str], manifest: Manifest) -> list[tuple[str, str]]:
    """``(output embedding, input embedding)`` name pairs that a model may tie.

    Pairs must have the same dtype and shape; the output embedding comes first.
    """
    outs = [n for n in names if n.endswith(_OUTPUT_EMBEDDINGS) or n in ("output.weight",)]
    ins = [n for n in names if n.endswith(_INPUT_EMBEDDINGS)]
    pairs = []
    for o in outs:
        for i in ins:
            a, b = manifest.tensors[names[o]], manifest.tensors[names[i]]
            if a.dtype == b.dtype and a.shape == b.shape:
                pairs.append((o, i))
    return pairs


def same_storage(manifest: Manifest, a: str, b: str) -> bool:
    """Whether stored tensors ``a`` and ``b`` are the same bytes of the same files."""
    ca, cb = manifest.tensors[a].chunks, manifest.tensors[b].chunks
    return len(ca) == len(cb) and all(
        (x.file, x.offset, x.encoding) == (y.file, y.offset, y.encoding)
        for x, y in zip(ca, cb, strict=True)
    )


def same_written_bytes(out_dir: str, plan: ConsolidationPlan, a: str, b: str) -> bool:
    """Whether tensors ``a`` and ``b`` of ``plan``, written into ``out_dir``, hold equal bytes."""
    where: dict[str, tuple[str, TensorPlan]] = {}
    for f in plan.files:
        for t in f.tensors:
            if t.name in (a, b):
                where[t.name] = (f.name, t)
    (pa, ta), (pb, tb) = where[a], where[b]
    if ta.nbytes != tb.nbytes:
        return False
    # out_dir is a local directory, or the object-store prefix the files were uploaded to
    with storage.open_reader(out_dir) as reader:
        done = 0
        while done < ta.nbytes:
            n = min(_COMPARE_BLOCK_BYTES, ta.nbytes - done)
            if reader.read(pa, ta.begin + done, n) != reader.read(pb, tb.begin + done, n):
                return False
            done += n
    return True


@dataclass(frozen=True)
class Export:
    """What a model directory gets: the plan, and how the tensors were chosen.

    Attributes:
        names: output name → stored FQN of the tensors written.
        dropped: ``(dropped, kept)`` tied weights left out (the config ties them).
        candidates: ``(output, input)`` embedding pairs a model may tie (:func:`tied_candidates`).
        plan: the files and their tensors.
        adapter_config: the ``adapter_config.json`` to write (``--adapter``), else None.
        merge: the weights to merge a LoRA adapter into after the copy (``--merge-lora``).
    """

    names: dict[str, str]
    dropped: tuple[tuple[str, str], ...]
    candidates: tuple[tuple[str, str], ...]
    plan: ConsolidationPlan
    manifest: Manifest | None = None  # the plan's FQNs' manifest when a conversion added entries
    keymap: KeyMap | None = None  # the conversion applied (ckptools.plan.conversions), if any
    adapter_config: dict[str, Any] | None = None
    merge: tuple[lora.MergeTarget, ...] = ()
    config: dict[str, Any] | None = None  # the model's config.json a producer's view made
    #: output name -> the decoder computing it from its stored form (a layout's ``decodes``
    #: with a dtype: :mod:`ckptools.producers.decoding`)
    decoders: Mapping[str, RowDecoder] = field(default_factory=dict)
    #: config.json keys the written model no longer has (what the decoders consumed)
    config_drops: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def _quiet(options: ExportOptions) -> bool:
    """``consolidate``'s ``quiet`` (plain :class:`ExportOptions`, as ``save_pretrained`` plans
    with, has none): no status line while a conversion is derived."""
    return bool(getattr(options, "quiet", False))


def _with_masters(manifest: Manifest) -> Manifest:
    """``--masters``: the manifest with the distributed optimizer's fp32 masters as the model
    (the producer's view, ``with_masters``).

    Raises:
        UsageError: the source's producer keeps no masters, or it holds none.
    """
    views = views_of(manifest)
    if views is None or not getattr(views, "HAS_MASTERS", False):
        raise UsageError(
            f"{manifest.root}: --masters takes {' or '.join(declared('MASTERS'))}; "
            f"this is a {manifest.layout} checkpoint: drop --masters"
        )
    return views.with_masters(manifest)


def plan_export(
    manifest: Manifest,
    options: ExportOptions,
    tie: bool | None,
    config: Mapping[str, Any] | None = None,
    *,
    boxes_only: bool = False,
    check: bool = True,
) -> Export:
    """Choose the tensors to write and plan the files: the one front half of :func:`consolidate`
    and :func:`ckptools.save_pretrained`, so that both write the same directory.

    Args:
        manifest: the checkpoint (or, for ``save_pretrained``, what ``dcp.save`` would write).
        options: selection, shard size and dtype.
        tie: the config's ``tie_word_embeddings`` (:func:`tie_setting`); when true the output
            embedding is left out, as transformers re-ties it to the input embedding on load.
        config: the model's ``config.json``: names are converted to the on-disk format
            (:func:`ckptools.engine.converted.to_disk_names`) unless
            ``options.keep_in_memory_names``; ``boxes_only`` for a manifest without bytes.
        check: CRC-check the records a conversion splits now (false for a dry run).
    """
    names = select_tensors(manifest, options.select, options.strip_prefix, flag=options.select_flag)
    if options.adapter:
        return _plan_adapter(manifest, names, options, config)
    if options.select is None and not options.merge_lora:
        select = ".".join(keys.find_model_part(manifest).path) or "'*'"
        lora.refuse_peft_names(names, manifest, options.PEFT_WAYS.format(select=select))
    merge: list[lora.MergeTarget] = []
    if options.merge_lora:
        found = lora.adapter_names(names, manifest, options.adapter_name)
        cfg = lora.adapter_config(
            found[2], found[1], lora_alpha=options.lora_alpha,
            config_file=options.adapter_config, model_config=config, source=manifest.root,
            defaults=False,  # the merge reads r, alpha, rslora: peft (115 MiB) stays unimported
        )  # fmt: skip
        names, merge = lora.merged_names(names, manifest, options.adapter_name, cfg)
    keymap, made = None, None
    views = views_of(manifest) if options.select is None else None
    if options.masters:
        manifest = _with_masters(manifest)
    if views is not None and not options.keep_in_memory_names:
        # a producer whose names are not the model's: its own view as the HF model
        manifest, names, keymap, made = views.as_hf(manifest, names, config, check=check)
    elif config is not None and not options.keep_in_memory_names:
        # imported here: a source without a config (or kept in memory names) needs none of the
        # conversion machinery, and its import is most of a small consolidate's start-up
        from ckptools.engine.converted import to_disk_names

        manifest, names, keymap = to_disk_names(manifest, names, config, boxes_only=boxes_only,
                                               check=check, quiet=_quiet(options))  # fmt: skip
    placeholders = manifest.placeholders_only(names.values())
    if placeholders is not None:
        raise UsageError(placeholders)
    decoded = None
    as_stored: tuple[str, ...] = ()
    # stored forms that are not the model's tensors (quantized data and its scales): the
    # layout's own reading of them at the dtype asked, or its refusal by name; a plain copy
    # keeps them as stored, and the layout says so
    decodes = decodes_of(manifest)
    if decodes is not None and options.dtype is not None:
        decoded = decodes.decoded(manifest, names, options.dtype)
        names = dict(decoded.names)
    elif decodes is not None:
        as_stored = decodes.decoded(manifest, names, None).notes
    candidates = tuple(tied_candidates(names, manifest))
    dropped: list[tuple[str, str]] = []
    if tie:
        for o, i in candidates:
            if o in names:
                dropped.append((o, i))
                del names[o]
    kept = {n: d for n, d in (keymap.kept_dtypes if keymap else {}).items() if n in names}
    plan = plan_consolidation(manifest, names, max_shard_size=options.max_shard_bytes,
                              dtype=options.dtype, kept_dtypes=kept)  # fmt: skip
    notes = decoded.notes if decoded else as_stored
    widened = kept_note(manifest, names, kept)
    return Export(
        names=names, dropped=tuple(dropped), candidates=candidates, plan=plan,
        manifest=manifest, keymap=keymap, merge=tuple(merge), config=made,
        decoders=decoded.decoders if decoded else {},
        config_drops=decoded.config_drops if decoded else (),
        notes=(*notes, widened) if widened else notes,
    )  # fmt: skip


def kept_note(manifest: Manifest, names: Mapping[str, str], kept: Mapping[str, str]) -> str | None:
    """The note for the tensors the model keeps in a dtype of their own (``kept``: name ->
    dtype, :attr:`ckptools.plan.conversions.KeyMap.kept_dtypes`) that are stored in another:
    written (or compared) in the model's dtype, e.g. a bf16 run's router widened to float32.
    None when every one is stored so."""
    moved: dict[tuple[str, str], list[str]] = {}
    for name, want in kept.items():
        stored = manifest.tensors[names[name]].dtype
        if dtypes.canonical(want) != stored:
            moved.setdefault((stored, dtypes.canonical(want)), []).append(name)
    parts = []
    for (stored, want), found in moved.items():
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        exact = dtypes.dtype(stored).itemsize < dtypes.dtype(want).itemsize
        how = "widened, exactly," if exact else "cast"
        parts.append(f"{found[0]}{more} {how} from {stored} to {want}")
    if not parts:
        return None
    return "; ".join(parts) + ": the model keeps them in that dtype whatever its own"


def _plan_adapter(
    manifest: Manifest,
    names: Mapping[str, str],
    options: ExportOptions,
    config: Mapping[str, Any] | None,
) -> Export:
    """The adapter alone, in one ``adapter_model.safetensors`` (peft never shards it)."""
    out, adapter, found = lora.adapter_names(names, manifest, options.adapter_name)
    cfg = lora.adapter_config(
        found, adapter, lora_alpha=options.lora_alpha, config_file=options.adapter_config,
        model_config=config, source=manifest.root,
    )  # fmt: skip
    plan = plan_consolidation(manifest, out, max_shard_size=2**63, dtype=options.dtype)
    (only,) = plan.files
    plan = replace(plan, files=(replace(only, name=lora.ADAPTER_WEIGHTS_NAME),))
    return Export(names=out, dropped=(), candidates=(), plan=plan, manifest=manifest,
                  adapter_config=cfg)  # fmt: skip


def write_index(directory: str, plan: ConsolidationPlan) -> None:
    """Write the index of a sharded model directory, durably (nothing for a single file).

    The index commits a sharded model directory: call it last, after every shard is written.
    """
    if plan.index is not None:
        index = (json.dumps(plan.index, indent=2) + "\n").encode()
        write_file_synced(storage.join(directory, INDEX_NAME), index)
