"""What :func:`ckptools.verify` reports: a :class:`Finding` per problem, in a :class:`VerifyReport`.

Damage is data, never an exception: every finding names the file, FQN, rank and chunk it is
about, as text for a person and as fields for a program (``ckpt verify --json``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from ckptools.verbs.diff import DiffReport

FindingKind = Literal[
    "missing_file",  # a file the metadata refers to does not exist
    "truncated",  # a file ends before a recorded byte range
    "no_marker",  # the commit marker (.metadata, index) is missing: the save never finished
    "metadata",  # the marker or metadata cannot be read or is inconsistent
    "unsafe",  # the metadata asks to run code (refused, never run)
    "corrupt",  # another inconsistency found while reading the manifest
    "tiling",  # a tensor's chunks leave a gap, overlap, or lie outside its shape
    "overlap",  # two items share bytes of one file
    "index",  # a safetensors index and its shards disagree
    "unreadable",  # a chunk's archive cannot be parsed
    "dtype_shape",  # a chunk holds another dtype or shape than the metadata records
    "crc",  # a zip record's CRC-32 does not match its bytes
    "nonfinite",  # NaN/Inf values (check_finite)
    "checksum",  # bytes differ from the checksum manifest
]


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem: what kind, a message naming file/FQN/rank, and those facts as fields."""

    kind: FindingKind
    message: str
    file: str | None = None
    fqn: str | None = None
    rank: int | None = None
    chunk: tuple[int, ...] | None = None  # offsets of the chunk in the global tensor

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "message": self.message,
            "file": self.file,
            "fqn": self.fqn,
            "rank": self.rank,
            "chunk": list(self.chunk) if self.chunk is not None else None,
        }


@dataclass(frozen=True)
class VerifyReport:
    """The result of :func:`verify`.

    Attributes:
        findings: every problem found; empty when the checkpoint is whole.
        checksum_file: where the checksum manifest is (or would be written).
        checksums_checked: whether a checksum manifest was found and checked.
        diff: the comparison with ``against``, when asked for.
    """

    path: str
    format: str | None
    layout: str | None
    quick: bool
    check_finite: bool
    findings: tuple[Finding, ...]
    tensors: int = 0
    chunks: int = 0
    files: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    checksum_file: str | None = None
    checksums_checked: bool = False
    diff: DiffReport | None = None

    @property
    def ok(self) -> bool:
        """No findings, and no differences from ``against``."""
        return not self.findings and (self.diff is None or self.diff.identical)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "layout": self.layout,
            "ok": self.ok,
            "quick": self.quick,
            "check_finite": self.check_finite,
            "tensors": self.tensors,
            "chunks": self.chunks,
            "files": self.files,
            "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 4),
            "checksum_file": self.checksum_file,
            "checksums_checked": self.checksums_checked,
            "findings": [f.to_dict() for f in self.findings],
            "diff": self.diff.to_dict() if self.diff is not None else None,
        }
