"""Ctrl-C: one line saying how to go on, and exit code 130 (128 + SIGINT, as shells report it).

Two phases. Until a command starts (Python importing click, the commands, later torch inside a
command's body) nothing has been written, so the handler :func:`leave_on_interrupt` installs
prints the line and ends the process at once: an interrupt there used to print a
``KeyboardInterrupt`` traceback from whichever import it hit. While a command runs, Python's
own handler raises ``KeyboardInterrupt`` so that every ``finally`` and ``except BaseException``
in the library runs (a staging directory removed, or kept with its resume journal), and the
group (:mod:`ckptools.cli.main`) turns it into the same line (:func:`message`).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from ckptools.cli.exit_codes import EXIT_INTERRUPTED

#: what an interrupt that kept nothing tells the user: every ckpt command is safe to re-run
#: (writers commit atomically, so an interrupted one left no output that looks complete)
NOTHING_KEPT = "interrupted; nothing was committed: run the same command again"


def message(interrupt: BaseException) -> str:
    """The line for ``interrupt``: the way to resume that the library noted on it (a resumable
    conversion keeps the files written so far, :func:`ckptools.io.staging.discard`), else
    :data:`NOTHING_KEPT`."""
    notes = getattr(interrupt, "__notes__", None) or []
    return f"interrupted; {notes[-1]}" if notes else NOTHING_KEPT


def _leave(signum: int, frame: FrameType | None) -> None:
    os.write(2, f"{NOTHING_KEPT}\n".encode())
    os._exit(EXIT_INTERRUPTED)


def leave_on_interrupt() -> None:
    """Make Ctrl-C end this process at once with :data:`NOTHING_KEPT` (for the import phase of
    the ``ckpt`` entry point; :func:`raising` takes over while a command runs)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _leave)


@contextmanager
def raising() -> Iterator[None]:
    """Within the block Ctrl-C raises ``KeyboardInterrupt`` (so the library cleans up); after
    it the handler in force before comes back, or, when that was :func:`leave_on_interrupt`'s,
    Ctrl-C is ignored while the finished command's process exits."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: Callable[[int, FrameType | None], Any] | int | None = signal.signal(
        signal.SIGINT, signal.default_int_handler
    )
    try:
        yield
    finally:
        if previous is _leave:
            # the command has finished (its output committed): an interrupt while the process
            # exits must not say that nothing was
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        elif previous is not None:  # None: a handler not set from Python (cannot be restored)
            signal.signal(signal.SIGINT, previous)
