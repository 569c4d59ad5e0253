"""Every error ckptools raises on purpose.

One root, :class:`CkptError`; each leaf also subclasses the built-in exception that fits, so callers
that already catch ``FileNotFoundError`` or ``ValueError`` keep working. Errors carry the facts as
fields (``path``, ``fqn``, ``rank``) and a message that says what happened, why, and what to do.
The CLI turns them into one line and an exit code; anything not derived from :class:`CkptError`
is a bug and propagates with its traceback.
"""

from __future__ import annotations


class CkptError(Exception):
    """Root of all ckptools errors.

    Attributes:
        path: the file or directory the problem is about, when there is one.
        fqn: the tensor or entry key, when there is one.
        rank: the rank that wrote the data, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        fqn: str | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.fqn = fqn
        self.rank = rank

    def __str__(self) -> str:
        return self.message


class CheckpointNotFoundError(CkptError, FileNotFoundError):
    """The path does not exist, or a file the checkpoint names is missing."""


class UnknownFormatError(CkptError, ValueError):
    """No layout recognised the path; the message lists each layout's reason, or, when a
    checkpoint lies one level down, names it (the reasons are then in :attr:`details`)."""

    def __init__(self, message: str, *, path: str | None = None, details: tuple[str, ...] = ()):
        super().__init__(message, path=path)
        #: what ``--debug`` adds to the one line: each layout's reason for refusing ``path``
        self.details = details


class CorruptCheckpointError(CkptError, ValueError):
    """The checkpoint exists but its bytes are not what its metadata promises."""


class IncompleteCheckpointError(CorruptCheckpointError):
    """The checkpoint was never committed (no marker) or lacks part of its data."""


class DecodingLimitError(CorruptCheckpointError):
    """Decoding the checkpoint's metadata would exceed a limit on work or memory (objects,
    nesting, a size a constructor asks for); the message names the tunable that raises it.

    Attributes:
        tunable: the ``CKPTOOLS_*`` variable whose limit was reached; None for a limit no
            setting raises (a size larger than the bytes that hold it).
    """

    def __init__(self, message: str, *, tunable: str | None, path: str | None = None) -> None:
        super().__init__(message, path=path)
        self.tunable = tunable


class UnsafeCheckpointError(CkptError, ValueError):
    """Reading would run code: the data asks for a callable outside the allowlist."""

    def __init__(self, message: str, *, global_name: str, path: str | None = None) -> None:
        super().__init__(message, path=path)
        self.global_name = global_name


class OutsideCheckpointError(UnsafeCheckpointError):
    """A path the checkpoint names (a file in its metadata or index, a symbolic link among its
    files) leads outside the checkpoint; nothing there was read.

    Attributes:
        entry: the name as the checkpoint wrote it (the outside target is never resolved into a
            message).
    """

    def __init__(
        self, message: str, *, entry: str, path: str | None = None, fqn: str | None = None
    ) -> None:
        super().__init__(message, global_name="", path=path)
        self.entry = entry
        self.fqn = fqn


class UnsupportedCheckpointError(CkptError, NotImplementedError):
    """A valid checkpoint uses a feature ckptools does not handle (named in the message)."""


class UsageError(CkptError, ValueError):
    """Arguments that cannot work together (the CLI exits with code 2)."""


class HubError(CkptError):
    """The Hugging Face Hub refused or failed a request (the message says what to do).

    Attributes:
        repo_id: the repository the request was about.
        status: the HTTP status the Hub answered, or None when it was not reached.
    """

    def __init__(
        self,
        message: str,
        *,
        repo_id: str | None = None,
        status: int | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__(message, path=path)
        self.repo_id = repo_id
        self.status = status


class HubAuthError(HubError, PermissionError):
    """401/403: no token, an invalid one, or one without write access to the repository."""


class HubNotFoundError(HubError, FileNotFoundError):
    """404: the repository or revision does not exist (or the token may not see it)."""


class HubConflictError(HubError):
    """409: the repository changed or was busy while pushing; re-running resumes."""


class HubConnectionError(HubError, ConnectionError):
    """The Hub could not be reached (network down, wrong endpoint, offline mode)."""


class HubFileTooLargeError(HubError, ValueError):
    """A file is over the Hub's per-file limit; nothing was uploaded."""


class DiskFullError(CkptError, OSError):
    """The output's filesystem is full (or a quota or file-size limit was reached) while writing,
    or holds too little space for the whole output before anything was written (the check
    before writing; ``CKPTOOLS_SPACE_CHECK=0`` skips it). The staging location is removed.

    Attributes:
        errno: ``ENOSPC``, ``EDQUOT`` or ``EFBIG`` as the system said it (``ENOSPC`` for the
            check before writing).
        needed_bytes: what the run still had to write, when known.
        free_bytes: what the filesystem offered this user at the time, when known.
        mount: the mount point of the output's filesystem, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        errno: int,
        path: str | None = None,
        needed_bytes: int | None = None,
        free_bytes: int | None = None,
        mount: str | None = None,
    ) -> None:
        super().__init__(message, path=path)
        self.errno = errno
        self.filename = path
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        self.mount = mount


class PieceAbortedError(CkptError):
    """A piece of work stopped because another piece of the same run failed first. Never the
    error a run reports: the pool that ran the pieces raises the first real one instead."""
