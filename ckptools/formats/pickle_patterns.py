"""The regular expressions that let :mod:`ckptools.formats.pickle_scan` judge a pickle at C speed.

Two kinds: :func:`known_safe` clears a whole pickle that can neither share, hash nor grow the
memo (most of what a checkpoint holds), and :func:`records` recognises the batches of small
records that are the bulk of a DCP ``.metadata``, which the scan then steps over in one move.
Both are compiled on first use (tens of ms): ``ckpt --help`` and a small checkpoint never pay.
"""

from __future__ import annotations

import functools
import re

# --------------------------------------------------------------------------------------------------
# When the scan is needed
# --------------------------------------------------------------------------------------------------
#
# Most pickles a checkpoint holds need no scan: a ``torch.save`` of one tensor (a DCP item's
# ``data.pkl``, hundreds of thousands per reshard) has no memo GET, so nothing in it is shared,
# and no dict or set, so nothing is hashed. One regular expression proves that at C speed: it
# matches a pickle made only of opcodes that can neither share, hash, nor grow the memo past
# 2**16, with their arguments skipped exactly (strings up to 255 bytes; a longer one, or any
# other opcode, sends the pickle to :func:`.pickle_scan.scan`).


def _sized(ops: bytes, prefix: int) -> bytes:
    """One of ``ops`` followed by a ``prefix``-byte length and that many bytes (< 256)."""
    lengths = b"|".join(re.escape(n.to_bytes(prefix, "little")) + b".{%d}" % n for n in range(256))
    return b"[" + re.escape(ops) + b"](?:" + lengths + b")"


# Each alternative starts with its own opcode bytes, so the match splits the pickle into the
# same opcodes the unpickler reads. Left out: memo GETs and DUP (sharing), DICT, SETITEM(S),
# ADDITEMS and FROZENSET (hashing), PUT and LONG_BINPUT from 2**16 (memo size), INST, big ints
# and text arguments (rare, and scanned).
_UNSHARED_TOKENS = b"|".join(
    [
        rb"[N\x88\x89\)\]\}\x8f\x85\x86\x87t(Rb\x81\x9301Qaelo\x92\x94\x97\x98]",
        rb"[Kq\x82\x80].",
        rb"[M\x83]..",
        rb"[J\x84].{4}",
        rb"r..\x00\x00",
        rb"[G\x95].{8}",
        _sized(b"\x8cCU\x8a", 1),
        _sized(b"XBT", 4),
        rb"c[^\n]{1,512}\n[^\n]{1,512}\n",
    ]
)


@functools.cache
def _unshared() -> re.Pattern[bytes]:
    # compiled on first use (tens of ms): `ckpt --help` never needs it
    return re.compile(b"(?:" + _UNSHARED_TOKENS + rb")*+\.", re.DOTALL)


def known_safe(data: bytes) -> bool:
    """Whether ``data`` provably needs no :func:`.pickle_scan.scan`: a C-speed match (~1 µs for a
    DCP item's ``data.pkl``) shows it shares nothing through the memo and hashes nothing."""
    return _unshared().fullmatch(data) is not None


# --------------------------------------------------------------------------------------------------
# Batches of records, passed over at C speed
# --------------------------------------------------------------------------------------------------
#
# A DCP ``.metadata`` is millions of small records (per chunk a ``ChunkStorageMetadata``, a
# ``MetadataIndex`` and a ``_StorageInfo``), pickled 1,000 to a MARK ... APPENDS or SETITEMS
# batch; following each one's ~40 opcodes in Python cost as much as torch's whole load. A
# regular expression recognises a batch made only of such records (an object built by NEWOBJ
# from a memoised class and an empty tuple, its state a dict of at most 6 keys whose keys are
# strings or memo GETs and whose values are ints, strings, memo GETs or a ``torch.Size``-shaped
# REDUCE of a flat tuple of at most 8 small ints), and the scan steps over it in one move:
#
# * memo: such a batch only MEMOIZEs (no index of its choosing); the entries it adds are
#   counted exactly (:data:`_MEMO_RUNS`) so that later GETs name the same objects as in the
#   unpickler, and each weighs at most :data:`RECORD_WEIGHT` (a 1-tuple of a flat tuple);
# * hashing: the only keys hashed are the state dicts' (strings, or GETs of objects that weigh
#   at most the heaviest object made before, which must be at most :data:`RECORD_WEIGHT`) and
#   the records themselves (SETITEMS: hashed by identity); each key and its value take at least
#   3 bytes, so the batch hashes at most :data:`BULK_NODES_PER_BYTE` nodes per byte, which is
#   what it is charged; no int in it reaches 2**61 - 1 (LONG1 of at most 7 bytes);
# * tuples: at most 8 items.
#
# Anything else (a FRAME is allowed between any two opcodes) fails the match, and the batch is
# followed opcode by opcode as before. The scan of a 144 MiB ``.metadata`` (1.16M chunks) takes
# ~5 s of CPU, most of it the MEMOIZE count (:func:`_memo_runs_pattern`).

#: the most a record batch's memo entries weigh: a 1-tuple holding a tuple of 8 ints of up to
#: 7 bytes (each 1 + 7 // 4 nodes), as :func:`.pickle_scan._scan` counts them
RECORD_WEIGHT = 1 + 1 + 8 * 2
#: nodes charged per byte of a batch: a key of :data:`RECORD_WEIGHT` nodes hashed, and compared
#: once, per 3 bytes of key and value
BULK_NODES_PER_BYTE = 2 * RECORD_WEIGHT // 3
RECORD_START = {0x6A, 0x95}  # LONG_BINGET, FRAME (BINGET is checked with its EMPTY_TUPLE)

_GET_TOKEN = rb"(?:h.|j.{4})"
# ints below 2**55: BININT1/2, BININT, LONG1 of 1-7 bytes; None and the bools
_INT_TOKEN = rb"(?:K.|M..|J.{4}|\x8a(?:" + b"|".join(b"%c.{%d}" % (n, n) for n in range(1, 8))
_INT_TOKEN += rb")|N|\x88|\x89)"


def _record_pattern(frames: bool) -> bytes:
    """One record; with ``frames``, a FRAME allowed before any of its objects. A pickle's frames
    break at ~64 KB, between two records or inside one: a batch is matched as runs of records
    without frames (14x faster than allowing one before every object), a FRAME between two
    records stepped over, and only a record with one inside is matched allowing them."""
    f = rb"(?:\x95.{8})?" if frames else b""
    get, num, text = _GET_TOKEN, _INT_TOKEN, _sized(b"\x8c", 1)
    flat = (
        b"(?:" + f + b"(?:" + (f + num) + b"){1,3}" + f + rb"[\x85\x86\x87]" + f + rb"\x94"
        + b"|" + f + rb"\(" + b"(?:" + f + num + b"){4,8}" + f + rb"t" + f + rb"\x94"
        + b"|" + f + rb"\))"
    )  # fmt: skip
    size = f + get + flat + f + rb"\x85" + f + rb"\x94" + f + rb"R" + f + rb"\x94"
    key = b"(?:" + f + get + b"|" + f + text + f + rb"\x94)"
    value = b"(?:" + f + get + b"|" + f + num + b"|" + f + text + f + rb"\x94|" + size + b")"
    record = (
        f + get + f + rb"\)" + f + rb"\x81" + f + rb"\x94" + f + rb"\}" + f + rb"\x94" + f
        + rb"\(" + b"(?:" + key + value + b"){1,6}" + f + rb"u" + f + rb"b"
    )  # fmt: skip
    return record


def _memo_runs_pattern() -> bytes:
    """Every opcode a batch may hold but MEMOIZE (the one-byte ones first: the most frequent),
    as runs up to a MEMOIZE, or to the end."""
    other = b"|".join(
        [
            rb"[\)\x81\}\(ub\x85\x86\x87tRe\x88\x89N]",
            rb"h.",
            rb"K.",
            rb"M..",
            rb"J.{4}",
            rb"j.{4}",
            rb"\x8a(?:" + b"|".join(b"%c.{%d}" % (n, n) for n in range(1, 8)) + b")",
            _sized(b"\x8c", 1),
            rb"\x95.{8}",
        ]
    )
    return b"(?:" + other + rb")*+\x94|(?:" + other + rb")++\Z"


def batch_end(records: Patterns, data: bytes, i: int) -> int:
    """The end of the batch of records (one or more, then APPENDS or SETITEMS) that starts at
    ``i``, with a FRAME allowed before any object; 0 when none starts there."""
    runs, framed_record, _ = records
    at, found = i, False
    while True:
        end = runs.match(data, at).end()  # type: ignore[union-attr]  # `*+` always matches
        found = found or end > at
        op = data[end] if end < len(data) else -1
        if op == 0x65 or op == 0x75:  # APPENDS, SETITEMS
            return end + 1 if found else 0
        if op == 0x95:  # FRAME between two records (or before the first, or the end)
            at = end + 9
            continue
        m = framed_record.match(data, end)  # a record with a FRAME inside
        if m is None:
            return 0
        at, found = m.end(), True


Patterns = tuple[re.Pattern[bytes], re.Pattern[bytes], re.Pattern[bytes]]


@functools.cache
def records() -> Patterns:
    # compiled on first use (tens of ms), like _unshared
    return (
        re.compile(b"(?:" + _record_pattern(frames=False) + b")*+", re.DOTALL),
        re.compile(_record_pattern(frames=True), re.DOTALL),
        re.compile(_memo_runs_pattern(), re.DOTALL),
    )
