"""What a tensor in a pickle becomes: a description of its bytes, never the bytes (torch-free).

The allowlist unpickler (:mod:`ckptools.formats.safe_pickle`) turns torch's rebuild calls into
these values (:mod:`ckptools.formats.torch_rebuild`): a dense tensor is a :class:`TensorRef`, a
byte range of a storage record described by dtype, offset, shape and strides; a tensor that is
not one byte range (sparse, nested, quantized, meta, built from values inside the pickle) is an
:class:`OtherTensor` that says what it is, so a reader can refuse it by name instead of dropping
it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ckptools.core.sizes import human_bytes

#: An expanded view (``t.expand``: stride 0 over a dim longer than 1) declares more elements
#: than its storage holds, and writing it out materializes every one of them in memory: a
#: 2 KiB ``torch.save`` file declared 64 GiB over the 4 bytes of one float that way. Beyond
#: this many bytes such a tensor is refused when it is read, before anything is allocated.
EXPANDED_VIEW_MAX_BYTES = 64 * 2**20


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

    def span_bytes(self, itemsize: int) -> int:
        """Bytes of its storage from its first element to its last (0 when it is empty)."""
        if math.prod(self.shape) == 0:
            return 0
        last = sum((s - 1) * st for s, st in zip(self.shape, self.strides, strict=True))
        return (last + 1) * itemsize

    def expansion_problem(self, itemsize: int) -> str | None:
        """Why the tensor cannot be written out: it declares more bytes than its storage span
        holds (an expanded view) and more than :data:`EXPANDED_VIEW_MAX_BYTES`; None if fine."""
        numel = math.prod(self.shape)
        declared, span = numel * itemsize, self.span_bytes(itemsize)
        if declared <= max(span, EXPANDED_VIEW_MAX_BYTES):
            return None
        return (
            f"declares {numel} elements ({human_bytes(declared)}) over {span} bytes of storage "
            f"(strides {list(self.strides)}), an expanded view that writing it out would "
            "materialize in memory; re-save it with t.contiguous() if it really holds that much"
        )


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
