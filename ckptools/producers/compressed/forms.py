"""What a quantized model directory stores, as plain data: its scheme, its block size, and for
each quantized weight the stored tensors that make it.

Three producers' forms, each read from what the producer itself writes:

* **compressed-tensors** (llmcompressor's ``FP8_BLOCK``, ``FP8``, ``FP8_DYNAMIC``): config.json's
  ``quantization_config`` with ``quant_method: compressed-tensors``, ``format:
  float-quantized`` and ``config_groups`` whose ``weights`` are 8-bit ``float`` with a
  ``strategy`` (``block`` with ``block_structure``, ``channel``, ``tensor``); each weight stored
  as ``<module>.weight`` (F8_E4M3) beside ``<module>.weight_scale``.
* **DeepSeek-V3 / transformers' FineGrainedFP8**: ``quant_method: fp8``, ``fmt: e4m3``,
  ``weight_block_size: [128, 128]``; ``<module>.weight`` (F8_E4M3) beside
  ``<module>.weight_scale_inv`` (float32, ``[ceil(out/128), ceil(in/128)]``), which, despite its
  name, multiplies (DeepSeek's ``weight_dequant``: ``y = x * s``).
* **torchao** (transformers' ``TorchAoConfig`` save, or ``torchao.prototype.safetensors``): each
  file's header metadata names every tensor (``tensor_names``) and its ``_type``; a
  ``Float8Tensor`` ``<module>.weight`` is stored as ``<module>._weight_qdata`` and
  ``<module>._weight_scale``, its ``block_size`` in the metadata.

The weight is ``f32(q) * f32(scale)`` per block (the scale element of the block holding the
element; partial blocks at the edges included). What this module does not understand is kept
as the reason, shown by ``inspect`` and raised by a ``--dtype`` export, never cast.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ckptools.core.manifest import Manifest, TensorEntry

#: ``Manifest.details`` key (and ``inspect --json`` key) of a quantized model's facts
KEY = "quantized"
#: the stored float8 dtypes this family dequantizes
FLOAT8 = ("float8_e4m3fn", "float8_e5m2")
#: the scale dtypes it reads
SCALES = ("float32", "bfloat16", "float16")
#: tensors beside a quantized weight that quantize activations or the KV cache at run time: a
#: plain model has none, so the dequantized model leaves them out
RUNTIME_SCALES = ("input_scale", "output_scale", "k_scale", "v_scale")


@dataclass(frozen=True)
class Quantized:
    """One quantized weight: ``weight`` (the plain model's name) is ``data`` times ``scale``
    per block of ``block`` elements (rows, columns), the product rounded to ``product`` (its
    producer's reading: float32, or compressed-tensors' scale dtype) before the output dtype."""

    weight: str
    data: str
    scale: str
    block: tuple[int, int]
    product: str = "float32"


@dataclass(frozen=True)
class Form:
    """A quantized model's form: ``scheme`` as its producer names it, ``block`` (None where
    each weight has its own), its quantized weights, the run-time scales a plain model drops,
    and ``refused``: why it is not dequantized (None when it is)."""

    producer: str
    scheme: str
    block: tuple[int, int] | None
    weights: tuple[Quantized, ...]
    dropped: tuple[str, ...]
    refused: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Form:
        block = d.get("block")
        return cls(
            producer=d["producer"],
            scheme=d["scheme"],
            block=tuple(block) if block else None,  # type: ignore[arg-type]
            weights=tuple(
                Quantized(w["weight"], w["data"], w["scale"], tuple(w["block"]), w["product"])  # type: ignore[arg-type]
                for w in d["weights"]
            ),
            dropped=tuple(d["dropped"]),
            refused=d.get("refused"),
        )


def _pair_of_sizes(value: Any) -> tuple[int, int] | None:
    """``value`` as a block size (two positive integers), None when it is not one."""
    ok = isinstance(value, list) and len(value) == 2
    ok = ok and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in value)
    return (value[0], value[1]) if ok else None


def _blocks_fit(data: TensorEntry, scale: TensorEntry, block: tuple[int, int]) -> bool:
    """Whether ``scale`` holds one element per ``block`` of ``data`` (edge blocks partial)."""
    if len(data.shape) != 2:
        return False
    want = (math.ceil(data.shape[0] / block[0]), math.ceil(data.shape[1] / block[1]))
    have = tuple(scale.shape) if len(scale.shape) == 2 else None
    if len(scale.shape) < 2 and math.prod(scale.shape) == 1:
        have = (1, 1)
    return have == want


def _pairs(
    tensors: Mapping[str, TensorEntry], scale_suffix: str, block_of: Any, in_scale_dtype: bool
) -> tuple[list[Quantized], list[str], str | None]:
    """Each float8 ``<m>.weight`` with its ``<m>.weight<scale_suffix>``: the quantized weights,
    the run-time scales beside them, and the first reason one cannot be read (else None)."""
    weights: list[Quantized] = []
    dropped: list[str] = []
    for fqn, entry in tensors.items():
        if fqn.endswith(scale_suffix):
            if fqn[: -len(scale_suffix)] + ".weight" not in tensors:
                return weights, dropped, f"scale {fqn!r} has no weight beside it"
            continue
        if entry.dtype not in FLOAT8:
            continue
        scale_name = fqn[: -len(".weight")] + scale_suffix if fqn.endswith(".weight") else None
        scale = tensors.get(scale_name) if scale_name else None
        if scale_name is None or scale is None:
            return weights, dropped, f"float8 tensor {fqn!r} has no {scale_suffix[1:]!r} scale"
        if scale.dtype not in SCALES:
            return weights, dropped, f"scale {scale_name!r} is {scale.dtype}"
        block = block_of(entry)
        if block is None or not _blocks_fit(entry, scale, block):
            return (
                weights,
                dropped,
                (
                    f"scale {scale_name!r} {list(scale.shape)} does not give one element per "
                    f"block {list(block) if block else '?'} of {fqn!r} {list(entry.shape)}"
                ),
            )
        product = scale.dtype if in_scale_dtype else "float32"
        weights.append(Quantized(fqn, fqn, scale_name, block, product))
        module = fqn[: -len(".weight")]
        dropped.extend(f"{module}.{n}" for n in RUNTIME_SCALES if f"{module}.{n}" in tensors)
    return weights, dropped, None


def compressed_tensors(qc: Mapping[str, Any], manifest: Manifest) -> Form:
    """compressed-tensors' ``quantization_config``: float-quantized 8-bit float weights."""
    fmt = str(qc.get("format"))
    groups = qc.get("config_groups") or {}
    refused: str | None = None
    blocks: set[tuple[int, int]] = set()
    strategies: set[str] = set()
    for name, group in groups.items() if isinstance(groups, dict) else ():
        w = (group or {}).get("weights") or {}
        g_fmt = str(group.get("format") or fmt)
        strategy = str(w.get("strategy"))
        if g_fmt != "float-quantized":
            refused = refused or f"compressed-tensors format {g_fmt!r} (group {name})"
        elif w.get("type") != "float" or w.get("num_bits") != 8:
            refused = refused or (
                f"compressed-tensors weights of type {w.get('type')!r}, "
                f"{w.get('num_bits')} bits (group {name})"
            )
        elif strategy not in ("block", "channel", "tensor"):
            refused = refused or f"compressed-tensors strategy {strategy!r} (group {name})"
        elif strategy == "block":
            bs = w.get("block_structure")
            pair = _pair_of_sizes(bs)
            if pair is None:
                refused = refused or f"compressed-tensors block_structure {bs!r} (group {name})"
            else:
                blocks.add(pair)
        strategies.add(strategy)
    if not groups and refused is None:
        refused = "compressed-tensors config with no config_groups"
    if len(blocks) > 1 and refused is None:
        refused = f"compressed-tensors groups with several block sizes {sorted(blocks)}"
    block = next(iter(blocks)) if len(blocks) == 1 else None

    def block_of(entry: TensorEntry) -> tuple[int, int] | None:
        scale = manifest.tensors.get(entry.fqn + "_scale")
        if len(entry.shape) != 2 or scale is None:
            return None
        if block is not None:
            return block
        if tuple(scale.shape) == (entry.shape[0], 1):  # channel: one scale per row
            return (1, entry.shape[1])
        if math.prod(scale.shape) == 1:  # tensor: one scale
            return (entry.shape[0], entry.shape[1])
        return None

    # compressed-tensors multiplies in the scale's dtype: ``x_q.to(scale.dtype) * scale``
    weights, dropped, problem = _pairs(manifest.tensors, ".weight_scale", block_of, True)
    if any(f.endswith((".weight_zero_point", ".weight_global_scale")) for f in manifest.tensors):
        problem = problem or "compressed-tensors zero points or global scales"
    scheme = f"float-quantized ({', '.join(sorted(strategies)) or '?'})"
    return Form("compressed-tensors", scheme, block, tuple(weights), tuple(dropped),
                refused or problem)  # fmt: skip


def fine_grained_fp8(qc: Mapping[str, Any], manifest: Manifest) -> Form:
    """DeepSeek-V3's (and transformers' FineGrainedFP8) ``quant_method: fp8`` blocks."""
    fmt = qc.get("fmt", "e4m3")
    bs = qc.get("weight_block_size")
    refused = None
    block: tuple[int, int] | None = None
    if fmt != "e4m3":
        refused = f"fp8 fmt {fmt!r}"
    elif _pair_of_sizes(bs) is None:
        refused = f"fp8 weight_block_size {bs!r} (per-tensor fp8 is not read yet)"
    else:
        block = _pair_of_sizes(bs)
    weights, dropped, problem = _pairs(
        manifest.tensors, ".weight_scale_inv", lambda entry: block, False
    )
    return Form("DeepSeek-V3 / FineGrainedFP8", f"fp8 {fmt} blocks", block,
                tuple(weights), tuple(dropped), refused or problem)  # fmt: skip


def torchao(metadata: Mapping[str, Mapping[str, str]], manifest: Manifest) -> Form:
    """torchao's flattened tensor subclasses, from each file's header metadata."""
    weights: list[Quantized] = []
    refused: str | None = None
    blocks: set[tuple[int, int]] = set()
    for meta in metadata.values():
        try:
            names = json.loads(meta.get("tensor_names", "[]"))
        except (ValueError, RecursionError):
            names = []
        for name in names:
            try:
                info = json.loads(meta.get(name, "{}"))
            except (ValueError, RecursionError):
                info = {}
            kind = info.get("_type")
            if kind in ("Tensor", "torch.Tensor"):
                continue
            if kind != "Float8Tensor":
                refused = refused or f"torchao {kind} {name!r}"
                continue
            module, _, attr = name.rpartition(".")
            data_names = info.get("_tensor_data_names") or []
            data = manifest.tensors.get(f"{module}._{attr}_qdata")
            scale = manifest.tensors.get(f"{module}._{attr}_scale")
            parts = (f"{module}._{attr}_qdata", f"{module}._{attr}_scale")
            extra = [n for n in manifest.tensors if n.startswith(f"{module}._{attr}_")
                     and n not in parts]  # fmt: skip
            bs = (info.get("_data") or {}).get("block_size")
            if list(data_names) != ["qdata", "scale"] or extra or data is None or scale is None:
                refused = refused or f"torchao Float8Tensor {name!r} stored as {data_names or '?'}"
            elif data.dtype not in FLOAT8 or scale.dtype not in SCALES:
                refused = refused or (
                    f"torchao Float8Tensor {name!r} of {data.dtype} scaled by {scale.dtype}"
                )
            elif not (isinstance(bs, list) and len(bs) == 2) or not _blocks_fit(
                data, scale, (bs[0], bs[1])
            ):
                refused = refused or f"torchao Float8Tensor {name!r} block_size {bs!r}"
            else:
                weights.append(Quantized(name, data.fqn, scale.fqn, (bs[0], bs[1])))
                blocks.add((bs[0], bs[1]))
    scheme = "Float8Tensor" + (" (per row)" if all(b[0] == 1 for b in blocks) and blocks else "")
    block = next(iter(blocks)) if len(blocks) == 1 else None
    return Form("torchao", scheme, block, tuple(weights), (), refused)


def torchao_metadata(metadata: Mapping[str, Mapping[str, str]]) -> bool:
    """Whether safetensors header metadata is torchao's (``tensor_names`` and ``_type``s)."""
    return any("tensor_names" in m and any('"_type"' in v for v in m.values())
               for m in metadata.values())  # fmt: skip


def form_of(config: Mapping[str, Any] | None, manifest: Manifest) -> Form | None:
    """The quantized form of a model directory (its config and the manifest of its files), a
    form that refuses for a quantization this family does not read, None for a plain model."""
    metadata = manifest.details.get("metadata") or {}
    qc = (config or {}).get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == "compressed-tensors":
        return compressed_tensors(qc, manifest)  # type: ignore[arg-type]
    if method == "fp8":
        return fine_grained_fp8(qc, manifest)  # type: ignore[arg-type]
    if method == "torchao" or torchao_metadata(metadata):
        return torchao(metadata, manifest)
    if qc is not None:
        return Form(str(method), str(method), None, (), (),
                    f"quantization {method!r} (quant_method in config.json)")  # fmt: skip
    return None
