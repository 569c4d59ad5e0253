"""Stand-ins for the torch globals ``torch.load(weights_only=True)`` admits (torch-free).

torch 2.13's weights-only unpickler accepts a fixed set of globals by default
(``torch._weights_only_unpickler._get_allowed_globals``): dtypes, the legacy ``*Storage`` and
``*Tensor`` classes, quantization schemes, ``torch.device``, ``nn.Parameter`` and the tensor
rebuild functions of ``torch._utils`` and ``torch._tensor``. ckptools admits the same names
(:data:`TORCH_GLOBALS`, a unit test compares the lists), each mapped to a stand-in here that
only describes data: a rebuilt tensor stays a :class:`~ckptools.formats.tensor_refs.TensorRef`
(a byte range of a storage record), whatever wraps it:

* ``torch._tensor._rebuild_from_type_v2(func, type, args, state)``: how torch pickles a tensor
  that carries Python attributes (FSDP1's gathered full state dicts mark theirs
  ``_has_been_cloned``); it is the inner rebuild's tensor, the attribute state dropped.
* ``_rebuild_parameter`` / ``_rebuild_parameter_with_state``: the parameter's data.
* tensors that are not one byte range (sparse, nested, quantized, meta, wrapper subclasses, a
  device tensor cast on load, one built from a numpy array) become
  :class:`~ckptools.formats.tensor_refs.OtherTensor`, which says what it is; readers refuse
  it by name rather than drop it.
* a tensor *class* is a type whose call refuses: ``torch.FloatTensor(values)`` builds a tensor
  from values inside the pickle (the pre-1.0 form), which has no byte range; as the class
  argument of ``_rebuild_from_type_v2`` it is fine. ``nn.Parameter(data)`` (NEWOBJ) is
  ``data``.
"""

from __future__ import annotations

import reprlib
from typing import Any, ClassVar

from ckptools.core import dtypes
from ckptools.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptools.formats.tensor_refs import DTypeName, OtherTensor, StorageRef, StorageType, TensorRef

_brief = reprlib.Repr()
_brief.maxlevel = 2
_brief.maxstring = _brief.maxother = 60


def _tensor_ref(
    storage: Any, storage_offset: Any, size: Any, stride: Any, dtype: Any, metadata: Any
) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise CorruptCheckpointError("tensor without a storage in pickle")
    if dtype is not None and not isinstance(dtype, str):  # str() of a shared tuple never ends
        raise CorruptCheckpointError("tensor dtype in pickle is not a dtype name")
    name = str(dtype) if dtype is not None else storage.dtype
    if name is None:
        raise CorruptCheckpointError("tensor with untyped storage and no dtype")
    if not isinstance(metadata or {}, dict):
        raise CorruptCheckpointError("tensor metadata in pickle is not a dict")
    flags = tuple(sorted(str(k) for k, v in (metadata or {}).items() if v))
    ref = TensorRef(
        storage=storage,
        storage_offset=int(storage_offset),
        shape=tuple(int(s) for s in size),
        strides=tuple(int(s) for s in stride),
        dtype=dtypes.canonical(name),
        flags=flags,
    )
    if min((ref.storage_offset, *ref.shape, *ref.strides)) < 0:
        raise CorruptCheckpointError(
            f"tensor with a negative offset, size or stride in pickle: shape {list(ref.shape)}, "
            f"strides {list(ref.strides)}, offset {ref.storage_offset}"
        )
    return ref


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> TensorRef:
    return _tensor_ref(storage, storage_offset, size, stride, None, metadata)


def _rebuild_tensor_v3(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> TensorRef:
    return _tensor_ref(storage, storage_offset, size, stride, dtype, metadata)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> TensorRef:
    return _tensor_ref(storage, storage_offset, size, stride, None, None)


def _tensor(value: Any, what: str) -> TensorRef | OtherTensor:
    if not isinstance(value, TensorRef | OtherTensor):
        raise CorruptCheckpointError(f"{what} in pickle holds {_brief.repr(value)}, not a tensor")
    return value


def _rebuild_parameter(data: Any, *_ignored: Any) -> TensorRef | OtherTensor:
    # _ignored: requires_grad, backward_hooks, state (the Parameter's, nothing of the data)
    return _tensor(data, "nn.Parameter")


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    # torch: ``func(*args)``, then ``as_subclass(new_type)`` and the Python attributes set from
    # ``state``. The data is the inner rebuild's; attributes (``_has_been_cloned``) are dropped.
    if isinstance(new_type, type) and issubclass(new_type, WrapperClass):
        return _wrapped_tensor(func, new_type, args, state)
    if not (isinstance(new_type, type) and issubclass(new_type, TensorClass)):
        raise CorruptCheckpointError(
            f"_rebuild_from_type_v2 in pickle asks for type {_brief.repr(new_type)}, "
            "not a tensor class"
        )
    if not (callable(func) and isinstance(args, tuple)):
        raise CorruptCheckpointError("_rebuild_from_type_v2 in pickle has no rebuild call")
    return _tensor(func(*args), "_rebuild_from_type_v2")


_SPARSE_PARTS = 6


def _text(value: Any) -> str:
    # a dtype or device name as the pickle gave it, bounded: kept in every OtherTensor made
    return value if isinstance(value, str) and len(value) <= 64 else _brief.repr(value)


def _shape(value: Any) -> tuple[int, ...] | None:
    # ``torch.Size`` arrives as the tuple itself (never copied); a list is not a shape here
    if isinstance(value, tuple) and all(type(v) is int for v in value):
        return value
    return None


def _rebuild_qtensor(
    storage: Any, storage_offset: Any, size: Any, stride: Any, quantizer_params: Any, *_ignored: Any
) -> OtherTensor:
    # _ignored: requires_grad, backward_hooks (a live tensor's, nothing of the data)
    data = _tensor_ref(storage, storage_offset, size, stride, None, None)
    scheme = quantizer_params[0] if isinstance(quantizer_params, tuple) and quantizer_params else ""
    kind = "quantized"
    if isinstance(scheme, str) and scheme:
        kind = f"quantized ({_text(scheme).removeprefix('torch.')})"
    return OtherTensor(kind, data.dtype, data.shape, (data,))


def _rebuild_sparse_tensor(layout: Any, data: Any) -> OtherTensor:
    # (indices, values, size[, coalesced]) or (compressed, plain, values, size): a few parts.
    # Anything longer is refused rather than copied: a memoised list passed again and again
    # would otherwise grow memory with the square of the pickle.
    if not (isinstance(data, tuple | list) and len(data) <= _SPARSE_PARTS):
        raise CorruptCheckpointError("sparse tensor in pickle without its few parts")
    parts = tuple(data)
    shapes = [s for s in map(_shape, parts) if s is not None]
    refs = [p for p in parts if isinstance(p, TensorRef)]
    kind = _text(layout).removeprefix("torch.") if isinstance(layout, str) else "sparse"
    return OtherTensor(
        kind, refs[-1].dtype if refs else None, shapes[-1] if shapes else None, tuple(refs)
    )


def _rebuild_nested_tensor(
    buffer: Any, sizes: Any, strides: Any, storage_offsets: Any
) -> OtherTensor:
    data = _tensor(buffer, "nested tensor buffer")
    return OtherTensor("nested", data.dtype, None, (data,))


def _rebuild_meta_tensor_no_storage(
    dtype: Any, size: Any, stride: Any, requires_grad: Any = False
) -> OtherTensor:
    return OtherTensor("meta (no data)", _text(dtype), _shape(size), ())


def _rebuild_wrapper_subclass(
    cls: Any,
    dtype: Any,
    size: Any,
    stride: Any,
    storage_offset: Any,
    layout: Any,
    device: Any,
    requires_grad: Any = False,
) -> OtherTensor:
    where = _text(device)
    return OtherTensor(f"wrapper subclass on {where} (no data)", _text(dtype), _shape(size))


def _rebuild_device_tensor_from_cpu_tensor(
    data: Any, dtype: Any, device: Any, requires_grad: Any = False
) -> TensorRef | OtherTensor:
    # torch: ``data.to(dtype=dtype, device=device)``; saved by ``.cpu()``, so the dtype matches
    # and the CPU tensor's bytes are the tensor.
    ref = _tensor(data, "device tensor")
    name = _text(dtype)
    if (
        isinstance(ref, TensorRef)
        and dtypes.is_dtype_name(name)
        and dtypes.canonical(name) == ref.dtype
    ):
        return ref
    return OtherTensor(f"cast to {name} on load", name, ref.shape, (ref,))


def _rebuild_device_tensor_from_numpy(
    data: Any, dtype: Any, device: Any, requires_grad: Any = False
) -> OtherTensor:
    return OtherTensor("built from a numpy array inside the pickle", _text(dtype))


def _device(kind: Any, index: Any = None) -> str:
    # bounded: a memoised name repeated would otherwise be copied into every result
    if not (isinstance(kind, str) and len(kind) <= 64 and (index is None or type(index) is int)):
        raise CorruptCheckpointError(f"torch.device in pickle with arguments {_brief.repr(kind)}")
    return kind if index is None else f"{kind}:{index}"


class TensorClass:
    """Stand-in for a tensor class named in a pickle (``torch.Tensor``, ``torch.FloatTensor``).

    Valid as the class argument of ``_rebuild_from_type_v2``; called, it refuses: the legacy
    constructors build a tensor from values inside the pickle, which is not a stored tensor.
    """

    qualname: ClassVar[str] = "torch.Tensor"

    def __new__(cls, *args: Any) -> Any:
        raise UnsupportedCheckpointError(
            f"the pickle calls {cls.qualname}(...) to build a tensor from values inside it (the "
            "legacy pre-1.0 form), not from stored bytes; load it with torch and save it again"
        )


class ParameterClass(TensorClass):
    """``torch.nn.parameter.Parameter``: ``Parameter(data, requires_grad)`` is ``data``."""

    qualname: ClassVar[str] = "torch.nn.parameter.Parameter"

    def __new__(cls, data: Any = None, requires_grad: Any = True) -> Any:
        return _tensor(data, "nn.Parameter")


class TypedStorageClass:
    """``torch.storage.TypedStorage``: stored storages are persistent ids, never this call."""

    def __new__(cls, *args: Any) -> Any:
        raise UnsupportedCheckpointError(
            "the pickle calls torch.storage.TypedStorage(...) to build a storage from values "
            "inside it, not from stored bytes; load it with torch and save it again"
        )


class WrapperClass(TensorClass):
    """A tensor subclass a producer family declares (``PICKLE_WRAPPERS``) as a wrapper around
    one plain tensor held in the attribute ``attribute``: pickled as
    ``_rebuild_from_type_v2(_rebuild_wrapper_subclass, cls, (cls, dtype, size, stride, offset,
    layout, device, requires_grad), {attribute: <tensor>, ...})``, it reads as that tensor
    (:func:`_wrapped_tensor`); its other attributes (configs, scales derived from it) are
    dropped. Called any other way, it refuses as every tensor class does."""

    attribute: ClassVar[str] = ""


def wrapper_class(qualname: str, attribute: str) -> type[WrapperClass]:
    """The stand-in of the wrapper class ``qualname`` whose plain tensor is ``attribute``."""
    name = qualname.rsplit(".", 1)[-1]
    return type(name, (WrapperClass,), {"qualname": qualname, "attribute": attribute})


def _wrapped_tensor(func: Any, new_type: type[WrapperClass], args: Any, state: Any) -> TensorRef:
    """The plain tensor a wrapper subclass pickles in its state, checked against the wrapper's
    own dtype and size (what torch's ``_rebuild_wrapper_subclass`` gives it)."""
    what = f"a {new_type.qualname} in the pickle"
    if func is not _rebuild_wrapper_subclass or not isinstance(args, tuple):
        raise CorruptCheckpointError(f"{what} is not rebuilt as a wrapper subclass")
    outer = func(*args)
    if isinstance(state, tuple) and len(state) == 2 and state[0] in (None, {}):
        state = state[1]  # (instance dict, slots)
    inner = state.get(new_type.attribute) if isinstance(state, dict) else None
    if not isinstance(inner, TensorRef):
        raise CorruptCheckpointError(
            f"{what} holds {_brief.repr(inner)} in {new_type.attribute!r}, not a stored tensor"
        )
    dtype = _text(outer.dtype)
    if not (dtypes.is_dtype_name(dtype) and dtypes.canonical(dtype) == inner.dtype) or (
        outer.shape != inner.shape
    ):
        raise CorruptCheckpointError(
            f"{what} says {dtype} {list(outer.shape or ())} but wraps a {inner.dtype} tensor of "
            f"shape {list(inner.shape)}"
        )
    return inner


def _tensor_class(qualname: str) -> type[TensorClass]:
    return type(qualname.rsplit(".", 1)[-1], (TensorClass,), {"qualname": qualname})


class QScheme(str):
    """A quantization scheme named in a pickle (``torch.per_tensor_affine``)."""

    __slots__ = ()


# The names below are torch 2.13's default weights-only allowlist (tests/unit/
# test_weights_only_parity.py compares them with torch's own).
_DTYPES = (
    "bfloat16",
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "bool",
    "complex128",
    "complex32",
    "complex64",
    "float16",
    "float32",
    "float4_e2m1fn_x2",
    "float64",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "int1",
    "int2",
    "int3",
    "int4",
    "int5",
    "int6",
    "int7",
    "int8",
    "int16",
    "int32",
    "int64",
    "qint32",
    "qint8",
    "quint2x4",
    "quint4x2",
    "quint8",
    "uint1",
    "uint2",
    "uint3",
    "uint4",
    "uint5",
    "uint6",
    "uint7",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
)
_QSCHEMES = (
    "per_tensor_affine",
    "per_tensor_symmetric",
    "per_channel_affine",
    "per_channel_symmetric",
    "per_channel_affine_float_qparams",
)
# legacy class name stem -> dtype: ``torch.FloatStorage``, ``torch.cuda.FloatTensor``...
_LEGACY = {
    "BFloat16": "bfloat16",
    "Bool": "bool",
    "Byte": "uint8",
    "Char": "int8",
    "Double": "float64",
    "Float": "float32",
    "Half": "float16",
    "Int": "int32",
    "Long": "int64",
    "Short": "int16",
}
_COMPLEX = {"ComplexDouble": "complex128", "ComplexFloat": "complex64"}
_QUANTIZED = {
    "QInt32": "qint32",
    "QInt8": "qint8",
    "QUInt2x4": "quint2x4",
    "QUInt4x2": "quint4x2",
    "QUInt8": "quint8",
}


def _dtype_name(name: str) -> DTypeName:
    # A dtype ckptools has no table entry for (int3, bits8) is still a name; a tensor of it is
    # refused where its size is needed.
    return DTypeName(dtypes.canonical(name) if dtypes.is_dtype_name(name) else name)


#: ``torch.<name>`` values: what DCP ``.metadata`` pickles name too (dtypes, storage types).
TORCH_VALUES: dict[str, Any] = {
    **{n: _dtype_name(n) for n in _DTYPES},
    **{n: QScheme(f"torch.{n}") for n in _QSCHEMES},
    **{f"{s}Storage": StorageType(d) for s, d in {**_LEGACY, **_COMPLEX, **_QUANTIZED}.items()},
}

#: every torch global ``torch.load(weights_only=True)`` admits by default, as a stand-in
TORCH_GLOBALS: dict[str, Any] = {
    **{f"torch.{n}": v for n, v in TORCH_VALUES.items()},
    **{f"torch.cuda.{s}Storage": StorageType(d) for s, d in {**_LEGACY, **_COMPLEX}.items()},
    **{
        f"{m}.{s}Tensor": _tensor_class(f"{m}.{s}Tensor")
        for m in ("torch", "torch.cuda", "torch.sparse", "torch.cuda.sparse")
        for s in _LEGACY
        if not (s == "Bool" and m.endswith("sparse"))
    },
    "torch.Tensor": TensorClass,
    "torch.nn.parameter.Parameter": ParameterClass,
    "torch.device": _device,
    "torch.storage.UntypedStorage": StorageType(None),
    "torch.storage.TypedStorage": TypedStorageClass,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    **{
        f"torch._utils.{f.__name__}": f
        for f in (
            _rebuild_tensor,
            _rebuild_tensor_v2,
            _rebuild_tensor_v3,
            _rebuild_parameter,
            _rebuild_qtensor,
            _rebuild_sparse_tensor,
            _rebuild_nested_tensor,
            _rebuild_meta_tensor_no_storage,
            _rebuild_wrapper_subclass,
            _rebuild_device_tensor_from_cpu_tensor,
            _rebuild_device_tensor_from_numpy,
        )
    },
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
}
