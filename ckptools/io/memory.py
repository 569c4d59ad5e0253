"""Memory a read is about to fill: fault its pages in with one call instead of one trap each.

Memory that was allocated and never written (``torch.empty``, a model's ``to_empty``) has no
pages yet: the first write to each 4 KiB page traps into the kernel, which finds and zeroes a
page and returns. A read into such memory pays that trap once per page, and for a read from the
page cache the traps cost more than the copy (2 GB: ~500,000 traps). ``madvise`` with
``MADV_POPULATE_WRITE`` (Linux 5.14+) asks the kernel to fault a whole range in one system call;
the pages are still zeroed, but the per-page trap and return are gone. Measured on this project's
dev machine, 1 GiB read from the page cache with ``preadv``: 0.74 s into fresh memory, 0.39 s
after :func:`populate`, 0.22 s into memory already touched (median of 7, same run).

It is a hint: where the kernel, the platform or the range does not allow it, nothing happens and
the read faults its pages as before. Memory that already has its pages costs a walk of the page
tables (microseconds per MiB).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

#: ``MADV_POPULATE_WRITE`` from ``<linux/mman.h>``
_MADV_POPULATE_WRITE = 23
_PAGE = 4096
#: smaller ranges fault few pages: the system call would cost more than it saves
MIN_BYTES = 1 << 20

_madvise: Any = None
_usable = sys.platform.startswith("linux")


def _function() -> Any:
    global _madvise, _usable
    if _madvise is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            madvise = libc.madvise
        except (OSError, AttributeError):
            _usable = False
            return None
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        madvise.restype = ctypes.c_int
        _madvise = madvise
    return _madvise


def populate(address: int, nbytes: int) -> bool:
    """Fault in the whole pages inside ``[address, address + nbytes)`` for writing.

    Returns whether the kernel did; False (and never again tried in this process) where
    ``MADV_POPULATE_WRITE`` is unknown (Linux < 5.14, other systems). Ranges under
    :data:`MIN_BYTES` are left alone.
    """
    if not _usable or nbytes < MIN_BYTES:
        return False
    madvise = _function()
    if madvise is None:
        return False
    start = -(-address // _PAGE) * _PAGE
    end = (address + nbytes) // _PAGE * _PAGE
    if end <= start:
        return False
    if madvise(start, end - start, _MADV_POPULATE_WRITE) == 0:
        return True
    _disable(ctypes.get_errno())
    return False


def _disable(errno_value: int) -> None:
    """After EINVAL (the kernel does not know the advice) there is no point asking again; other
    errors (ENOMEM under pressure, EFAULT for an odd mapping) concern one range only."""
    global _usable
    if errno_value == 22:  # EINVAL
        _usable = False
