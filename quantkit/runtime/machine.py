"""Probes of the machine this process runs on (memory available, this process's peak RSS), and handing its freed heap pages back."""

from __future__ import annotations

import functools
import os
import sys


def available_host_memory() -> int:
    """MemAvailable (Linux), else total physical memory; the default host budget."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_rss() -> int:
    """This process's peak resident set so far, bytes (what the reports and benchmarks compare with the plan)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def return_freed_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim(0)); a no-op elsewhere.

    Why: glibc serves allocations under its mmap threshold from the heap and keeps their pages
    when they are freed, and every large free raises that threshold (up to 32 MiB), so after a
    phase's micro-batches and a chunk's Hessians are freed, their pages stay in the RSS and the
    next phase's peak lands on top of them (docs/benchmarks.md,
    "Speed and peak memory"). Called at phase boundaries (after a layer's attention, after
    each expert chunk), not per allocation, so the pages it returns fault back in once per phase
    rather than once per tensor. Returns nothing: what it freed is measured by the RSS, not here.
    """
    lib = _glibc()
    if lib is not None:
        lib.malloc_trim(0)


@functools.cache
def _glibc():
    """glibc through ctypes, looked up once; None where there is no malloc_trim (musl, macOS, Windows)."""
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None
