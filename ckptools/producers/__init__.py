"""On-disk layouts, one module each, imported when detection first tries one of their layouts.

Wrapper layouts (which hold DCP directories inside) are tried before the plain formats, so the
outer directory a user has is recognised as what it is (:data:`ckptools.producers.base._MODULES`
lists them in that order).
"""

from __future__ import annotations

from ckptools.producers.base import Layout, detect, layouts, read_manifest

__all__ = ["Layout", "detect", "layouts", "read_manifest"]
