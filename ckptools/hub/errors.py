"""What a failed push says: ``huggingface_hub`` and network exceptions as one-line
:class:`~ckptools.errors.HubError` messages that say what to do.

The mapping is an ordered table (:func:`rules`), read top to bottom like ``huggingface_hub``'s own
``hf_raise_for_status``: the first row whose exception type, HTTP status and message prefix all
match decides the error class and the message. Order matters where classes overlap:
``OfflineModeIsEnabled`` is a ``ConnectionError``, ``HFValidationError`` a ``ValueError``, and the
client raises ``RepositoryNotFoundError`` for a 401 too, which must read as an authentication
failure, not as a missing repository.

``huggingface_hub`` is imported only when an exception is mapped, so importing this module stays
light.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ckptools.errors import (
    CkptError,
    HubAuthError,
    HubConflictError,
    HubConnectionError,
    HubError,
    HubFileTooLargeError,
    HubNotFoundError,
    UsageError,
)

#: The shard size ckptools' messages suggest when a file is over the limit: transformers' own
#: default.
SUGGESTED_MAX_SHARD_SIZE = "5GB"
#: What every message about an interrupted push ends with.
RESUME = "re-running the push resumes it (files already on the Hub are not sent again)"


@dataclass(frozen=True)
class Rule:
    """One row of the table: which exceptions it catches and what they become.

    Attributes:
        catches: the exception types of the row.
        error: the :class:`~ckptools.errors.CkptError` class raised instead.
        message: a :meth:`str.format` template over the fields of :func:`_fields` (``repo_id``,
            ``endpoint``, ``revision``, ``namespace``, ``status``, ``said``, ``first``, ``kind``,
            ``lines``, ``details``, ``resume``, ``suggested``).
        status: the HTTP statuses the row takes (None: any, or none).
        prefix: the row takes only exceptions whose text starts with it.
        fixed_status: the status recorded on the error when the exception carries none.
    """

    catches: tuple[type[BaseException], ...]
    error: type[CkptError]
    message: str
    status: Callable[[int | None], bool] | None = None
    prefix: str | None = None
    fixed_status: int | None = None

    def matches(self, e: BaseException, status: int | None) -> bool:
        return (
            isinstance(e, self.catches)
            and (self.status is None or self.status(status))
            and (self.prefix is None or str(e).startswith(self.prefix))
        )


def _is(code: int) -> Callable[[int | None], bool]:
    return lambda status: status == code


def rules() -> tuple[Rule, ...]:
    """The table, first match wins. Built per call: the network exception types depend on which
    HTTP library the installed ``huggingface_hub`` has loaded."""
    from huggingface_hub.utils import (  # type: ignore[attr-defined]
        HfHubHTTPError,
        HFValidationError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    http = (HfHubHTTPError,)
    not_found = (
        "{repo_id}: repository not found (404){said}: check the name; a private repository also "
        "answers 404 to a token that cannot see it"
    )
    return (
        Rule(
            (OfflineModeIsEnabled,),
            HubConnectionError,
            "{endpoint}: HF_HUB_OFFLINE is set, so nothing can be pushed: unset it and re-run",
        ),
        Rule((HFValidationError,), UsageError, "{repo_id!r}: {first}"),
        Rule(
            (RevisionNotFoundError,),
            HubNotFoundError,
            "{repo_id}: revision {revision!r} not found{said}: push to an existing branch, or "
            "drop --revision",
        ),
        Rule(
            http,
            HubAuthError,
            "{endpoint}: not authenticated (401){said}: log in with `hf auth login`, set "
            "HF_TOKEN, or pass --token with a token that has write access",
            status=_is(401),
        ),
        Rule(
            http,
            HubAuthError,
            "{repo_id}: no write access (403){said}: use a token with write permission on the "
            "'{namespace}' namespace (a fine-grained token needs it explicitly), or push to a "
            "repository of your own",
            status=_is(403),
        ),
        Rule((RepositoryNotFoundError,), HubNotFoundError, not_found),
        Rule(http, HubNotFoundError, not_found, status=_is(404)),
        Rule(
            http,
            HubConflictError,
            "{repo_id}: conflict (409){said}: the repository changed or was busy while pushing; "
            "{resume}",
            status=_is(409),
        ),
        Rule(
            http,
            HubFileTooLargeError,
            "{repo_id}: the Hub refused the upload as too large (413){said}: re-consolidate with "
            "a smaller --max-shard-size (e.g. {suggested})",
            status=_is(413),
        ),
        Rule(
            http,
            HubError,
            "{endpoint}: the Hub failed ({status}){said}: try again later; {resume}",
            status=lambda status: status is not None and status >= 500,
        ),
        Rule(http, HubError, "{repo_id}: the Hub refused the request ({status}){said}"),
        Rule(
            # The client's own check of a README.md front matter (a 400 of /api/validate-yaml).
            (ValueError,),
            HubError,
            "{repo_id}: the Hub refused the metadata of README.md ({details}): fix its YAML "
            "front matter, or remove README.md to have ckptools write a model card",
            prefix="Invalid metadata in README.md",
            fixed_status=400,
        ),
        Rule(
            (ValueError,),
            HubError,
            "{repo_id}: the Hub refused an upload ({lines}); {resume}",
            prefix="LFS batch API returned errors",
        ),
        Rule(
            network_errors(),
            HubConnectionError,
            "{endpoint}: cannot reach the Hub ({kind}: {first}): check the network and the "
            "endpoint (HF_ENDPOINT, --endpoint); {resume}",
        ),
    )


def network_errors() -> tuple[type[BaseException], ...]:
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


def first_line(text: str | None) -> str:
    """The first line of ``text``, at most 300 characters (a server's answer can be a page)."""
    if not text:
        return ""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:300]


def status_of(e: BaseException) -> int | None:
    """The HTTP status of the response an exception carries, or None."""
    return getattr(getattr(e, "response", None), "status_code", None)


def _fields(
    e: BaseException, status: int | None, *, repo_id: str, endpoint: str, revision: str | None
) -> dict[str, Any]:
    text = str(e)
    said = first_line(getattr(e, "server_message", None)) or first_line(text)
    lines = text.splitlines()[1:3]
    return {
        "repo_id": repo_id,
        "endpoint": endpoint,
        "revision": revision or "main",
        "namespace": repo_id.split("/")[0],
        "status": status,
        "said": f" ({said})" if said else "",
        "first": first_line(text),
        "kind": type(e).__name__,
        "lines": " ".join(lines),
        "details": " ".join(line.lstrip("- ") for line in lines),
        "resume": RESUME,
        "suggested": SUGGESTED_MAX_SHARD_SIZE,
    }


def hub_error(
    e: BaseException, *, repo_id: str, endpoint: str, revision: str | None = None
) -> CkptError | None:
    """The one-line :class:`~ckptools.errors.HubError` for an exception of ``huggingface_hub``,
    or None when it is not a Hub failure (a bug, which must propagate as is)."""
    from huggingface_hub.utils import HfHubHTTPError  # type: ignore[attr-defined]

    status = status_of(e) if isinstance(e, HfHubHTTPError) else None
    for rule in rules():
        if rule.matches(e, status):
            message = rule.message.format(
                **_fields(e, status, repo_id=repo_id, endpoint=endpoint, revision=revision)
            )
            error = rule.error
            if not issubclass(error, HubError):
                return error(message)
            return error(
                message,
                repo_id=repo_id,
                status=status if status is not None else rule.fixed_status,
            )
    return None


@contextlib.contextmanager
def raised_as_hub_errors(*, repo_id: str, endpoint: str, revision: str | None) -> Iterator[None]:
    """Inside: a ``huggingface_hub`` failure is raised as its :func:`hub_error` (from the
    original); our own :class:`~ckptools.errors.UsageError` and anything else propagate as is."""
    try:
        yield
    except UsageError:
        raise
    except Exception as e:
        mapped = hub_error(e, repo_id=repo_id, endpoint=endpoint, revision=revision)
        if mapped is None:
            raise
        raise mapped from e
