"""A pass over a pickle's opcodes that bounds what CPython's C unpickler does inside ``load()``.

Three things happen in the C unpickler before any ckptools code sees the value, so neither the
allowlist nor the object budget can stop them:

* **Memo size**: ``PUT``/``LONG_BINPUT`` with index ``i`` resizes the memo array to ``2 * i``
  pointers and zeroes it: 8 bytes of pickle naming index 10**8 take 1.5 GiB.
* **Hashing**: ``SETITEM(S)``, ``DICT``, ``ADDITEMS`` and ``FROZENSET`` hash their keys, and a
  tuple's hash walks it as a tree: ``t = (t, t)`` repeated 40 times with memo ``GET`` s (under
  1 KB) hashes 2**40 nodes, a comparison between two such keys as many; a key nested a million
  tuples deep overflows the C stack.
* **Big ints**: an int's hash reads all its digits, every time.

:func:`scan` follows the unpickler's stack with one number per object, the nodes hashing it
visits (shared references counted once per path; lists, dicts and sets count 1 since hashing
them fails at once, records 1 since they hash by identity). It refuses a memo index beyond the
pickle's own length, a hashed key of more than :data:`ckptools.io.tunables.PICKLE_KEY_NODES` nodes,
hashing more nodes in all than the object budget, and a tuple larger than the budget, each with
one line naming the file. It does not judge values (the allowlist and the budget do): a pickle
it cannot follow (unknown opcode, stack underflow, truncated argument) is left to the
unpickler, which stops at the same place.

Cost: one Python step per opcode (a 7.7 MiB DCP ``.metadata`` of 3.8M opcodes takes about as
long as the C unpickler's load), except over batches of small records, the bulk of a DCP
``.metadata``, which a regular expression admits and the scan steps over in one move
(:func:`_skip_records`: 2.5x faster on 145k chunks). Callers skip the scan where a C-speed match
proves it unneeded (:func:`.pickle_patterns.known_safe`: no memo GET, no hashing), as for a
DCP item's ``data.pkl``. :func:`check` does both, and leaves the regular expressions uncompiled
(~28 ms) until a process has scanned 64 KiB of pickles without them.
"""

from __future__ import annotations

import bisect
from typing import Any, Protocol

from ckptools.errors import CkptError, DecodingLimitError
from ckptools.formats import pickle_patterns
from ckptools.formats.pickle_patterns import RECORD_START, RECORD_WEIGHT
from ckptools.io import tunables


class Budget(Protocol):
    """What the scan needs of :class:`ckptools.formats.pickle_budget.DecodeBudget`."""

    source: str
    pickle_bytes: int

    @property
    def objects(self) -> int: ...

    def charge(self, objects: int) -> None: ...


# Opcodes that push one object whose hash costs one node (None, bools, small ints, floats,
# empty containers, extension-registry globals), by the bytes of their argument.
_PUSH_ARG = [-1] * 256
for _op, _n in {
    b"N": 0, b"\x88": 0, b"\x89": 0, b"}": 0, b"]": 0, b")": 0, b"\x8f": 0, b"\x97": 0,
    b"K": 1, b"M": 2, b"J": 4, b"G": 8, b"\x82": 1, b"\x83": 2, b"\x84": 4,
}.items():  # fmt: skip
    _PUSH_ARG[_op[0]] = _n
# str and bytes (they keep their hash), by the bytes of their length prefix
_SIZED = {b"\x8c"[0]: 1, b"C"[0]: 1, b"U"[0]: 1, b"X"[0]: 4, b"B"[0]: 4, b"T"[0]: 4,
          b"\x8d"[0]: 8, b"\x8e"[0]: 8, b"\x96"[0]: 8}  # fmt: skip
_TEXT_PUSH = {b"F"[0], b"S"[0], b"V"[0], b"P"[0]}  # a line of text, one object


class _Stop(Exception):
    """The pickle stops making sense here; the unpickler will refuse it at the same opcode."""


class _Rescan(Exception):
    """A memo index chosen by the pickle (PUT) after record batches were passed over: the memo's
    count is then followed exactly only by scanning every opcode (no DCP metadata does this)."""


class _Memo(dict[int, int]):
    """Weights of the unpickler's memo entries, by index. The entries of record batches
    (:func:`_skip_records`, all :data:`.pickle_patterns.RECORD_WEIGHT`) are kept as index
    ranges, not one key each (15M of them at 1.16M chunks); ``ranged`` counts them, so
    ``len(memo) + ranged`` is the unpickler's count, the index its next MEMOIZE takes."""

    def __init__(self) -> None:
        super().__init__()
        self.ranged = 0
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add_range(self, first: int, count: int) -> None:
        self._starts.append(first)
        self._ends.append(first + count)
        self.ranged += count

    def __missing__(self, index: int) -> int:
        k = bisect.bisect_right(self._starts, index) - 1
        if k >= 0 and index < self._ends[k]:
            return RECORD_WEIGHT
        raise KeyError(index)


#: Pickle bytes a process follows opcode by opcode before it compiles the regular expressions
#: of :func:`.pickle_patterns.known_safe` and :func:`_skip_records`: a small checkpoint's one
#: ``.metadata`` (2.5 KB for 10 tensors: 0.7 ms) never pays for them, and a run of many
#: pickles pays at most about twice what compiling first would have cost (issue 27, goal 5).
#: Measured on this project's 2-core VM (CPU ms, fresh process; issue 38): a 1.1 GB Mixtral
#: run's 96 KB ``.metadata`` 10 exactly against 32-41 with the patterns (compiling them is
#: most of it); a 208 KB DCP ``.metadata`` of 1,000 small tensors 37-43 against 52-70. The
#: exact scan wins below ~300 KB, so 64 KiB (the first setting) made mid-sized runs pay
#: ~30 ms of start-up for nothing.
_EXACT_BYTES_BEFORE_PATTERNS = 256 * 1024
_exact_bytes = 0  # followed so far without the patterns (threads may race: only a heuristic)


def check(data: bytes, budget: Budget) -> None:
    """Refuse, before the unpickler runs, what :func:`scan` refuses in a pickle that
    :func:`.pickle_patterns.known_safe` does not clear: the check every pickle ckptools
    decodes goes through.

    Raises:
        DecodingLimitError: a limit would be exceeded (the message names it).
    """
    global _exact_bytes
    if _exact_bytes + len(data) > _EXACT_BYTES_BEFORE_PATTERNS:
        _exact_bytes = _EXACT_BYTES_BEFORE_PATTERNS  # compiled now: used from here on
        if not pickle_patterns.known_safe(data):
            scan(data, budget)
        return
    _exact_bytes += len(data)
    try:
        # every opcode followed: the record path's hashing charge (12 nodes a byte) is an upper
        # bound of what this counts, so nothing it would let through is let through here
        scan(data, budget, bulk=False)
    except DecodingLimitError:
        # The scan is stricter than known_safe in one place: a LONG_BINPUT index past the
        # pickle's end but below 2**16 (at most 1 MiB of memo), which known_safe lets through
        # unscanned. No other refusal can befall a pickle known_safe clears (it neither shares
        # nor hashes, so no weight exceeds its length and nothing was charged to ``budget``).
        if not pickle_patterns.known_safe(data):
            raise


def scan(data: bytes, budget: Budget, *, bulk: bool = True) -> None:
    """Follow ``data``'s opcodes as the C unpickler would and refuse, before it runs, a memo
    index it would have to allocate, or keys whose hashing would not end. ``bulk``: pass over
    batches of DCP records at C speed (:func:`_skip_records`; False: every opcode, exactly).

    Raises:
        DecodingLimitError: a limit would be exceeded (the message names it).
    """
    try:
        try:
            _scan(data, budget, bulk=bulk)
        except _Rescan:
            _scan(data, budget, bulk=False)
    except CkptError:
        raise
    except (_Stop, IndexError, KeyError, ValueError):
        # an underflow, a memo entry read before it was written, an argument past the end or
        # not a number: the unpickler stops at the same opcode with its own error
        return


def _memo_too_big(budget: Budget, index: int) -> DecodingLimitError:
    return DecodingLimitError(
        f"{budget.source}: refusing to decode: the pickle ({budget.pickle_bytes} bytes) stores "
        f"at memo index {index}, which would allocate {16 * index} bytes; a pickle numbers its "
        "memo from 0, one entry per object it holds",
        tunable=None,
        path=budget.source,
    )


def _key_too_big(budget: Budget) -> DecodingLimitError:
    return DecodingLimitError(
        f"{budget.source}: refusing to decode: a dict key or set element would hash more than "
        f"{tunables.PICKLE_KEY_NODES} nodes (shared references walked as a tree, or nested that "
        "deep) or holds an integer of 2**61 - 1 or more (such keys can be made to share one "
        "hash, which makes decoding quadratic); a checkpoint's keys are names and small ids",
        tunable=None,
        path=budget.source,
    )


#: ints at least this large hash modulo it (``sys.hash_info.modulus``): ``k`` and
#: ``k + n * (2**61 - 1)`` share a hash, so a dict of many such keys costs the unpickler time
#: quadratic in their number
_HASH_MODULUS = 2**61 - 1
#: the weight :func:`_scan` gives such an int: more than any key may have, so using one as a key
#: (or inside one) is refused, while holding it as a value costs no more than a 40 KB int
_BIG_INT = tunables.PICKLE_KEY_NODES + 1


def _line(data: bytes, i: int) -> tuple[bytes, int]:
    end = data.index(b"\n", i)
    return data[i:end], end + 1


class _Hashing:
    """Nodes hashed so far: each key's hash, and one comparison with an equal key."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.cap = tunables.PICKLE_KEY_NODES
        self.total = 0

    def keys(self, weights: list[int]) -> None:
        for w in weights:
            if w > self.cap:
                raise _key_too_big(self.budget)
            self.total += 2 * w
        if self.total > self.budget.objects:
            self.budget.charge(self.budget.objects + 1)  # raises, naming the tunable


def _scan(data: bytes, budget: Budget, *, bulk: bool = True) -> tuple[int, int]:
    """The scan: the memo's count at STOP, bytes of record batches passed over (tests)."""
    # One branch per opcode, the frequent first (a DCP .metadata's); ``continue`` ends each.
    stack: list[int] = []  # per object on the unpickler's stack: nodes hashing it visits
    marks: list[int] = []
    memo, hashing, limit = _Memo(), _Hashing(budget), budget.objects
    push, pop, push_arg = stack.append, stack.pop, _PUSH_ARG
    records = pickle_patterns.records() if bulk else None
    # peak: the heaviest object made so far (no weight on the stack or in the memo is more)
    peak, skipped, i = 1, 0, 0
    while True:
        op = data[i]
        i += 1
        if op == 0x94:  # MEMOIZE: the next index, as the unpickler counts its entries
            memo[len(memo) + memo.ranged] = stack[-1]
            continue
        n = push_arg[op]
        if n >= 0:
            push(1)
            i += n
            continue
        if op == 0x68:  # BINGET
            push(memo[data[i]])
            i += 1
            continue
        if op == 0x6A:  # LONG_BINGET
            push(memo[int.from_bytes(data[i : i + 4], "little")])
            i += 4
            continue
        if op == 0x28 or op == 0x62:  # MARK, BUILD: a batch of records may start after them
            if op == 0x28:
                marks.append(len(stack))
            else:
                pop()
                stack[-1]
            if (
                records is not None
                and marks
                and peak <= RECORD_WEIGHT
                and ((data[i] == 0x68 and data[i + 2] == 0x29) or data[i] in RECORD_START)
            ):
                end = _skip_records(records, data, i, stack, marks, memo, hashing)
                skipped += end - i if end else 0
                i = end or i
            continue
        if op == 0x71:  # BINPUT (protocols 2 and 3; an index below 256 allocates nothing)
            if memo.ranged:
                raise _Rescan
            memo[data[i]] = stack[-1]
            i += 1
            continue
        if op == 0x86 or op == 0x85:  # TUPLE2, TUPLE1: one node plus its items'
            w = 1 + (pop() + stack[-1] if op == 0x86 else stack[-1])
            peak = max(peak, w)
            if w > limit:
                budget.charge(limit + 1)  # raises, naming the tunable
            stack[-1] = w
            continue
        if op == 0x87 or op == 0x74:  # TUPLE3, TUPLE
            k = 3 if op == 0x87 else len(stack) - marks.pop()
            if k > len(stack):
                raise _Stop
            w = 1 + sum(stack[len(stack) - k :])
            del stack[len(stack) - k :]
            peak = max(peak, w)
            if w > limit:
                budget.charge(limit + 1)  # raises, naming the tunable
            push(w)
            continue
        if op == 0x52:  # REDUCE: a callable may return its argument (torch.Size does)
            w = pop()
            stack[-1] = w
            continue
        if op == 0x81 or op == 0x93:  # NEWOBJ (an instance hashes by identity), STACK_GLOBAL
            pop()
            stack[-1] = 1
            continue
        if op == 0x61:  # APPEND
            pop()
            stack[-1]
            continue
        if op == 0x75 or op == 0x64 or op == 0x90 or op == 0x91:
            # SETITEMS, DICT (keys at even offsets), ADDITEMS, FROZENSET: hashed
            at = marks.pop()
            hashing.keys(stack[at::2] if op == 0x75 or op == 0x64 else stack[at:])
            del stack[at:]
            if op == 0x64 or op == 0x91:
                push(1)  # unhashable, or (a frozenset) keeping its hash
            continue
        if op in _SIZED:
            k = _SIZED[op]
            if i + k > len(data):
                raise _Stop
            i += k + int.from_bytes(data[i : i + k], "little")
            push(1)
            continue
        if op == 0x2E:  # STOP
            return len(memo) + memo.ranged, skipped
        i = _rare(op, data, i, stack, marks, memo, hashing)
        peak = max(peak, stack[-1]) if stack else peak  # an int's weight, an OBJ's


def _int_weight(op: int, data: bytes, i: int) -> tuple[int, int]:
    """The weight of the int an INT, LONG, LONG1 or LONG4 at ``i`` pushes, and the next offset:
    its hash reads every digit, every time, and one of 2**61 - 1 or more may share its hash
    with others (:data:`_BIG_INT`)."""
    if op == 0x8A or op == 0x8B:
        k = 1 if op == 0x8A else 4
        if i + k > len(data):
            raise _Stop
        size = int.from_bytes(data[i : i + k], "little")
        big = (
            size > 8
            or (  # read only when it is at most 8 bytes
                abs(int.from_bytes(data[i + k : i + k + size], "little", signed=True))
                >= _HASH_MODULUS
            )
        )
        i += k + size
    else:
        text, i = _line(data, i)
        size = len(text)
        digits = text.rstrip(b"L").lstrip(b"+-")
        big = len(digits) > 19 or (digits.isdigit() and int(digits) >= _HASH_MODULUS)
    return (_BIG_INT if big else 1 + size // 4), i


def _rare(
    op: int,
    data: bytes,
    i: int,
    stack: list[int],
    marks: list[int],
    memo: dict[int, int],
    hashing: _Hashing,
) -> int:
    """The opcodes a checkpoint's pickles seldom use; returns the offset of the next one."""
    budget = hashing.budget
    push, pop = stack.append, stack.pop
    if op == 0x73:  # SETITEM
        pop()
        hashing.keys([pop()])
        stack[-1]
        return i
    if op == 0x71 or op == 0x72 or op == 0x70:  # BINPUT, LONG_BINPUT, PUT
        if op == 0x71:
            idx = data[i]
            i += 1
        elif op == 0x72:
            if i + 4 > len(data):
                raise _Stop
            idx = int.from_bytes(data[i : i + 4], "little")
            i += 4
        else:
            text, i = _line(data, i)
            idx = int(text)
        if idx > len(data):  # the C memo would be resized to 2 * idx pointers
            raise _memo_too_big(budget, idx)
        if idx < 0:
            raise _Stop
        if isinstance(memo, _Memo) and memo.ranged:
            raise _Rescan
        memo[idx] = stack[-1]
        return i
    if op == 0x65 or op == 0x31:  # APPENDS, POP_MARK
        del stack[marks.pop() :]
        return i
    if op == 0x6C:  # LIST
        del stack[marks.pop() :]
        push(1)
        return i
    if op == 0x95 or op == 0x80:  # FRAME, PROTO
        i += 8 if op == 0x95 else 1
        return i
    if op == 0x30:  # POP: the mark, when one is on top (as the unpickler does)
        if marks and marks[-1] == len(stack):
            marks.pop()
        else:
            pop()
        return i
    if op == 0x32:  # DUP
        push(stack[-1])
        return i
    if op == 0x67:  # GET
        text, i = _line(data, i)
        push(memo[int(text)])
        return i
    if op == 0x8A or op == 0x8B or op == 0x49 or op == 0x4C:  # LONG1, LONG4, INT, LONG
        w, i = _int_weight(op, data, i)
        push(w)
        return i
    if op in _TEXT_PUSH:
        _, i = _line(data, i)
        push(1)
        return i
    if op == 0x51:  # BINPERSID: a storage reference of strings and ints
        stack[-1] = 1
        return i
    if op == 0x92:  # NEWOBJ_EX
        del stack[-2:]
        stack[-1] = 1
        return i
    if op == 0x63 or op == 0x69:  # GLOBAL, INST: module and name lines
        _, i = _line(data, i)
        _, i = _line(data, i)
        if op == 0x63:
            push(1)
            return i
    if op == 0x6F or op == 0x69:  # OBJ, INST: a call, bounded by its arguments
        at = marks.pop()
        w = 1 + sum(stack[at:])
        del stack[at:]
        push(min(w, budget.objects + 1))
        return i
    if op == 0x98:  # READONLY_BUFFER
        stack[-1]
        return i
    raise _Stop  # not an opcode: the unpickler refuses it here


def key_nodes(value: object, budget: Budget) -> int:
    """Nodes that hashing ``value`` visits (tuples as trees, an int per 4 bytes of digits), for
    a constructor about to hash it; refuses, as :func:`scan` does, more than
    :data:`~ckptools.io.tunables.PICKLE_KEY_NODES`."""
    cap = tunables.PICKLE_KEY_NODES
    nodes = 0
    todo = [value]
    while todo:
        v = todo.pop()
        nodes += 1
        if type(v) is tuple:
            todo.extend(v)
        elif isinstance(v, int):
            if abs(v) >= _HASH_MODULUS:
                raise _key_too_big(budget)
            nodes += v.bit_length() // 32
        if nodes > cap:
            raise _key_too_big(budget)
    return nodes


def charge_keys(items: Any, budget: Budget, *, pairs: bool) -> None:
    """Bound the hashing a set, frozenset or OrderedDict constructor is about to do on the
    elements of ``items`` (the keys of its pairs), as :func:`scan` bounds the
    unpickler's own: a shared tuple as an element would hash as a tree."""
    if isinstance(items, dict):
        return  # its keys were hashed, within bounds, when it was built
    # only tuples and ints hash in more than one step; the types are gathered at C speed, so a
    # memoised list of 100k Nones copied again and again costs no Python loop per copy
    if pairs:
        items = [i[0] for i in items if isinstance(i, tuple | list) and i]
    if not set(map(type, items)) & _WEIGHED_KEY_TYPES:
        return
    for key in items:
        if type(key) is tuple or isinstance(key, int):
            budget.charge(2 * key_nodes(key, budget))


_WEIGHED_KEY_TYPES = {tuple, int, bool}


def _skip_records(
    records: pickle_patterns.Patterns,
    data: bytes,
    i: int,
    stack: list[int],
    marks: list[int],
    memo: _Memo,
    hashing: _Hashing,
) -> int:
    """Where the batch of records that starts at ``i`` (after its MARK, or after a record read
    one by one) ends, with its memo entries, hashing and stack accounted for; 0 when what
    starts there is not such a batch."""
    end = pickle_patterns.batch_end(records, data, i)
    if not end:
        return 0
    memo_runs = records[2]
    # MEMOIZEs in the batch: the runs up to each, and the tail after the last (a batch ends in
    # BUILD and APPENDS or SETITEMS). Whole runs from the batch's start follow its opcodes
    # exactly; a byte left over would mean they did not, and the batch is scanned instead.
    rest, runs = memo_runs.subn(b"", memoryview(data)[i:end])
    if rest or not runs:
        return 0
    memo.add_range(len(memo) + memo.ranged, runs - 1)
    hashing.total += pickle_patterns.BULK_NODES_PER_BYTE * (end - i)
    if hashing.total > hashing.budget.objects:
        hashing.budget.charge(hashing.budget.objects + 1)  # raises, naming the tunable
    # the batch ends appending or setting items down to the mark: what was pushed since
    # (records read one by one before the batch) is hashed as keys by a SETITEMS, as the scan
    # of that opcode does
    at = marks.pop()
    if data[end - 1] == 0x75:
        hashing.keys(stack[at::2])
    del stack[at:]
    return end
