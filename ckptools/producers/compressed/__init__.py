"""Compressed and quantized checkpoints: what ckptools knows about tensors stored in a form other
than the plain tensor (compressed streams, quantized blocks with their scales, training
wrappers), and how each is read back as the plain tensor, bit-exactly, or refused by name.

Plain data only (the registry imports it; see docs/adding-a-producer.md): each format declares
what the house must know without its readers, in its own block below.
"""

from __future__ import annotations

# --- quantized Hugging Face model directories (quantized, forms, dequantize) ------------------
# FP8 weights beside their scales: compressed-tensors' "float-quantized" (llmcompressor's
# FP8_BLOCK / FP8 / FP8_DYNAMIC: ``weight`` + ``weight_scale``), DeepSeek-V3's and transformers'
# FineGrainedFP8 (``weight`` + ``weight_scale_inv``, ``quant_method: fp8``) and torchao's
# flattened tensor subclasses (``_weight_qdata`` + ``_weight_scale``, ``_type`` in the header).
# A plain copy keeps them as stored; ``consolidate --dtype`` writes the plain model,
# ``dtype(f32(q) * f32(scale))`` per block; any other quantized form is refused by name.

#: the layout of a model directory whose config.json has a ``quantization_config`` (or whose
#: safetensors header names torchao's tensor subclasses): before "safetensors" (30)
LAYOUTS = (("quantized_safetensors", "quantized", 28),)
#: ``inspect``'s facts of a quantized model (``quantized`` in ``--json``)
FACTS = ("compressed.quantized_facts",)
HELP = (
    ("reads", ("FP8-quantized HF model",
               "ckpt consolidate fp8_model hf_model --dtype bfloat16")),
    ("consolidate --dtype",
     "A quantized model (compressed-tensors FP8, DeepSeek's FP8 blocks, torchao Float8) is "
     "dequantized: weight = dtype(f32(q) * f32(scale)) per block, scales and "
     "quantization_config dropped; other quantized forms are refused by name. Without --dtype "
     "it is copied as stored."),
)  # fmt: skip
