"""Probes of the machine this process runs on: memory available, this process's peak RSS."""

from __future__ import annotations

import os
import sys

# glibc's mallopt parameter number, and the value quantkit sets (bytes)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 128 * 1024


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




def return_freed_memory() -> bool:
    """Have glibc give every freed allocation over MMAP_THRESHOLD back to the system at once; True if set.

    glibc serves an allocation of 128 KiB or more with its own mmap, unmapped when freed, but raises
    that threshold (up to 32 MiB) each time such a block is freed, so after a few micro-batches the
    tensors below 32 MiB come from the heap, whose freed pages stay in our RSS. On the random
    DeepSeek-V3-layout benchmark (docs/benchmarks.md, issue 30) that slack was 140 MB of an 844 MB
    peak; fixing the threshold (which also stops glibc adjusting it) gave 706 MB, at the cost of
    page faults on every fresh mapping (system time 7 -> 24 s of that ~90 s-CPU run). Called once at
    process start by the `quantkit` command; arithmetic and output bytes do not change (torch aligns
    every buffer to 64 bytes either way). A no-op off glibc, or when the user set
    MALLOC_MMAP_THRESHOLD_ themselves (the way to opt out: e.g. 33554432, glibc's own ceiling)."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
