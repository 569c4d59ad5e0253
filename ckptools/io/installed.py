"""The version of an installed distribution, without importing ``importlib.metadata`` where the
installer's directory names it.

``importlib.metadata.version`` imports the ``email`` package to parse the distribution's
``METADATA`` and walks every ``sys.path`` entry: ~60-90 ms of a consolidate's start-up on this
project's machine, paid for a string that only keys a cache. A wheel install names its
``<name>-<version>.dist-info`` directory beside the package (the wheel spec), so finding the
package and that directory tells the version in well under a millisecond; anything else
(an editable or egg install, two ``.dist-info`` directories) asks ``importlib.metadata``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re


@functools.cache
def version(dist: str, module: str | None = None) -> str | None:
    """The installed version of distribution ``dist`` (importable as ``module``, by default
    ``dist``), or None when it is not installed; what ``importlib.metadata.version`` says."""
    found = _from_dist_info(dist, module or dist)
    if found is not None:
        return found
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _from_dist_info(dist: str, module: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    site = os.path.dirname(os.path.abspath(next(iter(spec.submodule_search_locations))))
    want = _normal(dist)
    try:
        found = [
            stem.rpartition("-")
            for stem in (
                n[: -len(".dist-info")] for n in os.listdir(site) if n.endswith(".dist-info")
            )
        ]
    except OSError:
        return None
    versions = [v for name, _, v in found if name and v and _normal(name) == want]
    return versions[0] if len(versions) == 1 else None


def _normal(name: str) -> str:
    """A project name as the wheel spec escapes it in a ``.dist-info`` directory's name."""
    return re.sub(r"[-_.]+", "_", name).lower()
