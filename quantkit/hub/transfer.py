"""Making one file of a ``Repo`` complete and verified under a ``Layout``, resuming what an earlier run began.

``ensure`` takes the first of: the file already there (checked by its marker, else re-hashed once);
a copy (or, for a streamed source, the file in place) from the HF cache; a download with ``http_get``
into a partial file under ``.cache/quantkit/incomplete/`` that the next run resumes with a ranged GET.
Nothing appears under the file's final name before its size and checksum (sha256 for LFS files, git
blob sha1 for small files) have been verified.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

from huggingface_hub.utils import WeakFileLock

from quantkit.hub.repo import Repo
from quantkit.hub.store import (
    HASH_CHUNK,
    NO_PROGRESS,
    Cancelled,
    ChecksumError,
    HubError,
    Layout,
    Progress,
    RemoteFile,
    Sink,
    expected_digest,
    hash_file,
    new_hasher,
)
from quantkit.runtime.units import human_bytes

logger = logging.getLogger("quantkit.hub")  # the name these messages have always been logged under


class Missing(Exception):
    """Offline and not available locally."""


def ensure(
    repo: Repo,
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
        if final.is_file() and _already_there(repo, rf, layout, stop):
            return final, 0, "local"
        cached = repo.from_hf_cache(rf)
        if cached is not None:
            if borrow_hf_cache:
                if digest_ok(rf, hash_file(cached, rf, stop)):
                    return cached, 0, "hf-cache"
            elif copy_verified(repo, rf, cached, layout, progress, stop):
                return final, 0, "hf-cache"
            logger.warning("%s: %s in the HF cache (%s) fails verification; ignoring it", repo.label, rf.name, cached)
        if repo.offline:
            raise Missing(rf.name)
        return final, download(repo, rf, layout, progress, stop), "hub"


def _already_there(repo: Repo, rf: RemoteFile, layout: Layout, stop) -> bool:
    """The final file is present but not (or no longer) known-good: verify it once; if it fails, delete it."""
    final = layout.final(rf.name)
    if final.stat().st_size == rf.size:
        if digest_ok(rf, hash_file(final, rf, stop)):
            layout.write_marker(rf, repo.commit)
            return True
    logger.warning("%s: %s under %s fails verification; replacing it", repo.label, rf.name, layout.root)
    final.unlink()
    layout.drop_marker(rf.name)
    return False


# ---------------------------------------------------------------------------------------------------------------
# verification and publishing
# ---------------------------------------------------------------------------------------------------------------


def digest_ok(rf: RemoteFile, actual: str | None) -> bool:
    expected = expected_digest(rf)[1]
    return expected is None or actual == expected


def verify_or_raise(repo: Repo, rf: RemoteFile, actual: str | None, bad: Path) -> None:
    kind, expected = expected_digest(rf)
    if expected is None or actual == expected:
        return
    bad.unlink(missing_ok=True)
    raise ChecksumError(
        f"{repo.label} file {rf.name!r}: {kind} mismatch (expected {expected}, got {actual}); "
        "the corrupt download was deleted; fix: re-run to download it again (if it persists, the mirror or "
        "HF_ENDPOINT serves bad data)",
        repo_id=repo.repo_id,
        filename=rf.name,
        expected=expected,
        actual=actual or "",
    )


def publish(repo: Repo, rf: RemoteFile, partial: Path, layout: Layout) -> None:
    """A verified partial file under its final name, with its verified marker."""
    final = layout.final(rf.name)
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(partial, final)
    layout.write_marker(rf, repo.commit)


def copy_verified(repo: Repo, rf: RemoteFile, src: Path, layout: Layout, progress: Progress, stop) -> bool:
    """Copy `src` (the HF cache's copy) through a partial file, hashing as it goes; publish it if it verifies."""
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
    if not digest_ok(rf, h.hexdigest() if h is not None else None):
        partial.unlink(missing_ok=True)
        return False
    publish(repo, rf, partial, layout)
    return True


# ---------------------------------------------------------------------------------------------------------------
# download with resume
# ---------------------------------------------------------------------------------------------------------------


def download(repo: Repo, rf: RemoteFile, layout: Layout, progress: Progress, stop) -> int:
    """Download `rf` into its partial file (resuming it), verify, publish; returns the bytes received."""
    _check_head(repo, rf)
    partial, resume = _partial_to_resume(repo, rf, layout)
    actual, received = _receive(repo, rf, partial, resume, progress, stop)
    verify_or_raise(repo, rf, actual, partial)
    publish(repo, rf, partial, layout)
    return received


def _check_head(repo: Repo, rf: RemoteFile) -> None:
    """The file's HEAD agrees with the listing: the same commit, the same size."""
    meta = repo.file_metadata(rf)
    if meta.commit_hash and meta.commit_hash != repo.commit:
        raise HubError(
            f"{repo.label} file {rf.name!r}: the Hub resolved it at commit {meta.commit_hash[:12]}; "
            "fix: check HF_ENDPOINT (a mirror serving another commit?)",
            repo_id=repo.repo_id,
            filename=rf.name,
        )
    if meta.size is not None and meta.size != rf.size:
        raise HubError(
            f"{repo.label} file {rf.name!r}: size {meta.size} from /resolve differs from the listing ({rf.size}); "
            "fix: re-run (the repo may have changed) or check HF_ENDPOINT",
            repo_id=repo.repo_id,
            filename=rf.name,
        )


def _partial_to_resume(repo: Repo, rf: RemoteFile, layout: Layout) -> tuple[Path, int]:
    """The partial file of this version of `rf` and how much of it is there (partials of other versions
    of the file are deleted; one longer than the file starts over)."""
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
        logger.info("%s: resuming %s at %s of %s", repo.label, rf.name, human_bytes(resume), human_bytes(rf.size))
    return partial, resume


def _receive(repo: Repo, rf: RemoteFile, partial: Path, resume: int, progress: Progress, stop) -> tuple[str | None, int]:
    """Append the rest of the file to `partial` (hashing the part already there first); returns
    (the digest of the whole file, bytes received)."""
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
            repo.get(rf, sink, resume)
            f.flush()
            os.fsync(f.fileno())
    finally:
        progress.end_file(task)
    actual = hash_file(partial, rf, stop) if sink.dirty else (hasher.hexdigest() if hasher is not None else None)
    return actual, sink.received
