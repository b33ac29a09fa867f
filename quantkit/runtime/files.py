"""Files every stage handles the same way: the one atomic text write, quantkit's cache folder, a file's sha256."""

from __future__ import annotations

import hashlib
import json
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


def with_filename(e: BaseException, path: Path) -> OSError | None:
    """A failed write's error with its file named, for the one-line message (quantkit.conversion.outputs):
    an OSError from write() carries no file name, and safetensors' writer puts only the errno in its
    message ("... (os error 27)"). None when `e` names its file already or carries no errno."""
    import re

    from safetensors import SafetensorError

    if isinstance(e, OSError):
        code = None if e.filename or e.errno is None else e.errno
    elif isinstance(e, SafetensorError):
        found = re.findall(r"\(os error (\d+)\)", str(e))
        code = int(found[0]) if found else None
    else:
        code = None
    return None if code is None else OSError(code, os.strerror(code), str(path))


def readable_per_umask(path: Path) -> None:
    """Give a file the mode a plain open() would have (0644 under umask 022): safetensors writes
    through a private temporary file (0600), which a server running as another user cannot read."""
    os.chmod(path, 0o666 & ~_UMASK)


def _read_umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; done once, at import, before any thread
    os.umask(mask)
    return mask


_UMASK = _read_umask()


RESULTS_PENDING = ".validation.pending.json"  # validate's marker: its result files being made visible together


def staged(path: Path) -> Path:
    """Where `commit_renames` stages the new content of `path`: a hidden name beside it, same suffix
    (matplotlib picks the format from it)."""
    path = Path(path)
    return path.with_name(f".{path.stem}.staged{path.suffix}")


def commit_renames(marker: Path, finals: list[Path]) -> None:
    """Make several files' new contents, already written at `staged(final)`, visible all together:
    the list is written to `marker` (atomically), then each staged file is renamed over its final
    name, in the given order, then the marker is removed. A crash before the marker leaves every
    old file; after it, `finish_renames(marker)` (run by the next reader or writer) completes them,
    so no two of the files ever stay from different writes."""
    from quantkit.runtime import faults

    atomic_write_text(marker, json.dumps([str(f) for f in finals]) + "\n")
    faults.point("renames:marked")
    finish_renames(marker)


def finish_renames(marker: Path) -> bool:
    """Complete an interrupted `commit_renames` (True if one was); with no marker, a no-op."""
    from quantkit.runtime import faults

    try:
        finals = [Path(f) for f in json.loads(Path(marker).read_text())]
    except FileNotFoundError:
        return False
    for final in finals:
        try:
            os.replace(staged(final), final)
        except FileNotFoundError:  # renamed already, by a previous finish or one running beside this
            continue
        faults.point("renames:renamed")
    Path(marker).unlink(missing_ok=True)
    return True


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
