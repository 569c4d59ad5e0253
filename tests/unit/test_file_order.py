"""tests/support/file_order.py: files dealt longest first, by the last session's times."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.support import file_order


class _Cache:
    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def get(self, key: str, default: Any) -> Any:
        return self.data.get(key, default)

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value


def _items(*nodeids: str) -> list[Any]:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def _configured(**attributes: Any) -> Any:
    config = SimpleNamespace(stash=pytest.Stash(), **attributes)
    file_order.pytest_configure(config)  # type: ignore[arg-type]
    return config


def test_longest_file_first_each_file_in_its_own_order() -> None:
    known = {
        "tests/unit/test_slow.py": 40.0,
        "tests/distributed/test_quick.py": 2.0,
    }
    config = _configured(cache=_Cache({file_order.CACHE_KEY: known}))
    items = _items(
        "tests/unit/test_a.py::test_1",  # never timed: 1 s
        "tests/distributed/test_quick.py::test_1",
        "tests/unit/test_slow.py::test_2",
        "tests/unit/test_slow.py::test_1",
        "tests/integration/test_new.py::test_1",  # never timed: 5 s
        "tests/distributed/test_quick.py::test_0",
        "tests/distributed/test_new.py::test_1",  # never timed: 30 s
    )
    file_order.pytest_collection_modifyitems(config, items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        "tests/unit/test_slow.py::test_2",
        "tests/unit/test_slow.py::test_1",
        "tests/distributed/test_new.py::test_1",
        "tests/integration/test_new.py::test_1",
        "tests/distributed/test_quick.py::test_1",
        "tests/distributed/test_quick.py::test_0",
        "tests/unit/test_a.py::test_1",
    ]


def test_without_a_cache_the_directories_decide() -> None:
    items = _items("tests/unit/test_a.py::t", "tests/integration/test_b.py::t",
                   "tests/distributed/test_c.py::t")  # fmt: skip
    file_order.pytest_collection_modifyitems(_configured(cache=None), items)
    assert [i.nodeid.split("/")[1] for i in items] == ["distributed", "integration", "unit"]


def test_workers_order_by_what_the_controller_read_not_by_their_own_reading() -> None:
    """Another session may rewrite the cache while the workers collect: each worker gets the
    controller's reading (xdist's workerinput), so all of them collect the same order."""
    controller = _configured(cache=_Cache({file_order.CACHE_KEY: {"tests/unit/b.py": 9.0}}))
    node = SimpleNamespace(config=controller, workerinput={})
    file_order.pytest_configure_node(node)
    rewritten = _Cache({file_order.CACHE_KEY: {"tests/unit/a.py": 99.0}})
    worker = _configured(cache=rewritten, workerinput=node.workerinput)
    items = _items("tests/unit/a.py::t", "tests/unit/b.py::t")
    file_order.pytest_collection_modifyitems(worker, items)
    assert [i.nodeid for i in items] == ["tests/unit/b.py::t", "tests/unit/a.py::t"]


def test_the_controller_records_each_files_time_and_keeps_the_others(monkeypatch: Any) -> None:
    monkeypatch.setattr(file_order, "_timed", type(file_order._timed)(float))
    for nodeid, seconds in [("tests/unit/t.py::a", 1.5), ("tests/unit/t.py::b", 2.0),
                            ("tests/distributed/d.py::a", 7.25)]:  # fmt: skip
        file_order.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds))  # type: ignore[arg-type]
    cache = _Cache({file_order.CACHE_KEY: {"tests/unit/t.py": 9.0, "tests/unit/old.py": 3.0}})
    worker = SimpleNamespace(config=SimpleNamespace(cache=cache, workerinput={}))
    file_order.pytest_sessionfinish(worker)  # type: ignore[arg-type]
    assert cache.data[file_order.CACHE_KEY]["tests/unit/t.py"] == 9.0  # a worker records nothing
    controller = SimpleNamespace(config=SimpleNamespace(cache=cache))
    file_order.pytest_sessionfinish(controller)  # type: ignore[arg-type]
    assert cache.data[file_order.CACHE_KEY] == {
        "tests/unit/t.py": 3.5,
        "tests/distributed/d.py": 7.25,
        "tests/unit/old.py": 3.0,
    }
