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

Layout: this module is the public surface (``parse_hf_id``, ``HubSource``, ``pull`` and the types they use);
:mod:`quantkit.hub.repo` holds ``Repo`` (listing, resolution, verified download with resume) and
:mod:`quantkit.hub.store` the local side (error/file types, hashing, progress, the on-disk layout).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import shutil
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from huggingface_hub import hf_hub_url
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import build_hf_headers, validate_repo_id

from quantkit.hub.repo import SHA1, Missing, Repo, check_commit, repo_folder
from quantkit.hub.store import (
    Cancelled,
    ChecksumError,
    HubError,
    Layout,
    Progress,
    RemoteFile,
    atomic_write,
    human,
    manifest_dict,
    short,
)

__all__ = [
    "ChecksumError",
    "HubError",
    "HubSource",
    "PullResult",
    "RemoteFile",
    "parse_hf_id",
    "pull",
]

logger = logging.getLogger("quantkit.hub")


# ---------------------------------------------------------------------------------------------------------------
# public types (HubError, ChecksumError and RemoteFile live in hub_store; re-exported above)
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class PullResult:
    repo_id: str
    commit: str
    files: list[str]
    bytes: int  # total size of `files`, all complete and verified under `out`
    seconds: float
    downloaded: int = 0  # bytes actually transferred over the network by this run
    out: Path | None = None
    unverified: list[str] | None = None  # accepted on size alone (allow_unverified: no checksum listed)


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
        allow_unverified: bool = False,
    ):
        rid, spec_rev = parse_hf_id(repo_id)
        if revision and spec_rev and revision != spec_rev:
            raise HubError(f"{repo_id}: revision given twice ({spec_rev!r} and {revision!r}); fix: pass only one")
        self._repo = Repo(rid, revision or spec_rev, endpoint=endpoint, token=token, hf_cache=hf_cache_dir,
                           allow_unverified=allow_unverified)
        self.cache_dir = Path(cache_dir)
        self._base = self.cache_dir / "hub" / repo_folder(rid)
        ref_file = self._base / "refs" / quote(self._repo.revision, safe="")
        manifests = []
        known = self._repo.revision if SHA1.fullmatch(self._repo.revision) else None
        if known is None and ref_file.is_file():
            known = check_commit(rid, ref_file.read_text().strip(), f"the cached ref {ref_file}")
        if known:
            manifests.append(Layout(self._base / "snapshots" / known).manifest)
        self._repo.resolve(manifests)
        self._layout = Layout(self._base / "snapshots" / self._repo.commit)
        if self._repo.listing_source == "hub":
            atomic_write(
                self._layout.manifest,
                json.dumps(manifest_dict(rid, self._repo.revision, self._repo.commit, self._repo.files)),
            )
            atomic_write(ref_file, self._repo.commit)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._borrowed: set[str] = set()

    repo_id = property(lambda self: self._repo.repo_id)
    revision = property(lambda self: self._repo.revision)
    commit = property(lambda self: self._repo.commit)
    files = property(lambda self: self._repo.files)
    unverified = property(lambda self: list(self._repo.unverified))  # accepted on size alone (allow_unverified)
    endpoint = property(lambda self: self._repo.endpoint)

    def __repr__(self) -> str:
        return f"HubSource({self.repo_id!r}, revision={self.revision!r}, commit={self.commit[:12]!r})"

    def _file(self, filename: str) -> RemoteFile:
        rf = self.files.get(filename)
        if rf is None:
            raise HubError(
                f"{self._repo.label}: no file {filename!r} in this repo; fix: use one of {short(sorted(self.files), 5)}",
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
            except Missing:
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
                logger.info("%s: fetched %s (%s)", self._repo.label, filename, human(n))
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
    allow_unverified: bool = False,
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
    layout = Layout(out)
    r = Repo(repo_id, revision or spec_rev, endpoint=endpoint, token=token, hf_cache=cache_dir,
              allow_unverified=allow_unverified)
    r.resolve([layout.manifest])

    selected = sorted(_select(r.files, include), key=lambda f: (-f.size, f.name))
    if not selected:
        raise HubError(
            f"{r.label}: no file matches include={include}; fix: adjust the patterns "
            f"(files: {short(sorted(r.files), 6)})",
            repo_id=repo_id,
        )
    out.mkdir(parents=True, exist_ok=True)
    if r.listing_source == "hub":
        atomic_write(layout.manifest, json.dumps(manifest_dict(repo_id, r.revision, r.commit, r.files)))

    todo = [f for f in selected if not layout.marked_complete(f)]
    need = sum(f.size - layout.partial_size(f) for f in todo)
    free = _free_space(out)
    if free is not None and need > free:
        raise HubError(
            f"{r.label}: needs {human(need)} more under {out} but only {human(free)} is free; "
            "fix: free space or choose another --out",
            repo_id=repo_id,
        )

    bar = Progress(progress and bool(todo), f"{repo_id}@{r.commit[:8]}", need)
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
                            except Missing:
                                missing.append(rf.name)
                            except Cancelled:
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
            f"{short(missing)}; fix: unset HF_HUB_OFFLINE to download them",
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
        unverified=sorted(set(r.unverified) & set(names)),
    )
    logger.info(
        "%s: %d files (%s) complete in %s, %s downloaded in %.1fs",
        r.label,
        len(names),
        human(result.bytes),
        out,
        human(downloaded),
        result.seconds,
    )
    return result
