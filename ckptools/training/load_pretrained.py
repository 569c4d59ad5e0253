"""``ckptools.load_pretrained``: a Hugging Face model directory read straight into a sharded model.

The start of a fine-tune, without ``from_pretrained`` on every rank (the whole model in CPU
memory per rank) or on rank 0 plus a broadcast. Every rank:

1. finds its own boxes: for each entry of the model's sharded state dict
   (``get_model_state_dict(full_state_dict=False)``, so FSDP2, FSDP1, DDP, ``torch.compile`` and
   activation-checkpoint wrappers all give the same FQNs), the box of the global tensor its
   local tensor holds: a DTensor's chunk (what ``dcp.save`` records, e.g. FSDP2's dim-0 rows,
   :func:`ckptools.core.geometry.fsdp2_rows`), an FSDP1 ``ShardedTensor``'s local shards, or
   the whole tensor of an unsharded module;
2. reads the safetensors headers (:func:`ckptools.producers.hf.safetensors.read_safetensors`; the
   conversion given, else transformers' own as ``from_pretrained`` applies it
   (:mod:`ckptools.training.pretrained_keys`), maps the published names and byte runs to the
   in-memory ones), checks names, shapes and dtypes against the model before any tensor byte is
   read (what the model's own loading rules ignore is not reported), and
3. copies the intersection of each stored tensor with each of its boxes
   (:func:`ckptools.core.geometry.copy_runs`) straight from the file into the local tensor with
   ranged reads (:func:`ckptools.io.storage.open_reader`): for a dim-0 shard that is one read of
   exactly the shard's bytes, into the parameter's own memory when dtype and device agree, else
   through one bounded buffer with a cast per piece.

Nothing is gathered: extra memory per rank is one read buffer (FSDP1 adds its sharded state dict
copy and torch's per-unit all-gather when the shards are loaded back).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from ckptools import _compat
from ckptools.core.manifest import Manifest, TensorEntry
from ckptools.engine import collective
from ckptools.errors import (
    CheckpointNotFoundError,
    HubConnectionError,
    HubNotFoundError,
    UsageError,
)
from ckptools.io import storage
from ckptools.io.tunables import env_size
from ckptools.producers.hf.safetensors import read_safetensors
from ckptools.training.fill import (
    Copy,
    Filler,
    Target,
    check_entry,
    check_shape,
    dtype_name,
    find_targets,
    torch_dtype,
)
from ckptools.training.pretrained_keys import KeyFilter, ignore_filter, in_memory_names

if TYPE_CHECKING:
    from torch import nn

__all__ = ["Conversion", "LoadPretrainedResult", "load_pretrained"]

log = logging.getLogger(__name__)

#: A conversion from the published tensors to the model's in-memory ones: given the manifest of
#: the files, a manifest of the same files whose entries carry the in-memory names and shapes,
#: each chunk a raw byte run of a file placed at its offsets in the in-memory tensor (a fused
#: [E, 2I, H] MoE tensor is 2E chunks). Pure: no I/O, no torch.
Conversion = Callable[[Manifest], Manifest]

#: Bytes of the one buffer a rank reads through when a piece cannot go straight into the local
#: tensor (a dtype cast, a GPU tensor). 32 MiB: large enough that
#: a read costs far more than its call, small against the 256 MiB a rank may use beyond its shard.
READ_BUFFER_ENV = "CKPTOOLS_LOAD_BUFFER_BYTES"
DEFAULT_READ_BUFFER_BYTES = 32 * 2**20
#: Files fetched from the Hub: the weights, their index and the config (never code or pickles).
HUB_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "config.json")
#: A Hub repo id (``name`` or ``namespace/name``), as huggingface_hub validates it.
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
#: Module-name segments wrappers insert (torch's state_dict API strips them).
_WRAPPER_SEGMENTS = frozenset(
    {_compat.COMPILED_SEGMENT, _compat.CHECKPOINT_WRAPPED_SEGMENT, "_fsdp_wrapped_module"}
)


class LoadPretrainedResult(NamedTuple):
    """What :func:`load_pretrained` did not match, as ``nn.Module.load_state_dict`` reports it.

    Attributes:
        missing_keys: the model's tensors the files do not hold (ties filled from their
            partner are not missing).
        unexpected_keys: tensors in the files the model does not have.
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


def _clean(name: str) -> str:
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_SEGMENTS)


def _ties(model: nn.Module) -> dict[str, list[str]]:
    """Clean FQN → the other FQNs of the same parameter (tied weights): the same object under
    several names in the module tree, found the same way on every rank. FSDP1 (without
    ``use_orig_params``) keeps shared parameters in its flat parameters' records."""
    groups: dict[int, list[str]] = {}
    for name, param in _compat.unwrap_model(model).named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(_clean(name))
    pairs = [names for names in groups.values() if len(names) > 1]
    pairs += [[_clean(a), _clean(b)] for a, b in _compat.fsdp1_shared_params(model)]
    ties: dict[str, list[str]] = {}
    for names in pairs:
        for name in names:
            ties.setdefault(name, []).extend(n for n in names if n != name)
    return ties


def _check_match(root: str, target: Target, entry: TensorEntry, strict: bool) -> None:
    """Refuse a shape mismatch always (nothing sensible can be loaded), and with ``strict`` a
    dtype change other than floating point to floating point."""
    where = check_shape(root, target, entry, "model")
    stored = torch_dtype(entry.dtype)
    floats = stored.is_floating_point and target.dtype.is_floating_point
    if strict and stored != target.dtype and not floats:
        raise UsageError(
            f"{where}: {entry.fqn!r} is {entry.dtype}, the model's {target.fqn!r} is "
            f"{dtype_name(target.dtype)}; pass strict=False to cast",
            path=where,
            fqn=entry.fqn,
        )


def _refuse_scaled(root: str, target: Target, entry: TensorEntry) -> None:
    """Refuse a float8 tensor for a parameter of another dtype, whatever ``strict``: a
    quantized model's float8 weight is its weight only times its scale (stored beside it), so
    a cast would load numbers that are not the model's."""
    if entry.dtype.startswith("float8") and dtype_name(target.dtype) != entry.dtype:
        raise UsageError(
            f"{root}: {entry.fqn!r} is stored as {entry.dtype} (a quantized weight, whose "
            f"scale is another tensor), the model's {target.fqn!r} is "
            f"{dtype_name(target.dtype)}: write the plain model first with `ckpt consolidate "
            f"{root} plain_model --dtype {dtype_name(target.dtype)}` and load that",
            path=root,
            fqn=entry.fqn,
        )


def _first(keys: Sequence[str]) -> str:
    more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
    return f"{keys[0]!r}{more}"


def _same_memory(a: Target, b: Target) -> bool:
    """Whether two targets' local tensors are the same memory (a tie FSDP2 or a plain module
    keeps as one tensor), so filling one fills the other."""
    pa = [(x.local.data_ptr(), x.local.shape) for x in a.boxes]
    pb = [(x.local.data_ptr(), x.local.shape) for x in b.boxes]
    return pa == pb


def _plan_copies(
    root: str,
    manifest: Manifest,
    targets: Mapping[str, Target],
    ties: Mapping[str, Sequence[str]],
    strict: bool,
    ignore: KeyFilter | None = None,
) -> tuple[list[Copy], LoadPretrainedResult]:
    """The copies this rank makes, and the keys that did not match (less those ``ignore``,
    the model's own loading rules, drops); validates names, shapes and dtypes first (no tensor
    byte read). Same answer on every rank (global facts only)."""
    stored = manifest.tensors
    sources: dict[str, str] = {}  # target fqn -> file tensor
    missing: list[str] = []
    for fqn in targets:
        if fqn in stored:
            sources[fqn] = fqn
            continue
        partner = next((p for p in ties.get(fqn, ()) if p in stored and p in targets), None)
        if partner is None:
            missing.append(fqn)
        elif not _same_memory(targets[fqn], targets[partner]):
            sources[fqn] = partner  # a tie kept as two tensors (FSDP1's copies): fill both
    unexpected = [fqn for fqn in stored if fqn not in targets]
    for fqn, source in sources.items():  # before the key checks, whose hint is strict=False
        _refuse_scaled(root, targets[fqn], stored[source])
    if ignore is not None:
        missing, unexpected = ignore(missing, unexpected)
    if strict and missing:
        raise UsageError(
            f"{root}: holds no tensor for the model's {_first(missing)}; pass strict=False to "
            "load the rest",
            path=root,
            fqn=missing[0],
        )
    if strict and unexpected:
        raise UsageError(
            f"{root}: holds {_first(unexpected)} that the model does not have; pass "
            "strict=False to ignore",
            path=root,
            fqn=unexpected[0],
        )
    copies: list[Copy] = []
    for fqn, source in sources.items():
        entry = stored[source]
        check_entry(root, entry)
        _check_match(root, targets[fqn], entry, strict)
        for box in targets[fqn].boxes:
            for chunk in entry.chunks:
                copies.append(Copy(fqn, source, chunk, box, entry.dtype))
    copies.sort(key=lambda c: (c.chunk.file, c.chunk.offset))  # sequential reads per file
    return copies, LoadPretrainedResult(missing, unexpected)


def _resolve_local(text: str, revision: str | None) -> str | None:
    """``text`` when it names a path or URL (``revision`` must then be None), else None."""
    if storage.is_url(text) or os.path.exists(text):
        if revision is not None:
            raise UsageError(f"{text}: revision= applies to a Hub repo id, not to a path")
        return text
    return None


def download(repo_id: str, revision: str | None) -> str:
    """The local snapshot of ``repo_id`` at ``revision`` in huggingface_hub's cache, fetching
    the safetensors files, their index and ``config.json`` (only those) when not cached.

    ``HF_HUB_OFFLINE=1`` uses the cache alone; ``HF_ENDPOINT``, ``HF_HOME`` and the token are
    huggingface_hub's own settings.
    """
    if not _REPO_ID.match(repo_id) or ".." in repo_id:
        raise CheckpointNotFoundError(
            f"{repo_id}: no such file or directory, and not a Hub repo id", path=repo_id
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}@{revision}" if revision else repo_id
    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_PATTERNS))
    except LocalEntryNotFoundError as e:  # first: an EntryNotFoundError too
        raise HubNotFoundError(
            f"{where}: not in the local Hub cache and the Hub cannot be reached (offline); "
            "download it once online, or pass a local directory",
            path=repo_id,
        ) from e
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as e:
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HubNotFoundError(f"{where}: not found on the Hub ({said})", path=repo_id) from e
    except (HfHubHTTPError, OSError) as e:
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HubConnectionError(f"{where}: download failed ({said})", path=repo_id) from e
    return str(path)


def _source(text: str, revision: str | None, ranks: collective.Ranks) -> str:
    """The directory or URL to read. Collective for a Hub repo id: rank 0 downloads first;
    the others use its snapshot when they see it (one node, or a shared cache), else fetch
    their own (another node's cache)."""
    local = _resolve_local(text, revision)
    if local is not None:
        return local
    first = ranks.from_root(lambda: download(text, revision), "load_pretrained")
    if ranks.is_root or os.path.isdir(first):
        return first
    return download(text, revision)


def _is_fsdp1(model: nn.Module) -> bool:
    fsdp1 = _compat.fsdp1_class()
    return any(isinstance(m, fsdp1) for m in model.modules())


def _way(source: str) -> str:
    """For a training checkpoint given as a published model: how to read it instead."""
    from ckptools.errors import CkptError
    from ckptools.producers.base import detect

    try:
        layout = detect(source).name
    except CkptError:
        return ""
    return (
        f": it is a {layout} training checkpoint; resume from it with ckptools.load(path, model, "
        "optimizer), or `ckpt consolidate` it into a model directory first"
    )


def _fill(
    model: nn.Module,
    state: Mapping[str, Any],
    source: str,
    strict: bool,
    conversion: Conversion | None,
    quiet: bool,
) -> tuple[LoadPretrainedResult, int]:
    """This rank's share of :func:`load_pretrained`: read the headers, check, copy its boxes.
    Returns the unmatched keys and the tensor bytes read."""
    manifest = read_safetensors(source)
    if not manifest.tensors:
        raise CheckpointNotFoundError(f"{source}: holds no safetensors tensors{_way(source)}",
                                      path=source)  # fmt: skip
    targets = find_targets(state)
    if conversion is not None:
        manifest = conversion(manifest)
    else:
        manifest = in_memory_names(model, manifest, source, targets, quiet=quiet)
    copies, result = _plan_copies(
        source, manifest, targets, _ties(model), strict, ignore_filter(model)
    )
    filler = Filler(
        storage.open_reader(manifest.data_root or manifest.root),
        env_size(READ_BUFFER_ENV, DEFAULT_READ_BUFFER_BYTES),
    )
    with torch.no_grad(), filler.reader:
        for c in copies:
            filler.copy(c)
    return result, filler.bytes_read


@storage.accepts_storage_options
def load_pretrained(
    model: nn.Module,
    path_or_repo_id: str | os.PathLike[str],
    *,
    revision: str | None = None,
    strict: bool = True,
    conversion: Conversion | None = None,
    storage_options: storage.StorageOptions | None = None,
) -> LoadPretrainedResult:
    """Fill ``model`` (sharded or not) from a safetensors model directory, each rank reading
    only the bytes of its own shards.

    Collective: every rank of the default process group calls it, in the same order, with its
    own shard of the same model: FSDP2 ``fully_shard`` at any world size, FSDP1, DDP,
    ``torch.compile`` or a plain module (then without a process group too). Each rank reads
    the headers, checks every name, shape and dtype, then reads exactly the byte ranges of its
    boxes into its local tensors in place (a DTensor's ``to_local()``; an FSDP1 model's sharded
    state dict, loaded back through torch's ``set_model_state_dict``). No rank holds the full
    model; extra memory is one read buffer of ``CKPTOOLS_LOAD_BUFFER_BYTES`` (32 MiB), used
    only when a piece is cast or goes to a GPU: otherwise it is read straight into the
    parameter. An error on any rank raises on every rank.

    Tied weights: a tensor the files lack whose parameter is tied to one they hold (the same
    parameter under two names, e.g. ``lm_head.weight`` and ``model.embed_tokens.weight`` with
    ``tie_word_embeddings``) is filled through the tie and not reported missing.

    Dtypes: a stored floating-point tensor is cast to a floating-point parameter's dtype, as
    ``from_pretrained`` casts to the model's dtype (exact when widening, e.g. bfloat16 into a
    float32 master copy; rounded when narrowing); the cast is done piece by piece, within the
    buffer. Any other dtype change (integers, bool) is refused with ``strict=True`` and done
    by ``Tensor.copy_`` with ``strict=False``. A float8 tensor (a quantized model's weight,
    whose scale is another tensor) is refused for a parameter of any other dtype, always:
    ``ckpt consolidate SRC plain --dtype bfloat16`` writes the plain model.

    Meta-device models: build under ``torch.device("meta")``, shard, then allocate with
    ``model.to_empty(device="cpu")`` (or ``"cuda"``) and call this; a model larger than one
    rank's memory then starts training with each rank holding only its shard. Buffers the files
    do not hold (rotary ``inv_freq``, non-persistent) are left as ``to_empty`` left them:
    initialise them as the model's own ``_init_weights`` would.

    Args:
        model: the model, wrapped as it will train.
        path_or_repo_id: a model directory or ``.safetensors`` file, an fsspec URL of one, or a
            Hub repo id (``"org/name"``), downloaded into huggingface_hub's cache first (only
            ``*.safetensors``, the index and ``config.json``).
        revision: a branch, tag or commit of a Hub repo id.
        strict: raise when the files and the model do not hold the same tensors (after ties),
            or on a non-floating-point dtype change. A shape mismatch always raises.
        conversion: maps the published tensors to the model's in-memory names and shapes (see
            :data:`Conversion`); None follows ``from_pretrained``
            (:func:`ckptools.training.pretrained_keys.in_memory_names`: transformers' conversion
            mapping, e.g. per-expert MoE files into fused experts, and ``base_model_prefix``).
        storage_options: fsspec options for URL paths (credentials, endpoint...).

    Returns:
        A :class:`LoadPretrainedResult` ``(missing_keys, unexpected_keys)``, the same on every
        rank.

    Raises:
        UsageError: a shape mismatch; with ``strict``, a missing or unexpected tensor or a
            refused dtype change; a model on the meta device.
        CheckpointNotFoundError: no such path, or no safetensors file in it.
        HubNotFoundError / HubConnectionError: the repo id could not be fetched.
        CkptError: another rank failed.

    Example:
        >>> import torch, ckptools
        >>> model = torch.nn.Linear(4, 2)
        >>> _ = ckptools.save_pretrained(model, "/tmp/ckptools-doc/lp", overwrite=True)
        >>> ckptools.load_pretrained(torch.nn.Linear(4, 2), "/tmp/ckptools-doc/lp")
        LoadPretrainedResult(missing_keys=[], unexpected_keys=[])
    """
    started = time.perf_counter()
    text = os.fspath(path_or_repo_id)
    ranks = collective.of_group(None)
    source = _source(text, revision, ranks)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    found = ranks.from_all(
        lambda: _fill(model, state, source, strict, conversion, ranks.rank != 0),
        "load_pretrained",
    )
    if _is_fsdp1(model):
        set_model_state_dict(model, state, options=StateDictOptions(strict=False))
    result, bytes_read = found[ranks.rank]
    log.info(
        "load_pretrained read %d bytes of %s on rank %d in %.2f s",
        bytes_read, source, ranks.rank, time.perf_counter() - started,
    )  # fmt: skip
    return result
