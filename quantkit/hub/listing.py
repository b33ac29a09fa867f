"""A repo's file list at one commit, from wherever it can be had: the Hub's ``model_info`` answer
(online), a manifest an earlier quantkit run wrote, or an HF cache snapshot (offline). Every name,
commit and checksum is checked on the way in (quantkit.hub.names).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.hub.names import SHA1, SHA256, check_checksums, check_commit, check_name, repo_folder
from quantkit.hub.store import HubError, RemoteFile, read_manifest

logger = logging.getLogger("quantkit.hub")  # the name these messages have always been logged under


@dataclass
class Listing:
    commit: str
    files: dict[str, RemoteFile]
    source: str  # "hub", or the manifest / HF cache snapshot it was read from
    unverified: list[str] = field(default_factory=list)  # accepted on size alone (allow_unverified)


def from_model_info(repo_id: str, info, label: str, allow_unverified: bool) -> Listing:
    """The listing in a ``model_info(files_metadata=True)`` answer (`label` names the repo in errors)."""
    if not info.sha:
        raise HubError(f"{label}: the Hub returned no commit sha; fix: check HF_ENDPOINT", repo_id=repo_id)
    check_commit(repo_id, info.sha, "the Hub listing")
    files, unverified = {}, []
    for s in info.siblings or []:
        check_name(repo_id, s.rfilename)
        size = s.lfs.size if s.lfs is not None else s.size
        if size is None:
            raise HubError(
                f"{repo_id}: the Hub listing has no file sizes; fix: check HF_ENDPOINT points to a Hub-compatible server",
                repo_id=repo_id,
            )
        files[s.rfilename] = RemoteFile(s.rfilename, int(size), s.lfs.sha256 if s.lfs is not None else None, s.blob_id)
        if not check_checksums(repo_id, files[s.rfilename], allow_unverified):
            unverified.append(s.rfilename)
    return Listing(info.sha, files, "hub", unverified)


def from_manifests(repo_id: str, revision: str, manifests: list[Path], allow_unverified: bool) -> Listing | None:
    """The listing in the first of `manifests` (written by an earlier run) that is for this repo and revision."""
    for path in manifests:
        got = read_manifest(path, repo_id, revision)
        if got is None:
            continue
        commit, files = got
        check_commit(repo_id, commit, f"the manifest {path}")
        unverified = []
        for name, rf in files.items():
            check_name(repo_id, name)
            if not check_checksums(repo_id, rf, allow_unverified):
                unverified.append(name)
        return Listing(commit, files, str(path), unverified)
    return None


def from_hf_cache(repo_id: str, revision: str, hf_cache: Path) -> Listing:
    """The files of the HF cache snapshot of `revision` (a commit, or a ref the cache knows); only those
    ever downloaded there are known. A HubError naming what is missing when there is no such snapshot."""
    commit = revision if SHA1.fullmatch(revision) else None
    repo_dir = hf_cache / repo_folder(repo_id)
    if commit is None:
        try:
            commit = (repo_dir / "refs" / revision).read_text().strip()
        except OSError:
            commit = None
    if commit is not None:
        check_commit(repo_id, commit, f"the HF cache ref {repo_dir / 'refs' / revision}")
    snap = repo_dir / "snapshots" / commit if commit else None
    if snap is None or not snap.is_dir():
        raise HubError(
            f"{repo_id}@{revision}: HF_HUB_OFFLINE=1 and no local copy: nothing pulled before "
            f"(no quantkit manifest) and not in the HF cache {hf_cache}; missing: all files; "
            "fix: unset HF_HUB_OFFLINE to download, or point HF_HOME/HF_HUB_CACHE at a cache that has it",
            repo_id=repo_id,
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
            blob if SHA256.fullmatch(blob) else None,
            blob if SHA1.fullmatch(blob) else None,
        )
    logger.warning(
        "%s: offline, file list taken from the HF cache snapshot %s; files never downloaded there are not known",
        repo_id,
        snap,
    )
    return Listing(commit, files, str(snap))
