"""The ``ckpt`` command line: a thin translator from options to library calls.

click lives only in this package. Commands import heavy modules inside their bodies so that
``ckpt --help`` stays fast and never imports torch.
"""

from __future__ import annotations

from ckptools.cli.main import main

__all__ = ["main"]
