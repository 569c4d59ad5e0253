"""The ``ckpt`` command line: a thin translator from options to library calls.

click lives only in this package. Each command parses its options, calls one library function
and prints the result with :func:`ckptools.cli.render.emit` (human text, or one JSON object with
``--json``). Option names are the library's keyword arguments, so a command passes the options
it does not use itself straight through (``**options``), never restating a default; options
several commands take are defined once in :mod:`ckptools.cli.options`, exit codes in
:mod:`ckptools.cli.exit_codes`. Commands import heavy modules inside their bodies so that
``ckpt --help`` stays fast and never imports torch.
"""

from __future__ import annotations

from ckptools.cli.main import main

__all__ = ["main"]
