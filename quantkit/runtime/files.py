"""Files every stage handles the same way: the one atomic text write, quantkit's cache folder, a file's sha256."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path


def atomic_write_text(path: Path, text: str, *, make_parents: bool = False) -> None:
    """Write `path` so it is either absent, its old content, or complete (a full disk leaves no
    0-byte file under the final name): UTF-8 into a temporary file beside it, fsync, rename.

    The temporary name is unique to the process and thread (`.<name>.<pid>.<thread>.tmp`), so that
    writers racing for one path (two pulls of one repo, ranks sharing a cache) never rename each
    other's half-written file; a write that fails removes it. `make_parents`: create the folder
    first."""
    path = Path(path)
    if make_parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def readable_per_umask(path: Path) -> None:
    """Give a file the mode a plain open() would have (0644 under umask 022): safetensors writes
    through a private temporary file (0600), which a server running as another user cannot read."""
    os.chmod(path, 0o666 & ~_UMASK)


def _read_umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; done once, at import, before any thread
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def cache_dir() -> Path:
    """quantkit's own cache folder: $QUANTKIT_CACHE, default ~/.cache/quantkit (read at each call)."""
    return Path(os.environ.get("QUANTKIT_CACHE", Path.home() / ".cache" / "quantkit"))


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 16 MiB chunks (source identity, data identity)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()
