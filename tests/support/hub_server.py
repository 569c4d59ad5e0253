"""A local stand-in for the Hugging Face Hub that records what the real client sends.

``HubServer`` listens on 127.0.0.1 (a free port) and answers just enough of the Hub's HTTP API
for the real ``huggingface_hub`` client to create a repository, branch, pre-upload, upload LFS
objects (basic transfer, with verify) and commit — the requests :func:`ckptools.push_to_hub`
makes — keeping every request and the repository contents so tests can assert on what arrived.
It checks what the Hub checks where a test relies on it: the token (when one is required), an
LFS object's SHA-256 and size, that a committed LFS pointer names an uploaded object, that a
branch exists, and that a ``README.md`` front matter is valid YAML.

Upload modes: by default every file is "regular" (its bytes travel base64-encoded in the commit,
as the Hub does for small text files), so no LFS/Xet storage is needed. With ``lfs_min_bytes``
set, files at least that large are "lfs": the client then uploads them through the LFS batch
API, which it uses only when Xet is off (``huggingface_hub.constants.HF_HUB_DISABLE_XET``); Xet's
content-addressed store is not emulated, and a client that asks for an Xet token gets a 404.

Failures are injected per route: ``server.fail("commit", 409, "...")`` makes the next commit
request answer 409 with the Hub's error headers.

Example:
    >>> with HubServer() as hub:  # doctest: +SKIP
    ...     push_to_hub(model_dir, "me/model", endpoint=hub.url, token="hf_test")
    ...     hub.head_files("me/model")
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

USER = "testuser"
_REPO = r"(?P<repo>[^/]+/[^/]+|[^/]+)"
_ROUTES: list[tuple[str, str, re.Pattern[str]]] = [
    ("POST", "create", re.compile(r"^/api/repos/create$")),
    ("POST", "validate_yaml", re.compile(r"^/api/validate-yaml$")),
    ("POST", "preupload", re.compile(rf"^/api/models/{_REPO}/preupload/(?P<rev>.+)$")),
    ("POST", "commit", re.compile(rf"^/api/models/{_REPO}/commit/(?P<rev>.+)$")),
    ("POST", "branch", re.compile(rf"^/api/models/{_REPO}/branch/(?P<rev>.+)$")),
    ("POST", "lfs_batch", re.compile(rf"^/{_REPO}\.git/info/lfs/objects/batch$")),
    ("PUT", "lfs_upload", re.compile(r"^/lfs-objects/(?P<oid>[0-9a-f]{64})$")),
    ("POST", "lfs_verify", re.compile(r"^/lfs-objects/(?P<oid>[0-9a-f]{64})/verify$")),
    ("GET", "repo_info", re.compile(rf"^/api/models/{_REPO}(?:/revision/(?P<rev>.+))?$")),
]
# Routes a pre-signed storage URL serves: no Authorization header is sent there.
_UNAUTHENTICATED = {"lfs_upload", "validate_yaml"}


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob, which the Hub reports as a regular file's oid."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Request:
    """One request as it arrived."""

    method: str
    route: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    params: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)

    def ndjson(self) -> list[Any]:
        return [json.loads(line) for line in self.body.splitlines() if line.strip()]


@dataclass
class StoredFile:
    data: bytes
    lfs: bool

    @property
    def oid(self) -> str:
        return hashlib.sha256(self.data).hexdigest() if self.lfs else git_blob_sha1(self.data)


@dataclass
class Commit:
    """A commit the server accepted."""

    oid: str
    repo_id: str
    ref: str
    summary: str
    description: str
    added: dict[str, StoredFile]
    deleted: list[str]
    parent: str | None
    pr_num: int | None = None


@dataclass
class Repo:
    repo_id: str
    private: bool
    refs: dict[str, str] = field(default_factory=dict)  # ref name -> commit oid
    trees: dict[str, dict[str, StoredFile]] = field(default_factory=dict)  # commit oid -> files
    prs: int = 0


@dataclass
class _Failure:
    route: str
    status: int
    message: str
    error_code: str | None
    times: int


class HubServer:
    """The recording server; use as a context manager (see the module docstring)."""

    def __init__(self, *, token: str | None = None, lfs_min_bytes: int | None = None) -> None:
        self.token = token
        self.lfs_min_bytes = lfs_min_bytes
        self.requests: list[Request] = []
        self.repos: dict[str, Repo] = {}
        self.commits: list[Commit] = []
        self.lfs_objects: dict[str, bytes] = {}
        self._failures: list[_Failure] = []
        self._lock = threading.Lock()
        self._counter = 0
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        # A short poll interval: shutdown() waits up to one interval, once per test.
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)

    # -- what tests call -------------------------------------------------------------------------

    def fail(
        self,
        route: str,
        status: int,
        message: str = "injected failure",
        *,
        error_code: str | None = None,
        times: int = 1,
    ) -> None:
        """Answer the next ``times`` requests to ``route`` with ``status``."""
        assert route in {name for _, name, _ in _ROUTES}, route
        self._failures.append(_Failure(route, status, message, error_code, times))

    def add_repo(self, repo_id: str, *, private: bool = False) -> Repo:
        """A repository that exists before the push (with the Hub's initial commit)."""
        with self._lock:
            return self._new_repo(repo_id, private)

    def routes(self) -> list[str]:
        """The route of every request, in order."""
        return [r.route for r in self.requests]

    def to(self, route: str) -> list[Request]:
        return [r for r in self.requests if r.route == route]

    def files_at(self, repo_id: str, ref: str = "main") -> dict[str, bytes]:
        """The repository's files at ``ref``: path -> content."""
        repo = self.repos[repo_id]
        return {p: f.data for p, f in repo.trees[repo.refs[ref]].items()}

    # -- request handling ------------------------------------------------------------------------

    def _new_repo(self, repo_id: str, private: bool) -> Repo:
        repo = Repo(repo_id, private)
        oid = self._new_oid()
        attributes = StoredFile(b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n", False)
        repo.trees[oid] = {".gitattributes": attributes}
        repo.refs["main"] = oid
        self.repos[repo_id] = repo
        return repo

    def _new_oid(self) -> str:
        self._counter += 1
        return hashlib.sha1(f"commit-{self._counter}".encode()).hexdigest()

    def handle(self, method: str, raw_path: str, headers: dict[str, str], body: bytes) -> Any:
        split = urlsplit(raw_path)
        route, params = "unknown", {}
        for m, name, pattern in _ROUTES:
            match = pattern.match(split.path)
            if m == method and match:
                route = name
                params = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                break
        request = Request(method, route, split.path, parse_qs(split.query), headers, body, params)
        with self._lock:
            self.requests.append(request)
            for failure in self._failures:
                if failure.route == route and failure.times > 0:
                    failure.times -= 1
                    return _error(failure.status, failure.message, failure.error_code)
            if route == "unknown":
                return _error(404, f"no such route: {method} {split.path}")
            if route not in _UNAUTHENTICATED and self.token is not None:
                given = headers.get("authorization", "")
                if given != f"Bearer {self.token}":
                    return _error(401, "Invalid credentials in Authorization header")
            result: Any = getattr(self, f"_{route}")(request)
            return result

    def _repo(self, request: Request) -> Repo | tuple[int, dict[str, str], bytes]:
        repo = self.repos.get(request.params["repo"])
        if repo is None:
            return _error(404, "Repository not found", "RepoNotFound")
        return repo

    def _ref(self, repo: Repo, rev: str) -> str | None:
        if rev in repo.refs:
            return rev
        return None

    def _create(self, request: Request) -> Any:
        payload = request.json()
        repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
        if payload.get("type") not in (None, "model"):
            return _error(400, "only model repositories here")
        if repo_id in self.repos:
            return _error(409, "You already created this model repo")
        self._new_repo(repo_id, payload.get("visibility") == "private")
        return _json({"url": f"{self.url}/{repo_id}", "name": repo_id, "id": repo_id})

    def _validate_yaml(self, request: Request) -> Any:
        import yaml

        content = request.json()["content"]
        m = re.match(r"^---\n(.*?)\n---\n", content, re.S)
        if m is None:
            return _json(
                {"errors": [], "warnings": [{"message": "empty or missing yaml metadata"}]}
            )
        try:
            meta = yaml.safe_load(m.group(1))
        except yaml.YAMLError as e:
            return _json({"errors": [{"message": f"invalid YAML: {e}"}]}, 400)
        if not isinstance(meta, dict):
            return _json({"errors": [{"message": "metadata must be a mapping"}]}, 400)
        return _json({"errors": [], "warnings": []})

    def _repo_info(self, request: Request) -> Any:
        repo = self._repo(request)
        if not isinstance(repo, Repo):
            return repo
        ref = self._ref(repo, request.params.get("rev", "main"))
        if ref is None:
            return _error(404, "Revision not found", "RevisionNotFound")
        sha = repo.refs[ref]
        siblings = [{"rfilename": p} for p in sorted(repo.trees[sha])]
        return _json(
            {"id": repo.repo_id, "sha": sha, "private": repo.private, "siblings": siblings}
        )

    def _branch(self, request: Request) -> Any:
        repo = self._repo(request)
        if not isinstance(repo, Repo):
            return repo
        branch = request.params["rev"]
        if branch in repo.refs:
            return _error(409, f"Reference {branch} already exists")
        start = (request.json() if request.body else {}).get("startingPoint") or "main"
        if start not in repo.refs:
            return _error(404, "Revision not found", "RevisionNotFound")
        repo.refs[branch] = repo.refs[start]
        return _json({})

    def _preupload(self, request: Request) -> Any:
        repo = self._repo(request)
        if not isinstance(repo, Repo):
            return repo
        ref = self._ref(repo, request.params["rev"])
        if ref is None:
            return _error(404, "Revision not found", "RevisionNotFound")
        tree = repo.trees[repo.refs[ref]]
        out = []
        for f in request.json()["files"]:
            base64.b64decode(f["sample"], validate=True)
            lfs = self.lfs_min_bytes is not None and int(f["size"]) >= self.lfs_min_bytes
            existing = tree.get(f["path"])
            oid = existing.oid if existing is not None and existing.lfs == lfs else None
            out.append(
                {
                    "path": f["path"],
                    "uploadMode": "lfs" if lfs else "regular",
                    "shouldIgnore": False,
                    "oid": oid,
                }
            )
        return _json({"files": out, "commitOid": repo.refs[ref]})

    def _lfs_batch(self, request: Request) -> Any:
        repo = self._repo(request)
        if not isinstance(repo, Repo):
            return repo
        payload = request.json()
        assert payload["operation"] == "upload", payload
        objects = []
        for obj in payload["objects"]:
            entry: dict[str, Any] = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.lfs_objects:
                href = f"{self.url}/lfs-objects/{obj['oid']}"
                entry["actions"] = {
                    "upload": {"href": href, "header": {}},
                    "verify": {"href": f"{href}/verify"},
                }
            objects.append(entry)
        return _json({"transfer": "basic", "objects": objects})

    def _lfs_upload(self, request: Request) -> Any:
        oid = request.params["oid"]
        if hashlib.sha256(request.body).hexdigest() != oid:
            return _error(400, "uploaded content does not match its sha256")
        self.lfs_objects[oid] = request.body
        return 200, {}, b""

    def _lfs_verify(self, request: Request) -> Any:
        data = request.json()
        stored = self.lfs_objects.get(request.params["oid"])
        if stored is None or len(stored) != data["size"] or data["oid"] != request.params["oid"]:
            return _error(404, "object not found or wrong size")
        return _json({})

    def _commit(self, request: Request) -> Any:
        repo = self._repo(request)
        if not isinstance(repo, Repo):
            return repo
        base = self._ref(repo, request.params["rev"])
        if base is None:
            return _error(404, "Revision not found", "RevisionNotFound")
        header: dict[str, Any] = {}
        added: dict[str, StoredFile] = {}
        deleted: list[str] = []
        for item in request.ndjson():
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
            elif key == "file":
                assert value["encoding"] == "base64", value
                added[value["path"]] = StoredFile(base64.b64decode(value["content"]), False)
            elif key == "lfsFile":
                data = self.lfs_objects.get(value["oid"])
                if data is None or ("size" in value and len(data) != value["size"]):
                    return _error(400, f"LFS object of {value['path']} was never uploaded")
                added[value["path"]] = StoredFile(data, True)
            elif key in ("deletedFile", "deletedFolder"):
                deleted.append(value["path"])
            else:
                return _error(400, f"unknown commit operation {key!r}")
        if not header.get("summary"):
            return _error(400, "commit summary is required")
        parent = repo.refs[base]
        tree = {p: f for p, f in repo.trees[parent].items() if p not in deleted}
        tree.update(added)
        oid = self._new_oid()
        repo.trees[oid] = tree
        pr_num = None
        if request.query.get("create_pr") == ["1"]:
            repo.prs += 1
            pr_num = repo.prs
            ref = f"refs/pr/{pr_num}"
        else:
            ref = base
        repo.refs[ref] = oid
        self.commits.append(
            Commit(
                oid, repo.repo_id, ref, header["summary"], header.get("description", ""),
                added, deleted, parent, pr_num,
            )
        )  # fmt: skip
        return _json(
            {
                "success": True,
                "commitOid": oid,
                "commitUrl": f"{self.url}/{repo.repo_id}/commit/{oid}",
                "pullRequestUrl": (
                    f"{self.url}/{repo.repo_id}/discussions/{pr_num}" if pr_num else None
                ),
            }
        )


def _json(data: Any, status: int = 200) -> tuple[int, dict[str, str], bytes]:
    return status, {"Content-Type": "application/json"}, json.dumps(data).encode()


def _error(
    status: int, message: str, error_code: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": "application/json", "X-Error-Message": message}
    if error_code:
        headers["X-Error-Code"] = error_code
    return status, headers, json.dumps({"error": message}).encode()


def _handler(server: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                parts = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline().strip():
                            pass  # trailers
                        return b"".join(parts)
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _serve(self) -> None:
            body = self._body()
            headers = {k.lower(): v for k, v in self.headers.items()}
            status, out_headers, data = server.handle(self.command, self.path, headers, body)
            self.send_response(status)
            for k, v in out_headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _serve

    return Handler


#: The token the test server requires; the tests pass it explicitly.
TEST_TOKEN = "hf_test_token"


@pytest.fixture
def no_saved_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Never send the developer's own token (HF_TOKEN, saved login) to the test server."""
    import huggingface_hub.constants as constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))


@pytest.fixture
def hub() -> Iterator[HubServer]:
    """A :class:`HubServer` requiring :data:`TEST_TOKEN`."""
    with HubServer(token=TEST_TOKEN) as server:
        yield server
