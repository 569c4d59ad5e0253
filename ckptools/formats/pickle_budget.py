"""What one pickle may decode into: the budget :mod:`ckptools.formats.safe_pickle` charges.

The C unpickler makes at most one object per opcode, so the work past the pickle's own length
comes from constructors that copy (charged per object, and a size they are asked for may not
exceed the bytes of the pickle) and from walks that expand shared references into a tree. The
budget of the pickle a thread is decoding is :func:`current`, set by :func:`decoding`; its
limits are tunables (:mod:`ckptools.io.tunables`) and a breach is a one-line
:class:`~ckptools.errors.DecodingLimitError` naming the one to raise.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ckptools.errors import DecodingLimitError
from ckptools.formats import pickle_scan
from ckptools.io import tunables

UNSET: Any = object()  # an argument the pickle did not pass


class DecodeBudget:
    """What one pickle may decode into, charged by the constructors that copy and by the walk
    over the result: at most :func:`ckptools.io.tunables.pickle_objects` objects, nesting at most
    :func:`ckptools.io.tunables.pickle_depth` deep, and no size asked of a constructor larger than
    the pickle itself (a legitimate pickle only copies bytes it contains)."""

    def __init__(self, source: str, pickle_bytes: int) -> None:
        self.source = source
        self.pickle_bytes = pickle_bytes
        self.used = 0

    # Read from the environment only when needed: a reshard decodes a pickle per chunk.
    @functools.cached_property
    def objects(self) -> int:
        return tunables.pickle_objects(self.pickle_bytes)

    @functools.cached_property
    def depth(self) -> int:
        return tunables.pickle_depth()

    def charge(self, objects: int) -> None:
        self.used += objects
        if self.used > self.objects:
            raise DecodingLimitError(
                f"{self.source}: refusing to decode: the pickle ({self.pickle_bytes} bytes) "
                f"expands to more than {self.objects} objects (shared references walked as a "
                f"tree, or copies); if the checkpoint is trusted, raise "
                f"{tunables.MAX_PICKLE_OBJECTS_ENV}",
                tunable=tunables.MAX_PICKLE_OBJECTS_ENV,
                path=self.source,
            )

    def too_deep(self) -> DecodingLimitError:
        return DecodingLimitError(
            f"{self.source}: refusing to decode: values nest more than {self.depth} levels "
            f"deep; if the checkpoint is trusted, raise {tunables.MAX_PICKLE_DEPTH_ENV}",
            tunable=tunables.MAX_PICKLE_DEPTH_ENV,
            path=self.source,
        )

    def size(self, requested: int, what: str) -> None:
        if requested > self.pickle_bytes:
            raise DecodingLimitError(
                f"{self.source}: refusing to decode: the pickle asks {what} for {requested} "
                f"bytes, more than its own {self.pickle_bytes} bytes could hold",
                tunable=None,
                path=self.source,
            )
        self.charge(requested)


_current = threading.local()  # the budget of the pickle this thread is decoding


def current() -> DecodeBudget:
    """The budget of the pickle this thread is decoding (inside :func:`decoding`)."""
    budget: DecodeBudget = _current.budget
    return budget


@contextmanager
def decoding(budget: DecodeBudget) -> Iterator[DecodeBudget]:
    """Make ``budget`` this thread's :func:`current` while a pickle decodes (nesting restores
    the outer one: a pickle's object may hold another pickle)."""
    outer = getattr(_current, "budget", None)
    _current.budget = budget
    try:
        yield budget
    finally:
        _current.budget = outer


def copying(make: Callable[..., Any], what: str, *, pairs: bool = False) -> Callable[..., Any]:
    """An allowlisted constructor that copies its argument, charging what it made: a memoised
    list fed to it again and again would otherwise grow memory with the square of the pickle.
    ``pairs``: it takes (key, value) pairs, whose keys it hashes."""

    # Fixed arity (bytearray takes the most: source, encoding, errors), so a memoised tuple of
    # many arguments fails at once instead of being copied per call.
    def build(source: Any = UNSET, encoding: Any = UNSET, errors: Any = UNSET) -> Any:
        args = tuple(a for a in (source, encoding, errors) if a is not UNSET)
        budget = current()
        if args and isinstance(args[0], int) and not isinstance(args[0], bool):
            budget.size(args[0], what)  # bytearray(n): n zero bytes the pickle never held
        elif args and hasattr(args[0], "__len__"):
            budget.charge(len(args[0]))  # the work of the copy, charged before it is done
            if make is not bytearray:  # the elements (pairs' keys) are hashed: bounded first
                pickle_scan.charge_keys(args[0], budget, pairs=pairs)
        out = make(*args)
        budget.charge(len(out))
        return out

    build.__qualname__ = build.__name__ = what
    return build
