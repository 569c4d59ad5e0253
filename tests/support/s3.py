"""A real S3-compatible server on loopback for the object-storage tests (moto's server mode).

One server per test session (``s3_endpoint``), started on 127.0.0.1 on a free port, and a fresh
bucket per test (``s3_bucket``). The environment points every AWS client at it, the way users
point ckptools at theirs (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``...), so the code under test
takes its ordinary path through fsspec and s3fs; ranks spawned by ``tests.support.dist`` inherit
it. Nothing leaves the machine.

:class:`GetCounter` counts the bytes the server sent for GET requests, on the client side at
s3fs's single request function, independently of ckptools' own accounting.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    # no proxy may sit between the client and the loopback server
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}


def _s3fs_available() -> bool:
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of a moto S3 server, with the AWS environment set to it."""
    if not _s3fs_available():
        pytest.fail("s3fs and moto[server] are dev dependencies: pip install -e '.[dev]'")
    from moto import backends
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    # moto 5 lists its own package directory (~170 entries, an isdir each) on every request to
    # find the service a Host header names: ~6 % of the S3 tests' CPU. The directory does not
    # change while the session runs, so it is listed once.
    listed = backends.list_of_moto_modules
    modules = tuple(listed())
    backends.list_of_moto_modules = lambda: modules
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in [*_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(_ENV)
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        yield endpoint
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()
        backends.list_of_moto_modules = listed


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """``s3://<fresh bucket>`` on the session's server."""
    import s3fs

    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem()
    fs.mkdir(name)
    fs.invalidate_cache()
    return f"s3://{name}"


class GetCounter:
    """Counts bytes received by GetObject calls of s3fs (every ranged read goes through
    ``S3FileSystem._call_s3``), while active."""

    def __init__(self) -> None:
        self.bytes = 0
        self.requests = 0
        self._lock = threading.Lock()

    def __enter__(self) -> GetCounter:
        import s3fs

        self._original = s3fs.S3FileSystem._call_s3
        counter = self

        async def counting(fs: Any, method: str, *args: Any, **kwargs: Any) -> Any:
            out = await counter._original(fs, method, *args, **kwargs)
            if method == "get_object":
                with counter._lock:
                    counter.bytes += int(out.get("ContentLength") or 0)
                    counter.requests += 1
            return out

        s3fs.S3FileSystem._call_s3 = counting
        return self

    def __exit__(self, *exc: object) -> None:
        import s3fs

        s3fs.S3FileSystem._call_s3 = self._original


def upload(local_dir: str, url: str) -> None:
    """Copy a local checkpoint directory to ``url`` with s3fs itself (not through ckptools)."""
    import s3fs

    fs = s3fs.S3FileSystem()
    dest = url.removeprefix("s3://").rstrip("/")
    for root, _, files in os.walk(local_dir):
        for name in files:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, local_dir).replace(os.sep, "/")
            fs.put_file(full, f"{dest}/{rel}")
    fs.invalidate_cache()


def download(url: str, local_dir: str) -> list[str]:
    """Copy every object under ``url`` into ``local_dir`` with s3fs itself; returns the relative
    paths, sorted."""
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    base = url.removeprefix("s3://").rstrip("/")
    rels = []
    for key in fs.find(base):
        rel = key[len(base) + 1 :]
        target = os.path.join(local_dir, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fs.get_file(key, target)
        rels.append(rel)
    return sorted(rels)


def objects(url: str) -> dict[str, int]:
    """Relative key -> size of every object under ``url`` (a fresh listing)."""
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    base = url.removeprefix("s3://").rstrip("/")
    return {
        key[len(base) + 1 :]: int(info["size"]) for key, info in fs.find(base, detail=True).items()
    }
