"""Budgets on untrusted input: the unpickler's copies and walks counted, sizes capped by the pickle,
depth capped; the world size a conversion plans for bounded."""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from pathlib import PurePosixPath
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptools.errors import CorruptCheckpointError, DecodingLimitError, UsageError
from ckptools.formats import pickle_budget, pickle_patterns, pickle_scan, safe_pickle
from ckptools.io import tunables

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
    from ckptools.verbs.reshard import ReshardOptions

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


# --------------------------------------------------------------------------------------------------
# Inside the C unpickler (formats/pickle_scan.py): memo size, hashing, argument tuples
# --------------------------------------------------------------------------------------------------

METADATA = safe_pickle.METADATA_GLOBALS


def _shared_tuple(levels: int) -> bytes:
    """Pushes t = (t, t) nested ``levels`` deep from (), each level two memo GETs of the one
    below: 2**(levels + 1) - 1 nodes when hashed as a tree."""
    out = b")q\x00"
    for k in range(levels):
        out += b"0h" + bytes([k]) + b"h" + bytes([k]) + b"\x86q" + bytes([k + 1])
    return out


def _tree(levels: int) -> tuple[Any, ...]:
    t: tuple[Any, ...] = ()
    for _ in range(levels):
        t = (t, t)
    return t


@pytest.mark.parametrize("piece", [b"Nr\x00\xe1\xf5\x05", b"Np100000000\n"])
def test_memo_index_is_bounded_by_the_pickle(piece: bytes) -> None:
    # 8 bytes made the C unpickler allocate and zero 1.6 GB of memo
    with pytest.raises(DecodingLimitError, match=r"x\.pkl.*memo index 100000000") as e:
        _loads(b"\x80\x02" + piece + b".")
    assert e.value.tunable is None and e.value.path == "x.pkl"
    assert _loads(b"\x80\x02Nr\x05\x00\x00\x00.") is None  # an index within its own length


def test_shared_tuple_key_is_refused_before_it_is_hashed() -> None:
    # 40 levels: 2**41 nodes, beyond the object budget (the C unpickler hashed for ever)
    with pytest.raises(DecodingLimitError, match=tunables.MAX_PICKLE_OBJECTS_ENV):
        _loads(b"\x80\x02}" + _shared_tuple(40) + b"K\x01s.")
    # 14 levels: 32,767 nodes fit the budget but are no key
    with pytest.raises(DecodingLimitError, match="would hash more than 10000 nodes") as e:
        _loads(b"\x80\x02}" + _shared_tuple(14) + b"K\x01s.")
    assert e.value.tunable is None
    assert _loads(b"\x80\x02}" + _shared_tuple(3) + b"K\x01s.") == {_tree(3): 1}


def test_keys_hashed_by_constructors_are_weighed() -> None:
    # the frozenset opcode, set(list) and OrderedDict(pairs) all hash what they are given
    for data in (
        b"\x80\x04(" + _shared_tuple(14) + b"\x91.",
        b"\x80\x02cbuiltins\nset\n]" + _shared_tuple(14) + b"a\x85R.",
        b"\x80\x02ccollections\nOrderedDict\n]" + _shared_tuple(14) + b"N\x86a\x85R.",
    ):
        with pytest.raises(DecodingLimitError, match="would hash more than 10000 nodes"):
            _loads(data)
    assert _loads(b"\x80\x02cbuiltins\nset\n]" + _shared_tuple(3) + b"a\x85R.") == {_tree(3)}


def test_deep_key_is_refused() -> None:
    # a key a million tuples deep crashed the interpreter (hashing recurses in C)
    with pytest.raises(DecodingLimitError, match="would hash more than 10000 nodes"):
        _loads(b"\x80\x02}N" + b"\x85" * 20_000 + b"K\x01s.")


def test_key_size_limit_boundary() -> None:
    assert tunables.PICKLE_KEY_NODES == 10_000
    (key,) = _loads(b"\x80\x02}(" + b"N" * 9_999 + b"tK\x01s.")  # 10,000 nodes
    assert len(key) == 9_999
    with pytest.raises(DecodingLimitError, match="would hash more than 10000 nodes"):
        _loads(b"\x80\x02}(" + b"N" * 10_000 + b"tK\x01s.")


def test_big_int_keys_are_refused() -> None:
    # an int's hash reads all its digits, every time, and ints past 2**61 - 1 can share hashes:
    # a 100 KB int, or any int that large, is no key
    big = (1 << 800_000) - 1
    for key in (big, 2**63):
        with pytest.raises(DecodingLimitError, match=r"2\*\*61 - 1 or more"):
            _loads(pickle.dumps({key: 1}, protocol=2))
    assert _loads(pickle.dumps({2**60: 1, -5: 2}, protocol=2)) == {2**60: 1, -5: 2}


@pytest.mark.parametrize(
    ("global_line", "table"),
    [
        (b"torch.distributed.checkpoint.metadata\nMetadataIndex\n", METADATA),
        (b"builtins\nset\n", ARCHIVE),
        (b"collections\nOrderedDict\n", ARCHIVE),
        (b"builtins\nbytearray\n", ARCHIVE),
    ],
)
def test_a_memoised_argument_tuple_fails_at_the_first_call(
    global_line: bytes, table: dict[str, Any]
) -> None:
    # *args would copy the 1000 arguments per call (quadratic for a long run of calls)
    data = b"\x80\x02(" + b"N" * 1000 + b"tq\x00c" + global_line + b"q\x01"
    data += b"h\x01h\x00R0" * 3 + b"N."
    with pytest.raises(CorruptCheckpointError, match=r"arguments but 100[01] were given"):
        safe_pickle.restricted_loads(data, table, source="x.pkl")


def test_path_parts_are_charged() -> None:
    # pathlib takes any number of parts: 10,000 of them (one memoised string) joined 1000 times
    data = b"\x80\x02X\x01\x00\x00\x00pq\x000(" + b"h\x00" * 10_000 + b"tq\x01"
    data += b"cpathlib\nPosixPath\nq\x02" + b"h\x02h\x01R0" * 1000 + b"N."
    with pytest.raises(DecodingLimitError, match=tunables.MAX_PICKLE_OBJECTS_ENV):
        safe_pickle.restricted_loads(data, METADATA, source="m")
    path = pickle.dumps(PurePosixPath("ckpt/step-1/__0_0.distcp"), protocol=2)
    assert safe_pickle.restricted_loads(path, METADATA, source="m") == "ckpt/step-1/__0_0.distcp"


def test_ordered_dict_state_is_charged() -> None:
    # one state of 1000 keys memoised and built onto 2000 OrderedDicts: 2M copies from 19 KB
    keys = b"".join(b"X\x04\x00\x00\x00%04dN" % i for i in range(1000))
    data = b"\x80\x02ccollections\nOrderedDict\nq\x00}q\x01(" + keys + b"u"
    data += b"h\x00)Rh\x01b0" * 2000 + b"N."
    with pytest.raises(DecodingLimitError, match=tunables.MAX_PICKLE_OBJECTS_ENV):
        _loads(data)
    # a state dict's own state (torch.save keeps ``_metadata`` there) still decodes
    sd: OrderedDict[str, Any] = OrderedDict(w=1)
    sd._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    out = _loads(pickle.dumps(sd, protocol=2))
    assert out == sd and out._metadata == {"": {"version": 1}}


def test_pickles_without_sharing_or_hashing_skip_the_scan() -> None:
    import torch

    buf = io.BytesIO()
    torch.save(torch.arange(12.0).reshape(3, 4)[1:], buf)
    with zipfile.ZipFile(buf) as z:
        (name,) = (n for n in z.namelist() if n.endswith("data.pkl"))
        item = z.read(name)
    assert pickle_patterns.known_safe(item)  # a DCP item's data.pkl: no GET, no dict key
    shared = [1, 2]
    for needs in (
        pickle.dumps({"a": 1}, protocol=2),  # a key is hashed
        pickle.dumps([shared, shared], protocol=2),  # a memo GET
        b"\x80\x02Nr\x00\x00\x01\x00.",  # a memo index from 2**16
        item[:-1],  # no STOP
    ):
        assert not pickle_patterns.known_safe(needs)


# ints a key may be: those of 2**61 - 1 or more are refused as keys (they can share one hash)
_key_ints = st.integers(min_value=-(2**61 - 2), max_value=2**61 - 2)
_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=3) | _key_ints, inner, max_size=3)
        | st.frozensets(_key_ints | st.text(max_size=3), max_size=3)
        | st.sets(st.tuples(_key_ints, st.text(max_size=2)), max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(value=_values, protocol=st.integers(0, 5), share=st.booleans())
def test_scan_follows_every_pickle_python_writes(value: Any, protocol: int, share: bool) -> None:
    # the scan's model of the unpickler's stack and memo reaches STOP on whatever pickle writes
    # (shared references included), and what it lets through decodes as pickle does
    obj = [value, value] if share else value
    data = pickle.dumps(obj, protocol=protocol)
    pickle_scan._scan(data, pickle_budget.DecodeBudget("x.pkl", len(data)))
    assert _loads(data) == pickle.loads(data)


# Ints of 2**61 - 1 or more hash modulo it: k and k + n * (2**61 - 1) share one hash, and a dict
# of many such keys is quadratic to build. No checkpoint keys by such ints; holding them as
# values (an RNG's 128-bit state) stays fine.
_P = 2**61 - 1


@pytest.fixture(scope="module")
def colliding_keys() -> dict[int, None]:
    # quadratic to build, which is the point: built once, outside the timed part of the tests
    return {7 + n * _P: None for n in range(1, 20_000)}


# The timeout shows the refusal comes before the quadratic dict is built; it times the test
# function alone, since building the input is just as slow on a loaded machine.
@pytest.mark.timeout(20, func_only=True)
@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_colliding_big_int_keys_are_refused(protocol: int, colliding_keys: dict[int, None]) -> None:
    keys = colliding_keys
    assert len({hash(k) for k in keys}) == 1
    with pytest.raises(DecodingLimitError, match=r"2\*\*61 - 1 or more"):
        _loads(pickle.dumps(keys, protocol=protocol))
    with pytest.raises(DecodingLimitError, match=r"2\*\*61 - 1 or more"):
        _loads(pickle.dumps({(1, 7 + _P): 0}, protocol=protocol))  # inside a tuple key too


def test_colliding_big_ints_through_a_set_constructor_are_refused() -> None:
    # set(list) hashes in the constructor, after the scan: the constructor's charge refuses them
    data = pickle.dumps(set(), protocol=2).replace(
        b"]", b"]" + pickle.dumps([_P + 7, 2 * _P + 7], 2)[2:-1], 1
    )
    value = pickle.dumps({_P + 7, 2 * _P + 7}, protocol=2)
    with pytest.raises(DecodingLimitError, match=r"2\*\*61 - 1 or more"):
        _loads(value)
    del data


def test_big_ints_as_values_and_small_int_keys_still_load() -> None:
    state = {"state": {"state": 2**127 + 5, "inc": -(2**100)}, 0: 1, 2**60: "x", -5: [2**64]}
    assert _loads(pickle.dumps(state, protocol=2)) == state
    assert _loads(pickle.dumps(state, protocol=0)) == state
