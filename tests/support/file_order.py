"""The longest test files first, so that pytest-xdist's workers finish together.

``make test`` deals whole files to three workers (``--dist loadfile``). By default xdist orders
the files by their number of tests, most first: the many quick unit files went out first and the
few long distributed ones (torchrun, rank pools, Megatron) last, so a worker could still be
running one long file while the others had nothing left, with a core idle. Dealt longest first
(the rule of thumb for scheduling jobs on parallel machines), the short files fill the gaps at
the end instead.

A file's length is the wall time its tests took in the last session that ran it (setup, call and
teardown, as the workers reported them), kept in pytest's cache (``.pytest_cache``); a file never
timed counts by its directory (``tests/distributed`` 30 s, ``tests/integration`` 5 s, other 1 s).
The Makefile passes ``--no-loadscope-reorder`` so that xdist keeps this order. The controller
reads the cache once and hands what it read to every worker (``workerinput``): the workers must
collect the same order, and another session finishing meanwhile may rewrite the cache.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

#: the pytest cache entry: {file: seconds}
CACHE_KEY = "ckptools/file-seconds"
_DEFAULT_SECONDS = {"tests/distributed/": 30.0, "tests/integration/": 5.0}
_timed: defaultdict[str, float] = defaultdict(float)


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _default_seconds(path: str) -> float:
    return next((s for prefix, s in _DEFAULT_SECONDS.items() if path.startswith(prefix)), 1.0)


_KNOWN = pytest.StashKey[dict[str, float]]()


@pytest.hookimpl(trylast=True)  # after the cache provider's
def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        known = config.workerinput.get(CACHE_KEY, {})
    else:
        cache = getattr(config, "cache", None)  # none with -p no:cacheprovider
        known = (cache.get(CACHE_KEY, {}) if cache is not None else {}) or {}
    config.stash[_KNOWN] = known


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist's controller, for each worker it starts: the times it read."""
    node.workerinput[CACHE_KEY] = node.config.stash[_KNOWN]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    known = config.stash.get(_KNOWN, {})
    seconds = {f: known.get(f, _default_seconds(f)) for f in {_file(i.nodeid) for i in items}}
    # longest first; ties by name, so that every worker sorts alike
    rank = {f: n for n, f in enumerate(sorted(seconds, key=lambda f: (-seconds[f], f)))}
    items.sort(key=lambda item: rank[_file(item.nodeid)])  # stable: a file's own order kept


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _timed[_file(report.nodeid)] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    cache = getattr(config, "cache", None)
    if hasattr(config, "workerinput") or cache is None or not _timed:
        return  # a worker (its reports reach the controller too), or no cache to keep them in
    known = cache.get(CACHE_KEY, {}) or {}
    cache.set(CACHE_KEY, {**known, **{f: round(s, 2) for f, s in _timed.items()}})
