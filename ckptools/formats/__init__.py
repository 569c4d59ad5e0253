"""File formats read and written without torch and without running checkpoint code: the
``torch.save`` zip archive, the allowlisted unpickler, DCP's ``.metadata`` pickle, and the
safetensors header (read and validated by the library's own rules, and written).
Layouts (:mod:`ckptools.producers`) combine these into manifests.
"""
