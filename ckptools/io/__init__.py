"""Where bytes live and how outputs are committed: local paths and fsspec URLs behind one
facade (:mod:`~ckptools.io.storage`), readers, durable writes, staging strategies (local rename,
object-store marker), resumable-conversion journals and progress bars. Knows nothing of any
checkpoint format.
"""
