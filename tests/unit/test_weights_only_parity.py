"""The allowlist for ``torch.save`` files is ``torch.load(weights_only=True)``'s, as lazy stand-ins.

torch's own default list (``torch._weights_only_unpickler._get_allowed_globals``, private, read
here only) is the truth: ckptools admits every name on it and nothing more, and what torch
rebuilds from real files written by ``torch.save`` ckptools describes as byte ranges whose
bytes equal torch's tensors.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import _weights_only_unpickler as weights_only

import ckptools
from ckptools.errors import UnsafeCheckpointError, UnsupportedCheckpointError
from ckptools.formats import safe_pickle, torch_rebuild
from tests.support.reference import tensor_bytes

#: torch's default globals ckptools does not admit, each with why. Empty: every one has a
#: stand-in (calls that build a tensor from pickled values are refused when made, below).
EXCLUDED: dict[str, str] = {}


def _ours() -> set[str]:
    names = set(safe_pickle.WEIGHTS_ONLY_GLOBALS)
    # ``torch.<name>`` globals are also resolved by ``_torch_global`` whatever the table.
    names |= {f"torch.{n}" for n in dir(torch) if safe_pickle._torch_global(n) is not None}
    return names


def test_allowlist_equals_torch_weights_only_default() -> None:
    theirs = set(weights_only._get_allowed_globals())
    missing = sorted(theirs - _ours() - set(EXCLUDED))
    extra = sorted(_ours() - theirs)
    assert not missing, f"torch admits, ckptools refuses: {missing}"
    assert not extra, f"ckptools admits, torch refuses: {extra}"
    assert set(EXCLUDED) <= theirs


def test_torch_values_admitted_by_every_table_are_torchs() -> None:
    # _torch_global answers for DCP .metadata too: it must not widen any table past torch's.
    theirs = set(weights_only._get_allowed_globals())
    assert {f"torch.{n}" for n in torch_rebuild.TORCH_VALUES} <= theirs


def test_no_torch_import_at_run_time() -> None:
    import ast
    import inspect

    for module in (safe_pickle, torch_rebuild):
        tree = ast.parse(inspect.getsource(module))
        imported = {
            (a.name if isinstance(n, ast.Import) else n.module or "").split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.Import | ast.ImportFrom)
            for a in n.names
        }
        assert "torch" not in imported, module.__name__


# --------------------------------------------------------------------------------------------------
# Real files: what torch rebuilds, ckptools describes as byte ranges with the same bytes
# --------------------------------------------------------------------------------------------------


def _with_attr(t: torch.Tensor) -> torch.Tensor:
    t._has_been_cloned = True  # type: ignore[attr-defined]  # what FSDP1's full state dict sets
    return t


def _param_with_attr() -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3), requires_grad=False)
    p.tag = "kept by torch, dropped by ckptools"  # type: ignore[attr-defined]
    return p


DENSE: dict[str, Callable[[], torch.Tensor]] = {
    "attr_fp32": lambda: _with_attr(torch.randn(5, 4, generator=torch.Generator().manual_seed(1))),
    "attr_bf16": lambda: _with_attr(torch.arange(12.0).reshape(3, 4).to(torch.bfloat16)),
    "attr_fp8": lambda: _with_attr(torch.linspace(-2, 2, 8).to(torch.float8_e4m3fn)),
    "attr_transposed": lambda: _with_attr(torch.arange(12.0).reshape(3, 4).t()),
    "attr_view_offset": lambda: _with_attr(torch.arange(20, dtype=torch.int64)[5:15]),
    "parameter": lambda: torch.nn.Parameter(torch.ones(3, 2) * 7),
    "parameter_with_state": _param_with_attr,
}


def _save(tmp_path: Path, value: Any, name: str = "state.pt") -> Path:
    path = tmp_path / name
    torch.save(value, path)
    return path


def _digest(path: Path) -> bytes:
    return path.read_bytes()


def test_dense_tensors_read_as_torch_loads_them(tmp_path: Path) -> None:
    state = {name: make() for name, make in DENSE.items()}
    path = _save(tmp_path, {"model": state, "step": 3})
    before = _digest(path)
    expected = torch.load(path, weights_only=True)["model"]
    manifest = ckptools.read_manifest(str(path))
    for name, tensor in expected.items():
        fqn = f"model.{name}"
        assert manifest.tensors[fqn].shape == tuple(tensor.shape)
        got = ckptools.read_tensor(manifest, fqn)
        assert got.dtype == tensor.dtype, name
        assert torch.equal(tensor_bytes(got), tensor_bytes(tensor.detach())), name
    assert _digest(path) == before


def test_values_torch_admits_are_decoded(tmp_path: Path) -> None:
    values = {
        "counter": Counter(a=2, b=1),
        "ordered": OrderedDict(x=1),
        "set": {1, 2},
        "complex": 1 + 2j,
        "bytearray": bytearray(b"\x00\x01"),
        "bytes": b"\xff\x00",
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "device": torch.device("cuda", 1),
        "cpu": torch.device("cpu"),
        "qscheme": torch.per_channel_affine,
    }
    path = _save(tmp_path, {"w": torch.ones(2), "extra": values})
    torch.load(path, weights_only=True)  # torch admits all of it
    objects = ckptools.read_manifest(str(path)).objects
    got = {k.removeprefix("extra."): v.value for k, v in objects.items()}
    # Counter and OrderedDict are dicts: flattened like DCP flattens them
    assert got["counter.a"] == 2 and got["counter.b"] == 1 and got["ordered.x"] == 1
    assert got["set"] == {1, 2} and got["complex"] == 1 + 2j
    assert got["bytearray"] == bytearray(b"\x00\x01") and got["bytes"] == b"\xff\x00"
    assert got["size"] == (2, 3) and got["dtype"] == "bfloat16"
    assert got["device"] == "cuda:1" and got["cpu"] == "cpu"
    assert got["qscheme"] == "torch.per_channel_affine"


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.arange(4.0), 0.5, 1, torch.qint8)


def _nested() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


NOT_ONE_RANGE: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "sparse": (lambda: torch.eye(3).to_sparse(), "sparse_coo"),
    "quantized": (_quantized, "quantized (per_tensor_affine)"),
    "meta": (lambda: torch.empty(2, 3, device="meta"), "meta (no data)"),
    "nested": (_nested, "nested"),
}


@pytest.mark.parametrize("name", sorted(NOT_ONE_RANGE))
def test_tensors_that_are_not_one_byte_range_are_named_and_refused(
    tmp_path: Path, name: str
) -> None:
    make, kind = NOT_ONE_RANGE[name]
    path = _save(tmp_path, {"model": {"ok": torch.ones(2), name: make()}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.load(path, weights_only=True)  # torch admits it
    with pytest.raises(UnsupportedCheckpointError) as info:
        ckptools.read_manifest(str(path))
    message = str(info.value)
    assert f"'model.{name}' is a {kind}" in message and str(path) in message
    assert "\n" not in message


def test_legacy_constructor_call_is_refused_not_run() -> None:
    # torch admits calling torch.FloatTensor(values) (a pre-1.0 pickle); its data are values
    # inside the pickle, not a stored byte range, so ckptools refuses the call by name.
    data = b"\x80\x02ctorch\nFloatTensor\n]q\x00(G?\xf0\x00\x00\x00\x00\x00\x00e\x85R."
    assert torch.equal(weights_only.Unpickler(io.BytesIO(data)).load(), torch.tensor([1.0]))
    with pytest.raises(UnsupportedCheckpointError, match=r"torch\.FloatTensor\(\.\.\.\)"):
        safe_pickle.restricted_loads(data, safe_pickle.WEIGHTS_ONLY_GLOBALS, source="old.pt")


def test_nn_parameter_newobj_is_its_data() -> None:
    # torch's weights-only unpickler special-cases NEWOBJ of nn.Parameter; so do we.
    storage = safe_pickle.StorageRef("0", "float32", "cpu", 4)
    table = {**safe_pickle.WEIGHTS_ONLY_GLOBALS, "x.storage": lambda: storage}
    data = (
        b"\x80\x02ctorch.nn.parameter\nParameter\n"
        b"ctorch._utils\n_rebuild_tensor_v2\n(cx\nstorage\n)RK\x00K\x04\x85K\x01\x85\x89"
        b"ccollections\nOrderedDict\n)Rtq\x00R\x88\x86\x81."
    )
    ref = safe_pickle.restricted_loads(data, table, source="p.pt")
    assert isinstance(ref, safe_pickle.TensorRef) and ref.shape == (4,)


@pytest.mark.parametrize(
    ("value", "global_name"),
    [
        (np.arange(3), "numpy"),
        (frozenset({1}), "builtins.frozenset"),
        (io.BytesIO(b"x"), "_io.BytesIO"),
    ],
    ids=["numpy", "frozenset", "bytesio"],
)
def test_globals_torch_refuses_are_refused_in_torch_save_files(
    tmp_path: Path, value: Any, global_name: str
) -> None:
    path = _save(tmp_path, {"w": torch.ones(2), "v": value})
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    with pytest.raises(UnsafeCheckpointError) as info:
        ckptools.read_manifest(str(path))
    assert info.value.global_name.startswith(global_name)
    assert os.fspath(path) in str(info.value)


def test_stand_ins_copy_nothing_a_hostile_pickle_repeats() -> None:
    # A memoised value passed to a stand-in again and again must not be copied into each result
    # (memory would grow with the square of the pickle): sparse parts are few, shapes are the
    # torch.Size tuple itself, names are bounded.
    from ckptools.errors import CorruptCheckpointError

    many = list(range(10_000))
    with pytest.raises(CorruptCheckpointError, match="sparse tensor"):
        torch_rebuild._rebuild_sparse_tensor("torch.sparse_coo", many)
    meta = torch_rebuild._rebuild_meta_tensor_no_storage("x" * 10_000, many, many)
    assert meta.shape is None and len(meta.dtype or "") < 100
    size = (2, 3)
    assert torch_rebuild._rebuild_meta_tensor_no_storage("float32", size, (3, 1)).shape is size
