"""Budgets on untrusted input: the unpickler's copies and walks counted, sizes capped by the pickle,
depth capped; the world size a conversion plans for bounded."""

from __future__ import annotations

import pickle
from collections import OrderedDict
from typing import Any

import pytest

from ckptools import tunables
from ckptools.errors import CorruptCheckpointError, DecodingLimitError, UsageError
from ckptools.formats import safe_pickle

ARCHIVE = safe_pickle.ARCHIVE_GLOBALS


def _loads(data: bytes, **kw: Any) -> Any:
    return safe_pickle.restricted_loads(data, ARCHIVE, source="x.pkl", **kw)


def _dag(levels: int) -> list[Any]:
    v: list[Any] = [1]
    for _ in range(levels):
        v = [v, v]
    return v


def _bytearray_of(size: int) -> bytes:
    raw = size.to_bytes((size.bit_length() + 8) // 8, "little", signed=True)
    return b"\x80\x02cbuiltins\nbytearray\n\x8a" + bytes([len(raw)]) + raw + b"\x85R."


@pytest.fixture(autouse=True)
def _defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (tunables.MAX_PICKLE_OBJECTS_ENV, tunables.MAX_PICKLE_DEPTH_ENV):
        monkeypatch.delenv(name, raising=False)


def test_tunables_defaults_and_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tunables.pickle_objects(10) == tunables.DEFAULT_MAX_PICKLE_OBJECTS
    assert tunables.pickle_objects(10**7) == tunables.PICKLE_OBJECTS_PER_BYTE * 10**7
    assert tunables.pickle_depth() == tunables.DEFAULT_MAX_PICKLE_DEPTH
    monkeypatch.setenv(tunables.MAX_PICKLE_OBJECTS_ENV, "5")
    monkeypatch.setenv(tunables.MAX_PICKLE_DEPTH_ENV, "7")
    monkeypatch.setenv(tunables.MAX_WORLD_SIZE_ENV, "9")
    assert tunables.pickle_objects(0) == 5
    assert tunables.pickle_depth() == 7
    assert tunables.max_world_size() == 9
    monkeypatch.setenv(tunables.MAX_WORLD_SIZE_ENV, "many")
    with pytest.raises(UsageError, match=tunables.MAX_WORLD_SIZE_ENV):
        tunables.max_world_size()


def test_bytearray_size_is_capped_by_the_pickle() -> None:
    with pytest.raises(DecodingLimitError, match=r"x\.pkl.*bytearray for 3221225472 bytes"):
        _loads(_bytearray_of(3 << 30))
    assert _loads(_bytearray_of(4)) == bytearray(4)  # within the pickle's own length
    assert _loads(pickle.dumps(bytearray(b"abc"), protocol=2)) == bytearray(b"abc")


def test_copies_are_charged(monkeypatch: pytest.MonkeyPatch) -> None:
    # set(list) rebuilt from the memo: each copy costs the pickle 5 bytes, the reader len(list)
    data = b"\x80\x02cbuiltins\nset\nq\x00](" + b"K\x01" * 1000 + b"eq\x01("
    data += b"h\x00h\x01\x85R" * 2000 + b"l."
    with pytest.raises(DecodingLimitError, match=tunables.MAX_PICKLE_OBJECTS_ENV) as e:
        _loads(data)
    assert e.value.tunable == tunables.MAX_PICKLE_OBJECTS_ENV and e.value.path == "x.pkl"
    monkeypatch.setenv(tunables.MAX_PICKLE_OBJECTS_ENV, "10000000")
    assert len(_loads(data)) == 2000


def test_legitimate_containers_still_decode() -> None:
    value = OrderedDict(a={1, 2}, b=frozenset({3}), c=[b"x", (1, 2)])
    assert _loads(pickle.dumps(value, protocol=2)) == value


def test_dag_is_counted_when_walked() -> None:
    data = pickle.dumps({"x": _dag(40)}, protocol=2)
    assert len(data) < 1024
    with pytest.raises(DecodingLimitError, match="expands to more than 1000000 objects"):
        _loads(data)
    shared = _loads(data, walk=False)["x"]  # not walked: decoded as the DAG it is
    assert shared[0] is shared[1]
    # the walk counts shared nodes once per path: 2**12 leaves fit, as a tree would
    assert len(_loads(pickle.dumps(_dag(12), protocol=2))) == 2


def test_shared_tensor_refs_are_cheap() -> None:
    # tied weights: the same object under two keys is two visits, nothing more
    data = pickle.dumps({"a": [1, 2], "b": None}, protocol=2)
    assert _loads(data) == {"a": [1, 2], "b": None}


@pytest.mark.parametrize("depth", [100_000, 102])
def test_deep_nesting_is_one_error(depth: int) -> None:
    data = b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."
    with pytest.raises(DecodingLimitError, match="nest more than 100 levels") as e:
        _loads(data)
    assert e.value.tunable == tunables.MAX_PICKLE_DEPTH_ENV


def test_nesting_within_the_limit_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"\x80\x02" + b"]" * 100 + b"a" * 99 + b"."
    assert isinstance(_loads(data), list)
    monkeypatch.setenv(tunables.MAX_PICKLE_DEPTH_ENV, "10")
    with pytest.raises(DecodingLimitError, match="nest more than 10 levels"):
        _loads(data)


def test_torch_size_takes_only_a_tuple() -> None:
    good = b"\x80\x02ctorch\nSize\nK\x02K\x03\x86\x85R."
    assert _loads(good) == (2, 3)
    bad = b"\x80\x02ctorch\nSize\n](K\x02K\x03e\x85R."  # torch.Size([2, 3]): a list, copied
    with pytest.raises(CorruptCheckpointError, match="not a readable pickle"):
        _loads(bad)


def test_negative_tensor_geometry_is_refused() -> None:
    storage = safe_pickle.StorageRef("0", "float32", "cpu", 4)
    with pytest.raises(CorruptCheckpointError, match="negative"):
        safe_pickle._tensor_ref(storage, 0, (-1, 4), (4, 1), None, None)
    ref = safe_pickle._tensor_ref(storage, 0, (1, 4), (0, 1), None, None)  # expanded: stride 0
    assert ref.shape == (1, 4)


def test_short_repr_is_bounded() -> None:
    text = safe_pickle.short(_dag(60))
    assert len(text) < 200
    deep = safe_pickle._record_class("a.B")()
    node = deep
    for _ in range(10_000):
        child = safe_pickle._record_class("a.B")()
        node.__dict__["next"] = child
        node = child
    assert len(repr(deep)) < 200


def test_world_size_is_bounded_before_planning(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptools.reshard import ReshardOptions

    monkeypatch.delenv(tunables.MAX_WORLD_SIZE_ENV, raising=False)
    limit = tunables.DEFAULT_MAX_WORLD_SIZE
    assert ReshardOptions(world_size=limit).world_size == limit
    with pytest.raises(UsageError, match=f"{10**9}.*{tunables.MAX_WORLD_SIZE_ENV}"):
        ReshardOptions(world_size=10**9)
    monkeypatch.setenv(tunables.MAX_WORLD_SIZE_ENV, str(10**9))
    assert ReshardOptions(world_size=10**9).world_size == 10**9


def test_a_state_built_onto_many_records_is_shared_not_copied() -> None:
    # one memoised state dict of 3000 keys BUILT onto 3000 records: the C default copied it
    # into each (33 KB of pickle -> 436 MiB); records adopt it instead
    n = k = 3000
    data = b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadataIndex\nq\x00}q\x01("
    data += b"".join(b"M" + i.to_bytes(2, "little") + b"N" for i in range(n)) + b"u("
    data += b"h\x00)\x81h\x01b" * k + b"l."
    records = safe_pickle.restricted_loads(
        data, safe_pickle.METADATA_GLOBALS, source="m", walk=False
    )
    assert len(records) == k and records[0].__dict__ is records[-1].__dict__


def test_record_state_of_another_form_is_corrupt() -> None:
    data = b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadataIndex\n)\x81K\x05b."
    with pytest.raises(CorruptCheckpointError, match="MetadataIndex is a int, not a dict"):
        safe_pickle.restricted_loads(data, safe_pickle.METADATA_GLOBALS, source="m")
