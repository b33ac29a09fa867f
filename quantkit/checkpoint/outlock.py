"""One owner per output folder: `<out>/.quantkit.lock`, held with flock for as long as the
process runs, and holding the owner's pid and host for the error message.

Why flock and not just "the file exists": the kernel drops the lock when the owner dies, SIGKILL
included, so a lock left by a dead run is recognisable (its file is there, nobody holds it) and is
taken over, and reported, without guessing from pids. The file is removed on release; a process
that opened it just before then re-checks that the path still names the inode it locked.

The lock is re-entrant within one process (convert runs validate on the same folder).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import LockedError, OutputError

LOCK = ".quantkit.lock"
_held: dict[str, "OutputLock"] = {}


@dataclass
class OutputLock:
    path: Path
    fd: int
    depth: int = 1
    took_over: dict | None = None  # the stale owner's record, when a dead run's lock was taken over

    def release(self) -> None:
        self.depth -= 1
        if self.depth:
            return
        _held.pop(str(self.path), None)
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)  # closing drops the flock

    def __enter__(self) -> "OutputLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(out: Path, command: str) -> OutputLock:
    """Own `out` (created if needed) or raise LockedError naming the live owner; a folder that
    cannot be made or written (a file in its place, a read-only filesystem, no permission) is one
    OutputError naming it, before any work."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise unusable(out, e, command) from None
    path = (out / LOCK).resolve()
    if str(path) in _held:
        lk = _held[str(path)]
        lk.depth += 1
        return lk
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise unusable(out, e, command) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read(fd)
            os.close(fd)
            who = f"pid {owner.get('pid', '?')} on {owner.get('host', '?')} ({owner.get('command', '?')})" if owner else "another process"
            other = ", or choose another --out" if command == "convert" else ""
            raise LockedError(f"{out}: in use by {who}; wait for it to finish{other}") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the owner released and removed the file between our open and flock: retry
    stale = _read(fd) or None
    record = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    lk = _held[str(path)] = OutputLock(path, fd, took_over=stale)
    return lk


def holds(path: Path) -> bool:
    """This process holds the lock file `path` (readers then know the live owner is themselves)."""
    return str(Path(path).resolve()) in _held


def unusable(out: Path, e: OSError, command: str) -> OutputError:
    """An OSError on the output folder as one line: what the system said, and the fix."""
    why = e.strerror or str(e)
    if isinstance(e, (FileExistsError, NotADirectoryError)) or (out.exists() and not out.is_dir()):
        why = "a file is there, not a folder"
    where = f"{e.filename}: " if e.filename and Path(e.filename) != out else ""
    fix = "choose another --out" if command == "convert" else "make it writable"
    return OutputError(f"{out}: cannot write the output folder ({where}{why}, errno {e.errno}); {fix}")


def _read(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        return json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}
