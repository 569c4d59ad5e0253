"""Checks of a push that need no network: is the directory a whole model, is every file within
the Hub's per-file limit, is the repository id valid.

Each runs before the first request, so a push never leaves half a model on the Hub. The limits
are named here with their reasons; each can be overridden by a ``CKPTOOLS_HUB_*`` variable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from ckptools.core.manifest import Manifest
from ckptools.core.sizes import human_size, parse_size
from ckptools.errors import (
    CheckpointNotFoundError,
    HubFileTooLargeError,
    IncompleteCheckpointError,
    UnknownFormatError,
    UsageError,
)
from ckptools.hub.errors import SUGGESTED_MAX_SHARD_SIZE, first_line
from ckptools.io.tunables import env_size

#: The Hub rejects any single file over 50 GB (its documented hard limit per file; it recommends
#: far smaller files). Decimal GB, the smaller reading of "50 GB", so a file that passes here is
#: never refused there. Override with ``max_file_bytes=`` or ``CKPTOOLS_HUB_MAX_FILE_BYTES``
#: (tests use a tiny limit; a self-hosted Hub may allow more).
HUB_MAX_FILE_BYTES = 50 * 10**9
MAX_FILE_BYTES_ENV = "CKPTOOLS_HUB_MAX_FILE_BYTES"
#: Above this many bytes, weight files go through ``upload_folder``'s multi-commit upload (see
#: :mod:`ckptools.hub`): at ~100 MB/s, 100 GB is hours of upload, long enough that an interruption
#: should not throw away everything already sent. Below it, one atomic commit. Override with
#: ``CKPTOOLS_HUB_LARGE_FOLDER_BYTES``.
LARGE_FOLDER_BYTES = 100 * 10**9
LARGE_FOLDER_BYTES_ENV = "CKPTOOLS_HUB_LARGE_FOLDER_BYTES"
#: Directories never uploaded: git metadata and huggingface_hub's own upload state.
_SKIP_DIRS = frozenset({".git", ".cache"})
_SHARD_NAME = re.compile(r"-\d{5}-of-\d{5}\.safetensors$")


def resolve_max_file_bytes(value: str | int | None = None) -> int:
    """The per-file limit: ``value`` > ``CKPTOOLS_HUB_MAX_FILE_BYTES`` > the Hub's 50 GB."""
    if value is not None:
        return parse_size(value)
    return env_size(MAX_FILE_BYTES_ENV, HUB_MAX_FILE_BYTES)


def large_folder_bytes() -> int:
    """``CKPTOOLS_HUB_LARGE_FOLDER_BYTES`` > :data:`LARGE_FOLDER_BYTES`."""
    return env_size(LARGE_FOLDER_BYTES_ENV, LARGE_FOLDER_BYTES)


def list_files(directory: str) -> list[tuple[str, int]]:
    """``(path in repo, size)`` of every regular file under ``directory``, sorted, without
    ``.git/`` and ``.cache/`` (git metadata and ``huggingface_hub``'s upload state)."""
    out: list[tuple[str, int]] = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in names:
            full = os.path.join(root, name)
            if not os.path.isfile(full):
                continue  # a socket, a broken link: nothing the Hub could hold
            rel = os.path.relpath(full, directory).replace(os.sep, "/")
            out.append((rel, os.path.getsize(full)))
    out.sort()
    return out


def check_model_directory(directory: str) -> Manifest:
    """Check that ``directory`` is a complete model directory; return its manifest.

    Uses :func:`ckptools.verify` at the structural level (headers and file sizes, no tensor
    data): the index names only shards that exist and hold what it says, no file is truncated.
    Also refuses shards that the index does not name (left from an earlier run), sharded files
    without their index (the index is written last, so the save never finished), and directories
    without weights.

    Raises:
        CheckpointNotFoundError: ``directory`` does not exist or is not a directory.
        IncompleteCheckpointError: no weights, or a missing, truncated, stray or unindexed file
            (the message names it).
        UsageError: ``directory`` is a distributed checkpoint, not a model directory.
    """
    from ckptools.producers import detect, read_manifest
    from ckptools.verify import verify

    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "no such directory"
        raise CheckpointNotFoundError(
            f"{directory}: {what}; push a model directory (from ckpt consolidate)", path=directory
        )
    try:
        layout = detect(directory)
    except UnknownFormatError as e:
        raise IncompleteCheckpointError(
            f"{directory}: no model weights (*.safetensors or pytorch_model*.bin); push a "
            "directory written by ckpt consolidate or save_pretrained",
            path=directory,
        ) from e
    if not layout.model_directory:
        raise UsageError(
            f"{directory}: a {layout.name} checkpoint, not a model directory: consolidate it "
            f"first (ckpt consolidate {directory} OUT), then push OUT"
        )
    report = verify(directory, quick=True, quiet=True)
    if report.findings:
        first = report.findings[0]
        more = len(report.findings) - 1
        raise IncompleteCheckpointError(
            f"not a complete model directory: {first.message}"
            + (f" (and {more} more problem(s): ckpt verify {directory})" if more else "")
            + "; nothing was uploaded",
            path=os.path.join(directory, first.file) if first.file else directory,
            fqn=first.fqn,
        )
    manifest = read_manifest(directory)
    stray = _stray_weights(directory, manifest)
    if stray is not None:
        name, why = stray
        path = os.path.join(directory, name)
        raise IncompleteCheckpointError(f"{path}: {why}; nothing was uploaded", path=path)
    return manifest


def _stray_weights(directory: str, manifest: Manifest) -> tuple[str, str] | None:
    """A ``.safetensors`` file that loaders would not read as part of the model, and why: one
    the index does not name (left from an earlier run), or a shard without any index (the index
    is written last, so the save never finished)."""
    if manifest.format != "safetensors":
        return None
    top = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if manifest.markers:
        stray = [n for n in top if n not in manifest.files]
        if stray:
            return stray[0], (
                f"not named by {manifest.markers[0]} (left from an earlier save?); loaders "
                "ignore it and the Hub would store it: remove it, or consolidate into a new "
                "directory"
            )
        return None
    sharded = [n for n in top if _SHARD_NAME.search(n)]
    if sharded:
        return sharded[0], (
            "a shard, but the directory has no model.safetensors.index.json (written last, so "
            "the save never finished): consolidate again"
        )
    return None


def preflight(repo_id: str, *, max_shard_size: str | int | None = None) -> None:
    """Checks of a push that need neither the directory nor the network: a valid repository id
    and, for a consolidation about to be pushed, a ``max_shard_size`` within the per-file limit
    (so a too-large shard is refused before hours of consolidation, not after).

    Raises:
        UsageError: an invalid ``repo_id``, or ``max_shard_size`` over the limit.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id  # type: ignore[attr-defined]

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise UsageError(f"repo id {repo_id!r}: {first_line(str(e))}") from e
    if max_shard_size is not None:
        limit = resolve_max_file_bytes()
        if parse_size(max_shard_size) > limit:
            raise UsageError(
                f"--max-shard-size {max_shard_size} is over the Hub's limit of {human_size(limit)} "
                f"per file: use --max-shard-size {SUGGESTED_MAX_SHARD_SIZE}"
            )


def check_sizes(
    files: Sequence[tuple[str, int]],
    limit: int,
    *,
    directory: str,
    repo_id: str,
    source: str | None = None,
) -> None:
    """Raise before any upload if a file is over the Hub's per-file limit.

    Raises:
        HubFileTooLargeError: names the largest such file and the ``--max-shard-size`` to use.
    """
    over = [(name, size) for name, size in files if size > limit]
    if not over:
        return
    name, size = max(over, key=lambda f: f[1])
    redo = f"ckpt consolidate {source or 'SRC'} NEW_DIR --max-shard-size {SUGGESTED_MAX_SHARD_SIZE}"
    raise HubFileTooLargeError(
        f"{os.path.join(directory, name)}: {size} bytes ({human_size(size)}), over the Hub's "
        f"limit of {limit} bytes ({human_size(limit)}) per file"
        + (f" ({len(over)} files are)" if len(over) > 1 else "")
        + f"; nothing was uploaded: re-consolidate with smaller shards: {redo}",
        repo_id=repo_id,
        path=os.path.join(directory, name),
    )
