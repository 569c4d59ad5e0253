"""The executors that move bytes as plans say: kernel copies and positional I/O on a bounded
thread pool (:mod:`~ckptools.engine.runtime`), the safetensors executor
(:mod:`~ckptools.engine.executor`), the DCP writer (:mod:`~ckptools.engine.dcp_writer`,
:mod:`~ckptools.engine.crc_segments`), copies that check each source record's CRC-32 on the
way (:mod:`~ckptools.engine.checked_copy`), and reading tensors and objects
(:mod:`~ckptools.engine.reader`).
"""
