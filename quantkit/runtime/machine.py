"""Probes of the machine this process runs on: memory available, this process's peak RSS."""

from __future__ import annotations

import os


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


