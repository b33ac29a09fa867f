"""A convert output that is not finished, named as such: still running, or interrupted with the
exact `quantkit convert ... --resume` that continues it.

Why its own module: verify, validate and check-serving all meet such a folder (`*.partial/`,
`.quantkit-convert/`, no convert-report.json yet), and each used to call it "not written by
quantkit convert ... reconvert it", which invites deleting hours of finished layers. convert
records the command that continues it (`record_command`) in its state folder when it starts; the
readers here only look (they never take the folder's lock, so a running convert is not disturbed).
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
from pathlib import Path

from quantkit.checkpoint.outlock import LOCK, holds

STATE_DIR = ".quantkit-convert"  # quantkit.conversion.resume's state folder
COMMAND = "command.json"  # in STATE_DIR: {"command": [...], "layers": N}
REPORT = "convert-report.json"


def record_command(state_dir: Path, argv: list[str], layers: int) -> None:
    """convert, at its start: the command line (without --resume) that produced this folder."""
    (Path(state_dir) / COMMAND).write_text(json.dumps({"command": argv, "layers": layers}) + "\n")


def resume_command(out: Path) -> str:
    """The shell line that continues the convert into `out` (as recorded when it started)."""
    try:
        argv = json.loads((Path(out) / STATE_DIR / COMMAND).read_text())["command"]
    except (OSError, ValueError, KeyError, TypeError):
        argv = ["quantkit", "convert", "<the same model and options>", "--out", str(out)]
    return shlex.join([*argv, "--resume"]).replace("'<the same model and options>'", "<the same model and options>")


def is_unfinished(out: Path) -> bool:
    """A convert went into `out` and has not finished (its report is written last)."""
    out = Path(out)
    started = (out / STATE_DIR).is_dir() or any((out / f"{w}.partial").is_dir() for w in ("prefill", "decode"))
    return started and not ((out / REPORT).is_file() and not (out / STATE_DIR).exists())


def unfinished(out: Path) -> str | None:
    """One line for a convert output that is not finished, else None: who is still writing it, or
    how far the interrupted run got and the command that continues it."""
    out = Path(out)
    if not is_unfinished(out):
        return None
    owner = running(out)
    if owner is not None:
        return (f"{out}: a convert into this folder is still running (pid {owner.get('pid', '?')} on "
                f"{owner.get('host', '?')}, since {owner.get('since', '?')}); wait for it to finish")
    done = ""
    try:
        state = json.loads((out / STATE_DIR / "state.json").read_text())
        layers = json.loads((out / STATE_DIR / COMMAND).read_text()).get("layers")
        done = f" after {max(state.get('next_layer', 0), 0)}{f' of {layers}' if layers else ''} layers"
    except (OSError, ValueError, AttributeError):
        pass
    return (f"{out}: a convert into this folder was interrupted{done} (its completed layers are kept); "
            f"continue it with: {resume_command(out)}")


def running(out: Path) -> dict | None:
    """The record of the live process holding `out`'s lock (quantkit.checkpoint.outlock), else None.
    Tried with a shared lock on a read-only descriptor, released at once: it never creates the file."""
    path = Path(out) / LOCK
    if holds(path):
        return None  # this process owns it (validate inside convert): not "another run"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            data = os.pread(fd, 4096, 0)
            try:
                return json.loads(data) if data else {}
            except ValueError:
                return {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
