"""``Repo``: one Hub model repo at a pinned commit -- listing, error translation, verified download with resume.

``resolve()`` turns a revision into a commit and the full file list (online: one ``model_info`` call; offline: a
manifest written by an earlier run, else an HF cache snapshot).  ``ensure()`` makes one file complete and verified
under a ``Layout``: already there, copied (or borrowed in place) from the HF cache, or downloaded with
``http_get`` into a partial file that the next run resumes with a ranged GET.  Used by :mod:`quantkit.hub.download`.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from pathlib import Path

import httpx
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import WeakFileLock, build_hf_headers

from quantkit.hub.store import (
    HASH_CHUNK,
    NO_PROGRESS,
    STATE,
    Cancelled,
    ChecksumError,
    HubError,
    Layout,
    NoBar,
    Progress,
    RemoteFile,
    Sink,
    expected_digest,
    hash_file,
    human,
    new_hasher,
    read_manifest,
)

logger = logging.getLogger("quantkit.hub")  # the name these messages have always been logged under

_SHA256 = re.compile(r"[0-9a-f]{64}")
SHA1 = re.compile(r"[0-9a-f]{40}")


# ---------------------------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------------------------


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


def repo_folder(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def _check_name(repo_id: str, name: str) -> None:
    """A listed file name becomes a path under the cache: every component must be a plain name
    (no '..', no separators, no NUL or control characters, at most 255 bytes; the whole at most 1024)."""
    parts = name.split("/") if isinstance(name, str) else [""]
    if (
        not name
        or name.startswith("/")
        or "\\" in name
        or any(p in ("", ".", "..") for p in parts)
        or tuple(parts[:2]) == STATE
        or any(ord(c) < 32 or ord(c) == 127 for c in name)
        or any(len(p.encode("utf-8", "surrogatepass")) > 255 for p in parts)
        or len(name) > 1024
    ):
        raise HubError(f"{repo_id}: refusing unsafe file name {name!r:.80} from the Hub listing (path components must be "
                       "plain names of at most 255 bytes); fix: check HF_ENDPOINT points to a trusted Hub", repo_id=repo_id)


def check_commit(repo_id: str, commit, where: str) -> str:
    """The commit becomes a folder name under snapshots/: it must be a 40-hex git sha."""
    if not isinstance(commit, str) or not SHA1.fullmatch(commit):
        raise HubError(f"{repo_id}: {where} gave commit {str(commit)[:60]!r}, not a 40-hex git sha; refusing it "
                       "(it would name a folder); fix: check HF_ENDPOINT points to a trusted Hub", repo_id=repo_id)
    return commit


def _check_checksums(repo_id: str, rf: RemoteFile, allow_unverified: bool) -> bool:
    """True when `rf` has a well-formed checksum; False (accepted on size alone) only with
    allow_unverified; otherwise a HubError."""
    if rf.sha256 is not None and not _SHA256.fullmatch(str(rf.sha256)):
        raise HubError(f"{repo_id} file {rf.name!r}: malformed sha256 {str(rf.sha256)[:70]!r} in the Hub listing; "
                       "fix: check HF_ENDPOINT points to a trusted Hub", repo_id=repo_id, filename=rf.name)
    if rf.blob_id is not None and not SHA1.fullmatch(str(rf.blob_id)):
        raise HubError(f"{repo_id} file {rf.name!r}: malformed blob id {str(rf.blob_id)[:50]!r} in the Hub listing; "
                       "fix: check HF_ENDPOINT points to a trusted Hub", repo_id=repo_id, filename=rf.name)
    if rf.sha256 or rf.blob_id:
        return True
    if not allow_unverified:
        raise HubError(f"{repo_id} file {rf.name!r}: the Hub listing gives no checksum (no LFS sha256, no blob id), so "
                       "it could only be checked by size; fix: check HF_ENDPOINT, or pass --allow-unverified to accept "
                       "such files (recorded in the report)", repo_id=repo_id, filename=rf.name)
    return False


class Missing(Exception):
    """Offline and not available locally."""


# ---------------------------------------------------------------------------------------------------------------
# the repo at a pinned commit
# ---------------------------------------------------------------------------------------------------------------


class Repo:
    def __init__(self, repo_id: str, revision: str | None, *, endpoint: str | None, token: str | None, hf_cache: Path | None,
                 allow_unverified: bool = False):
        self.repo_id = repo_id
        self.allow_unverified = allow_unverified
        self.unverified: list[str] = []  # files accepted on size alone (allow_unverified)
        self.revision = revision or constants.DEFAULT_REVISION
        self.endpoint = _endpoint(endpoint)
        self._token = token  # None => huggingface_hub reads HF_TOKEN / the stored token; never logged
        self.hf_cache = Path(hf_cache) if hf_cache is not None else _default_hf_cache()
        self.offline = _offline_mode()
        self.commit: str = ""
        self.files: dict[str, RemoteFile] = {}
        self.listing_source = ""

    def __repr__(self) -> str:
        return f"Repo({self.repo_id!r}, commit={self.commit[:12]!r})"

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
        check_commit(self.repo_id, info.sha, "the Hub listing")
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
            if not _check_checksums(self.repo_id, files[s.rfilename], self.allow_unverified):
                self.unverified.append(s.rfilename)
        self.commit, self.files, self.listing_source = info.sha, files, "hub"

    def resolve_offline(self, manifests: list[Path]) -> None:
        """Offline: the file list comes from a manifest we wrote earlier, else from an HF cache snapshot."""
        for path in manifests:
            got = read_manifest(path, self.repo_id, self.revision)
            if got is not None:
                self.commit, self.files = got
                check_commit(self.repo_id, self.commit, f"the manifest {path}")
                for name, rf in self.files.items():
                    _check_name(self.repo_id, name)
                    if not _check_checksums(self.repo_id, rf, self.allow_unverified):
                        self.unverified.append(name)
                self.listing_source = str(path)
                return
        commit = self.revision if SHA1.fullmatch(self.revision) else None
        repo_dir = self.hf_cache / repo_folder(self.repo_id)
        if commit is None:
            try:
                commit = (repo_dir / "refs" / self.revision).read_text().strip()
            except OSError:
                commit = None
        if commit is not None:
            check_commit(self.repo_id, commit, f"the HF cache ref {repo_dir / 'refs' / self.revision}")
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
                blob if SHA1.fullmatch(blob) else None,
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
        expected = expected_digest(rf)[1]
        return expected is None or actual == expected

    def verify_or_raise(self, rf: RemoteFile, actual: str | None, bad: Path) -> None:
        kind, expected = expected_digest(rf)
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
        layout: Layout,
        *,
        progress: Progress = NO_PROGRESS,
        stop: threading.Event | None = None,
        borrow_hf_cache: bool = False,
    ) -> tuple[Path, int, str]:
        """Make ``rf`` complete and verified; returns ``(path, bytes transferred, source)``.

        source: "local" (already there), "hf-cache" (copied, or borrowed in place, from the HF cache), "hub".
        Raises ``Missing`` when offline and the file is nowhere local.
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
                    if self._digest_ok(rf, hash_file(final, rf, stop)):
                        layout.write_marker(rf, self.commit)
                        return final, 0, "local"
                logger.warning("%s: %s under %s fails verification; replacing it", self.label, rf.name, layout.root)
                final.unlink()
                layout.drop_marker(rf.name)
            cached = self.from_hf_cache(rf)
            if cached is not None:
                if borrow_hf_cache:
                    if self._digest_ok(rf, hash_file(cached, rf, stop)):
                        return cached, 0, "hf-cache"
                elif self._copy_verified(rf, cached, layout, progress, stop):
                    return final, 0, "hf-cache"
                logger.warning("%s: %s in the HF cache (%s) fails verification; ignoring it", self.label, rf.name, cached)
            if self.offline:
                raise Missing(rf.name)
            return final, self._download(rf, layout, progress, stop), "hub"

    def _copy_verified(self, rf: RemoteFile, src: Path, layout: Layout, progress: Progress, stop) -> bool:
        partial = layout.partial(rf)
        partial.parent.mkdir(parents=True, exist_ok=True)
        h = new_hasher(rf)
        task = progress.start_file(rf.name + " (from HF cache)", rf.size, 0)
        try:
            with open(src, "rb") as fi, open(partial, "wb") as fo:
                while chunk := fi.read(HASH_CHUNK):
                    if stop is not None and stop.is_set():
                        raise Cancelled()
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

    def _publish(self, rf: RemoteFile, partial: Path, layout: Layout) -> None:
        final = layout.final(rf.name)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, final)
        layout.write_marker(rf, self.commit)

    def _download(self, rf: RemoteFile, layout: Layout, progress: Progress, stop) -> int:
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
            logger.info("%s: resuming %s at %s of %s", self.label, rf.name, human(resume), human(rf.size))

        # "identity": byte ranges must address the file itself, not a gzip stream of it
        headers = build_hf_headers(token=self._token, headers={"Accept-Encoding": "identity"})
        hasher = new_hasher(rf)
        task = progress.start_file(rf.name, rf.size, resume)
        try:
            with open(partial, "r+b" if partial.exists() else "w+b") as f:
                if resume and hasher is not None:
                    remaining = resume
                    while remaining and (chunk := f.read(min(HASH_CHUNK, remaining))):
                        hasher.update(chunk)
                        remaining -= len(chunk)
                f.seek(resume)
                f.truncate()
                sink = Sink(f, hasher, lambda n: progress.advance(task, n), stop)
                try:
                    http_get(
                        url,
                        sink,  # type: ignore[arg-type]
                        resume_size=resume,
                        headers=headers,
                        expected_size=rf.size,
                        displayed_filename=rf.name,
                        tqdm_class=NoBar,  # type: ignore[arg-type]
                    )
                except Cancelled:
                    raise
                except Exception as e:
                    raise self.error(e, rf.name) from e
                f.flush()
                os.fsync(f.fileno())
        finally:
            progress.end_file(task)
        actual = hash_file(partial, rf, stop) if sink.dirty else (hasher.hexdigest() if hasher is not None else None)
        self.verify_or_raise(rf, actual, partial)
        self._publish(rf, partial, layout)
        return sink.received
