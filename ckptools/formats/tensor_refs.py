"""What a tensor in a pickle becomes: a description of its bytes, never the bytes (torch-free).

The allowlist unpickler (:mod:`ckptools.formats.safe_pickle`) turns torch's rebuild calls into
these values (:mod:`ckptools.formats.torch_rebuild`): a dense tensor is a :class:`TensorRef`, a
byte range of a storage record described by dtype, offset, shape and strides; a tensor that is
not one byte range (sparse, nested, quantized, meta, built from values inside the pickle) is an
:class:`OtherTensor` that says what it is, so a reader can refuse it by name instead of dropping
it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class DTypeName(str):
    """A torch dtype named in a pickle (``torch.float32`` → ``DTypeName("float32")``)."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class StorageType:
    """A ``torch.*Storage`` class named in a pickle; ``dtype`` None is ``UntypedStorage``."""

    dtype: str | None


@dataclass(frozen=True, slots=True)
class StorageRef:
    """A storage a ``torch.save`` pickle refers to: bytes live in ``<prefix>/data/<key>``."""

    key: str
    dtype: str | None
    location: str
    numel: int  # elements of ``dtype`` (bytes when dtype is None)


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor in a ``torch.save`` pickle, described without its bytes."""

    storage: StorageRef
    storage_offset: int  # in elements
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    flags: tuple[str, ...] = ()  # e.g. ("conj",): bits raw copying cannot honour

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


@dataclass(frozen=True, slots=True)
class OtherTensor:
    """A tensor ``torch.load(weights_only=True)`` accepts that is not one dense byte range.

    ``kind`` says what it is (``"sparse_coo"``, ``"nested"``, ``"quantized"``, ``"meta"``...),
    ``shape`` its size when the pickle says, and ``parts`` the stored tensors it is made of (as
    :class:`TensorRef`, still lazy) or the pickled values that define it.
    """

    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    parts: tuple[Any, ...] = ()

    def describe(self) -> str:
        dims = f" of shape {list(self.shape)}" if self.shape is not None else ""
        dt = f" {self.dtype}" if self.dtype else ""
        return f"a {self.kind}{dt} tensor{dims}"
