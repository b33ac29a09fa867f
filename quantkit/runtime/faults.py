"""Named crash points for the reliability suite (tests/test_reliability.py).

convert calls `point("...")` at every step that writes to disk; validate after each layer of its
prompt pass (`validate:layer`). With QUANTKIT_FAULT unset (always,
outside the tests) a point costs one dict lookup. QUANTKIT_FAULT=`<point>[#<n>][:<how>]` makes the
n-th time (default the first) that point is reached fail, as

    kill     SIGKILL of the process (default): nothing unwinds, as with a power cut or the OOM killer
    raise    an InjectedFault exception (in-process tests; `finally` blocks run)
    enospc   OSError(ENOSPC), as a full disk raises it
    interrupt  KeyboardInterrupt, as Ctrl-C raises it
    term     SIGTERM to the process, as `kill` or a job scheduler's stop sends it
    hang     sleep forever, as a stuck rank (a wedged GPU, a dead NFS mount) would

`points()` lists the points reached by a run (QUANTKIT_FAULT_LOG=<file> appends one per line).
In a multi-rank convert (quantkit.runtime.distributed) every rank inherits QUANTKIT_FAULT; with
QUANTKIT_FAULT_RANK=<r> only rank r (torchrun's RANK) fails.
"""

from __future__ import annotations

import errno
import os
import signal
import threading

_seen: dict[str, int] = {}
_lock = threading.Lock()  # parts are saved by background threads (quantkit.checkpoint.writer.CheckpointWriter)
_MODES = ("kill", "raise", "enospc", "interrupt", "term", "hang")


class InjectedFault(BaseException):
    """Raised at a crash point with QUANTKIT_FAULT=...:raise (a BaseException: nothing catches it)."""


def point(name: str) -> None:
    spec = os.environ.get("QUANTKIT_FAULT")
    log = os.environ.get("QUANTKIT_FAULT_LOG")
    if not spec and not log:
        return
    with _lock:
        _seen[name] = n = _seen.get(name, 0) + 1
        if log:
            with open(log, "a") as f:
                f.write(f"{name}#{n}\n")
    if not spec or os.environ.get("QUANTKIT_FAULT_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
        return
    where, _, how = spec.rpartition(":")  # point names contain ':' themselves
    if how not in _MODES:
        where, how = spec, "kill"
    target, _, count = where.partition("#")
    if target != name or n != int(count or 1):
        return
    if how == "raise":
        raise InjectedFault(f"{name}#{n}")
    if how == "interrupt":
        raise KeyboardInterrupt
    if how == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if how == "term":
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if how == "hang":
        import time

        while True:
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)


def reset() -> None:
    _seen.clear()
