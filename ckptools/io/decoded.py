"""The items a reader decoded (:class:`DecodedFiles`): DCP items stored through a stream
transform (zstd), each decoded once, held in memory or in a private spool, and read from there
under a name of their own (:mod:`ckptools.io.readers`). The decoding itself is the engine's
(:func:`ckptools.engine.reader.decoded_item`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator

from ckptools.io import spool
from ckptools.io.tunables import decoded_item_memory, workers


class DecodedFiles:
    """Items a reader has decoded (stream transforms undone), each once. Each is known to the
    reader under a name of its own (:meth:`add`, :meth:`hold`), so every read of it (``read``,
    ``readinto``, ``crc32``, ``size``) goes to its decoded bytes instead of the checkpoint;
    nothing else outside the checkpoint is ever read. Thread-safe: :meth:`lock` serialises the
    decoding of one item, so threads meeting the same item wait for the first to decode it
    instead of decoding it again.

    Where they are:

    * in memory (:meth:`hold`, :meth:`view`): an item of at most
      :func:`~ckptools.io.tunables.decoded_item_memory` bytes; the items held and being
      decoded take at most ``workers`` (:func:`~ckptools.io.tunables.workers`) times that,
      the least recently used let go (:meth:`room`). Its bytes are written from there (no
      spool file, no second copy). An item let go and asked for again is decoded again, by
      the ``redo`` it was held with.
    * in a file of a private spool directory (:func:`ckptools.io.spool.make_spool_dir`, made
      at the first such item, removed at :meth:`close`): a larger item, read (and copied in
      the kernel, ``fileno``) from there.
    """

    def __init__(self, memory: int | None = None) -> None:
        self._dir: str | None = None
        self._paths: dict[str, str] = {}  # name -> local path
        self._items: dict[tuple[str, int], tuple[str, int]] = {}  # (file, offset) -> name, size
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._lock = threading.Lock()
        #: bytes of items held in memory at most (a single item is held whatever its size)
        self.memory = memory if memory is not None else workers() * decoded_item_memory()
        self._held: OrderedDict[str, memoryview] = OrderedDict()  # least recently used first
        self._held_bytes = 0
        self._decoding = 0  # bytes of room made for items being decoded into memory
        self._redo: dict[str, tuple[tuple[str, int], Callable[[], memoryview]]] = {}

    def __contains__(self, rel: str) -> bool:
        return rel in self._paths or rel in self._redo

    def path(self, rel: str) -> str:
        """The local spool file holding the decoded item named ``rel``."""
        return self._paths[rel]

    def in_memory(self, rel: str) -> bool:
        """Whether ``rel`` is an item decoded in memory (held now, or decoded again when read)."""
        return rel in self._redo

    def view(self, rel: str) -> memoryview | None:
        """The decoded bytes of ``rel`` when it is an item decoded in memory (decoded again if
        it was let go), else None. The view stays valid while the caller holds it."""
        with self._lock:
            found = self._held.get(rel)
            if found is not None:
                self._held.move_to_end(rel)
                return found
            entry = self._redo.get(rel)
        if entry is None:
            return None
        key, redo = entry
        with self.lock(key):
            with self._lock:
                found = self._held.get(rel)
            if found is None:
                with self.room(self._items[key][1]):
                    found = redo()
                    self._keep(rel, found)
            return found

    def lock(self, key: tuple[str, int]) -> threading.Lock:
        """The lock held while the item at ``key`` (its file, its offset) is decoded."""
        with self._lock:
            return self._locks.setdefault(key, threading.Lock())

    def get(self, key: tuple[str, int]) -> tuple[str, int] | None:
        """``(name, decoded size)`` of the item at ``key`` when decoded already."""
        return self._items.get(key)

    def new_file(self) -> str:
        """A fresh path in the spool directory (made now if needed) for an item to decode."""
        with self._lock:
            if self._dir is None:
                self._dir = spool.make_spool_dir(prefix="ckptools-decoded-")
            return os.path.join(self._dir, f"{len(self._locks)}-{threading.get_ident()}.item")

    @staticmethod
    def _name(key: tuple[str, int]) -> str:
        file, offset = key
        return f"{file}[decoded item at byte {offset}]"

    def add(self, key: tuple[str, int], local: str, size: int) -> str:
        """Make the decoded item at ``key``, written to ``local``, readable under a name of its
        own (which error messages show: the stored file and the item's offset); its name."""
        rel = self._name(key)
        with self._lock:
            self._paths[rel] = local
            self._items[key] = (rel, size)
        return rel

    def hold(self, key: tuple[str, int], data: memoryview, redo: Callable[[], memoryview]) -> str:
        """Make the decoded item at ``key``, whose bytes are ``data`` (in memory), readable
        under a name of its own (as :meth:`add`); ``redo`` decodes it again once let go."""
        rel = self._name(key)
        with self._lock:
            self._redo[rel] = (key, redo)
            self._items[key] = (rel, len(data))
        self._keep(rel, data)
        return rel

    def _keep(self, rel: str, data: memoryview) -> None:
        """Hold ``data`` as ``rel``'s bytes (room made for them by :meth:`room`)."""
        with self._lock:
            self._held[rel] = data
            self._held_bytes += len(data)

    @contextlib.contextmanager
    def room(self, size: int) -> Iterator[None]:
        """Room for an item of up to ``size`` bytes to be decoded into memory: the least
        recently used items held let go until those held and those being decoded fit in
        :attr:`memory` (their memory is freed once no reader holds a view of them)."""
        with self._lock:
            while self._held and self._held_bytes + self._decoding + size > self.memory:
                self._held_bytes -= len(self._held.popitem(last=False)[1])
            self._decoding += size
        try:
            yield
        finally:
            with self._lock:
                self._decoding -= size

    def close(self) -> None:
        """Remove the spool directory, let go of the items held in memory, forget them all."""
        with self._lock:
            if self._dir is not None:
                spool.remove_spool_dir(self._dir)
            self._dir = None
            self._paths.clear()
            self._items.clear()
            self._held.clear()
            self._held_bytes = 0
            self._redo.clear()
