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

Layout: this module is the public surface (``parse_hf_id``, ``HubSource``, ``pull`` and the types they use;
import them from here).  Behind it, from the top down:

    source    ``HubSource``: one file at a time, for streamed conversion
    transfer  one file made complete and verified on disk: already there, from the HF cache, or downloaded with resume
    repo      ``Repo``: the repo at a pinned commit and every request to the Hub for it (the token stays there)
    listing   the file list at a commit: from the Hub, a manifest of an earlier run, or an HF cache snapshot
    failures  an exception as one line with a fix; the token redacted
    names     checks on the user's id and on the names, commit and checksums a listing gives
    store     the local side: error/file types, hashing, progress, the on-disk layout
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

from quantkit.hub import transfer
from quantkit.hub.names import parse_hf_id
from quantkit.hub.repo import Repo
from quantkit.hub.source import HubSource
from quantkit.hub.store import (
    Cancelled,
    ChecksumError,
    HubError,
    Layout,
    Progress,
    RemoteFile,
    manifest_dict,
    short,
)
from quantkit.runtime.files import atomic_write_text
from quantkit.runtime.units import human_bytes

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


# ---------------------------------------------------------------------------------------------------------------
# pull: the whole repo (or a filtered part) into a folder
# ---------------------------------------------------------------------------------------------------------------


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
    r = Repo.open(repo, revision, endpoint=endpoint, token=token, hf_cache=cache_dir, allow_unverified=allow_unverified)
    out = Path(out)
    layout = Layout(out)
    r.resolve([layout.manifest])
    selected = _select(r, include)
    out.mkdir(parents=True, exist_ok=True)
    if r.listing_source == "hub":
        atomic_write_text(layout.manifest, json.dumps(manifest_dict(r.repo_id, r.revision, r.commit, r.files)),
                          make_parents=True)
    todo = [f for f in selected if not layout.marked_complete(f)]
    need = _check_space(r, todo, layout)
    downloaded, missing, errors = _fetch_all(r, todo, layout, need=need, max_workers=max_workers, progress=progress)
    _raise_failures(r, layout, missing, errors)
    return _done(r, selected, out, downloaded, t0)


def _select(r: Repo, include: list[str] | None) -> list[RemoteFile]:
    """The files `include` matches (all without it), largest first (the long downloads start first)."""
    files = r.files.values()
    chosen = list(files) if not include else [f for f in files if any(fnmatch.fnmatchcase(f.name, pat) for pat in include)]
    if not chosen:
        raise HubError(
            f"{r.label}: no file matches include={include}; fix: adjust the patterns "
            f"(files: {short(sorted(r.files), 6)})",
            repo_id=r.repo_id,
        )
    return sorted(chosen, key=lambda f: (-f.size, f.name))


def _free_space(path: Path) -> int | None:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _check_space(r: Repo, todo: list[RemoteFile], layout: Layout) -> int:
    """The bytes still to download (partial files count as far as they go); a HubError if they do not fit."""
    need = sum(f.size - layout.partial_size(f) for f in todo)
    free = _free_space(layout.root)
    if free is not None and need > free:
        raise HubError(
            f"{r.label}: needs {human_bytes(need)} more under {layout.root} but only {human_bytes(free)} is free; "
            "fix: free space or choose another --out",
            repo_id=r.repo_id,
        )
    return need


def _fetch_all(r: Repo, todo: list[RemoteFile], layout: Layout, *, need: int, max_workers: int,
               progress: bool) -> tuple[int, list[str], dict[str, BaseException]]:
    """Every file of `todo` ensured in parallel, under one progress display; returns (bytes downloaded,
    files missing offline, {file: its error}). An interrupt stops every transfer before it propagates."""
    bar = Progress(progress and bool(todo), f"{r.repo_id}@{r.commit[:8]}", need)
    stop = threading.Event()
    errors: dict[str, BaseException] = {}
    missing: list[str] = []
    downloaded = 0
    try:
        if todo:
            with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(todo))), thread_name_prefix="qk-pull") as ex:
                futs = {ex.submit(transfer.ensure, r, f, layout, progress=bar, stop=stop): f for f in todo}
                try:
                    downloaded = _collect(futs, missing, errors)
                except BaseException:
                    stop.set()
                    for fut in futs:
                        fut.cancel()
                    raise
    finally:
        bar.close()
    return downloaded, missing, errors


def _collect(futs: dict, missing: list[str], errors: dict[str, BaseException]) -> int:
    """Wait for every transfer; sort each outcome into bytes downloaded, `missing` or `errors`."""
    downloaded = 0
    pending = set(futs)
    while pending:
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        for fut in done:
            rf = futs[fut]
            try:
                _, n, _ = fut.result()
                downloaded += n
            except transfer.Missing:
                missing.append(rf.name)
            except Cancelled:
                pass
            except Exception as e:  # noqa: BLE001 - reported below, one line per file
                errors[rf.name] = e
    return downloaded


def _raise_failures(r: Repo, layout: Layout, missing: list[str], errors: dict[str, BaseException]) -> None:
    """One HubError for what did not complete: the files missing offline, else every failed file."""
    if missing:
        missing.sort()
        raise HubError(
            f"{r.label}: HF_HUB_OFFLINE=1 and {len(missing)} file(s) are not complete in {layout.root} nor in the HF cache: "
            f"{short(missing)}; fix: unset HF_HUB_OFFLINE to download them",
            repo_id=r.repo_id,
            filename=missing[0],
        )
    if not errors:
        return
    errs = [errors[k] if isinstance(errors[k], HubError) else r.error(errors[k], k) for k in sorted(errors)]
    if len(errs) == 1:
        raise errs[0]
    summary = "; ".join(str(e) for e in errs[:3]) + (f"; (+{len(errs) - 3} more)" if len(errs) > 3 else "")
    if all(isinstance(e, ChecksumError) for e in errs):
        e0 = errs[0]
        raise ChecksumError(
            f"{len(errs)} files failed verification: {summary}",
            repo_id=r.repo_id,
            filename=e0.filename or "",
            expected=e0.expected,  # type: ignore[attr-defined]
            actual=e0.actual,  # type: ignore[attr-defined]
        )
    raise HubError(f"{len(errs)} files failed: {summary}", repo_id=r.repo_id, filename=errs[0].filename)


def _done(r: Repo, selected: list[RemoteFile], out: Path, downloaded: int, t0: float) -> PullResult:
    """The result of a pull that completed, logged in one line."""
    names = sorted(f.name for f in selected)
    result = PullResult(
        repo_id=r.repo_id,
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
        human_bytes(result.bytes),
        out,
        human_bytes(downloaded),
        result.seconds,
    )
    return result
