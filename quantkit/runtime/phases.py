"""Seconds spent per phase of a convert (attention, Hessians, the GPTQ solve, expert outputs), per layer.

The planner predicts a convert's time phase by phase from their arithmetic (quantkit.planner.cost);
to say how close a run came to the machine's matmul rate, the same phases are timed where they run.
`timed(name)` adds one stretch of wall and CPU time to `name`; the layer loop reads the layer's
totals with `take()` (which also clears them) into convert-report.json's `layers[*].phases`, and
scripts/bench_convert.py divides the planner's FLOPs by them.

One process-wide tally, not an object threaded through every method's signature: the timings are
a report's annotation, never an input to any computation. CPU time is the process's (every torch
thread's): with one thread it is the phase's own; on a shared machine it is steadier than wall. On
a CUDA device each stretch ends with a synchronize, so the kernels it queued are counted in it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

__all__ = ["take", "timed"]

_wall: dict[str, float] = defaultdict(float)
_cpu: dict[str, float] = defaultdict(float)


def _sync() -> None:
    import sys

    torch = sys.modules.get("torch")  # never imports torch itself: a phase always runs torch work first
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextmanager
def timed(name: str) -> Iterator[None]:
    """Add the wall and CPU seconds of the enclosed block to phase `name`."""
    _sync()
    w, c = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        _sync()
        _wall[name] += time.perf_counter() - w
        _cpu[name] += time.process_time() - c


def take() -> dict[str, dict[str, float]]:
    """The phases timed since the last take, {name: {"wall": s, "cpu": s}} (rounded to ms), and clear them."""
    out = {k: {"wall": round(_wall[k], 3), "cpu": round(_cpu[k], 3)} for k in _wall}
    _wall.clear()
    _cpu.clear()
    return out
