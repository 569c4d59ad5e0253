"""The one progress bar (bytes, throughput and ETA, through tqdm) and a status line for slow
steps with no bytes to count (:func:`status`).

Off when the caller asks for quiet, when stderr is not a terminal (logs and pipes get no carriage
returns), or when ``CKPTOOLS_NO_PROGRESS`` is set to anything but ``""``/``"0"``. Safe to update
from several threads.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from types import TracebackType
from typing import Any

NO_PROGRESS_ENV = "CKPTOOLS_NO_PROGRESS"


def enabled(quiet: bool) -> bool:
    """Whether a bar should be shown (see module docstring)."""
    if quiet or os.environ.get(NO_PROGRESS_ENV, "") not in ("", "0"):
        return False
    return sys.stderr.isatty()


class ByteProgress:
    """A bytes progress bar, or a no-op when disabled.

    Example:
        >>> with ByteProgress(1024, "copy", quiet=True) as bar:
        ...     bar.update(512)
    """

    def __init__(self, total: int, desc: str, *, quiet: bool = False) -> None:
        self._lock = threading.Lock()
        self._bar: Any = None
        if enabled(quiet):
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False
            )

    def update(self, nbytes: int) -> None:
        if self._bar is not None and nbytes:
            with self._lock:
                self._bar.update(nbytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def status(text: str, *, quiet: bool = False) -> contextlib.AbstractContextManager[None]:
    """One status line on stderr while a slow step with no bytes to count runs (``text``, e.g.
    "reading transformers' conversion rules"): on a terminal it is erased when the step ends;
    elsewhere (a log) it is one plain line. Nothing with ``quiet`` or ``CKPTOOLS_NO_PROGRESS``.

    Example:
        >>> with status("deriving", quiet=True):
        ...     pass
    """
    return _Status(text, quiet)


class _Status:
    def __init__(self, text: str, quiet: bool) -> None:
        self.text = text
        self.shown = not quiet and os.environ.get(NO_PROGRESS_ENV, "") in ("", "0")
        self.tty = self.shown and sys.stderr.isatty()

    def __enter__(self) -> None:
        if self.shown:
            sys.stderr.write(self.text + ("" if self.tty else "\n"))
            sys.stderr.flush()

    def __exit__(self, *exc: object) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[K")  # erase the line: what follows starts clean
            sys.stderr.flush()
