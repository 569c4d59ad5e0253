"""Where checkpoint bytes live: the one facade the rest of ckptools reads storage through.

``from ckptools.io import storage; storage.join(...)`` keeps working while the ideas live in
their own modules:

* :mod:`ckptools.io.paths`: path primitives (:func:`join`, :func:`exists`, :func:`isdir`,
  :func:`listdir`, :func:`file_sizes`, :func:`walk_files`, :func:`read_bytes`,
  :func:`write_bytes`, :func:`remove_tree`, ...), local paths through ``os``, URLs through fsspec;
* :mod:`ckptools.io.readers`: :func:`open_reader`, :class:`LocalReader` and
  :class:`RemoteReader`, positional reads whose errors name the file;
* :mod:`ckptools.io.options`: :func:`storage_options`, the scoped credentials and endpoints that
  every public function taking ``storage_options=`` enters;
* :mod:`ckptools.io.durable`: the local fsyncs an atomic commit relies on;
* :mod:`ckptools.io.containment`: :func:`contained`, the rule that a path a checkpoint names stays
  inside it (the rules about an output directory are :mod:`ckptools.io.out_rules`').

How an output is staged and committed (local rename, object-store marker) is
:mod:`ckptools.io.staging`'s.
"""

from __future__ import annotations

from ckptools.io.containment import contained, outside_reason, shown
from ckptools.io.options import (
    StorageOptions,
    accepts_storage_options,
    options_for,
    parse_storage_options,
    pop_storage_options,
    push_storage_options,
    storage_options,
)
from ckptools.io.paths import (
    basename,
    dirname,
    exists,
    file_sizes,
    filesystem,
    get_file,
    is_url,
    isdir,
    isfile,
    join,
    lexists,
    listdir,
    local_path,
    makedirs,
    protocol_of,
    put_file,
    read_bytes,
    read_range,
    remote_failure,
    remove,
    remove_tree,
    size,
    walk_files,
    write_atomic,
    write_bytes,
)
from ckptools.io.readers import (
    CRC_WINDOW_BYTES,
    DEFAULT_REMOTE_PART_BYTES,
    LOCAL_ARCHIVE_TAIL_BYTES,
    REMOTE_ARCHIVE_TAIL_BYTES,
    REMOTE_PART_BYTES_ENV,
    LocalReader,
    Reader,
    RemoteReader,
    open_reader,
)
from ckptools.io.small_files import SMALL_FILE_LIMIT, TRACKER_LIMIT, read_bounded, read_json

__all__ = [
    "CRC_WINDOW_BYTES",
    "DEFAULT_REMOTE_PART_BYTES",
    "LOCAL_ARCHIVE_TAIL_BYTES",
    "REMOTE_ARCHIVE_TAIL_BYTES",
    "REMOTE_PART_BYTES_ENV",
    "SMALL_FILE_LIMIT",
    "TRACKER_LIMIT",
    "LocalReader",
    "Reader",
    "RemoteReader",
    "StorageOptions",
    "accepts_storage_options",
    "basename",
    "contained",
    "dirname",
    "exists",
    "file_sizes",
    "filesystem",
    "get_file",
    "is_url",
    "isdir",
    "isfile",
    "join",
    "lexists",
    "listdir",
    "local_path",
    "makedirs",
    "open_reader",
    "options_for",
    "outside_reason",
    "parse_storage_options",
    "pop_storage_options",
    "protocol_of",
    "push_storage_options",
    "put_file",
    "read_bounded",
    "read_bytes",
    "read_json",
    "read_range",
    "remote_failure",
    "remove",
    "remove_tree",
    "shown",
    "size",
    "storage_options",
    "walk_files",
    "write_atomic",
    "write_bytes",
]
