"""Building millions of small objects: the cyclic garbage collector paused meanwhile.

A 405B checkpoint at 1,024 ranks is 1.16M chunks: parsing its metadata builds millions of small
acyclic objects (records, tuples) and planning a reshard of it millions more (2M items at 2,048
ranks). CPython's collector, triggered by allocations, then walks every live object again and
again: 25 s -> 6 s for parsing 878k chunks, 32.6 -> 28.3 s of CPU for a 1,024 -> 2,048-rank
reshard plan. None of these objects form cycles; whatever garbage cycles the paused stretch
leaves are collected once the collector is back.

Pausing alone only defers the walk: everything made meanwhile is still in the youngest
generation, and the first collection after walks it all (1.9 s after parsing 1.16M chunks, 1.1 s
after planning 2M items), then each older one again. The ``ckpt`` process, which exists for one
command, says so with :func:`own_process`: a paused stretch then ends with ``gc.freeze()``, which
moves what it made out of every later collection (acyclic objects are still freed when their
last reference goes). A library call in someone else's process never freezes: a cycle of theirs
frozen with them would never be collected.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")


_owned = False  # whether this process exists for one ``ckpt`` command (:func:`own_process`)


def own_process() -> None:
    """Declare the process ``ckpt``'s own (its entry point does): a paused stretch ends by
    freezing what it made (see the module)."""
    global _owned
    _owned = True


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The collector off within the block (as it was after, also when nested); in ``ckpt``'s
    own process, what the block made is then frozen out of later collections."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _owned:
            gc.freeze()
        if enabled:
            gc.enable()


def without_gc(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` run under :func:`gc_paused`."""

    @functools.wraps(fn)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with gc_paused():
            return fn(*args, **kwargs)

    return paused
