"""The allowlist unpickler: stand-ins for what checkpoints hold, refusal for anything else."""

from __future__ import annotations

import io
import os
import pickle
from collections import OrderedDict
from pathlib import Path

import pytest

from ckptools.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptools.formats import safe_pickle


class _Payload:
    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.sentinel}",))


class _OpenPayload:
    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.sentinel, "w"))


@pytest.mark.parametrize("payload", [_Payload, _OpenPayload])
@pytest.mark.parametrize(
    "allowed", [safe_pickle.METADATA_GLOBALS, safe_pickle.ARCHIVE_GLOBALS], ids=["meta", "archive"]
)
def test_code_execution_is_refused_and_never_runs(
    tmp_path: Path, payload: type, allowed: dict[str, object]
) -> None:
    sentinel = tmp_path / "pwned"
    data = pickle.dumps({"x": [payload(str(sentinel))]}, protocol=2)
    with pytest.raises(UnsafeCheckpointError) as info:
        safe_pickle.restricted_loads(data, allowed, source="evil.pkl")
    assert info.value.global_name in {"posix.system", "os.system", "io.open", "builtins.open"}
    assert info.value.global_name in str(info.value)
    assert "evil.pkl" in str(info.value)
    assert not sentinel.exists()


def test_getattr_chains_are_refused() -> None:
    # A classic bypass: reach a dangerous callable through builtins.getattr.
    data = b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(Vos\ntRVsystem\ntR."
    with pytest.raises(UnsafeCheckpointError) as info:
        safe_pickle.restricted_loads(data, safe_pickle.ARCHIVE_GLOBALS, source="x")
    assert info.value.global_name == "builtins.getattr"


def test_plain_values_and_bytesio_round_trip() -> None:
    value = OrderedDict(
        a=1, b="s", c=[1.5, None, True], d={"k": (1, 2)}, e=b"\x00\xff", f={1, 2}, g=3 + 4j
    )
    data = pickle.dumps({"v": value, "bio": io.BytesIO(b"hello")}, protocol=2)
    out = safe_pickle.restricted_loads(data, safe_pickle.ARCHIVE_GLOBALS, source="ok")
    assert out["v"] == value
    assert safe_pickle.unwrap(out["bio"]) == safe_pickle.BytesValue(b"hello")


def test_stand_ins_cannot_be_repickled() -> None:
    cls = safe_pickle.METADATA_GLOBALS["torch.distributed.checkpoint.metadata.Metadata"]
    obj = cls.__new__(cls)  # type: ignore[operator]
    with pytest.raises(TypeError):
        pickle.dumps(obj)


def test_garbage_is_a_corrupt_error_not_a_crash() -> None:
    with pytest.raises(CorruptCheckpointError) as info:
        safe_pickle.restricted_loads(b"\x80\x02garbage", safe_pickle.METADATA_GLOBALS, source="m")
    assert "m: not a readable pickle" in str(info.value)


def test_numpy_rng_state_decodes_without_numpy_code() -> None:
    np = pytest.importorskip("numpy")
    state = np.random.RandomState(0).get_state()
    out = safe_pickle.restricted_loads(
        pickle.dumps(state, protocol=2), safe_pickle.ARCHIVE_GLOBALS, source="rng"
    )
    arr = safe_pickle.unwrap(out[1])
    assert isinstance(arr, safe_pickle.ArrayValue)
    assert arr.shape == (624,)
    assert arr.data == state[1].tobytes()
    assert out[0] == "MT19937" and out[2] == state[2]
