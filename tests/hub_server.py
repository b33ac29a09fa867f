"""A tiny in-process fake of the Hugging Face Hub, for offline tests of quantkit.hub.download.

It speaks exactly the part of the Hub HTTP API that huggingface_hub 1.33 uses to download model files:

* ``GET /api/models/{repo}[/revision/{rev}]?blobs=true`` -- ``HfApi.model_info(files_metadata=True)``:
  JSON with ``sha`` and ``siblings`` (``rfilename``, ``size``, ``blobId``, ``lfs: {sha256, size, pointerSize}``).
* ``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` -- ``get_hf_file_metadata`` / ``http_get`` / ``hf_hub_download``:
  ``X-Repo-Commit``, ``ETag`` (git blob id, or sha256 for LFS files), ``X-Linked-Etag``/``X-Linked-Size``
  for LFS files, ``Content-Length``, ``Accept-Ranges``; ``Range: bytes=a-[b]`` answered with 206 + ``Content-Range``.
  Errors carry ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``) like the real Hub.
* Optionally (``lfs_redirect=True``) LFS files are answered with a 302 to a "CDN" URL on another host name
  (``localhost`` instead of ``127.0.0.1``), like the Hub redirecting to its storage; the CDN needs no token.

No ``X-Xet-*`` headers and no xet fields are ever sent, so huggingface_hub never takes its xet path.

Fault injection, per file name: ``inject(name, "drop", after=N)`` sends N body bytes of the next GET of that
file and then closes the connection; ``inject(name, "status", 500)`` answers the next GET with that status.
Actions queue up and are consumed one per GET.  ``corrupt(name)`` serves different bytes (same size) while
the metadata keeps announcing the sha256 of the true content.

Malicious answers: ``listing_hook`` (a function of the model_info JSON body) rewrites the listing
(bad commit sha, unsafe names, missing checksums); ``truncate(name, n)`` serves the file ``n`` bytes
short, in a complete HTTP response whose headers agree with the short body.

Every body byte sent is counted (``bytes_served``, ``bytes_by_file``) and every request is recorded
(``requests``), so tests can assert how much was (re)transferred and which headers were sent.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

_CHUNK = 64 * 1024


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def default_is_lfs(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".pt", ".gguf")) or name.startswith("lfs/")


@dataclass
class FileEntry:
    name: str
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def blob_id(self) -> str:
        # for LFS files git stores a pointer; its oid is what the Hub reports as blobId
        if self.lfs:
            return git_blob_id(self.pointer)
        return git_blob_id(self.data)

    @property
    def pointer(self) -> bytes:
        return (
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.data)}\n"
        ).encode()


@dataclass
class FakeRepo:
    repo_id: str
    refs: dict[str, str] = field(default_factory=dict)
    commits: dict[str, dict[str, FileEntry]] = field(default_factory=dict)

    def commit(self, files: dict[str, bytes], *, branch: str = "main", is_lfs=default_is_lfs) -> str:
        """Add a commit holding exactly ``files`` and point ``branch`` at it; returns the 40-hex commit sha."""
        h = hashlib.sha1(f"{self.repo_id}:{len(self.commits)}".encode())
        for name in sorted(files):
            h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
        sha = h.hexdigest()
        self.commits[sha] = {n: FileEntry(n, bytes(d), bool(is_lfs(n))) for n, d in files.items()}
        if branch:
            self.refs[branch] = sha
        return sha

    def resolve(self, rev: str) -> str | None:
        if rev in self.refs:
            return self.refs[rev]
        if re.fullmatch(r"[0-9a-f]{40}", rev) and rev in self.commits:
            return rev
        return None


@dataclass
class Request:
    method: str
    path: str
    host: str
    range: str | None
    authorization: str | None
    status: int = 0


class FakeHub:
    """Fake Hub state plus a ThreadingHTTPServer on 127.0.0.1:<ephemeral port>."""

    def __init__(self, *, lfs_redirect: bool = False, required_token: str | None = None):
        self.repos: dict[str, FakeRepo] = {}
        self.lfs_redirect = lfs_redirect
        self.required_token = required_token
        self._faults: dict[str, deque] = defaultdict(deque)
        self._corrupt: set[str] = set()
        self._short: dict[str, int] = {}
        self.listing_hook = None  # callable(body: dict) -> dict, applied to every model_info answer
        self._lock = threading.Lock()
        self.requests: list[Request] = []
        self.bytes_served = 0
        self.bytes_by_file: dict[str, int] = defaultdict(int)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- repo content -------------------------------------------------------------------------------------
    def add_repo(self, repo_id: str) -> FakeRepo:
        repo = self.repos[repo_id] = FakeRepo(repo_id)
        return repo

    # -- fault injection ----------------------------------------------------------------------------------
    def inject(self, name: str, kind: str, after: int = 0, status: int = 500) -> None:
        assert kind in ("drop", "status")
        with self._lock:
            self._faults[name].append((kind, after if kind == "drop" else status))

    def corrupt(self, name: str, on: bool = True) -> None:
        with self._lock:
            (self._corrupt.add if on else self._corrupt.discard)(name)

    def truncate(self, name: str, n: int) -> None:
        with self._lock:
            self._short[name] = n

    def _next_fault(self, name: str):
        with self._lock:
            q = self._faults.get(name)
            return q.popleft() if q else None

    # -- accounting ---------------------------------------------------------------------------------------
    def reset_counters(self) -> None:
        with self._lock:
            self.requests.clear()
            self.bytes_served = 0
            self.bytes_by_file.clear()

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            self.bytes_served += n
            self.bytes_by_file[name] += n

    def _record(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)

    # -- lifecycle ----------------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cdn_url(self) -> str:
        return f"http://localhost:{self.port}"

    def start(self) -> "FakeHub":
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="fake-hub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "FakeHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"
    server_version = "FakeHub/1.0"

    def log_message(self, format, *args):  # noqa: A002 - keep the test output clean
        pass

    # -- helpers ------------------------------------------------------------------------------------------
    def _rec(self) -> Request:
        req = Request(
            method=self.command,
            path=self.path,
            host=self.headers.get("Host", ""),
            range=self.headers.get("Range"),
            authorization=self.headers.get("Authorization"),
        )
        self.hub._record(req)
        self._req = req
        return req

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self._req.status = status
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _error(self, status: int, code: str | None, message: str, extra: dict[str, str] | None = None) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        headers.update(extra or {})
        self._send(status, json.dumps({"error": message}).encode(), headers)

    def _authorized(self) -> bool:
        tok = self.hub.required_token
        if tok is None:
            return True
        return self.headers.get("Authorization") == f"Bearer {tok}"

    def _find_repo(self, repo_id: str) -> FakeRepo | None:
        if not self._authorized():
            if self.headers.get("Authorization"):
                self._error(401, None, "Invalid credentials in Authorization header")
            else:
                self._error(401, "RepoNotFound", "Repository not found")
            return None
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
        return repo

    # -- routing ------------------------------------------------------------------------------------------
    def do_HEAD(self):
        self._route()

    def do_GET(self):
        self._route()

    def _route(self) -> None:
        self._rec()
        try:
            parts = urlsplit(self.path)
            path = parts.path
            if path.startswith("/api/models/"):
                if self.command != "GET":
                    return self._error(405, None, "Method not allowed")
                return self._model_info(path[len("/api/models/") :], parse_qs(parts.query))
            if path.startswith("/cdn/"):
                return self._cdn(path[len("/cdn/") :])
            if "/resolve/" in path:
                return self._resolve(path)
            self._error(404, None, "Not found")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _model_info(self, rest: str, query: dict[str, list[str]]) -> None:
        if "/revision/" in rest:
            repo_id, rev = rest.split("/revision/", 1)
            rev = unquote(rev)
        else:
            repo_id, rev = rest, "main"
        repo = self._find_repo(unquote(repo_id))
        if repo is None:
            return
        sha = repo.resolve(rev)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        blobs = query.get("blobs", ["false"])[0].lower() in ("1", "true")
        siblings = []
        for name, e in sorted(repo.commits[sha].items()):
            s: dict = {"rfilename": name}
            if blobs:
                s["size"] = len(e.data)
                s["blobId"] = e.blob_id
                if e.lfs:
                    s["lfs"] = {"sha256": e.sha256, "size": len(e.data), "pointerSize": len(e.pointer)}
            siblings.append(s)
        body = {
            "_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": sha,
            "lastModified": "2026-01-01T00:00:00.000Z",
            "createdAt": "2025-01-01T00:00:00.000Z",
            "private": self.hub.required_token is not None,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": ["safetensors"],
            "library_name": "transformers",
            "siblings": siblings,
        }
        if self.hub.listing_hook is not None:
            body = self.hub.listing_hook(body)
        self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def _resolve(self, path: str) -> None:
        repo_part, rest = path.lstrip("/").split("/resolve/", 1)
        rev_q, _, file_q = rest.partition("/")
        repo = self._find_repo(unquote(repo_part))
        if repo is None:
            return
        rev = unquote(rev_q)
        sha = repo.resolve(rev)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        name = unquote(file_q)
        entry = repo.commits[sha].get(name)
        if entry is None:
            return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": sha})
        headers = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        if entry.lfs:
            headers["ETag"] = f'"{entry.sha256}"'
            headers["X-Linked-Etag"] = f'"{entry.sha256}"'
            headers["X-Linked-Size"] = str(len(entry.data))
            if self.hub.lfs_redirect:
                loc = f"{self.hub.cdn_url}/cdn/{entry.sha256}?name={quote(name, safe='')}&sig=fake"
                headers["Location"] = loc
                return self._send(302, b"", headers)
        else:
            headers["ETag"] = f'"{entry.blob_id}"'
        self._body(entry, headers)

    def _cdn(self, rest: str) -> None:
        sha256 = rest.split("?", 1)[0]
        for repo in self.hub.repos.values():
            for files in repo.commits.values():
                for e in files.values():
                    if e.lfs and e.sha256 == sha256:
                        return self._body(e, {"Accept-Ranges": "bytes", "ETag": f'"{sha256}"'})
        self._error(404, None, "No such blob")

    def _head(self, status: int, headers: dict[str, str], length: int) -> None:
        """Status line and headers of a file response (the body, if any, follows)."""
        self._req.status = status
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def _body(self, entry: FileEntry, headers: dict[str, str]) -> None:
        data = entry.data
        if entry.name in self.hub._corrupt:
            data = bytes(b ^ 0xFF for b in data[:64]) + data[64:]
        if entry.name in self.hub._short:
            data = data[: len(data) - self.hub._short[entry.name]]
            headers.pop("X-Linked-Size", None)
        total = len(data)
        start, end = 0, total - 1
        status = 200
        rng = self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if not m or int(m.group(1)) >= total:
                return self._error(416, None, "Range Not Satisfiable", {"Content-Range": f"bytes */{total}"})
            start = int(m.group(1))
            end = min(int(m.group(2)), total - 1) if m.group(2) else total - 1
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{total}"
        headers.setdefault("Content-Type", "application/octet-stream")
        body = data[start : end + 1]
        if self.command == "HEAD":
            return self._head(status, headers, len(body))
        fault = self.hub._next_fault(entry.name)
        if fault is not None and fault[0] == "status":
            return self._error(fault[1], None, "Injected failure")
        limit = len(body)
        if fault is not None and fault[0] == "drop":
            limit = min(limit, fault[1])
        self._head(status, headers, len(body))
        sent = 0
        try:
            while sent < limit:
                chunk = body[sent : min(sent + _CHUNK, limit)]
                self.wfile.write(chunk)
                sent += len(chunk)
                self.hub._count(entry.name, len(chunk))
        finally:
            if limit < len(body):
                # simulate a network failure: close mid-body
                self.close_connection = True
                try:
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def hf_cache_snapshot(cache, repo_id: str, folder, *, tags: tuple[str, ...] = ()) -> str:
    """Lay `folder` out in the HF hub cache `cache` as `hf download` / transformers leave it: blobs
    named by sha256 (LFS files) or git blob sha1 (small files), snapshots/<commit>/<file> ->
    ../../blobs/<blob>, refs/main and refs/<tag> naming the commit. Returns the commit."""
    import os
    from pathlib import Path

    repo_dir = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snap = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for p in sorted(Path(folder).iterdir()):
        if not p.is_file():
            continue
        data = p.read_bytes()
        blob = hashlib.sha256(data).hexdigest() if default_is_lfs(p.name) else git_blob_id(data)
        (repo_dir / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", snap / p.name)
    (repo_dir / "refs").mkdir()
    for ref in ("main", *tags):
        (repo_dir / "refs" / ref).write_text(commit)
    return commit


def serve_folder(monkeypatch, tmp_path, repo_id: str, folder) -> FakeHub:
    """A started FakeHub serving every file of `folder` as `repo_id` at one commit, with HF_HOME, the
    Hub cache and the quantkit cache private to the test and HF_ENDPOINT pointing at it (the caller
    stops it). The one set-up the hub tests share."""
    from huggingface_hub import constants as hf_constants

    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "qk"))
    for var in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
    server = FakeHub().start()
    server.content = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    server.commit_sha = server.add_repo(repo_id).commit(server.content)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    return server
