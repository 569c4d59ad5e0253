"""The house's ``PICKLE_WRAPPERS`` hook (formats.torch_rebuild.WrapperClass): a declared tensor
subclass reads as the plain tensor its attribute holds only when that tensor is the wrapper's
own dtype and size; anything else is refused in one line, and the class is never a constructor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ckptools.producers.base  # noqa: F401  (admits every family's declarations)
from ckptools.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptools.formats import safe_pickle, torch_rebuild
from ckptools.formats.tensor_refs import DTypeName, StorageRef, TensorRef

_CLASS = "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor"
_REBUILD = safe_pickle.ARCHIVE_GLOBALS["torch._tensor._rebuild_from_type_v2"]
_WRAPPER = safe_pickle.ARCHIVE_GLOBALS["torch._utils._rebuild_wrapper_subclass"]


def _ref(shape: tuple[int, ...], dtype: str = "bfloat16") -> TensorRef:
    storage = StorageRef("0", dtype, "cpu", 64)
    return TensorRef(storage, 0, shape, (shape[1], 1), dtype)


def _args(cls: object, dtype: str, shape: tuple[int, ...]) -> tuple[object, ...]:
    return (cls, DTypeName(dtype), shape, (shape[1], 1), 0, "torch.strided", "cpu", False)


def test_a_declared_wrapper_reads_as_its_tensor_and_nothing_else_does() -> None:
    cls = safe_pickle.ARCHIVE_GLOBALS[_CLASS]
    assert issubclass(cls, torch_rebuild.WrapperClass) and cls.attribute == "_tensor"
    inner = _ref((4, 8))
    state = {"_tensor": inner, "_dtype": DTypeName("float8_e4m3fn")}
    assert _REBUILD(_WRAPPER, cls, _args(cls, "bfloat16", (4, 8)), state) is inner
    with pytest.raises(CorruptCheckpointError, match="wraps a bfloat16 tensor of shape"):
        _REBUILD(_WRAPPER, cls, _args(cls, "bfloat16", (8, 8)), state)
    with pytest.raises(CorruptCheckpointError, match="says float32"):
        _REBUILD(_WRAPPER, cls, _args(cls, "float32", (4, 8)), state)
    with pytest.raises(CorruptCheckpointError, match="not a stored tensor"):
        _REBUILD(_WRAPPER, cls, _args(cls, "bfloat16", (4, 8)), {"_data": inner})
    with pytest.raises(CorruptCheckpointError, match="not rebuilt as a wrapper subclass"):
        _REBUILD(len, cls, _args(cls, "bfloat16", (4, 8)), state)
    with pytest.raises(UnsupportedCheckpointError):
        cls(inner)
    # WEIGHTS_ONLY_GLOBALS (torch.save files) and torchao's other classes are not admitted
    assert _CLASS not in safe_pickle.WEIGHTS_ONLY_GLOBALS
    assert "torchao.quantization.Float8Tensor" not in safe_pickle.ARCHIVE_GLOBALS


def test_inspect_reads_a_few_items_of_a_plain_dcp_not_one_per_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """inspect tells a float8 training DCP by its items' pickles (.metadata does not say): a
    plain DCP of many Linear weights is told by its first few, so an inspect of a large model
    stays a metadata read."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from ckptools.formats import torch_archive
    from ckptools.producers import read_manifest
    from ckptools.producers.compressed import float8_training

    state = {f"layers.{i}.weight": torch.zeros(4, 4) for i in range(40)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    reads = []
    real = torch_archive.read_archive

    def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_archive, "read_archive", counted)
    assert float8_training.facts(read_manifest(str(tmp_path / "plain"))) is None
    assert len(reads) == 16
