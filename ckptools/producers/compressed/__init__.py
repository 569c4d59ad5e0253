"""Compressed and quantized checkpoints: what ckptools knows about tensors stored in a form other
than the plain tensor (compressed streams, quantized blocks with their scales, training
wrappers), and how each is read back as the plain tensor, bit-exactly, or refused by name.

Plain data only (the registry imports it; see docs/adding-a-producer.md): each format declares
what the house must know without its readers, in its own block below; a block adds to a
declaration an earlier one made (``FACTS``, ``HELP``).
"""

from __future__ import annotations

# --- torchao float8 training wrappers in DCP items (float8_training) -------------------------
# torchao's ``convert_to_float8_training`` with ``enable_fsdp_float8_all_gather=True`` keeps each
# Linear weight as a tensor subclass holding the high-precision weight in ``_tensor``; DCP
# pickles it as ``_rebuild_from_type_v2(_rebuild_wrapper_subclass, cls, ..., {"_tensor": ...})``.
# Read as that plain tensor (torchao 0.18 has only the dynamic-scaling wrapper); anything else
# of torchao (a Float8TrainingTensor with its scale, a quantized tensor) stays refused by name.

#: (class, attribute holding its plain tensor): read as that tensor (formats.safe_pickle.admit)
PICKLE_WRAPPERS = (("torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor", "_tensor"),)
#: the wrapper's own state beside its tensor (gemm configs, NamedTuples): data, then dropped
PICKLE_RECORDS = (
    "torchao.float8.float8_training_tensor.LinearMMConfig",
    "torchao.float8.float8_training_tensor.ScaledMMConfig",
)
#: ``inspect``'s facts of them (``float8_training`` in ``--json``)
FACTS: tuple[str, ...] = ("compressed.float8_training",)
#: ``ckpt --help``'s row (cli/options.producers_say): reshard writes plain items out of them
HELP: tuple[tuple[str, object], ...] = (
    ("reads", ("torchao float8 training DCP", "ckpt reshard f8_ckpt plain_ckpt --world-size 8")),
)

# --- zstd DCP items (torch's ``FileSystemWriter(path, _extensions=[ZStandard()])``) ---------

#: stream transforms this family decodes: a DCP transform's name -> the module below
#: ``ckptools.producers`` whose ``decoder(version)`` undoes it (imported when an item stored
#: with it is met; :func:`ckptools.formats.stream_transforms.admit`)
DECODERS = (("stream.zstd", "compressed.zstd"),)
HELP = (*HELP, ("reads", ("zstd-compressed DCP", "ckpt consolidate zstd_ckpt hf_model")))

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
FACTS = (*FACTS, "compressed.quantized_facts")
HELP = (
    *HELP,
    ("reads", ("FP8-quantized HF model",
               "ckpt consolidate fp8_model hf_model --dtype bfloat16")),
    ("consolidate --dtype",
     "A quantized model (compressed-tensors FP8, DeepSeek's FP8 blocks, torchao Float8) is "
     "dequantized: weight = dtype(f32(q) * f32(scale)) per block, scales and "
     "quantization_config dropped; other quantized forms are refused by name. Without --dtype "
     "it is copied as stored."),
)  # fmt: skip
