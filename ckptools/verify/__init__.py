"""``ckptools.verify``: prove that a checkpoint is whole, or name what is wrong with it.

Two levels, each reporting every problem it finds as a :class:`Finding` (never stopping at the
first one, never raising for damage):

* **structure** (``quick=True`` stops here; metadata and ``stat`` only, seconds at any size): the
  commit marker is present; every referenced file exists and is long enough for every recorded
  byte range; items in one file do not overlap; each tensor's chunks tile its global shape with no
  gap and no overlap (:func:`ckptools.core.geometry.tiling_problems`, linear in the number of
  chunks, the check consolidate and reshard make too); a safetensors index and its shards agree.
* **content**: every chunk is read once, streaming, in blocks (memory = ``workers × block``),
  files in parallel: each DCP item's ``torch.save`` archive is parsed (its pickle through the
  allowlist: tensors only, objects are never unpickled) and must hold a tensor of the recorded
  dtype and shape; the CRC-32 that the zip format stores for every record is recomputed, so a
  flipped bit is found and named (file, FQN, chunk, rank); ``check_finite`` counts NaN/Inf per
  tensor; a checksum manifest (:mod:`ckptools.verify.checksums`), when present, is checked per
  chunk and per file.

``against=`` adds a :func:`ckptools.diff` of the model against another checkpoint.

The package, one module per idea: :mod:`~ckptools.verify.report` (what is returned),
:mod:`~ckptools.verify.structure`, :mod:`~ckptools.verify.scan` (the two levels),
:mod:`~ckptools.verify.digests` and :mod:`~ckptools.verify.checksums` (the checksum manifest: its
file, writing it, comparing with it), :mod:`~ckptools.verify.verifier` (``verify`` itself).
``verify_roundtrip`` (save, reload, compare in a training job) lives in
:mod:`ckptools.training.roundtrip` and is reached here on first use.

Example:
    >>> import ckptools
    >>> report = ckptools.verify("checkpoints/step-1000")  # doctest: +SKIP
    >>> report.ok, [f.message for f in report.findings]  # doctest: +SKIP
    (True, [])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptools.verify.report import Finding, FindingKind, VerifyReport
from ckptools.verify.verifier import verify

if TYPE_CHECKING:
    from ckptools.training.roundtrip import RoundtripReport, verify_roundtrip

__all__ = [
    "Finding",
    "FindingKind",
    "RoundtripReport",
    "VerifyReport",
    "verify",
    "verify_roundtrip",
]


def __getattr__(name: str) -> Any:
    # Training code imports torch: resolved on first use, so `ckpt verify` does not pay for it.
    if name in ("RoundtripReport", "verify_roundtrip"):
        from ckptools.training import roundtrip

        return getattr(roundtrip, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
