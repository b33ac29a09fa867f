"""``HubSource``: a model repo at a pinned commit, fetched file by file on demand, for streamed conversion.

quantkit.checkpoint.reader.Checkpoint reads such a source: every shard's header with
:meth:`HubSource.read_range`, each shard with :meth:`HubSource.fetch` when first needed, and (with
``release_consumed``) :meth:`HubSource.release` once it has been read.  The snapshot folder keeps the
HF cache's shape (``refs/<revision>`` names the commit) so that a later run, offline too, finds it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from urllib.parse import quote

from quantkit.hub import transfer
from quantkit.hub.names import SHA1, check_commit, repo_folder
from quantkit.hub.repo import Repo
from quantkit.hub.store import HubError, Layout, RemoteFile, manifest_dict, short
from quantkit.runtime.files import atomic_write_text
from quantkit.runtime.units import human_bytes

logger = logging.getLogger("quantkit.hub")  # the name these messages have always been logged under


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
        self._repo = Repo.open(repo_id, revision, endpoint=endpoint, token=token, hf_cache=hf_cache_dir,
                               allow_unverified=allow_unverified)
        self.cache_dir = Path(cache_dir)
        self._base = self.cache_dir / "hub" / repo_folder(self._repo.repo_id)
        ref_file = self._base / "refs" / quote(self._repo.revision, safe="")
        self._repo.resolve(self._known_manifests(ref_file))
        self._layout = Layout(self._base / "snapshots" / self._repo.commit)
        if self._repo.listing_source == "hub":
            self._record_listing(ref_file)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._borrowed: set[str] = set()

    def _known_manifests(self, ref_file: Path) -> list[Path]:
        """The manifest of the snapshot this revision is known to be at (it is a commit, or an earlier run
        recorded its ref): the file list offline."""
        revision = self._repo.revision
        known = revision if SHA1.fullmatch(revision) else None
        if known is None and ref_file.is_file():
            known = check_commit(self._repo.repo_id, ref_file.read_text().strip(), f"the cached ref {ref_file}")
        return [Layout(self._base / "snapshots" / known).manifest] if known else []

    def _record_listing(self, ref_file: Path) -> None:
        """Save the Hub's listing in the snapshot's manifest and the commit under the revision's ref."""
        r = self._repo
        atomic_write_text(self._layout.manifest, json.dumps(manifest_dict(r.repo_id, r.revision, r.commit, r.files)),
                          make_parents=True)
        atomic_write_text(ref_file, r.commit, make_parents=True)

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
                path, n, source = transfer.ensure(self._repo, rf, self._layout, borrow_hf_cache=True)
            except transfer.Missing:
                raise HubError(
                    f"{self._repo.label} file {filename!r}: HF_HUB_OFFLINE=1 and it is not in {self._layout.root} "
                    f"nor the HF cache; fix: unset HF_HUB_OFFLINE to download it",
                    repo_id=self.repo_id,
                    filename=filename,
                ) from None
            if source == "hf-cache":
                self._borrowed.add(filename)
                self._link(rf.name, path)  # the file stays where it was found; fetch returns that path
            else:
                self._borrowed.discard(filename)
            if n:
                logger.info("%s: fetched %s (%s)", self._repo.label, filename, human_bytes(n))
            return path

    def _link(self, name: str, found: Path) -> None:
        """Make a file used in place from the HF cache appear under its name in this snapshot (a
        symlink to where it was found), so that the snapshot folder holds every file of the repo,
        wherever each was found: the reader opens config.json, the index and the shards there.
        Without it, config.json found in the HF cache was looked for in quantkit's folder ("not found")."""
        final = self._layout.final(name)
        if final.is_symlink() and os.path.realpath(final) == os.path.realpath(found):
            return
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.link-{os.getpid()}")
        tmp.unlink(missing_ok=True)
        os.symlink(os.path.realpath(found), tmp)
        os.replace(tmp, final)  # atomic: a reader sees no file or the whole link

    def read_range(self, filename: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``filename`` from ``start`` (a local complete copy if there is one, else one
        ranged GET): how a streamed conversion reads every shard's safetensors header before fetching it."""
        rf = self._file(filename)
        local = self._layout.final(rf.name)
        if not (local.is_file() and local.stat().st_size == rf.size):
            local = self._repo.from_hf_cache(rf) or local  # offline, a shard's header from the HF cache's copy
        if local.is_file() and local.stat().st_size == rf.size:
            with open(local, "rb") as f:
                f.seek(start)
                return f.read(length)
        if length <= 0:
            return b""
        return self._repo.read_range(rf, start, length)

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
