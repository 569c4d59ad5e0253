"""Reading ``CKPTOOLS_*`` overrides of tunables: argument > environment variable > default.

Each tunable is a named constant with its unit and reason in the module that uses it; this is
the one place that parses the environment, so every override fails the same clear way.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ckptools.errors import UsageError

#: threads for I/O in consolidate, reshard, verify, checksum and push
WORKERS_ENV = "CKPTOOLS_WORKERS"
#: Default I/O threads: the copies are kernel copies and positional reads that release the GIL,
#: so a few threads keep a local NVMe disk or an object store's connections busy; more than 4
#: measured no gain on the 2 GB benchmarks and only multiplied the copy buffers.
DEFAULT_WORKERS = min(4, os.cpu_count() or 1)

#: bytes of copy buffers over all threads of a conversion
MEMORY_BUDGET_ENV = "CKPTOOLS_MEMORY_BUDGET"
#: 256 MiB keeps the process (interpreter, the manifest and, when casting, torch) under 512 MiB
#: peak RSS at any model size: conversions stream, so this bounds the resident set.
DEFAULT_MEMORY_BUDGET_BYTES = 256 * 2**20


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError("expected a positive integer")
    return value


def _from_env(name: str, default: int, parse: Callable[[str], int]) -> int:
    """``parse`` of environment variable ``name``, or ``default`` when unset/empty; a value it
    refuses is a :class:`UsageError` naming the variable."""
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        return parse(raw)
    except UsageError as e:
        raise UsageError(f"{name}={raw!r}: {e}") from e


def env_int(name: str, default: int) -> int:
    """The positive integer in environment variable ``name``, or ``default`` when unset/empty.

    Raises:
        UsageError: the variable holds anything but a positive integer.
    """
    return _from_env(name, default, _positive_int)


def env_size(name: str, default: int) -> int:
    """The byte size in environment variable ``name`` (``"50GB"``, ``"300KB"``, ``1024``), or
    ``default`` when unset/empty.

    Raises:
        UsageError: the variable holds anything but a positive size.
    """
    from ckptools.core.sizes import parse_size

    return _from_env(name, default, parse_size)


def workers(value: int | None = None) -> int:
    """I/O threads: ``value`` > ``CKPTOOLS_WORKERS`` > :data:`DEFAULT_WORKERS`.

    Raises:
        UsageError: ``value`` or the variable is not a positive integer.
    """
    if value is None:
        return env_int(WORKERS_ENV, DEFAULT_WORKERS)
    if value < 1:
        raise UsageError(f"workers={value}: expected a positive integer")
    return value


def memory_budget(value: str | int | None = None) -> int:
    """Bytes of copy buffers: ``value`` > ``CKPTOOLS_MEMORY_BUDGET`` > the 256 MiB default.

    Raises:
        UsageError: ``value`` or the variable is not a positive size.
    """
    if value is None or value == "":
        return env_size(MEMORY_BUDGET_ENV, DEFAULT_MEMORY_BUDGET_BYTES)
    from ckptools.core.sizes import parse_size

    return parse_size(value)


#: most bytes of one decoded item held in memory (see decoded_item_memory)
DECODED_ITEM_MEMORY_ENV = "CKPTOOLS_DECODED_ITEM_MEMORY"
#: An item decoded into memory (:class:`ckptools.io.readers.DecodedFiles`) is written out from
#: there, with no spool file between (which doubled the bytes the disk took: 4.2x of the floor
#: on the 1 GiB zstd bench). 64 MiB of data and its archive framing: torch's ZStandard writer
#: makes one item per tensor shard, and FSDP shards of large models are 1-64 MiB. A larger item
#: is decoded into the spool instead.
DEFAULT_DECODED_ITEM_MEMORY_BYTES = 64 * 2**20 + 64 * 1024


def decoded_item_memory() -> int:
    """Most bytes of one item decoded in memory: ``CKPTOOLS_DECODED_ITEM_MEMORY`` or
    :data:`DEFAULT_DECODED_ITEM_MEMORY_BYTES`.

    Raises:
        UsageError: the variable is not a positive size.
    """
    return env_size(DECODED_ITEM_MEMORY_ENV, DEFAULT_DECODED_ITEM_MEMORY_BYTES)


#: floor of the objects one pickle from a checkpoint may decode into (see pickle_objects)
MAX_PICKLE_OBJECTS_ENV = "CKPTOOLS_MAX_PICKLE_OBJECTS"
#: A pickle of a few KB can describe a huge value: shared references make a DAG that any walk
#: expands as a tree, and a constructor can be asked for gigabytes. The budget counts the
#: objects a constructor copies and the nodes a walk visits. Measured: a DCP ``.metadata`` of
#: 64k chunks (7.7 MiB) holds 3.8M opcodes, under 0.5 objects per byte; a ``torch.save`` state
#: dict's ``data.pkl`` under 0.2. 1M objects, or 16 per pickle byte, is 30x that headroom and
#: still bounds a hostile 1 MB pickle to about 5 s of walking.
DEFAULT_MAX_PICKLE_OBJECTS = 1_000_000
PICKLE_OBJECTS_PER_BYTE = 16

#: deepest nesting of containers a decoded pickle may have
MAX_PICKLE_DEPTH_ENV = "CKPTOOLS_MAX_PICKLE_DEPTH"
#: State dicts nest under 10 levels (optimizer state, trainer loops); the walks that flatten
#: them recurse once per level, so 100 keeps them far from Python's recursion limit (1000).
DEFAULT_MAX_PICKLE_DEPTH = 100

#: most ranks a reshard or shard may plan for
MAX_WORLD_SIZE_ENV = "CKPTOOLS_MAX_WORLD_SIZE"
#: Each target rank is a file and planning is O(tensors x world size): 131,072 is 8x the
#: largest published FSDP job (16,384 GPUs) and plans in seconds; a typo such as 10**9 is
#: refused at once instead of allocating per-rank lists for 35 s until memory runs out.
DEFAULT_MAX_WORLD_SIZE = 1 << 17


def pickle_objects(pickle_bytes: int) -> int:
    """Objects a pickle of ``pickle_bytes`` may decode into:
    max(``CKPTOOLS_MAX_PICKLE_OBJECTS`` or 1M, 16 x ``pickle_bytes``).

    Raises:
        UsageError: the variable is not a positive integer.
    """
    floor = env_int(MAX_PICKLE_OBJECTS_ENV, DEFAULT_MAX_PICKLE_OBJECTS)
    return max(floor, PICKLE_OBJECTS_PER_BYTE * pickle_bytes)


def pickle_depth() -> int:
    """Deepest nesting a decoded pickle may have: ``CKPTOOLS_MAX_PICKLE_DEPTH`` or 100.

    Raises:
        UsageError: the variable is not a positive integer.
    """
    return env_int(MAX_PICKLE_DEPTH_ENV, DEFAULT_MAX_PICKLE_DEPTH)


def max_world_size() -> int:
    """Most ranks a conversion may plan for: ``CKPTOOLS_MAX_WORLD_SIZE`` or 131,072.

    Raises:
        UsageError: the variable is not a positive integer.
    """
    return env_int(MAX_WORLD_SIZE_ENV, DEFAULT_MAX_WORLD_SIZE)


#: ``0`` skips the free-space check before a conversion writes (see space_check)
SPACE_CHECK_ENV = "CKPTOOLS_SPACE_CHECK"
_FLAG_WORDS = {"1": True, "true": True, "yes": True, "on": True,
               "0": False, "false": False, "no": False, "off": False}  # fmt: skip


def space_check() -> bool:
    """Whether writers compare the output's size with the free space before writing a byte:
    ``CKPTOOLS_SPACE_CHECK`` (``0``/``1``), on by default. Off is for filesystems whose
    ``statvfs`` reports less than they will take (some network, FUSE and compressing ones).

    Raises:
        UsageError: the variable is set to anything but a yes/no word.
    """
    raw = os.environ.get(SPACE_CHECK_ENV, "").strip().lower()
    if not raw:
        return True
    if raw not in _FLAG_WORDS:
        raise UsageError(f"{SPACE_CHECK_ENV}={raw!r}: expected 0 or 1")
    return _FLAG_WORDS[raw]


#: Most nodes hashing one dict key or set element from a pickle may visit (a tuple's hash walks
#: it as a tree, shared references once per path, and recurses in C once per level). A state
#: dict's keys are strings, ints and short tuples; 10,000 nodes is far above them, and keeps
#: hashing one key well under a millisecond and its recursion far from the C stack's end (a
#: key nested a million tuples deep crashes the interpreter). Not settable: no checkpoint needs
#: more.
PICKLE_KEY_NODES = 10_000
