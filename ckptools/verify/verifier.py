"""``verify()``: the structure check, the content scan, the checksum manifest and ``against``, in
that order (see :mod:`ckptools.verify`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ckptools.engine import collective
from ckptools.errors import CorruptCheckpointError, UsageError
from ckptools.formats.stream_transforms import require_decodable
from ckptools.io import storage, tunables
from ckptools.verify import checksums, scan
from ckptools.verify.report import Finding, VerifyReport
from ckptools.verify.structure import check_structure, read

if TYPE_CHECKING:
    from ckptools.verbs.diff import DiffReport


@storage.accepts_storage_options
def verify(
    path: str,
    *,
    quick: bool = False,
    check_finite: bool = False,
    workers: int | None = None,
    against: str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    format: str | None = None,
    quiet: bool = False,
    distributed: bool = False,
    storage_options: storage.StorageOptions | None = None,
) -> VerifyReport:
    """Check that the checkpoint at ``path`` is whole; report every problem found.

    Damage is reported as findings, not raised: a missing or truncated rank file, a garbled or
    missing ``.metadata``, chunks that do not tile a tensor, a flipped bit (CRC-32), bytes that
    differ from the checksum manifest, NaN/Inf (with ``check_finite``). Code stored in the
    checkpoint is never run: pickles go through the allowlist and objects are not unpickled.

    Args:
        path: a checkpoint ckptools reads (DCP directory or a wrapper of one, safetensors file
            or directory, ``torch.save`` file or directory).
        quick: structure only (metadata and file sizes; seconds at any size).
        check_finite: count NaN and Inf per floating tensor (a finding per tensor that has any).
        workers: files read in parallel (default ``CKPTOOLS_WORKERS`` or up to 4).
        against: also compare the model with this checkpoint (see :func:`ckptools.diff`).
        atol: absolute tolerance for ``against`` (default: bit-exact).
        rtol: relative tolerance for ``against`` (default: bit-exact).
        format: force the layout of ``path`` (as ``ckpt inspect --format``).
        quiet: no progress bar.
        distributed: under torchrun (``torchrun -m ckptools verify``), or called by every rank
            of an initialised process group: the files to read are split over the ranks by
            bytes and the findings gathered, so every rank returns the report one process would
            (:mod:`ckptools.engine.collective`). Off by default, because one rank of a training job
            calling ``verify`` alone is the common case.
        storage_options: fsspec options for URL paths (credentials, endpoint...), a mapping
            or its JSON text; see :func:`ckptools.io.storage.storage_options`.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is True when nothing was found (the same on
        every rank).

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        UnknownFormatError: ``path`` is no checkpoint ckptools recognises.
        UsageError: contradictory arguments (``quick`` with ``check_finite``).

    Example:
        >>> report = verify("checkpoints/step-1000", check_finite=True)  # doctest: +SKIP
        >>> for f in report.findings:  # doctest: +SKIP
        ...     print(f.kind, f.file, f.fqn, f.rank, f.message)
    """
    if quick and check_finite:
        raise UsageError("quick checks structure only; it cannot check values (drop --quick)")
    t0 = time.perf_counter()
    n_workers = tunables.workers(workers)
    block = scan.resolve_block_bytes()
    ranks = collective.current(distributed)
    manifest, findings = read(path, format)
    if manifest is None:
        diff_report = _diff(ranks, path, against, atol, rtol, format, findings)
        return VerifyReport(
            path, None, None, quick, check_finite, tuple(findings),
            seconds=time.perf_counter() - t0, diff=diff_report,
        )  # fmt: skip
    require_decodable(manifest)  # even under --quick, whose OK would promise a readable one
    structure = check_structure(manifest)
    findings.extend(structure.findings)
    sums, sum_findings = checksums.load_for_verify(manifest, structure.sizes, structure.root)
    findings.extend(sum_findings)
    bytes_read = 0
    if not quick:
        options = scan.ScanOptions(
            check_finite=check_finite, digests=sums is not None, block=block, workers=n_workers,
            quiet=quiet or not ranks.is_root,
        )  # fmt: skip
        content = scan.scan_content(ranks, structure, options)
        findings.extend(content.findings)
        bytes_read = content.bytes_read
        if sums is not None and content.digests is not None:
            findings.extend(checksums.compare_checksums(sums, content.digests, structure.items))
    diff_report = _diff(ranks, path, against, atol, rtol, format, findings)
    return VerifyReport(
        path=path,
        format=manifest.format,
        layout=manifest.layout,
        quick=quick,
        check_finite=check_finite,
        findings=tuple(findings),
        tensors=len(manifest.tensors),
        chunks=sum(len(t.chunks) for t in manifest.tensors.values()),
        files=len(manifest.files),
        bytes_read=bytes_read,
        seconds=time.perf_counter() - t0,
        checksum_file=checksums.checksum_path(manifest),
        checksums_checked=sums is not None and not quick,
        diff=diff_report,
    )


def _diff(
    ranks: collective.Ranks,
    path: str,
    against: str | None,
    atol: float | None,
    rtol: float | None,
    format: str | None,
    findings: list[Finding],
) -> DiffReport | None:
    """The comparison with ``against`` (rank 0 compares; every rank gets its report). A record
    the comparison finds damaged (``diff`` checks CRCs as it reads) ends it: no report, and
    the damage joins ``findings`` unless the scan of ``path`` found it already."""
    if against is None:
        return None
    from ckptools.verbs.diff import diff

    def compare() -> tuple[DiffReport | None, Finding | None]:
        try:
            return diff(path, against, atol=atol, rtol=rtol, format_a=format), None
        except CorruptCheckpointError as e:
            return None, Finding("crc", f"--against: {e}", e.path, e.fqn, e.rank)

    report, damaged = ranks.from_root(compare, "verify --against")
    if damaged is not None and not any(f.kind == "crc" and f.fqn == damaged.fqn for f in findings):
        findings.append(damaged)
    return report
