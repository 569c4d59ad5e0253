"""Reading pickles from checkpoints without running their code (torch-free).

DCP's ``.metadata`` is a pickle, DCP object items and ``torch.save`` files hold pickles, and a
pickle can call any importable function while it loads. ckptools never hands them to
:mod:`pickle` as they are: :class:`_RestrictedUnpickler` resolves each global the pickle names
through an allowlist that maps it to a *stand-in* defined here (a record, a dtype name, a tensor
reference), never to the real class or function. A pickle that names anything else is refused
with :class:`~ckptools.errors.UnsafeCheckpointError` naming the global, before anything runs.

The stand-ins keep the data a checkpoint legitimately holds: DCP metadata records, tensors as
:class:`TensorRef` (storage key, dtype, offset, shape, strides, no bytes), plain Python values,
``io.BytesIO`` contents and numpy arrays (RNG state) as :class:`BytesValue` / :class:`ArrayValue`.

Decoding is bounded (:mod:`ckptools.formats.pickle_budget`): the C unpickler makes at most one
object per opcode, so the work past the pickle's own length comes from constructors that copy
(charged per object, and a size they are asked for may not exceed the bytes of the pickle) and from
walks that expand shared references into a tree (``torch.save`` values are walked once, counted and
depth-capped, before anyone else walks them). What the C unpickler does inside ``load()`` (sizing
its memo, hashing keys) is bounded before it starts by :mod:`ckptools.formats.pickle_scan`. Limits
are tunables (:mod:`ckptools.io.tunables`) and a breach is a one-line
:class:`~ckptools.errors.DecodingLimitError` naming the one to raise.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
import reprlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptools.errors import (
    CkptError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from ckptools.formats import pickle_budget, pickle_scan, torch_rebuild
from ckptools.formats.tensor_refs import DTypeName as DTypeName
from ckptools.formats.tensor_refs import OtherTensor as OtherTensor
from ckptools.formats.tensor_refs import StorageRef as StorageRef
from ckptools.formats.tensor_refs import StorageType as StorageType
from ckptools.formats.tensor_refs import TensorRef as TensorRef

_UNSET = pickle_budget.UNSET


class Record:
    """Stand-in for an instance of an allowlisted class (a dataclass in DCP metadata).

    Attribute access returns the pickled state's fields. A dict state *becomes* the instance
    dict, not copied into it (see :meth:`__setstate__`); :class:`_StateRecord` keeps any other
    state in ``_state``.
    """

    _qualname = "Record"

    def __init__(self, first: Any = _UNSET, second: Any = _UNSET, third: Any = _UNSET) -> None:
        # Fixed arity, not *args: a memoised tuple of a million arguments passed to a record
        # class again and again would be copied per call (and kept); CPython refuses a fourth
        # positional argument before it builds anything, which ends the load at the first call.
        self._args = tuple(a for a in (first, second, third) if a is not _UNSET)

    def __reduce__(self) -> Any:
        raise TypeError(f"{self._qualname} stand-ins are read-only and cannot be pickled")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={short(v)}" for k, v in self.__dict__.items() if k != "_args")
        return f"{self._qualname}({fields})"

    def __setstate__(self, state: Any) -> None:
        # Adopting the state dict is the hot path of reading large metadata, and no slower than
        # the C unpickler's default, which copies it key by key (64k chunks: 0.14-0.17 s either
        # way on an idle machine; 0.15 vs 0.25 s on a busy one). It also bounds memory: a
        # state dict memoised once and built onto many records is shared, where the copies
        # grew with the square of the pickle (33 KB -> 436 MiB).
        if type(state) is dict and not self.__dict__:
            self.__dict__ = state
        elif isinstance(state, dict):
            self.__dict__.update(state)
        elif (
            isinstance(state, tuple)
            and len(state) == 2
            and (state[0] is None or isinstance(state[0], dict))
            and isinstance(state[1], dict)
        ):
            # (instance dict, slots dict): the protocol-2 form for classes with __slots__.
            self.__dict__.update(state[0] or {})
            self.__dict__.update(state[1])
        else:
            self._other_state(state)

    def _other_state(self, state: Any) -> None:
        raise CorruptCheckpointError(
            f"pickled state of {self._qualname} is a {type(state).__name__}, not a dict"
        )


class _StateRecord(Record):
    """A record whose pickled state may be a tuple (``TensorProperties.__getstate__``)."""

    def _other_state(self, state: Any) -> None:
        self.__dict__["_state"] = state


class _ShortRepr(reprlib.Repr):
    """``reprlib`` that shows a nested record by name: a repr of a decoded value stays short
    and shallow however deep or shared the value is."""

    def repr1(self, x: Any, level: int) -> str:
        if isinstance(x, Record):
            return f"<{x._qualname.rsplit('.', 1)[-1]}>"
        return super().repr1(x, level)


_SHORT = _ShortRepr()
_SHORT.maxlevel = 3
_SHORT.maxstring = _SHORT.maxother = 80


def short(value: Any) -> str:
    """A bounded repr of a decoded value, for messages (a hostile value may be a huge DAG)."""
    return _SHORT.repr(value)


class _OrderedDict(OrderedDict[Any, Any]):
    """An ``OrderedDict`` whose pickled state (``torch.save`` keeps a state dict's
    ``_metadata`` there) is charged: the C default copies it in, so one state memoised and
    built onto many dicts would cost the square of the pickle."""

    def __setstate__(self, state: Any) -> None:
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        for part in parts:
            if part is None:
                continue
            if not isinstance(part, dict):
                raise CorruptCheckpointError(f"pickled state of an OrderedDict is {short(part)}")
            pickle_budget.current().charge(len(part))
            self.__dict__.update(part)


# torch.Size((d0, d1, ...)): the argument is always a tuple, which ``() + t`` returns itself at
# C speed (DCP metadata holds three sizes per chunk); anything else is refused, not copied.
_SIZE = ().__add__


def _walk(value: Any, budget: pickle_budget.DecodeBudget) -> None:
    """Visit ``value`` as the tree every later walk (flatten, plain, ==, repr) will see,
    counting nodes against ``budget`` and capping the nesting: shared references make a DAG
    of a few KB expand exponentially, so this is the one walk that has to be bounded.

    Level by level, each level's nodes gathered by C-speed ``extend``: ~10M nodes/s here, so
    even the budget of a 1 MB pickle (16M nodes) is walked in a few seconds.
    """
    if type(value) is TensorRef:  # a DCP chunk's item, millions of times
        return
    level: list[Any] = [value]
    room = budget.objects - budget.used - 1
    depth = 0
    while level:
        deeper: list[Any] = []
        for v in level:
            if isinstance(v, list | tuple | set | frozenset):
                deeper.extend(v)
            elif isinstance(v, dict):
                deeper.extend(v)
                deeper.extend(v.values())
            elif isinstance(v, Record):
                deeper.extend(v.__dict__.values())
            else:
                continue
            if len(deeper) > room:
                budget.charge(budget.objects)  # raises, naming the tunable
        if deeper:
            depth += 1
            if depth > budget.depth:
                raise budget.too_deep()
        room -= len(deeper)
        level = deeper
    budget.charge(budget.objects - budget.used - room)


_RECORD_CLASSES: dict[str, type[Record]] = {}


def _record_class(qualname: str) -> type[Record]:
    cls = _RECORD_CLASSES.get(qualname)
    if cls is None:
        base = _StateRecord if qualname.endswith(("TensorProperties", "StorageMeta")) else Record
        cls = type(qualname.rsplit(".", 1)[-1], (base,), {"_qualname": qualname})
        _RECORD_CLASSES[qualname] = cls
    return cls


def is_record(obj: object, qualname_suffix: str) -> bool:
    return isinstance(obj, Record) and obj._qualname.endswith(qualname_suffix)


@dataclass(frozen=True, slots=True)
class BytesValue:
    """An ``io.BytesIO`` from a checkpoint, as its bytes."""

    data: bytes


@dataclass(frozen=True, slots=True)
class ArrayValue:
    """A numpy array from a checkpoint (e.g. RNG state), as dtype code, shape and raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


class _BytesIOStandIn(Record):
    _qualname = "_io.BytesIO"
    value: BytesValue

    def __setstate__(self, state: Any) -> None:
        value = state[0] if isinstance(state, tuple) and state else b""
        if not isinstance(value, bytes | bytearray):
            raise CorruptCheckpointError("io.BytesIO state holds no bytes")
        pickle_budget.current().charge(len(value))
        self.__dict__["value"] = BytesValue(bytes(value))


class _NumpyDTypeStandIn(Record):
    _qualname = "numpy.dtype"

    def __setstate__(self, state: Any) -> None:
        # (version, byteorder, subarray, names, fields, elsize, alignment, flags)
        order = state[1] if isinstance(state, tuple) and len(state) > 1 else "|"
        code = self._args[0] if self._args else "?"
        if not (isinstance(order, str) and isinstance(code, str)):  # str() of a DAG never ends
            raise CorruptCheckpointError("numpy dtype state holds no type code")
        self.__dict__["code"] = f"{'<' if order == '=' else order}{code}"


class _NumpyArrayStandIn(Record):
    _qualname = "numpy.ndarray"
    value: ArrayValue

    def __setstate__(self, state: Any) -> None:
        # (version, shape, dtype, is_fortran, rawdata)
        if not (isinstance(state, tuple) and len(state) == 5):
            raise CorruptCheckpointError("numpy array state has an unexpected form")
        _, shape, dt, _, raw = state
        if not isinstance(raw, bytes | bytearray):
            raise UnsafeCheckpointError(
                "numpy object arrays are not read", global_name="numpy.ndarray(object)"
            )
        code = getattr(dt, "code", "?")
        pickle_budget.current().charge(len(raw) + len(shape))
        self.__dict__["value"] = ArrayValue(str(code), tuple(shape), bytes(raw))


def _layout(name: Any) -> str:
    if not isinstance(name, str) or not name.startswith("torch."):
        raise CorruptCheckpointError(f"unexpected tensor layout {short(name)}")
    return name


def _enum_value(value: Any) -> Any:
    if not isinstance(value, int | str):
        raise CorruptCheckpointError(f"unexpected enum value {short(value)}")
    return value


def _path(*parts: Any) -> str:
    # The one allowlisted callable taking *args (a path has any number of parts): the copy of
    # the arguments is charged first, so a memoised tuple of many parts passed again and again
    # ends at the budget; and the joined length is bounded by the pickle's own.
    budget = pickle_budget.current()
    budget.charge(len(parts))
    if not all(isinstance(p, str) for p in parts):
        raise CorruptCheckpointError("a path in the checkpoint is not made of strings")
    budget.size(sum(map(len, parts)), "a path")
    return "/".join(parts)


def _codecs_encode(text: Any, encoding: str = "utf-8") -> bytes:
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8"):
        raise CorruptCheckpointError("unexpected bytes encoding in pickle")
    out = text.encode(encoding)
    pickle_budget.current().charge(len(out))
    return out


def _reconstructor(cls: Any, base: Any, state: Any = None) -> Any:
    # Protocol 0/1 form of object creation; only our stand-in classes may be created this way.
    if not (isinstance(cls, type) and issubclass(cls, Record)):
        raise UnsafeCheckpointError(
            "copyreg._reconstructor asked to build a non-allowlisted type",
            global_name="copyreg._reconstructor",
        )
    return cls.__new__(cls)


def _torch_global(name: str) -> Any:
    # ``torch.<name>`` that any pickle may name: torch's weights-only dtypes, storage types and
    # quantization schemes (DCP ``.metadata`` holds dtypes), and ``torch.Size``.
    if name == "Size":
        return _SIZE
    return torch_rebuild.TORCH_VALUES.get(name)


_tensor_ref = torch_rebuild._tensor_ref  # one check of a rebuilt tensor's numbers

_DCP = "torch.distributed.checkpoint"
_DCP_RECORDS = (
    f"{_DCP}.metadata.Metadata",
    f"{_DCP}.metadata.TensorStorageMetadata",
    f"{_DCP}.metadata.BytesStorageMetadata",
    f"{_DCP}.metadata.ChunkStorageMetadata",
    f"{_DCP}.metadata.TensorProperties",
    f"{_DCP}.metadata.MetadataIndex",
    f"{_DCP}.metadata.StorageMeta",
    f"{_DCP}.filesystem._StorageInfo",
    f"{_DCP}.filesystem._StoragePrefix",
    f"{_DCP}._hf_utils._HFStorageInfo",
    # a producer's writer may add every rank's plan to the metadata (``all_local_plans``)
    f"{_DCP}.planner.SavePlan",
    f"{_DCP}.planner.WriteItem",
    f"{_DCP}.planner.TensorWriteData",
    # torch < 2.2 kept TensorProperties with ShardedTensor.
    "torch.distributed._shard.sharded_tensor.metadata.TensorProperties",
)

_COMMON: dict[str, Any] = {
    "collections.OrderedDict": pickle_budget.copying(_OrderedDict, "OrderedDict", pairs=True),
    "builtins.set": pickle_budget.copying(set, "set"),
    "builtins.complex": complex,
    # torch.Size pickles as torch.Size((d0, d1, ...)). Callers check the elements' types.
    "torch.Size": _SIZE,
    "torch.serialization._get_layout": _layout,
}

# Globals a DCP ``.metadata`` pickle may name.
METADATA_GLOBALS: dict[str, Any] = {
    **_COMMON,
    "builtins.frozenset": pickle_budget.copying(frozenset, "frozenset"),
    "builtins.object": object,
    "copyreg._reconstructor": _reconstructor,
    **{q: _record_class(q) for q in _DCP_RECORDS},
    f"{_DCP}.metadata._MEM_FORMAT_ENCODING": _enum_value,
    f"{_DCP}.planner.WriteItemType": _enum_value,
    "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING": _enum_value,
    "pathlib.PosixPath": _path,
    "pathlib.WindowsPath": _path,
    "pathlib.PurePosixPath": _path,
    "pathlib.PureWindowsPath": _path,
    "pathlib.Path": _path,
}

# Globals ``torch.load(weights_only=True)`` admits by default (torch 2.13), and nothing more:
# what a ``torch.save`` file (a state dict, an optimizer, a Lightning ``.ckpt``) may name.
WEIGHTS_ONLY_GLOBALS: dict[str, Any] = {
    **_COMMON,
    "collections.Counter": pickle_budget.copying(Counter, "Counter"),
    "builtins.bytearray": pickle_budget.copying(bytearray, "bytearray"),
    "_codecs.encode": _codecs_encode,
    **torch_rebuild.TORCH_GLOBALS,
}


@dataclass(frozen=True, slots=True)
class EnumValue:
    """A member of an enum class a checkpoint names (a producer's run options), as data:
    the class's qualified name and the member's value, never the class itself."""

    enum: str
    value: Any

    def __str__(self) -> str:
        return f"{self.enum.rsplit('.', 1)[-1]}({self.value!r})"


def _enum_class(qualname: str) -> Callable[[Any], EnumValue]:
    def member(value: Any) -> EnumValue:
        return EnumValue(qualname, _enum_value(value))

    member.__qualname__ = member.__name__ = qualname
    return member


# What training state objects name beside tensors, as data: namespaces as records, a signal
# number as an :class:`EnumValue`. A producer's own classes (its enums and config dataclasses)
# are admitted by its family (:func:`admit`).
_TRAINING_STATE_GLOBALS: dict[str, Any] = {
    "argparse.Namespace": _record_class("argparse.Namespace"),
    "types.SimpleNamespace": _record_class("types.SimpleNamespace"),
    "signal.Signals": _enum_class("signal.Signals"),
    "pathlib.PosixPath": _path,
}

# Globals a DCP object item may name: torch loads those with ``weights_only=False``, and
# training state holds RNG states (numpy arrays), ``io.BytesIO`` and a few more builtins.
ARCHIVE_GLOBALS: dict[str, Any] = {
    **_TRAINING_STATE_GLOBALS,
    **WEIGHTS_ONLY_GLOBALS,
    "builtins.frozenset": pickle_budget.copying(frozenset, "frozenset"),
    "builtins.object": object,
    "builtins.slice": slice,
    "copyreg._reconstructor": _reconstructor,
    "_io.BytesIO": _BytesIOStandIn,
    "numpy.core.multiarray._reconstruct": lambda cls, shape, dt: cls.__new__(cls),
    "numpy._core.multiarray._reconstruct": lambda cls, shape, dt: cls.__new__(cls),
    "numpy.ndarray": _NumpyArrayStandIn,
    "numpy.dtype": _NumpyDTypeStandIn,
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(
        self,
        data: bytes,
        allowed: Mapping[str, Any],
        source: str,
        persistent_load: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed
        self._source = source
        self._persistent = persistent_load

    def find_class(self, module: str, name: str) -> Any:
        # Protocol < 3 pickles name Python 2 modules (``__builtin__.set``); map them as
        # pickle's own find_class does.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        qualname = f"{module}.{name}"
        found = self._allowed.get(qualname)
        if found is None and module == "torch":
            found = _torch_global(name)
        if found is None:
            raise UnsafeCheckpointError(
                f"{self._source}: refusing to load: the pickle asks for {qualname!r}, which is not "
                "on ckptools' allowlist of what checkpoints contain (loading it could run code)",
                global_name=qualname,
                path=self._source,
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise CorruptCheckpointError(f"{self._source}: unexpected persistent id in pickle")
        return self._persistent(pid)


def admit(
    *,
    enums: Iterable[str] = (),
    records: Iterable[str] = (),
    wrappers: Iterable[tuple[str, str]] = (),
) -> None:
    """Add a producer family's classes to :data:`ARCHIVE_GLOBALS` as data-only stand-ins: each
    of ``enums`` (qualified names) read as an :class:`EnumValue`, each of ``records`` as a
    :class:`Record`, each of ``wrappers`` (qualified name, attribute) as the plain tensor that
    tensor subclass holds in that attribute (:class:`torch_rebuild.WrapperClass`). Never the
    class itself: nothing of the producer is imported or run. Called by the producers' registry
    with what each family declares (``PICKLE_ENUMS``, ``PICKLE_RECORDS``, ``PICKLE_WRAPPERS``)."""
    ARCHIVE_GLOBALS.update({q: _enum_class(q) for q in enums})
    ARCHIVE_GLOBALS.update({q: _record_class(q) for q in records})
    ARCHIVE_GLOBALS.update({q: torch_rebuild.wrapper_class(q, a) for q, a in wrappers})


def restricted_loads(
    data: bytes,
    allowed: Mapping[str, Any],
    *,
    source: str,
    persistent_load: Callable[[Any], Any] | None = None,
    walk: bool = True,
) -> Any:
    """Unpickle ``data`` resolving globals only through ``allowed``, within a budget.

    ``walk``: visit the result once as a tree, counted and depth-capped, so that any later walk
    is bounded too. A reader that only follows named, type-checked fields (DCP ``.metadata``,
    where the walk would cost ~1 s at 878k chunks) passes False.

    Raises:
        UnsafeCheckpointError: the pickle names a global outside ``allowed``.
        DecodingLimitError: the value would exceed a decoding limit (the message names it).
        CorruptCheckpointError: the bytes are not a well-formed pickle of the expected kind.
    """
    budget = pickle_budget.DecodeBudget(source, len(data))
    try:
        with pickle_budget.decoding(budget):
            pickle_scan.check(data, budget)
            value = _RestrictedUnpickler(data, allowed, source, persistent_load).load()
            if walk:
                _walk(value, budget)
            return value
    except RecursionError as e:
        raise budget.too_deep() from e
    except CkptError:
        raise
    except Exception as e:
        raise CorruptCheckpointError(
            f"{source}: not a readable pickle ({type(e).__name__}: {' '.join(str(e).split())})",
            path=source,
        ) from e


def storage_persistent_load(pid: Any) -> StorageRef:
    """``persistent_load`` for ``torch.save`` archives: ('storage', type, key, location, numel)."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise CorruptCheckpointError(f"unexpected persistent id {short(pid)}")
    _, storage_type, key, location, numel = pid
    if not isinstance(storage_type, StorageType):
        raise CorruptCheckpointError(f"unexpected storage type {short(storage_type)}")
    if not (isinstance(key, str) and isinstance(location, str) and isinstance(numel, int)):
        raise CorruptCheckpointError(f"unexpected persistent id {short(pid)}")
    return StorageRef(str(key), storage_type.dtype, str(location), int(numel))


def plain(value: Any) -> Any:
    """Turn stand-ins into plain, JSON-friendly Python values (for display and comparison)."""
    if isinstance(value, _BytesIOStandIn):
        value = value.value
    if isinstance(value, _NumpyArrayStandIn):
        value = value.value
    if isinstance(value, BytesValue):
        return {"type": "io.BytesIO", "bytes": len(value.data)}
    if isinstance(value, ArrayValue):
        return {"type": "numpy.ndarray", "dtype": value.dtype, "shape": list(value.shape)}
    if isinstance(value, TensorRef):
        return {"type": "tensor", "dtype": value.dtype, "shape": list(value.shape)}
    if isinstance(value, OtherTensor):
        return {"type": "tensor", "kind": value.kind, "dtype": value.dtype, "shape": value.shape}
    if isinstance(value, bytes | bytearray):
        return {"type": "bytes", "bytes": len(value)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(v) for v in value]
    if isinstance(value, complex):
        return {"type": "complex", "real": value.real, "imag": value.imag}
    if isinstance(value, EnumValue):
        return {"type": value.enum.rsplit(".", 1)[-1], "value": plain(value.value)}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return {"type": type(value).__name__, "repr": short(value)[:200]}


def unwrap(value: Any) -> Any:
    """Replace ``io.BytesIO`` / numpy stand-ins by :class:`BytesValue` / :class:`ArrayValue`."""
    if isinstance(value, _BytesIOStandIn | _NumpyArrayStandIn):
        return value.value
    return value
