"""``ckptools.push_to_hub``: publish a model directory to the Hugging Face Hub, checked first.

Everything that can be checked locally is checked before the first request, so a push never
leaves half a model on the Hub:

1. **Complete.** The directory must be a model directory (safetensors, or ``pytorch_model*.bin``)
   that :func:`ckptools.verify` finds whole at the structural level: the index and the shards
   agree, no shard is missing or truncated, and no stray shard lies beside the ones the index
   names. A DCP checkpoint is refused with the ``ckpt consolidate`` command that makes one.
2. **Within the Hub's limits.** Every file is compared with :data:`HUB_MAX_FILE_BYTES`; a file over
   it fails the push before anything is sent, naming the ``--max-shard-size`` that fixes it.
3. **Described.** Unless the directory has its own ``README.md``, a model card is generated: YAML
   metadata (``library_name``, tags, and a ``ckptools`` block with the source checkpoint, step,
   world size, dtype and each file's SHA-256) and a short body. The card is uploaded from memory,
   never written into the directory: the directory stays exactly what ``ckpt consolidate`` (or
   the user) made it, a read-only directory can be pushed, and a later push of the same directory
   regenerates the card rather than mistaking an old generated card for the user's own.

Then the repository is created if needed and the files are uploaded with ``huggingface_hub``: as
one commit (:meth:`HfApi.create_commit`, which ``upload_folder`` also ends in), so the repository
goes from its previous state to the complete model at once; or, for directories above
:data:`LARGE_FOLDER_BYTES`, the weight files through ``upload_folder`` (which in
``huggingface_hub`` >= 1.x streams them through Xet in several commits, so an interruption keeps
what was committed) followed by one last commit with the index, config and card, so loaders that
start from the index never see a partial model. Uploads are content-addressed (LFS/Xet), and a
file the Hub already holds with the same content is left out of the commit, so re-running a push
that failed resumes it.

Errors the Hub answers (401, 403, 404, 409, ...) and an unreachable Hub become
:class:`~ckptools.errors.HubError` subclasses whose one-line message says what to do.

``huggingface_hub`` is imported only inside the functions that talk to the Hub, so
``import ckptools`` and ``ckpt --help`` stay light.

Example:
    >>> import ckptools
    >>> r = ckptools.push_to_hub("hf_model", "me/my-model", private=True)  # doctest: +SKIP
    >>> r.commit_url  # doctest: +SKIP
    'https://huggingface.co/me/my-model/commit/4f1c...'
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptools.core.manifest import Manifest
from ckptools.errors import (
    CheckpointNotFoundError,
    CkptError,
    HubAuthError,
    HubConflictError,
    HubConnectionError,
    HubError,
    HubFileTooLargeError,
    HubNotFoundError,
    IncompleteCheckpointError,
    UnknownFormatError,
    UsageError,
)
from ckptools.io.progress import ByteProgress
from ckptools.tunables import WORKERS_ENV, env_int, env_size

log = logging.getLogger(__name__)

#: The Hub rejects any single file over 50 GB (its documented hard limit per file; it recommends
#: far smaller files). Decimal GB, the smaller reading of "50 GB", so a file that passes here is
#: never refused there. Override with ``max_file_bytes=`` or ``CKPTOOLS_HUB_MAX_FILE_BYTES``
#: (tests use a tiny limit; a self-hosted Hub may allow more).
HUB_MAX_FILE_BYTES = 50 * 10**9
MAX_FILE_BYTES_ENV = "CKPTOOLS_HUB_MAX_FILE_BYTES"
#: Above this many bytes, weight files go through ``upload_folder``'s multi-commit upload (see the
#: module docstring): at ~100 MB/s, 100 GB is hours of upload, long enough that an interruption
#: should not throw away everything already sent. Below it, one atomic commit. Override with
#: ``CKPTOOLS_HUB_LARGE_FOLDER_BYTES``.
LARGE_FOLDER_BYTES = 100 * 10**9
LARGE_FOLDER_BYTES_ENV = "CKPTOOLS_HUB_LARGE_FOLDER_BYTES"
#: The shard size ckptools suggests when a file is over the limit: transformers' own default.
SUGGESTED_MAX_SHARD_SIZE = "5GB"
#: Hashing threads: hashlib releases the GIL on large buffers, so a few threads keep one disk busy.
DEFAULT_WORKERS = min(4, os.cpu_count() or 1)
CARD_NAME = "README.md"
#: Directories never uploaded: git metadata and huggingface_hub's own upload state.
_SKIP_DIRS = frozenset({".git", ".cache"})
_HASH_BLOCK_BYTES = 8 * 2**20
_SHARD_NAME = re.compile(r"-\d{5}-of-\d{5}\.safetensors$")
_STEP_PATTERNS = (
    re.compile(r"^checkpoint-(\d+)$"),  # transformers Trainer
    re.compile(r"^step[-_]?(\d+)$"),  # ckptools' CheckpointManager, torchtitan
    re.compile(r"^global_step_?(\d+)$"),  # DeepSpeed
    re.compile(r"(?:^|[-_])step=(\d+)"),  # Lightning's "epoch=0-step=100.ckpt"
)


@dataclass(frozen=True)
class HubFile:
    """One file of a push.

    Attributes:
        name: its path in the repository (``/``-separated).
        bytes: its size.
        sha256: hex SHA-256 of its content (None in a dry run, which reads no file data).
        generated: True for the model card ckptools generated (not a file of the directory).
    """

    name: str
    bytes: int
    sha256: str | None = None
    generated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "generated": self.generated,
        }


@dataclass(frozen=True)
class PushResult:
    """What :func:`push_to_hub` uploaded (or, with ``dry_run``, would upload).

    Attributes:
        directory: the model directory pushed.
        repo_id: the repository (``namespace/name`` once the Hub has resolved it).
        files: every file of the commit, the generated model card included.
        total_bytes: their total size.
        card: ``"generated"`` (ckptools wrote the model card) or ``"existing"`` (the directory's
            own ``README.md`` was uploaded as is).
        card_text: the generated model card, or None.
        provenance: where the weights came from (the ``ckptools`` block of the card).
        max_file_bytes: the per-file limit the files were checked against.
        method: ``"single_commit"`` or ``"multi_commit"`` (large directories); None for a dry run.
        created_repo: whether the push created the repository (None for a dry run).
        repo_url: the repository's URL, once known.
        commit_url: the URL of the commit (of the last commit, for ``multi_commit``).
        commit_oid: that commit's hash.
        pr_url: the pull request opened with ``create_pr``.
        seconds: wall time of the whole call.
        hash_seconds: of which hashing the files for the card.
        notes: facts worth showing.
    """

    directory: str
    repo_id: str
    files: tuple[HubFile, ...]
    total_bytes: int
    card: Literal["generated", "existing"]
    provenance: Mapping[str, Any]
    max_file_bytes: int
    dry_run: bool = False
    private: bool = False
    revision: str | None = None
    create_pr: bool = False
    commit_message: str = ""
    endpoint: str | None = None
    card_text: str | None = None
    method: Literal["single_commit", "multi_commit"] | None = None
    created_repo: bool | None = None
    repo_url: str | None = None
    commit_url: str | None = None
    commit_oid: str | None = None
    pr_url: str | None = None
    seconds: float = 0.0
    hash_seconds: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "repo_id": self.repo_id,
            "dry_run": self.dry_run,
            "private": self.private,
            "revision": self.revision,
            "create_pr": self.create_pr,
            "commit_message": self.commit_message,
            "endpoint": self.endpoint,
            "files": [f.to_dict() for f in self.files],
            "total_bytes": self.total_bytes,
            "max_file_bytes": self.max_file_bytes,
            "card": self.card,
            "card_text": self.card_text,
            "provenance": dict(self.provenance),
            "method": self.method,
            "created_repo": self.created_repo,
            "repo_url": self.repo_url,
            "commit_url": self.commit_url,
            "commit_oid": self.commit_oid,
            "pr_url": self.pr_url,
            "seconds": round(self.seconds, 4),
            "hash_seconds": round(self.hash_seconds, 4),
            "notes": list(self.notes),
        }


# --------------------------------------------------------------------------------------------------
# Local checks (no network)
# --------------------------------------------------------------------------------------------------


def human_size(n: int) -> str:
    """``n`` bytes in decimal units, as the Hub states its limits and ``--max-shard-size`` reads
    them (``"50.0 GB"``)."""
    for unit, div in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def _count(n: int) -> str:
    for unit, div in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def resolve_max_file_bytes(value: str | int | None = None) -> int:
    """The per-file limit: ``value`` > ``CKPTOOLS_HUB_MAX_FILE_BYTES`` > the Hub's 50 GB."""
    if value is not None:
        from ckptools.core.sizes import parse_size

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
    from ckptools.layouts import detect, read_manifest
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
    if layout.name not in ("safetensors", "torch_save"):
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
    top = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if manifest.format == "safetensors" and manifest.markers:
        stray = [n for n in top if n not in manifest.files]
        if stray:
            raise IncompleteCheckpointError(
                f"{os.path.join(directory, stray[0])}: not named by {manifest.markers[0]} (left "
                "from an earlier save?); loaders ignore it and the Hub would store it: remove it, "
                "or consolidate into a new directory; nothing was uploaded",
                path=os.path.join(directory, stray[0]),
            )
    elif manifest.format == "safetensors":
        sharded = [n for n in top if _SHARD_NAME.search(n)]
        if sharded:
            raise IncompleteCheckpointError(
                f"{os.path.join(directory, sharded[0])}: a shard, but the directory has no "
                "model.safetensors.index.json (written last, so the save never finished): "
                "consolidate again; nothing was uploaded",
                path=os.path.join(directory, sharded[0]),
            )
    return manifest


def preflight(repo_id: str, *, max_shard_size: str | int | None = None) -> None:
    """Checks of a push that need neither the directory nor the network: a valid repository id
    and, for a consolidation about to be pushed, a ``max_shard_size`` within the per-file limit
    (so a too-large shard is refused before hours of consolidation, not after).

    Raises:
        UsageError: an invalid ``repo_id``, or ``max_shard_size`` over the limit.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id  # type: ignore[attr-defined]

    from ckptools.core.sizes import parse_size

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise UsageError(f"repo id {repo_id!r}: {_first_line(str(e))}") from e
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


# --------------------------------------------------------------------------------------------------
# Provenance and model card
# --------------------------------------------------------------------------------------------------


def step_of(path: str) -> int | None:
    """The training step a checkpoint path names (``checkpoint-500``, ``step-1000``,
    ``global_step300``, ``epoch=0-step=100.ckpt``), or from a Trainer's ``trainer_state.json``."""
    state = os.path.join(path, "trainer_state.json")
    if os.path.isfile(state):
        with (
            contextlib.suppress(OSError, ValueError, TypeError, KeyError),
            open(state, encoding="utf-8") as f,
        ):
            return int(json.load(f)["global_step"])
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    for part in reversed(parts[-3:]):
        for pattern in _STEP_PATTERNS:
            m = pattern.search(part)
            if m:
                return int(m.group(1))
    return None


def provenance(
    manifest: Manifest,
    source: str | None = None,
    *,
    sha256: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Where the weights of a model directory came from: the ``ckptools`` block of the card.

    Args:
        manifest: the model directory's manifest.
        source: the checkpoint it was consolidated from; read (metadata only) for its layout,
            world size and step. Only its last two path components are recorded, since a full
            local path can leak private names into a public card.
        sha256: file name → hex SHA-256 of the files pushed.

    Raises:
        CkptError: ``source`` is given but cannot be read.
    """
    from ckptools._version import __version__

    out: dict[str, Any] = {"version": __version__}
    if source is not None:
        from ckptools.layouts import read_manifest

        src = read_manifest(source)
        parts = os.path.normpath(os.path.abspath(source)).split(os.sep)
        out["source"] = "/".join(p for p in parts[-2:] if p)
        out["source_layout"] = src.layout
        if src.world_size is not None:
            out["world_size"] = src.world_size
        step = step_of(source)
        if step is not None:
            out["step"] = step
    per_dtype: dict[str, int] = {}
    for t in manifest.tensors.values():
        per_dtype[t.dtype] = per_dtype.get(t.dtype, 0) + t.numel
    ranked = sorted(per_dtype, key=lambda d: -per_dtype[d])
    if len(ranked) == 1:
        out["dtype"] = ranked[0]
    elif ranked:
        out["dtype"] = {d: per_dtype[d] for d in ranked}  # parameters per dtype
    out["parameters"] = manifest.total_params
    out["tensors"] = len(manifest.tensors)
    if sha256:
        out["checksums"] = {"algorithm": "sha256", "files": dict(sorted(sha256.items()))}
    return out


def _read_config(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def model_card(
    repo_id: str,
    prov: Mapping[str, Any],
    files: Sequence[HubFile],
    config: Mapping[str, Any],
) -> str:
    """The ``README.md`` ckptools writes: YAML metadata (``library_name``, tags, the ``ckptools``
    provenance block), what the weights are and where they came from, the files, and how to load.
    """
    import yaml  # a dependency of huggingface_hub

    tags = ["ckptools"]
    if any(f.name.endswith(".safetensors") for f in files):
        tags.append("safetensors")
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type:
        tags.append(model_type)
    meta = {"library_name": "transformers", "tags": tags, "ckptools": dict(prov)}
    front = yaml.safe_dump(meta, sort_keys=False, default_flow_style=False, allow_unicode=True)
    name = repo_id.rsplit("/", 1)[-1]
    lines = [f"---\n{front}---", "", f"# {name}", ""]
    if "source" in prov:
        lines.append(
            "Weights consolidated with ckptools from the PyTorch distributed checkpoint below."
        )
    else:
        lines.append("Model weights uploaded with ckptools.")
    lines += ["", "| | |", "|---|---|"]
    if "source" in prov:
        where = f"`{prov['source']}` ({prov['source_layout']}"
        if "world_size" in prov:
            where += f", {prov['world_size']} ranks"
        lines.append(f"| Source checkpoint | {where}) |")
    if "step" in prov:
        lines.append(f"| Step | {prov['step']} |")
    dtype = prov.get("dtype")
    if isinstance(dtype, Mapping):
        dtype = ", ".join(f"{d} ({_count(n)} parameters)" for d, n in dtype.items())
    if dtype:
        lines.append(f"| dtype | {dtype} |")
    lines.append(f"| Parameters | {_count(int(prov.get('parameters', 0)))} |")
    lines += ["", "## Files", "", "| file | size | sha256 |", "|---|---:|---|"]
    for f in files:
        if not f.generated:
            lines.append(f"| `{f.name}` | {human_size(f.bytes)} | `{f.sha256 or '-'}` |")
    arch = config.get("architectures")
    cls = arch[0] if isinstance(arch, list) and arch and isinstance(arch[0], str) else "AutoModel"
    lines += [
        "",
        "## Load",
        "",
        "```python",
        f"from transformers import {cls}",
        "",
        f'model = {cls}.from_pretrained("{repo_id}")',
        "```",
    ]
    if not config:
        lines += ["", "The repository has no `config.json`: `from_pretrained` needs one."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Hashing
# --------------------------------------------------------------------------------------------------


def _sha256(path: str, bar: ByteProgress) -> str:
    h = hashlib.sha256()
    buf = bytearray(_HASH_BLOCK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            h.update(view[:n])  # hashlib releases the GIL on large buffers: threads scale
            bar.update(n)
    return h.hexdigest()


def hash_files(
    directory: str, files: Sequence[tuple[str, int]], *, workers: int, quiet: bool
) -> dict[str, str]:
    """File name → hex SHA-256, files hashed in parallel."""
    total = sum(size for _, size in files)
    with (
        ByteProgress(total, "sha256", quiet=quiet) as bar,
        ThreadPoolExecutor(max_workers=max(1, min(workers, len(files)))) as pool,
    ):
        digests = pool.map(lambda f: _sha256(os.path.join(directory, f[0]), bar), files)
        return {name: d for (name, _), d in zip(files, digests, strict=True)}


# --------------------------------------------------------------------------------------------------
# Talking to the Hub
# --------------------------------------------------------------------------------------------------


def _network_errors() -> tuple[type[BaseException], ...]:
    """Exception types of a request that never got an answer, for whichever HTTP library this
    ``huggingface_hub`` uses (httpx2/httpx from 1.x on, requests before), without importing one
    it does not use."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, names in (
        ("httpx2", ("TransportError",)),
        ("httpx", ("TransportError",)),
        ("requests", ("ConnectionError", "Timeout")),
    ):
        mod = sys.modules.get(module)
        for name in names:
            cls = getattr(mod, name, None) if mod is not None else None
            if isinstance(cls, type) and issubclass(cls, BaseException):
                found.append(cls)
    return tuple(found)


def _first_line(text: str | None) -> str:
    if not text:
        return ""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:300]


def hub_error(
    e: BaseException, *, repo_id: str, endpoint: str, revision: str | None = None
) -> CkptError | None:
    """The one-line :class:`~ckptools.errors.HubError` for an exception of ``huggingface_hub``,
    or None when it is not a Hub failure (a bug, which must propagate as is)."""
    from huggingface_hub.utils import (  # type: ignore[attr-defined]
        HfHubHTTPError,
        HFValidationError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    resume = "re-running the push resumes it (files already on the Hub are not sent again)"
    if isinstance(e, OfflineModeIsEnabled):
        return HubConnectionError(
            f"{endpoint}: HF_HUB_OFFLINE is set, so nothing can be pushed: unset it and re-run",
            repo_id=repo_id,
        )
    if isinstance(e, HFValidationError):
        return UsageError(f"{repo_id!r}: {_first_line(str(e))}")
    if isinstance(e, HfHubHTTPError):
        response = getattr(e, "response", None)
        status = getattr(response, "status_code", None)
        said = _first_line(getattr(e, "server_message", None)) or _first_line(str(e))
        said = f" ({said})" if said else ""
        if isinstance(e, RevisionNotFoundError):
            return HubNotFoundError(
                f"{repo_id}: revision {revision or 'main'!r} not found{said}: push to an "
                "existing branch, or drop --revision",
                repo_id=repo_id,
                status=status,
            )
        if status == 401:
            return HubAuthError(
                f"{endpoint}: not authenticated (401){said}: log in with `hf auth login`, set "
                "HF_TOKEN, or pass --token with a token that has write access",
                repo_id=repo_id,
                status=status,
            )
        if status == 403:
            return HubAuthError(
                f"{repo_id}: no write access (403){said}: use a token with write permission on "
                f"the '{repo_id.split('/')[0]}' namespace (a fine-grained token needs it "
                "explicitly), or push to a repository of your own",
                repo_id=repo_id,
                status=status,
            )
        if isinstance(e, RepositoryNotFoundError) or status == 404:
            return HubNotFoundError(
                f"{repo_id}: repository not found (404){said}: check the name; a private "
                "repository also answers 404 to a token that cannot see it",
                repo_id=repo_id,
                status=status,
            )
        if status == 409:
            return HubConflictError(
                f"{repo_id}: conflict (409){said}: the repository changed or was busy while "
                f"pushing; {resume}",
                repo_id=repo_id,
                status=status,
            )
        if status == 413:
            return HubFileTooLargeError(
                f"{repo_id}: the Hub refused the upload as too large (413){said}: re-consolidate "
                f"with a smaller --max-shard-size (e.g. {SUGGESTED_MAX_SHARD_SIZE})",
                repo_id=repo_id,
                status=status,
            )
        if status is not None and status >= 500:
            return HubError(
                f"{endpoint}: the Hub failed ({status}){said}: try again later; {resume}",
                repo_id=repo_id,
                status=status,
            )
        return HubError(
            f"{repo_id}: the Hub refused the request ({status}){said}",
            repo_id=repo_id,
            status=status,
        )
    if isinstance(e, ValueError) and str(e).startswith("Invalid metadata in README.md"):
        # The client's own check of a README.md front matter (a 400 of /api/validate-yaml).
        details = " ".join(line.lstrip("- ") for line in str(e).splitlines()[1:3])
        return HubError(
            f"{repo_id}: the Hub refused the metadata of README.md ({details}): fix its YAML front "
            "matter, or remove README.md to have ckptools write a model card",
            repo_id=repo_id,
            status=400,
        )
    if isinstance(e, ValueError) and str(e).startswith("LFS batch API returned errors"):
        said = " ".join(str(e).splitlines()[1:3])
        return HubError(f"{repo_id}: the Hub refused an upload ({said}); {resume}", repo_id=repo_id)
    if isinstance(e, _network_errors()):
        return HubConnectionError(
            f"{endpoint}: cannot reach the Hub ({type(e).__name__}: {_first_line(str(e))}): check "
            f"the network and the endpoint (HF_ENDPOINT, --endpoint); {resume}",
            repo_id=repo_id,
        )
    return None


@contextlib.contextmanager
def _hub_progress(quiet: bool) -> Iterator[None]:
    """huggingface_hub's own progress bars off for ``quiet`` (restored afterwards)."""
    from huggingface_hub.utils import (  # type: ignore[attr-defined]
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    was_disabled = are_progress_bars_disabled()
    if quiet and not was_disabled:
        disable_progress_bars()
    try:
        yield
    finally:
        if quiet and not was_disabled:
            enable_progress_bars()


def _create_repo(api: Any, repo_id: str, private: bool) -> tuple[str, str, bool]:
    """Create the repository if it does not exist: ``(repo_id, url, created)``.

    ``create_repo(exist_ok=True)`` would hide whether the repository existed; knowing it lets a
    ``private`` push refuse to go into an existing public repository.
    """
    from huggingface_hub.utils import HfHubHTTPError  # type: ignore[attr-defined]

    try:
        url = api.create_repo(repo_id, private=True if private else None, exist_ok=False)
        return str(getattr(url, "repo_id", None) or repo_id), str(url), True
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status not in (409, 401, 402, 403):
            raise
        try:
            # 409: it exists. 401/402/403: a token that may not create repositories here may
            # still write to an existing one; the commit will tell.
            info = api.repo_info(repo_id)
        except HfHubHTTPError:
            if status == 409:
                return repo_id, f"{api.endpoint}/{repo_id}", False
            raise e from None
    if private and info.private is False:
        raise UsageError(
            f"{repo_id} already exists and is public; private=True applies only to a new "
            "repository: make it private on the Hub first, or push without --private"
        )
    return str(info.id or repo_id), f"{api.endpoint}/{info.id or repo_id}", False


def _additions(
    directory: str, names: Sequence[str], sha256: Mapping[str, str], card: bytes | None
) -> list[Any]:
    from huggingface_hub import CommitOperationAdd

    ops = []
    for name in names:
        op = CommitOperationAdd(path_in_repo=name, path_or_fileobj=os.path.join(directory, name))
        info = op.upload_info
        if getattr(info, "is_hashed", True) is False:
            # Hashed already for the card; handing it over spares the client a second read.
            info.sha256 = bytes.fromhex(sha256[name])
        ops.append(op)
    if card is not None:
        ops.append(CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=card))
    return ops


def _glob_escape(name: str) -> str:
    """``name`` as an fnmatch pattern matching only itself (for ``allow_patterns``)."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def push_to_hub(
    directory: str,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    token: str | None = None,
    endpoint: str | None = None,
    source: str | None = None,
    dry_run: bool = False,
    quiet: bool = False,
    max_file_bytes: str | int | None = None,
    workers: int | None = None,
) -> PushResult:
    """Publish the model directory ``directory`` to the Hub repository ``repo_id``.

    Checks first, without network: that ``directory`` is a complete model directory (see
    :func:`check_model_directory`) and that every file is within the Hub's per-file limit. Then
    hashes the files for the model card, creates the repository if needed, and uploads every file
    plus a generated ``README.md`` model card (unless the directory has one) in one commit (or,
    above ``CKPTOOLS_HUB_LARGE_FOLDER_BYTES``, weights in several commits and the index, config
    and card last). Re-running after a failure resumes: files already on the Hub are not sent
    again.

    Args:
        directory: a model directory (``ckpt consolidate`` output, or ``save_pretrained``'s).
        repo_id: ``namespace/name`` (or ``name``, in the token owner's namespace).
        private: create the repository private; refuses to push into an existing public one.
        revision: the branch to push to (created from the default branch if missing).
        commit_message: the commit's summary (default: says ckptools, the source and step).
        create_pr: open a pull request with the commit instead of committing to the branch.
        token: a Hub token (default: ``HF_TOKEN`` or the saved login, as ``huggingface_hub``
            finds it).
        endpoint: the Hub's URL (default: ``huggingface_hub``'s, i.e. ``HF_ENDPOINT``).
        source: the checkpoint the directory was consolidated from: recorded in the card (its
            layout, world size and step).
        dry_run: check and list what would be uploaded, with sizes; no network, no file data read.
        quiet: no progress bars (neither ckptools' nor huggingface_hub's).
        max_file_bytes: per-file limit (default ``CKPTOOLS_HUB_MAX_FILE_BYTES`` or 50 GB).
        workers: threads hashing files (default ``CKPTOOLS_WORKERS`` or up to 4).

    Returns:
        A :class:`PushResult`; ``commit_url`` is the commit's URL, ``to_dict()`` plain data.

    Raises:
        IncompleteCheckpointError: the directory is not a complete model directory.
        HubFileTooLargeError: a file is over the per-file limit (nothing was uploaded).
        HubAuthError: 401/403 (no token, invalid, or no write access).
        HubNotFoundError: 404 (repository or revision).
        HubConflictError: 409 (re-run to resume).
        HubConnectionError: the Hub could not be reached.
        UsageError: an invalid ``repo_id`` or contradictory arguments.

    Example:
        >>> r = push_to_hub("hf_model", "me/llama-1b-sft", private=True,  # doctest: +SKIP
        ...                 source="checkpoints/step-1000")
        >>> print(r.commit_url)  # doctest: +SKIP
    """
    started = time.perf_counter()
    from huggingface_hub import constants

    preflight(repo_id)
    if revision is not None and not revision.strip():
        raise UsageError("revision must not be empty")
    n_workers = workers if workers is not None else env_int(WORKERS_ENV, DEFAULT_WORKERS)
    if n_workers < 1:
        raise UsageError(f"workers must be at least 1, got {n_workers}")
    limit = resolve_max_file_bytes(max_file_bytes)
    directory = directory.rstrip("/") or directory
    hub_url = (endpoint or constants.ENDPOINT).rstrip("/")

    manifest = check_model_directory(directory)
    files = list_files(directory)
    check_sizes(files, limit, directory=directory, repo_id=repo_id, source=source)
    own_card = any(name == CARD_NAME for name, _ in files)
    config = _read_config(directory)
    notes: list[str] = []
    if not config:
        notes.append("no config.json: from_pretrained cannot load the repository without one")
    if own_card:
        notes.append(f"{CARD_NAME} uploaded as it is (no model card generated)")
    prov_base = provenance(manifest, source)
    message = commit_message or _default_message(prov_base)

    def result(
        hubfiles: list[HubFile], card_text: str | None, prov: Mapping[str, Any], **kw: Any
    ) -> PushResult:
        return PushResult(
            directory=directory,
            repo_id=kw.pop("repo_id", repo_id),
            files=tuple(hubfiles),
            total_bytes=sum(f.bytes for f in hubfiles),
            card="existing" if own_card else "generated",
            provenance=prov,
            max_file_bytes=limit,
            dry_run=dry_run,
            private=private,
            revision=revision,
            create_pr=create_pr,
            commit_message=message,
            endpoint=hub_url,
            card_text=card_text,
            seconds=time.perf_counter() - started,
            notes=tuple(notes),
            **kw,
        )

    if dry_run:
        hubfiles = [HubFile(name, size) for name, size in files]
        card_text = None
        if not own_card:
            card_text = model_card(repo_id, prov_base, hubfiles, config)
            hubfiles.append(HubFile(CARD_NAME, len(card_text.encode()), generated=True))
            notes.append("the model card gets each file's sha256 when pushed")
        return result(hubfiles, card_text, prov_base)

    t_hash = time.perf_counter()
    sha = hash_files(directory, files, workers=n_workers, quiet=quiet)
    hash_seconds = time.perf_counter() - t_hash
    hubfiles = [HubFile(name, size, sha[name]) for name, size in files]
    prov = provenance(manifest, source, sha256={n: s for n, s in sha.items() if n != CARD_NAME})
    card_bytes: bytes | None = None
    card_text = None
    if not own_card:
        card_text = model_card(repo_id, prov, hubfiles, config)
        card_bytes = card_text.encode()
        hubfiles.append(
            HubFile(CARD_NAME, len(card_bytes), hashlib.sha256(card_bytes).hexdigest(), True)
        )

    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    total = sum(size for _, size in files)
    # A pull request is one reviewable commit, so it always takes the single-commit path.
    multi = total > large_folder_bytes() and not create_pr
    try:
        with _hub_progress(quiet):
            resolved, repo_url, created = _create_repo(api, repo_id, private)
            if revision is not None and not create_pr and not revision.startswith("refs/"):
                api.create_branch(resolved, branch=revision, exist_ok=True)
            names = [name for name, _ in files]
            if multi:
                data = [n for n in names if n in manifest.files]
                rest = [n for n in names if n not in manifest.files]
                api.upload_folder(
                    repo_id=resolved,
                    folder_path=directory,
                    allow_patterns=[_glob_escape(n) for n in data],
                    commit_message=message,
                    revision=revision,
                )
                info = api.create_commit(
                    resolved,
                    _additions(directory, rest, sha, card_bytes),
                    commit_message=f"{message} (index, config and model card)",
                    revision=revision,
                )
            else:
                info = api.create_commit(
                    resolved,
                    _additions(directory, names, sha, card_bytes),
                    commit_message=message,
                    revision=revision,
                    create_pr=create_pr,
                )
    except UsageError:
        raise
    except Exception as e:
        mapped = hub_error(e, repo_id=repo_id, endpoint=hub_url, revision=revision)
        if mapped is None:
            raise
        raise mapped from e
    if not created and private:
        notes.append("the repository existed (private); pushed into it")
    return result(
        hubfiles,
        card_text,
        prov,
        repo_id=resolved,
        method="multi_commit" if multi else "single_commit",
        created_repo=created,
        repo_url=repo_url,
        commit_url=str(info.commit_url),
        commit_oid=str(info.oid) if info.oid else None,
        pr_url=str(info.pr_url) if info.pr_url else None,
        hash_seconds=hash_seconds,
    )


def _default_message(prov: Mapping[str, Any]) -> str:
    message = "Upload model with ckptools"
    if "source" in prov:
        message += f" from {prov['source']}"
    if "step" in prov:
        message += f" (step {prov['step']})"
    return message
