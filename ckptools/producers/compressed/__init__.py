"""Compressed and quantized checkpoints: what ckptools knows about items and weights stored in a
form other than the plain tensor (compressed streams, quantized blocks, training wrappers), and
how each is read back as the plain tensor or refused by name.

Plain data only (the registry imports this module to learn what the family declares); the
readers are the modules named below, imported when a checkpoint needs them.
"""

# -- zstd DCP items (torch's ``FileSystemWriter(path, _extensions=[ZStandard()])``) ----------

#: stream transforms this family decodes: a DCP transform's name -> the module below
#: ``ckptools.producers`` whose ``decoder(version)`` undoes it (imported when an item stored
#: with it is met; :func:`ckptools.formats.stream_transforms.admit`)
DECODERS = (("stream.zstd", "compressed.zstd"),)
