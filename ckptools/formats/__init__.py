"""File formats read and written without torch and without running checkpoint code: the
``torch.save`` zip archive, the allowlisted unpickler, and DCP's ``.metadata`` pickle.
Layouts (:mod:`ckptools.layouts`) combine these into manifests.
"""
