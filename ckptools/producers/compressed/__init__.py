"""Compressed and quantized checkpoints: what training and quantization libraries store in
place of plain tensors (compressed items, tensor subclasses, quantized weights with scales),
read as the plain tensors they stand for, bit-exactly, or refused by name.

Plain data only (the registry imports it; see docs/adding-a-producer.md): each format declares
what the house must know without its readers, in its own block below.
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
FACTS = ("compressed.float8_training",)
#: ``ckpt --help``'s row (cli/options.producers_say): reshard writes plain items out of them
HELP = (
    ("reads", ("torchao float8 training DCP", "ckpt reshard f8_ckpt plain_ckpt --world-size 8")),
)

# --- zstd DCP items (torch's ``FileSystemWriter(path, _extensions=[ZStandard()])``) ---------

#: stream transforms this family decodes: a DCP transform's name -> the module below
#: ``ckptools.producers`` whose ``decoder(version)`` undoes it (imported when an item stored
#: with it is met; :func:`ckptools.formats.stream_transforms.admit`)
DECODERS = (("stream.zstd", "compressed.zstd"),)
