"""Storage options (credentials, endpoints) in force for the URLs a call opens.

Credentials and endpoints come first from the environment the backends read themselves
(``AWS_*`` including ``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS``, fsspec's
``FSSPEC_<PROTOCOL>_<OPTION>``), and on top from :func:`storage_options`, a scoped setting that
every public function taking ``storage_options=`` (and the CLI's ``--storage-options JSON``)
enters through :func:`accepts_storage_options`. The scope is process-wide rather than threaded
through each layer, so worker threads opening files see it too; :func:`options_for` is what
:func:`ckptools.io.paths.filesystem` asks when it opens a URL.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ParamSpec, TypeVar

from ckptools.errors import UsageError

_scopes: list[dict[str, Any]] = []
_scopes_lock = threading.Lock()


def parse_storage_options(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """Options given as JSON text or a mapping; ``{}`` for None or empty.

    Raises:
        UsageError: not a JSON object.
    """
    if value is None or value == "":
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise UsageError(f"--storage-options: not JSON ({e})") from e
    if not isinstance(parsed, dict):
        raise UsageError("--storage-options: expected a JSON object, e.g. '{\"anon\": true}'")
    return parsed


def _per_protocol(options: Mapping[str, Any]) -> bool:
    """``{"s3": {...}, "gs": {...}}`` (options per protocol) rather than one flat set."""
    from fsspec.registry import known_implementations

    return bool(options) and all(
        k in known_implementations and isinstance(v, Mapping) for k, v in options.items()
    )


@contextlib.contextmanager
def storage_options(options: str | Mapping[str, Any] | None) -> Iterator[None]:
    """Use ``options`` for every URL opened inside the block (process-wide, so worker threads
    see them too). Either one flat set, passed to every URL's filesystem (``{"anon": true}``,
    ``{"endpoint_url": "http://127.0.0.1:9000"}``), or one set per protocol (``{"s3": {...},
    "gs": {...}}``) when source and destination are on different stores. Nested blocks merge.

    Example:
        >>> with storage_options({"anon": True}):          # doctest: +SKIP
        ...     ckptools.inspect("s3://public-bucket/ckpt")
    """
    token = push_storage_options(options)
    try:
        yield
    finally:
        pop_storage_options(token)


def push_storage_options(options: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Enter a :func:`storage_options` scope that outlives a ``with`` block (an object's
    lifetime); returns the token for :func:`pop_storage_options`."""
    parsed = parse_storage_options(options)
    if not parsed:
        return None
    with _scopes_lock:
        _scopes.append(parsed)
    return parsed


def pop_storage_options(token: dict[str, Any] | None) -> None:
    """Leave the scope :func:`push_storage_options` entered."""
    if token is None:
        return
    with _scopes_lock:
        for i in range(len(_scopes) - 1, -1, -1):
            if _scopes[i] is token:
                del _scopes[i]
                break


#: What ``storage_options=`` accepts: a mapping, or its JSON text (the CLI's ``--storage-options``).
StorageOptions = Mapping[str, Any] | str

_P = ParamSpec("_P")
_R = TypeVar("_R")


def accepts_storage_options(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``fn`` inside :func:`storage_options` of its ``storage_options=`` keyword argument: how
    the public functions' (and the CLI's) ``storage_options`` reach every URL they open, worker
    threads included, without threading them through each layer."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with storage_options(kwargs.get("storage_options")):  # type: ignore[arg-type]
            return fn(*args, **kwargs)

    return wrapper


def options_for(protocol: str) -> dict[str, Any]:
    """The options in force for URLs of ``protocol``."""
    merged: dict[str, Any] = {}
    with _scopes_lock:
        scopes = list(_scopes)
    for scope in scopes:
        if _per_protocol(scope):
            merged.update(scope.get(protocol, {}))
        else:
            merged.update(scope)
    return merged
