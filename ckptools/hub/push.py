"""``push_to_hub`` and its steps: plan the commit, describe it, create the repository, upload.

The repository is created if needed and the files are uploaded with ``huggingface_hub``: as one
commit (:meth:`HfApi.create_commit`, which ``upload_folder`` also ends in), so the repository goes
from its previous state to the complete model at once; or, for directories above
:data:`~ckptools.hub.checks.LARGE_FOLDER_BYTES`, the weight files through ``upload_folder`` (which
in ``huggingface_hub`` >= 1.x streams them through Xet in several commits, so an interruption
keeps what was committed) followed by one last commit with the index, config and card, so loaders
that start from the index never see a partial model. Uploads are content-addressed (LFS/Xet), and
a file the Hub already holds with the same content is left out of the commit, so re-running a
push that failed resumes it.

``huggingface_hub`` is imported only inside the functions that talk to the Hub, so
``import ckptools`` and ``ckpt --help`` stay light.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptools.core.hf_files import ADAPTER_CONFIG_NAME, TOKENIZER_FILES
from ckptools.core.manifest import Manifest
from ckptools.errors import UsageError
from ckptools.hub.card import (
    CARD_NAME,
    HubFile,
    default_message,
    model_card,
    provenance,
    read_config,
    with_checksums,
)
from ckptools.hub.checks import (
    check_model_directory,
    check_sizes,
    large_folder_bytes,
    list_files,
    preflight,
    resolve_max_file_bytes,
)
from ckptools.hub.errors import raised_as_hub_errors, status_of
from ckptools.io import tunables
from ckptools.io.progress import ByteProgress

_HASH_BLOCK_BYTES = 8 * 2**20


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


@dataclass(frozen=True)
class PushOptions:
    """How to push: the keyword arguments of :func:`push_to_hub` (but ``token``, which no result
    or plan should hold), as one value the steps share."""

    private: bool = False
    revision: str | None = None
    commit_message: str | None = None
    create_pr: bool = False
    endpoint: str | None = None
    source: str | None = None
    dry_run: bool = False
    quiet: bool = False
    max_file_bytes: str | int | None = None
    workers: int | None = None
    weights_only: bool = False


@dataclass(frozen=True)
class PushPlan:
    """What a push will commit and where, decided locally before the first request.

    Attributes:
        directory: the model directory (checked complete, every file within the limit).
        repo_id: the repository as given.
        options: how to push, as given.
        files: ``(path in repo, size)`` of every file of the directory.
        manifest: the directory's manifest (which files hold weights).
        config: its ``config.json`` (``{}`` without one).
        provenance: the ``ckptools`` block of the card, before the files are hashed.
        own_card: the directory has its own ``README.md`` (no card is generated).
        message: the commit summary.
        max_file_bytes: the per-file limit the files were checked against.
        hub_url: the Hub's URL as results show it.
        workers: threads hashing the files.
        notes: facts about the directory worth showing.
    """

    directory: str
    repo_id: str
    options: PushOptions
    files: tuple[tuple[str, int], ...]
    manifest: Manifest
    config: Mapping[str, Any]
    provenance: Mapping[str, Any]
    own_card: bool
    message: str
    max_file_bytes: int
    hub_url: str
    workers: int
    notes: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


@dataclass(frozen=True)
class _Contents:
    """The files of the commit (the generated card last), the card's text and the provenance
    it records."""

    files: tuple[HubFile, ...]
    card_text: str | None
    provenance: Mapping[str, Any]


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
    weights_only: bool = False,
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
        weights_only: publish a directory without ``config.json`` (its weights alone, which
            ``from_pretrained`` cannot load); refused without it.

    Returns:
        A :class:`PushResult`; ``commit_url`` is the commit's URL, ``to_dict()`` plain data.

    Raises:
        IncompleteCheckpointError: the directory is not a complete model directory.
        HubFileTooLargeError: a file is over the per-file limit (nothing was uploaded).
        HubAuthError: 401/403 (no token, invalid, or no write access).
        HubNotFoundError: 404 (repository or revision).
        HubConflictError: 409 (re-run to resume).
        HubConnectionError: the Hub could not be reached.
        UsageError: an invalid ``repo_id`` or contradictory arguments; a directory without
            ``config.json`` and no ``weights_only``.
    Example:
        >>> r = push_to_hub("hf_model", "me/llama-1b-sft", private=True,  # doctest: +SKIP
        ...                 source="checkpoints/step-1000")
        >>> print(r.commit_url)  # doctest: +SKIP
    """
    started = time.perf_counter()
    options = PushOptions(
        private=private,
        revision=revision,
        commit_message=commit_message,
        create_pr=create_pr,
        endpoint=endpoint,
        source=source,
        dry_run=dry_run,
        quiet=quiet,
        max_file_bytes=max_file_bytes,
        workers=workers,
        weights_only=weights_only,
    )
    plan = plan_push(directory, repo_id, options)
    if dry_run:
        return _result(plan, _contents(plan, None), started)
    t_hash = time.perf_counter()
    sha256 = hash_files(plan.directory, plan.files, workers=plan.workers, quiet=quiet)
    hash_seconds = time.perf_counter() - t_hash
    contents = _contents(plan, sha256)
    committed = _upload(plan, contents, sha256, token=token)
    return _result(plan, contents, started, hash_seconds=hash_seconds, **committed)


def plan_push(directory: str, repo_id: str, options: PushOptions | None = None) -> PushPlan:
    """Every check of :func:`push_to_hub` that needs no network, and what it will commit.

    Raises:
        UsageError: an invalid ``repo_id``, ``revision`` or ``workers``.
        IncompleteCheckpointError: the directory is not a complete model directory.
        HubFileTooLargeError: a file is over the per-file limit.
    """
    from huggingface_hub import constants

    options = options or PushOptions()
    preflight(repo_id)
    if options.revision is not None and not options.revision.strip():
        raise UsageError("revision must not be empty")
    n_workers = tunables.workers(options.workers)
    limit = resolve_max_file_bytes(options.max_file_bytes)
    directory = directory.rstrip("/") or directory
    manifest = check_model_directory(directory)
    files = list_files(directory)
    check_sizes(files, limit, directory=directory, repo_id=repo_id, source=options.source)
    own_card = any(name == CARD_NAME for name, _ in files)
    config = read_config(directory)
    notes: list[str] = []
    adapter = any(name == ADAPTER_CONFIG_NAME for name, _ in files)  # PeftModel loads it
    if not config and not adapter and not options.weights_only:
        raise UsageError(
            f"{directory}: no config.json, so from_pretrained could not load the repository: "
            "add the model's config.json (`ckpt consolidate --config`), or pass --weights-only "
            "to publish the weights alone",
            path=directory,
        )
    if not config and not adapter:
        notes.append("weights only (--weights-only): from_pretrained cannot load the repository")
    elif not any(name in TOKENIZER_FILES for name, _ in files):
        notes.append(
            "no tokenizer files: the repository holds the model alone (copy the tokenizer's "
            "files into the directory to publish it with the model)"
        )
    if own_card:
        notes.append(f"{CARD_NAME} uploaded as it is (no model card generated)")
    prov = provenance(manifest, options.source)
    return PushPlan(
        directory=directory,
        repo_id=repo_id,
        options=options,
        files=tuple(files),
        manifest=manifest,
        config=config,
        provenance=prov,
        own_card=own_card,
        message=options.commit_message or default_message(prov),
        max_file_bytes=limit,
        hub_url=(options.endpoint or constants.ENDPOINT).rstrip("/"),
        workers=n_workers,
        notes=tuple(notes),
    )


def _contents(plan: PushPlan, sha256: Mapping[str, str] | None) -> _Contents:
    """The files of the commit and the model card, with each file's digest once hashed
    (``sha256`` None: a dry run, which reads no file data)."""
    prov = plan.provenance
    if sha256 is not None:
        prov = with_checksums(prov, {n: s for n, s in sha256.items() if n != CARD_NAME})
    digests = sha256 or {}
    files = [HubFile(name, size, digests.get(name)) for name, size in plan.files]
    if plan.own_card:
        return _Contents(tuple(files), None, prov)
    card_text = model_card(plan.repo_id, prov, files, plan.config)
    card = card_text.encode()
    digest = hashlib.sha256(card).hexdigest() if sha256 is not None else None
    files.append(HubFile(CARD_NAME, len(card), digest, generated=True))
    return _Contents(tuple(files), card_text, prov)


def _upload(
    plan: PushPlan,
    contents: _Contents,
    sha256: Mapping[str, str],
    *,
    token: str | None,
) -> dict[str, Any]:
    """Create the repository (and branch) if needed and commit the files; the
    :class:`PushResult` fields the Hub's answers fill."""
    from huggingface_hub import HfApi

    opts = plan.options
    api = HfApi(endpoint=opts.endpoint, token=token)
    card = contents.card_text.encode() if contents.card_text is not None else None
    names = [name for name, _ in plan.files]
    # A pull request is one reviewable commit, so it always takes the single-commit path.
    multi = plan.total_bytes > large_folder_bytes() and not opts.create_pr
    with (
        raised_as_hub_errors(repo_id=plan.repo_id, endpoint=plan.hub_url, revision=opts.revision),
        _hub_progress(opts.quiet),
    ):
        repo_id, repo_url, created = _create_repo(api, plan.repo_id, opts.private)
        revision = opts.revision
        if revision is not None and not opts.create_pr and not revision.startswith("refs/"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        if multi:
            info = _upload_large_folder(api, repo_id, plan, sha256, card)
        else:
            info = api.create_commit(
                repo_id,
                _additions(plan.directory, names, sha256, card),
                commit_message=plan.message,
                revision=opts.revision,
                create_pr=opts.create_pr,
            )
    return {
        "repo_id": repo_id,
        "method": "multi_commit" if multi else "single_commit",
        "created_repo": created,
        "repo_url": repo_url,
        "commit_url": str(info.commit_url),
        "commit_oid": str(info.oid) if info.oid else None,
        "pr_url": str(info.pr_url) if info.pr_url else None,
    }


def _upload_large_folder(
    api: Any, repo_id: str, plan: PushPlan, sha256: Mapping[str, str], card: bytes | None
) -> Any:
    """The weights through ``upload_folder`` (several commits, so an interruption keeps what
    was committed), then one last commit with the index, config and card, so loaders that start
    from the index never see a partial model. Returns that last commit's info."""
    names = [name for name, _ in plan.files]
    data = [n for n in names if n in plan.manifest.files]
    rest = [n for n in names if n not in plan.manifest.files]
    api.upload_folder(
        repo_id=repo_id,
        folder_path=plan.directory,
        allow_patterns=[_glob_escape(n) for n in data],
        commit_message=plan.message,
        revision=plan.options.revision,
    )
    return api.create_commit(
        repo_id,
        _additions(plan.directory, rest, sha256, card),
        commit_message=f"{plan.message} (index, config and model card)",
        revision=plan.options.revision,
    )


def _result(plan: PushPlan, contents: _Contents, started: float, **committed: Any) -> PushResult:
    """The :class:`PushResult` of ``plan``; ``committed`` holds what the Hub answered (nothing
    for a dry run)."""
    notes = list(plan.notes)
    if plan.options.dry_run and not plan.own_card:
        notes.append("the model card gets each file's sha256 when pushed")
    if committed.get("created_repo") is False and plan.options.private:
        notes.append("the repository existed (private); pushed into it")
    committed.setdefault("repo_id", plan.repo_id)
    return PushResult(
        directory=plan.directory,
        files=contents.files,
        total_bytes=sum(f.bytes for f in contents.files),
        card="existing" if plan.own_card else "generated",
        provenance=contents.provenance,
        max_file_bytes=plan.max_file_bytes,
        dry_run=plan.options.dry_run,
        private=plan.options.private,
        revision=plan.options.revision,
        create_pr=plan.options.create_pr,
        commit_message=plan.message,
        endpoint=plan.hub_url,
        card_text=contents.card_text,
        seconds=time.perf_counter() - started,
        notes=tuple(notes),
        **committed,
    )


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
        status = status_of(e)
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
