"""The core model every layer shares, torch-free and I/O-free.

:mod:`~ckptools.core.manifest` (what a checkpoint holds: tensors as boxes of byte ranges),
:mod:`~ckptools.core.geometry` (boxes, runs of contiguous elements, the one exact tiling check),
:mod:`~ckptools.core.keys` (the model part and its FQNs), :mod:`~ckptools.core.dtypes`,
:mod:`~ckptools.core.sizes` and :mod:`~ckptools.core.crc32` (CRC-32 arithmetic).
"""
