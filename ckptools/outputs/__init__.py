"""The one output protocol every writer runs (:mod:`ckptools.outputs.protocol`)."""
