"""Hugging Face Hub access for quantkit: pinned-commit, verified, resumable downloads.

Built on ``huggingface_hub`` (1.x): ``HfApi.model_info(files_metadata=True)`` resolves a revision to a commit and
lists every file with its size, git blob id and LFS sha256; ``get_hf_file_metadata`` does the per-file HEAD
(``/resolve/{commit}/{file}``); ``file_download.http_get`` does the HTTP transfer (ranged GETs, redirects, in-run
retries on dropped connections); ``hf_hub_download(local_files_only=True)`` finds files already in the HF cache.

Why not plain ``hf_hub_download``/``snapshot_download`` for the transfer: since huggingface_hub 1.x they write to a
per-process temporary file that is deleted when a download fails, so an interrupted multi-GB shard starts over on
the next run.  Here partial downloads are kept in ``<out>/.cache/quantkit/incomplete/`` and the next run finishes
them with a ranged GET (through ``http_get``'s ``resume_size``).  Nothing appears under a file's final name before
its size and checksum (sha256 for LFS files, git blob sha1 for small files) have been verified.

Environment: ``HF_TOKEN`` (read by huggingface_hub when no token is passed), ``HF_ENDPOINT``, ``HF_HUB_OFFLINE=1``
(use only what is complete in ``out/``/the quantkit cache/the HF cache; a clear error names what is missing),
``HF_HOME``/``HF_HUB_CACHE`` (where the HF cache is looked up).  The token is never printed or logged.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import quote

import httpx
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import WeakFileLock, build_hf_headers, validate_repo_id

from .errors import QuantkitError

__all__ = [
    "ChecksumError",
    "HubError",
    "HubSource",
    "PullResult",
    "RemoteFile",
    "parse_hf_id",
    "pull",
]

logger = logging.getLogger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHA1 = re.compile(r"[0-9a-f]{40}")
_HASH_CHUNK = 8 << 20
_STATE = (".cache", "quantkit")  # bookkeeping lives under <root>/.cache/quantkit/


# ---------------------------------------------------------------------------------------------------------------
# public types
# ---------------------------------------------------------------------------------------------------------------


class HubError(QuantkitError):
    """A Hub operation failed.  The message is one line naming the repo, the file (if any) and the fix."""

    def __init__(self, message: str, *, repo_id: str | None = None, filename: str | None = None):
        super().__init__(" ".join(str(message).split()))
        self.repo_id = repo_id
        self.filename = filename


class ChecksumError(HubError):
    """A downloaded file does not match the checksum published by the Hub (the bad file has been deleted)."""

    def __init__(self, message: str, *, repo_id: str, filename: str, expected: str, actual: str):
        super().__init__(message, repo_id=repo_id, filename=filename)
        self.expected = expected
        self.actual = actual


@dataclass
class RemoteFile:
    name: str
    size: int
    sha256: str | None  # from the LFS metadata; None for small (non-LFS) files
    blob_id: str | None = None  # git object id; verifies non-LFS files (sha1 of "blob <size>\0<content>")


@dataclass
class PullResult:
    repo_id: str
    commit: str
    files: list[str]
    bytes: int  # total size of `files`, all complete and verified under `out`
    seconds: float
    downloaded: int = 0  # bytes actually transferred over the network by this run
    out: Path | None = None


# ---------------------------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------------------------


def parse_hf_id(spec: str) -> tuple[str, str | None]:
    """``"hf://org/repo@rev"``, ``"org/repo@rev"`` or ``"org/repo"`` -> ``(repo_id, rev or None)``."""
    s = spec.strip()
    for prefix in ("hf://", "https://huggingface.co/", "http://huggingface.co/"):
        if s.startswith(prefix):
            s = s[len(prefix) :]
            break
    repo_id, at, rev = s.partition("@")
    repo_id = repo_id.strip("/")
    if at and not rev:
        raise HubError(f"bad model id {spec!r}: empty revision after '@'; fix: write org/repo@<branch|tag|commit>")
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise HubError(f"bad model id {spec!r}; fix: write hf://org/repo[@revision] or org/repo[@revision]") from None
    if "/" not in repo_id:
        raise HubError(f"bad model id {spec!r}: expected org/repo; fix: write hf://org/repo[@revision]")
    return repo_id, (rev or None)


def _is_true(value: str | None) -> bool:
    return str(value).strip().upper() in {"1", "ON", "YES", "TRUE"}


def _offline_mode() -> bool:
    """HF_HUB_OFFLINE, read now (huggingface_hub reads it once at import time)."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var) is not None:
            return _is_true(os.environ[var])
    return bool(constants.HF_HUB_OFFLINE)


def _endpoint(endpoint: str | None) -> str:
    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _default_hf_cache() -> Path:
    """The HF hub cache, from the environment as it is now (huggingface_hub reads it once at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def _repo_folder(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def _check_name(repo_id: str, name: str) -> None:
    parts = name.split("/")
    if (
        not name
        or name.startswith("/")
        or "\\" in name
        or any(p in ("", ".", "..") for p in parts)
        or tuple(parts[:2]) == _STATE
    ):
        raise HubError(f"{repo_id}: refusing unsafe file name {name!r} from the Hub listing", repo_id=repo_id)


def _short(names: list[str], n: int = 8) -> str:
    shown = ", ".join(names[:n])
    return shown + (f" (+{len(names) - n} more)" if len(names) > n else "")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


class _Cancelled(Exception):
    pass


class _Missing(Exception):
    """Offline and not available locally."""


# ---------------------------------------------------------------------------------------------------------------
# hashing / verification
# ---------------------------------------------------------------------------------------------------------------


def _new_hasher(rf: RemoteFile):
    if rf.sha256:
        return hashlib.sha256()
    if rf.blob_id:
        h = hashlib.sha1()
        h.update(b"blob %d\0" % rf.size)
        return h
    return None


def _expected(rf: RemoteFile) -> tuple[str, str | None]:
    if rf.sha256:
        return "sha256", rf.sha256
    if rf.blob_id:
        return "git-sha1", rf.blob_id
    return "size", None


def _hash_file(path: Path, rf: RemoteFile, stop: threading.Event | None = None) -> str | None:
    h = _new_hasher(rf)
    if h is None:
        return None
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            if stop is not None and stop.is_set():
                raise _Cancelled()
            h.update(chunk)
    return h.hexdigest()


class _Sink:
    """File object handed to ``http_get``: hashes and counts what is written, honours cancellation."""

    def __init__(self, f, hasher, on_bytes: Callable[[int], None], stop: threading.Event | None):
        self.f = f
        self.hasher = hasher
        self.on_bytes = on_bytes
        self.stop = stop
        self.received = 0
        self.dirty = False  # http_get rewound the file (server ignored the Range): rehash from disk at the end
        self._size_before_seek: int | None = None

    def write(self, chunk: bytes) -> int:
        if self.stop is not None and self.stop.is_set():
            raise _Cancelled()
        n = self.f.write(chunk)
        if self.hasher is not None:
            self.hasher.update(chunk)
        self.received += len(chunk)
        self.on_bytes(len(chunk))
        return n

    def tell(self) -> int:
        return self.f.tell()

    def seek(self, *args) -> int:
        self.dirty = True
        self._size_before_seek = os.fstat(self.f.fileno()).st_size
        return self.f.seek(*args)

    def truncate(self, *args) -> int:
        self.dirty = True
        before = self._size_before_seek if self._size_before_seek is not None else os.fstat(self.f.fileno()).st_size
        size = self.f.truncate(*args)
        self.on_bytes(size - before)
        return size

    def flush(self) -> None:
        self.f.flush()


class _NoBar:
    """tqdm stand-in for ``http_get``: quantkit draws its own (rich) progress."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        pass

    def close(self):
        pass


# ---------------------------------------------------------------------------------------------------------------
# progress
# ---------------------------------------------------------------------------------------------------------------


class _Progress:
    def __init__(self, enabled: bool, title: str, total: int):
        self._p = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._p = Progress(
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._p.start()
        self._overall = self._p.add_task(title, total=total)

    def start_file(self, name: str, total: int, done: int):
        if self._p is None:
            return None
        label = name if len(name) <= 48 else "…" + name[-47:]
        return self._p.add_task("  " + label, total=total, completed=done)

    def advance(self, task, n: int) -> None:
        if self._p is None:
            return
        if task is not None:
            self._p.advance(task, n)
        self._p.advance(self._overall, n)

    def end_file(self, task) -> None:
        if self._p is not None and task is not None:
            self._p.remove_task(task)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()


_NO_PROGRESS = _Progress(False, "", 0)


# ---------------------------------------------------------------------------------------------------------------
# on-disk layout of a destination folder
# ---------------------------------------------------------------------------------------------------------------


class _Layout:
    """``<root>/<repo path>`` for complete files; ``<root>/.cache/quantkit/`` for partials, markers, manifest."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.state = self.root.joinpath(*_STATE)

    @property
    def manifest(self) -> Path:
        return self.state / "manifest.json"

    def final(self, name: str) -> Path:
        return self.root.joinpath(*name.split("/"))

    def partial(self, rf: RemoteFile) -> Path:
        key = (rf.sha256 or rf.blob_id or f"size{rf.size}")[:16]
        return self.state.joinpath("incomplete", *rf.name.split("/")).with_name(
            f"{rf.name.rsplit('/', 1)[-1]}.{key}.incomplete"
        )

    def marker(self, name: str) -> Path:
        p = self.state.joinpath("verified", *name.split("/"))
        return p.with_name(p.name + ".json")

    def lock(self, name: str) -> Path:
        p = self.state.joinpath("locks", *name.split("/"))
        return p.with_name(p.name + ".lock")

    # -- completeness ---------------------------------------------------------------------------------------
    def marked_complete(self, rf: RemoteFile) -> bool:
        """Cheap check: final file present with the size and mtime recorded when it was verified."""
        try:
            st = self.final(rf.name).stat()
            m = json.loads(self.marker(rf.name).read_text())
        except (OSError, ValueError):
            return False
        if st.st_size != rf.size or m.get("size") != rf.size or m.get("mtime_ns") != st.st_mtime_ns:
            return False
        if rf.sha256:
            return m.get("sha256") == rf.sha256
        if rf.blob_id:
            return m.get("blob_id") == rf.blob_id
        return True

    def write_marker(self, rf: RemoteFile, commit: str | None) -> None:
        st = self.final(rf.name).stat()
        data = {"size": rf.size, "sha256": rf.sha256, "blob_id": rf.blob_id, "commit": commit, "mtime_ns": st.st_mtime_ns}
        _atomic_write(self.marker(rf.name), json.dumps(data))

    def drop_marker(self, name: str) -> None:
        self.marker(name).unlink(missing_ok=True)

    def partial_size(self, rf: RemoteFile) -> int:
        try:
            return min(self.partial(rf).stat().st_size, rf.size)
        except OSError:
            return 0


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _manifest_dict(repo_id: str, revision: str, commit: str, files: dict[str, RemoteFile]) -> dict:
    return {
        "repo_id": repo_id,
        "revision": revision,
        "commit": commit,
        "files": [
            {"name": f.name, "size": f.size, "sha256": f.sha256, "blob_id": f.blob_id} for f in files.values()
        ],
    }


def _read_manifest(path: Path, repo_id: str, revision: str) -> tuple[str, dict[str, RemoteFile]] | None:
    try:
        m = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if m.get("repo_id") != repo_id or revision not in (m.get("revision"), m.get("commit")):
        return None
    files = {d["name"]: RemoteFile(d["name"], int(d["size"]), d.get("sha256"), d.get("blob_id")) for d in m["files"]}
    return m["commit"], files


# ---------------------------------------------------------------------------------------------------------------
# the repo at a pinned commit
# ---------------------------------------------------------------------------------------------------------------


class _Repo:
    def __init__(self, repo_id: str, revision: str | None, *, endpoint: str | None, token: str | None, hf_cache: Path | None):
        self.repo_id = repo_id
        self.revision = revision or constants.DEFAULT_REVISION
        self.endpoint = _endpoint(endpoint)
        self._token = token  # None => huggingface_hub reads HF_TOKEN / the stored token; never logged
        self.hf_cache = Path(hf_cache) if hf_cache is not None else _default_hf_cache()
        self.offline = _offline_mode()
        self.commit: str = ""
        self.files: dict[str, RemoteFile] = {}
        self.listing_source = ""

    def __repr__(self) -> str:
        return f"_Repo({self.repo_id!r}, commit={self.commit[:12]!r})"

    @property
    def label(self) -> str:
        return f"{self.repo_id}@{self.commit[:12]}" if self.commit else f"{self.repo_id}@{self.revision}"

    # -- errors ---------------------------------------------------------------------------------------------
    def error(self, exc: BaseException, filename: str | None = None) -> HubError:
        """Translate a huggingface_hub / httpx / OS error into a one-line HubError with a fix."""
        where = self.label + (f" file {filename!r}" if filename else "")
        if isinstance(exc, HubError):
            return exc
        if isinstance(exc, GatedRepoError):
            msg = f"{where}: gated repository; fix: accept its terms on the model page, then set HF_TOKEN to a token of that account"
        elif isinstance(exc, RepositoryNotFoundError):
            msg = (
                f"{where}: repository not found or not accessible at {self.endpoint}; fix: check the repo id, "
                "or set HF_TOKEN (or --token) to a token with read access for private/gated repos"
            )
        elif isinstance(exc, RevisionNotFoundError):
            msg = f"{where}: revision {self.revision!r} not found; fix: pass an existing branch, tag or full commit sha"
        elif isinstance(exc, RemoteEntryNotFoundError):
            msg = f"{where}: file not found at this commit; fix: check the file name (see the repo's file list)"
        elif isinstance(exc, OfflineModeIsEnabled):
            msg = f"{where}: offline mode (HF_HUB_OFFLINE) blocks this download; fix: unset HF_HUB_OFFLINE"
        elif isinstance(exc, HfHubHTTPError):
            status = exc.response.status_code if exc.response is not None else "?"
            hint = exc.response.headers.get("X-Error-Message", "") if exc.response is not None else ""
            if status == 401:
                fix = "check HF_TOKEN / --token (expired or revoked?)"
            elif status == 403:
                fix = "use a token with read access to this repo (and accept its terms if gated)"
            elif status == 416:
                fix = "delete the partial file under .cache/quantkit/incomplete and re-run"
            else:
                fix = "re-run later; completed files are kept and partial ones resume"
            msg = f"{where}: HTTP {status} from {self.endpoint}{f' ({hint})' if hint else ''}; fix: {fix}"
        elif isinstance(exc, httpx.TransportError):
            msg = (
                f"{where}: network error talking to {self.endpoint} ({type(exc).__name__}: {exc}); "
                "fix: check connectivity and re-run (partial downloads resume), or set HF_HUB_OFFLINE=1 to use local files"
            )
        elif isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            msg = f"{where}: disk full; fix: free space (partial downloads are kept and resume)"
        elif isinstance(exc, OSError) and "Consistency check failed" in str(exc):
            msg = f"{where}: download ended early ({str(exc).splitlines()[0]}); fix: re-run, the partial file resumes"
        else:
            msg = f"{where}: {type(exc).__name__}: {exc}; fix: re-run, or report this with the log"
        return HubError(self.redact(msg), repo_id=self.repo_id, filename=filename)

    def redact(self, text: str) -> str:
        tok = self._token
        if tok is None:
            tok = os.environ.get("HF_TOKEN")
        if tok and len(tok) >= 4:
            text = text.replace(tok, "***")
        return re.sub(r"hf_[A-Za-z0-9]{8,}", "hf_***", text)

    # -- listing --------------------------------------------------------------------------------------------
    def resolve_online(self) -> None:
        """One ``model_info(files_metadata=True)`` call: revision -> commit, and the full file list."""
        try:
            info = HfApi(endpoint=self.endpoint, token=self._token).model_info(
                self.repo_id, revision=self.revision, files_metadata=True
            )
        except Exception as e:
            raise self.error(e) from e
        if not info.sha:
            raise HubError(f"{self.label}: the Hub returned no commit sha; fix: check HF_ENDPOINT", repo_id=self.repo_id)
        files = {}
        for s in info.siblings or []:
            _check_name(self.repo_id, s.rfilename)
            size = s.lfs.size if s.lfs is not None else s.size
            if size is None:
                raise HubError(
                    f"{self.repo_id}: the Hub listing has no file sizes; fix: check HF_ENDPOINT points to a Hub-compatible server",
                    repo_id=self.repo_id,
                )
            files[s.rfilename] = RemoteFile(
                s.rfilename, int(size), s.lfs.sha256 if s.lfs is not None else None, s.blob_id
            )
        self.commit, self.files, self.listing_source = info.sha, files, "hub"

    def resolve_offline(self, manifests: list[Path]) -> None:
        """Offline: the file list comes from a manifest we wrote earlier, else from an HF cache snapshot."""
        for path in manifests:
            got = _read_manifest(path, self.repo_id, self.revision)
            if got is not None:
                self.commit, self.files = got
                self.listing_source = str(path)
                return
        commit = self.revision if _SHA1.fullmatch(self.revision) else None
        repo_dir = self.hf_cache / _repo_folder(self.repo_id)
        if commit is None:
            try:
                commit = (repo_dir / "refs" / self.revision).read_text().strip()
            except OSError:
                commit = None
        snap = repo_dir / "snapshots" / commit if commit else None
        if snap is None or not snap.is_dir():
            raise HubError(
                f"{self.repo_id}@{self.revision}: HF_HUB_OFFLINE=1 and no local copy: nothing pulled before "
                f"(no quantkit manifest) and not in the HF cache {self.hf_cache}; missing: all files; "
                "fix: unset HF_HUB_OFFLINE to download, or point HF_HOME/HF_HUB_CACHE at a cache that has it",
                repo_id=self.repo_id,
            )
        files = {}
        for p in sorted(snap.rglob("*")):
            if not p.is_file():
                continue
            name = p.relative_to(snap).as_posix()
            blob = os.path.basename(os.path.realpath(p))
            files[name] = RemoteFile(
                name,
                p.stat().st_size,
                blob if _SHA256.fullmatch(blob) else None,
                blob if _SHA1.fullmatch(blob) else None,
            )
        logger.warning(
            "%s: offline, file list taken from the HF cache snapshot %s; files never downloaded there are not known",
            self.repo_id,
            snap,
        )
        self.commit, self.files, self.listing_source = commit, files, str(snap)

    def resolve(self, manifests: list[Path]) -> None:
        if self.offline:
            self.resolve_offline(manifests)
        else:
            self.resolve_online()

    # -- file materialization -------------------------------------------------------------------------------
    def from_hf_cache(self, rf: RemoteFile) -> Path | None:
        """A complete copy of this file at this commit in the HF cache (``hf_hub_download(local_files_only=True)``)."""
        if not self.hf_cache.is_dir():
            return None
        try:
            p = hf_hub_download(
                self.repo_id,
                rf.name,
                revision=self.commit,
                cache_dir=self.hf_cache,
                local_files_only=True,
                token=False,
            )
        except (EntryNotFoundError, OSError, ValueError):
            return None
        path = Path(p)
        try:
            if path.stat().st_size != rf.size:
                return None
        except OSError:
            return None
        return path

    @staticmethod
    def _digest_ok(rf: RemoteFile, actual: str | None) -> bool:
        expected = _expected(rf)[1]
        return expected is None or actual == expected

    def verify_or_raise(self, rf: RemoteFile, actual: str | None, bad: Path) -> None:
        kind, expected = _expected(rf)
        if expected is None or actual == expected:
            return
        bad.unlink(missing_ok=True)
        raise ChecksumError(
            f"{self.label} file {rf.name!r}: {kind} mismatch (expected {expected}, got {actual}); "
            "the corrupt download was deleted; fix: re-run to download it again (if it persists, the mirror or "
            "HF_ENDPOINT serves bad data)",
            repo_id=self.repo_id,
            filename=rf.name,
            expected=expected,
            actual=actual or "",
        )

    def ensure(
        self,
        rf: RemoteFile,
        layout: _Layout,
        *,
        progress: _Progress = _NO_PROGRESS,
        stop: threading.Event | None = None,
        borrow_hf_cache: bool = False,
    ) -> tuple[Path, int, str]:
        """Make ``rf`` complete and verified; returns ``(path, bytes transferred, source)``.

        source: "local" (already there), "hf-cache" (copied, or borrowed in place, from the HF cache), "hub".
        Raises ``_Missing`` when offline and the file is nowhere local.
        """
        if layout.marked_complete(rf):
            return layout.final(rf.name), 0, "local"
        lock = layout.lock(rf.name)
        lock.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(lock):
            if layout.marked_complete(rf):
                return layout.final(rf.name), 0, "local"
            final = layout.final(rf.name)
            if final.is_file():  # present but not (or no longer) known-good: verify it once
                if final.stat().st_size == rf.size:
                    if self._digest_ok(rf, _hash_file(final, rf, stop)):
                        layout.write_marker(rf, self.commit)
                        return final, 0, "local"
                logger.warning("%s: %s under %s fails verification; replacing it", self.label, rf.name, layout.root)
                final.unlink()
                layout.drop_marker(rf.name)
            cached = self.from_hf_cache(rf)
            if cached is not None:
                if borrow_hf_cache:
                    if self._digest_ok(rf, _hash_file(cached, rf, stop)):
                        return cached, 0, "hf-cache"
                elif self._copy_verified(rf, cached, layout, progress, stop):
                    return final, 0, "hf-cache"
                logger.warning("%s: %s in the HF cache (%s) fails verification; ignoring it", self.label, rf.name, cached)
            if self.offline:
                raise _Missing(rf.name)
            return final, self._download(rf, layout, progress, stop), "hub"

    def _copy_verified(self, rf: RemoteFile, src: Path, layout: _Layout, progress: _Progress, stop) -> bool:
        partial = layout.partial(rf)
        partial.parent.mkdir(parents=True, exist_ok=True)
        h = _new_hasher(rf)
        task = progress.start_file(rf.name + " (from HF cache)", rf.size, 0)
        try:
            with open(src, "rb") as fi, open(partial, "wb") as fo:
                while chunk := fi.read(_HASH_CHUNK):
                    if stop is not None and stop.is_set():
                        raise _Cancelled()
                    fo.write(chunk)
                    if h is not None:
                        h.update(chunk)
                    progress.advance(task, len(chunk))
                fo.flush()
                os.fsync(fo.fileno())
        finally:
            progress.end_file(task)
        if not self._digest_ok(rf, h.hexdigest() if h is not None else None):
            partial.unlink(missing_ok=True)
            return False
        self._publish(rf, partial, layout)
        return True

    def _publish(self, rf: RemoteFile, partial: Path, layout: _Layout) -> None:
        final = layout.final(rf.name)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, final)
        layout.write_marker(rf, self.commit)

    def _download(self, rf: RemoteFile, layout: _Layout, progress: _Progress, stop) -> int:
        url = hf_hub_url(self.repo_id, rf.name, revision=self.commit, endpoint=self.endpoint)
        try:
            meta = get_hf_file_metadata(url, token=self._token, endpoint=self.endpoint, retry_on_errors=True)
        except Exception as e:
            raise self.error(e, rf.name) from e
        if meta.commit_hash and meta.commit_hash != self.commit:
            raise HubError(
                f"{self.label} file {rf.name!r}: the Hub resolved it at commit {meta.commit_hash[:12]}; "
                "fix: check HF_ENDPOINT (a mirror serving another commit?)",
                repo_id=self.repo_id,
                filename=rf.name,
            )
        if meta.size is not None and meta.size != rf.size:
            raise HubError(
                f"{self.label} file {rf.name!r}: size {meta.size} from /resolve differs from the listing ({rf.size}); "
                "fix: re-run (the repo may have changed) or check HF_ENDPOINT",
                repo_id=self.repo_id,
                filename=rf.name,
            )

        partial = layout.partial(rf)
        partial.parent.mkdir(parents=True, exist_ok=True)
        same_file = re.compile(re.escape(rf.name.rsplit("/", 1)[-1]) + r"\.[0-9a-z]{1,16}\.incomplete")
        for other in partial.parent.glob("*.incomplete"):  # partials of other versions of this file
            if other != partial and same_file.fullmatch(other.name):
                other.unlink(missing_ok=True)
        resume = partial.stat().st_size if partial.exists() else 0
        if resume > rf.size:
            partial.unlink()
            resume = 0
        if resume:
            logger.info("%s: resuming %s at %s of %s", self.label, rf.name, _human(resume), _human(rf.size))

        # "identity": byte ranges must address the file itself, not a gzip stream of it
        headers = build_hf_headers(token=self._token, headers={"Accept-Encoding": "identity"})
        hasher = _new_hasher(rf)
        task = progress.start_file(rf.name, rf.size, resume)
        try:
            with open(partial, "r+b" if partial.exists() else "w+b") as f:
                if resume and hasher is not None:
                    remaining = resume
                    while remaining and (chunk := f.read(min(_HASH_CHUNK, remaining))):
                        hasher.update(chunk)
                        remaining -= len(chunk)
                f.seek(resume)
                f.truncate()
                sink = _Sink(f, hasher, lambda n: progress.advance(task, n), stop)
                try:
                    http_get(
                        url,
                        sink,  # type: ignore[arg-type]
                        resume_size=resume,
                        headers=headers,
                        expected_size=rf.size,
                        displayed_filename=rf.name,
                        tqdm_class=_NoBar,  # type: ignore[arg-type]
                    )
                except _Cancelled:
                    raise
                except Exception as e:
                    raise self.error(e, rf.name) from e
                f.flush()
                os.fsync(f.fileno())
        finally:
            progress.end_file(task)
        actual = _hash_file(partial, rf, stop) if sink.dirty else (hasher.hexdigest() if hasher is not None else None)
        self.verify_or_raise(rf, actual, partial)
        self._publish(rf, partial, layout)
        return sink.received


# ---------------------------------------------------------------------------------------------------------------
# HubSource: one file at a time, for streamed conversion
# ---------------------------------------------------------------------------------------------------------------


class HubSource:
    """A model repo at a pinned commit, fetched file by file on demand.

    Files land in ``<cache_dir>/hub/models--org--repo/snapshots/<commit>/<path>`` (partials and bookkeeping in
    that folder's ``.cache/quantkit/``).  A file already complete in the HF cache at this commit is used in place
    (verified, not copied) and is never deleted by :meth:`release`.
    """

    def __init__(
        self,
        repo_id: str,
        revision: str | None = None,
        *,
        cache_dir: Path,
        endpoint: str | None = None,
        token: str | None = None,
        hf_cache_dir: Path | None = None,
    ):
        rid, spec_rev = parse_hf_id(repo_id)
        if revision and spec_rev and revision != spec_rev:
            raise HubError(f"{repo_id}: revision given twice ({spec_rev!r} and {revision!r}); fix: pass only one")
        self._repo = _Repo(rid, revision or spec_rev, endpoint=endpoint, token=token, hf_cache=hf_cache_dir)
        self.cache_dir = Path(cache_dir)
        self._base = self.cache_dir / "hub" / _repo_folder(rid)
        ref_file = self._base / "refs" / quote(self._repo.revision, safe="")
        manifests = []
        known = self._repo.revision if _SHA1.fullmatch(self._repo.revision) else None
        if known is None and ref_file.is_file():
            known = ref_file.read_text().strip()
        if known:
            manifests.append(_Layout(self._base / "snapshots" / known).manifest)
        self._repo.resolve(manifests)
        self._layout = _Layout(self._base / "snapshots" / self._repo.commit)
        if self._repo.listing_source == "hub":
            _atomic_write(
                self._layout.manifest,
                json.dumps(_manifest_dict(rid, self._repo.revision, self._repo.commit, self._repo.files)),
            )
            _atomic_write(ref_file, self._repo.commit)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._borrowed: set[str] = set()

    repo_id = property(lambda self: self._repo.repo_id)
    revision = property(lambda self: self._repo.revision)
    commit = property(lambda self: self._repo.commit)
    files = property(lambda self: self._repo.files)
    endpoint = property(lambda self: self._repo.endpoint)

    def __repr__(self) -> str:
        return f"HubSource({self.repo_id!r}, revision={self.revision!r}, commit={self.commit[:12]!r})"

    def _file(self, filename: str) -> RemoteFile:
        rf = self.files.get(filename)
        if rf is None:
            raise HubError(
                f"{self._repo.label}: no file {filename!r} in this repo; fix: use one of {_short(sorted(self.files), 5)}",
                repo_id=self.repo_id,
                filename=filename,
            )
        return rf

    def _lock(self, filename: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(filename, threading.Lock())

    def local_path(self, filename: str) -> Path:
        """Where :meth:`fetch` puts ``filename`` (whether or not it is there yet)."""
        return self._layout.final(self._file(filename).name)

    def fetch(self, filename: str) -> Path:
        """Download ``filename`` (resuming a partial one), verify it against the Hub checksum, return its path."""
        rf = self._file(filename)
        with self._lock(filename):
            try:
                path, n, source = self._repo.ensure(rf, self._layout, borrow_hf_cache=True)
            except _Missing:
                raise HubError(
                    f"{self._repo.label} file {filename!r}: HF_HUB_OFFLINE=1 and it is not in {self._layout.root} "
                    f"nor the HF cache; fix: unset HF_HUB_OFFLINE to download it",
                    repo_id=self.repo_id,
                    filename=filename,
                ) from None
            if source == "hf-cache":
                self._borrowed.add(filename)
            else:
                self._borrowed.discard(filename)
            if n:
                logger.info("%s: fetched %s (%s)", self._repo.label, filename, _human(n))
            return path

    def read_range(self, filename: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``filename`` from ``start`` (a local complete copy if there is one, else one
        ranged GET): how a streamed conversion reads every shard's safetensors header before fetching it."""
        rf = self._file(filename)
        local = self._layout.final(rf.name)
        if local.is_file() and local.stat().st_size == rf.size:
            with open(local, "rb") as f:
                f.seek(start)
                return f.read(length)
        if length <= 0:
            return b""
        from huggingface_hub.utils import get_session

        url = hf_hub_url(self.repo_id, rf.name, revision=self.commit, endpoint=self.endpoint)
        headers = build_hf_headers(token=self._repo._token, headers={"Accept-Encoding": "identity", "Range": f"bytes={start}-{start + length - 1}"})
        try:
            r = get_session().get(url, headers=headers, follow_redirects=True)
            r.raise_for_status()
        except Exception as e:
            raise self._repo.error(e, rf.name) from e
        data = r.content
        if r.status_code == 200:  # server ignored the range
            data = data[start:start + length]
        return data

    def release(self, filename: str) -> None:
        """Delete the local copy of ``filename`` (files used in place from the HF cache are left alone)."""
        rf = self._file(filename)
        with self._lock(filename):
            if filename in self._borrowed:
                self._borrowed.discard(filename)
                logger.info("%s: %s lives in the HF cache; not deleting it", self._repo.label, filename)
                return
            self._layout.final(rf.name).unlink(missing_ok=True)
            self._layout.drop_marker(rf.name)
            self._layout.partial(rf).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------------------
# pull: the whole repo (or a filtered part) into a folder
# ---------------------------------------------------------------------------------------------------------------


def _select(files: dict[str, RemoteFile], include: list[str] | None) -> list[RemoteFile]:
    if not include:
        return list(files.values())
    return [f for f in files.values() if any(fnmatch.fnmatchcase(f.name, pat) for pat in include)]


def _free_space(path: Path) -> int | None:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def pull(
    repo: str,
    out: Path,
    *,
    revision: str | None = None,
    include: list[str] | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    max_workers: int = 8,
    progress: bool = True,
    cache_dir: Path | None = None,
) -> PullResult:
    """Download ``repo`` (``hf://org/repo[@rev]`` or ``org/repo[@rev]``) at one pinned commit into ``out``.

    Parallel (``max_workers`` threads), resumable (a re-run only fetches missing files and finishes partial ones
    with ranged GETs), every file verified (LFS: sha256; others: git blob id).  ``include``: fnmatch patterns on
    repo paths.  ``cache_dir``: the HF cache to reuse files from (default: ``$HF_HUB_CACHE`` / ``$HF_HOME/hub``).
    """
    t0 = time.monotonic()
    repo_id, spec_rev = parse_hf_id(repo)
    if revision and spec_rev and revision != spec_rev:
        raise HubError(f"{repo}: revision given twice ({spec_rev!r} and {revision!r}); fix: pass only one")
    out = Path(out)
    layout = _Layout(out)
    r = _Repo(repo_id, revision or spec_rev, endpoint=endpoint, token=token, hf_cache=cache_dir)
    r.resolve([layout.manifest])

    selected = sorted(_select(r.files, include), key=lambda f: (-f.size, f.name))
    if not selected:
        raise HubError(
            f"{r.label}: no file matches include={include}; fix: adjust the patterns "
            f"(files: {_short(sorted(r.files), 6)})",
            repo_id=repo_id,
        )
    out.mkdir(parents=True, exist_ok=True)
    if r.listing_source == "hub":
        _atomic_write(layout.manifest, json.dumps(_manifest_dict(repo_id, r.revision, r.commit, r.files)))

    todo = [f for f in selected if not layout.marked_complete(f)]
    need = sum(f.size - layout.partial_size(f) for f in todo)
    free = _free_space(out)
    if free is not None and need > free:
        raise HubError(
            f"{r.label}: needs {_human(need)} more under {out} but only {_human(free)} is free; "
            "fix: free space or choose another --out",
            repo_id=repo_id,
        )

    bar = _Progress(progress and bool(todo), f"{repo_id}@{r.commit[:8]}", need)
    stop = threading.Event()
    errors: dict[str, BaseException] = {}
    missing: list[str] = []
    downloaded = 0
    try:
        if todo:
            with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(todo))), thread_name_prefix="qk-pull") as ex:
                futs = {ex.submit(r.ensure, f, layout, progress=bar, stop=stop): f for f in todo}
                try:
                    pending = set(futs)
                    while pending:
                        done, pending = wait(pending, return_when=FIRST_COMPLETED)
                        for fut in done:
                            rf = futs[fut]
                            try:
                                _, n, _ = fut.result()
                                downloaded += n
                            except _Missing:
                                missing.append(rf.name)
                            except _Cancelled:
                                pass
                            except Exception as e:  # noqa: BLE001 - reported below, one line per file
                                errors[rf.name] = e
                except BaseException:
                    stop.set()
                    for fut in futs:
                        fut.cancel()
                    raise
    finally:
        bar.close()

    if missing:
        missing.sort()
        raise HubError(
            f"{r.label}: HF_HUB_OFFLINE=1 and {len(missing)} file(s) are not complete in {out} nor in the HF cache: "
            f"{_short(missing)}; fix: unset HF_HUB_OFFLINE to download them",
            repo_id=repo_id,
            filename=missing[0],
        )
    if errors:
        errs = [errors[k] if isinstance(errors[k], HubError) else r.error(errors[k], k) for k in sorted(errors)]
        if len(errs) == 1:
            raise errs[0]
        summary = "; ".join(str(e) for e in errs[:3]) + (f"; (+{len(errs) - 3} more)" if len(errs) > 3 else "")
        cls = ChecksumError if all(isinstance(e, ChecksumError) for e in errs) else HubError
        if cls is ChecksumError:
            e0 = errs[0]
            raise ChecksumError(
                f"{len(errs)} files failed verification: {summary}",
                repo_id=repo_id,
                filename=e0.filename or "",
                expected=e0.expected,  # type: ignore[attr-defined]
                actual=e0.actual,  # type: ignore[attr-defined]
            )
        raise HubError(f"{len(errs)} files failed: {summary}", repo_id=repo_id, filename=errs[0].filename)

    names = sorted(f.name for f in selected)
    result = PullResult(
        repo_id=repo_id,
        commit=r.commit,
        files=names,
        bytes=sum(f.size for f in selected),
        seconds=time.monotonic() - t0,
        downloaded=downloaded,
        out=out,
    )
    logger.info(
        "%s: %d files (%s) complete in %s, %s downloaded in %.1fs",
        r.label,
        len(names),
        _human(result.bytes),
        out,
        _human(downloaded),
        result.seconds,
    )
    return result
