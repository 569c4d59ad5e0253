"""The small files a checkpoint holds beside its data (a ``config.json``, an index, a marker, a
tracker, a YAML of the run), read whole with a bound.

Nothing a checkpoint holds is trusted, its sizes included: a 3 GiB ``config.json`` beside a
DCP would otherwise be read into memory whole (and parsed) before anything looked at it. Each
reader here states the most bytes it reads; a larger file is refused in one line naming it,
after one ``stat`` (or one HEAD on an object store), before a byte is read.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ckptools.errors import CorruptCheckpointError
from ckptools.io.paths import filesystem, is_url, local_path

#: the most bytes of one small file read whole: far above any real config, index or marker
#: (a 405B model's safetensors index is ~100 KiB, the largest tokenizer.json ~40 MiB)
SMALL_FILE_LIMIT = 64 << 20
#: a tracker file (a run's record of its latest save: an iteration number or a tag)
TRACKER_LIMIT = 4 << 10


def read_bounded(path: str, limit: int = SMALL_FILE_LIMIT, *, what: str = "file") -> bytes:
    """The whole file ``path``, which may hold at most ``limit`` bytes (``what`` it is names
    it in the refusal).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CorruptCheckpointError: the file is larger than ``limit``.
    """
    if not is_url(path):
        with open(local_path(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(limit + 1) if size <= limit else b""
            size = max(size, len(data))
    else:
        fs, inner = filesystem(path)
        size = int(fs.size(inner))
        data = bytes(fs.cat_file(inner)) if size <= limit else b""
    if size > limit:
        raise CorruptCheckpointError(
            f"{path}: {size:,} bytes, more than ckptools reads of a {what} ({limit:,}): not read",
            path=path,
        )
    return data


def read_json(path: str, limit: int = SMALL_FILE_LIMIT, *, what: str = "JSON file") -> Any:
    """The JSON value of the file ``path`` (at most ``limit`` bytes: :func:`read_bounded`).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CorruptCheckpointError: too large, or not JSON (nesting too deep for the parser
            included).
    """
    raw = read_bounded(path, limit, what=what)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        reason = "nested too deep" if isinstance(e, RecursionError) else str(e)
        raise CorruptCheckpointError(f"{path}: not a {what} ({reason})", path=path) from e
