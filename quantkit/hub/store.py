"""The local side of quantkit.hub.download: shared types, hashing, progress, and the on-disk layout of a destination.

* ``HubError``/``ChecksumError``/``RemoteFile``: defined here so that every hub module can use them; import them
  from :mod:`quantkit.hub.download`, which re-exports them.
* hashing/verification: a file is checked against its LFS sha256, else its git blob id (sha1 of
  ``"blob <size>\0<content>"``), else only its size; ``Sink`` hashes bytes as ``http_get`` writes them.
* ``Progress``: quantkit's own rich progress bars (``NoBar`` silences huggingface_hub's tqdm).
* ``Layout``: complete files under their repo path, everything else (partials, per-file verified markers, locks,
  the listing manifest) under ``<root>/.cache/quantkit/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from quantkit.errors import QuantkitError
from quantkit.runtime.files import atomic_write_text

HASH_CHUNK = 8 << 20
STATE = (".cache", "quantkit")  # bookkeeping lives under <root>/.cache/quantkit/


# ---------------------------------------------------------------------------------------------------------------
# public types (re-exported by quantkit.hub.download)
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


# ---------------------------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------------------------


def short(names: list[str], n: int = 8) -> str:
    shown = ", ".join(names[:n])
    return shown + (f" (+{len(names) - n} more)" if len(names) > n else "")


class Cancelled(Exception):
    pass


# ---------------------------------------------------------------------------------------------------------------
# hashing / verification
# ---------------------------------------------------------------------------------------------------------------


def new_hasher(rf: RemoteFile):
    if rf.sha256:
        return hashlib.sha256()
    if rf.blob_id:
        h = hashlib.sha1()
        h.update(b"blob %d\0" % rf.size)
        return h
    return None


def expected_digest(rf: RemoteFile) -> tuple[str, str | None]:
    if rf.sha256:
        return "sha256", rf.sha256
    if rf.blob_id:
        return "git-sha1", rf.blob_id
    return "size", None


def hash_file(path: Path, rf: RemoteFile, stop: threading.Event | None = None) -> str | None:
    h = new_hasher(rf)
    if h is None:
        return None
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            if stop is not None and stop.is_set():
                raise Cancelled()
            h.update(chunk)
    return h.hexdigest()


class Sink:
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
            raise Cancelled()
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


class NoBar:
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


class Progress:
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


NO_PROGRESS = Progress(False, "", 0)


# ---------------------------------------------------------------------------------------------------------------
# on-disk layout of a destination folder
# ---------------------------------------------------------------------------------------------------------------


class Layout:
    """``<root>/<repo path>`` for complete files; ``<root>/.cache/quantkit/`` for partials, markers, manifest."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.state = self.root.joinpath(*STATE)

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
        atomic_write_text(self.marker(rf.name), json.dumps(data), make_parents=True)

    def drop_marker(self, name: str) -> None:
        self.marker(name).unlink(missing_ok=True)

    def partial_size(self, rf: RemoteFile) -> int:
        try:
            return min(self.partial(rf).stat().st_size, rf.size)
        except OSError:
            return 0


def manifest_dict(repo_id: str, revision: str, commit: str, files: dict[str, RemoteFile]) -> dict:
    return {
        "repo_id": repo_id,
        "revision": revision,
        "commit": commit,
        "files": [
            {"name": f.name, "size": f.size, "sha256": f.sha256, "blob_id": f.blob_id} for f in files.values()
        ],
    }


def read_manifest(path: Path, repo_id: str, revision: str) -> tuple[str, dict[str, RemoteFile]] | None:
    try:
        m = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if m.get("repo_id") != repo_id or revision not in (m.get("revision"), m.get("commit")):
        return None
    files = {d["name"]: RemoteFile(d["name"], int(d["size"]), d.get("sha256"), d.get("blob_id")) for d in m["files"]}
    return m["commit"], files
