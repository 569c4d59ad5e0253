"""What ``inspect`` shows of torchao's float8 training wrappers in DCP items.

torchao's ``convert_to_float8_training`` (with ``Float8LinearConfig(enable_fsdp_float8_all_gather=
True)``) keeps each Linear weight as a ``WeightWithDynamicFloat8CastTensor`` holding the
high-precision weight in ``_tensor``. ``dcp.save`` pickles each item of such a weight as::

    torch._tensor._rebuild_from_type_v2(
        torch._utils._rebuild_wrapper_subclass,
        torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor,
        (cls, torch.bfloat16, size, stride, storage_offset, torch.strided, device, False),
        {"_tensor": torch._utils._rebuild_parameter(torch._utils._rebuild_tensor_v2(...)),
         "_linear_mm_config": LinearMMConfig(ScaledMMConfig(...) x 3),
         "_dtype": torch.float8_e4m3fn, "_precomputed_scale": None},
    )

and ``.metadata`` records a plain tensor of the weight's dtype and size: nothing there says an
item is wrapped. The package declares the class (``PICKLE_WRAPPERS``), so every reader takes the
``_tensor`` it holds, bit-exactly, without torchao (:class:`ckptools.formats.torch_rebuild.
WrapperClass`); what this module adds is ``inspect``'s account of which tensors were stored so,
read from the first item of each two-dimensional tensor (torchao wraps only Linear weights):
one small pickle per tensor, no tensor bytes; a DCP whose first 16 hold no wrapper is plain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptools.core.manifest import Manifest, TensorEntry
from ckptools.errors import CkptError
from ckptools.formats import safe_pickle, torch_archive, torch_rebuild
from ckptools.io import storage

#: ``inspect --json``'s key of these facts
KEY = "float8_training"
#: what ``inspect`` calls a tensor stored this way
LABEL = "float8 training wrapper"
_SHOWN = 8
#: two-dimensional tensors read before a DCP with no wrapper among them is taken as plain: the
#: embedding comes first, then Linear weights, which torchao wraps all or none of (an inspect
#: of a plain 405B DCP reads this many small pickles, not one per tensor)
_PROBED = 16


@dataclass(frozen=True, slots=True)
class _Wrapped:
    """An item whose tensor was a declared wrapper subclass (its class's qualified name)."""

    qualname: str
    dtype: str


_PLAIN_REBUILD = torch_rebuild.TORCH_GLOBALS["torch._tensor._rebuild_from_type_v2"]


def _seen(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    # the house's rebuild (which checks the wrapper and takes its tensor), remembering the class
    ref = _PLAIN_REBUILD(func, new_type, args, state)
    if isinstance(new_type, type) and issubclass(new_type, torch_rebuild.WrapperClass):
        return _Wrapped(new_type.qualname, ref.dtype)
    return ref


def _candidates(m: Manifest) -> list[TensorEntry]:
    return [
        t
        for t in m.tensors.values()
        if len(t.shape) == 2
        and t.chunks
        and t.chunks[0].encoding == "torch_save"
        and not t.chunks[0].transforms
    ]


def facts(m: Manifest) -> dict[str, Any] | None:
    """The tensors whose DCP items hold a declared wrapper subclass, with the classes; None
    when there are none. An item that does not read is left to the verbs (verify names it)."""
    candidates = _candidates(m)
    if not candidates:
        return None
    allowed = {**safe_pickle.ARCHIVE_GLOBALS, "torch._tensor._rebuild_from_type_v2": _seen}
    tensors: dict[str, str] = {}
    classes: dict[str, int] = {}
    with storage.open_reader(m.data_dir()) as reader:
        for i, t in enumerate(candidates):
            if i == _PROBED and not tensors:
                break  # torchao wraps every Linear weight: a plain DCP is told by its first few
            c = t.chunks[0]
            try:
                archive = torch_archive.read_archive(reader, c.file, c.offset, c.length)
                value = torch_archive.load_pickle(reader, archive, allowed)
            except CkptError:
                continue
            if isinstance(value, _Wrapped):
                tensors[t.fqn] = value.qualname
                classes[value.qualname] = classes.get(value.qualname, 0) + 1
    if not tensors:
        return None
    return {"label": LABEL, "tensors": tensors, "classes": classes}


def lines(f: dict[str, Any]) -> list[str]:
    """``inspect``'s lines of the facts :func:`facts` gave (read back from its JSON)."""
    names = list(f["tensors"])
    shown = ", ".join(names[:_SHOWN]) + (
        f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    )
    kinds = ", ".join(f"{q.rsplit('.', 1)[-1]} x{n}" for q, n in sorted(f["classes"].items()))
    return [
        f"  {f['label']}: {len(names)} tensor(s) stored as torchao {kinds}, read as the plain "
        f"tensor each wraps (torchao not needed): {shown}"
    ]
