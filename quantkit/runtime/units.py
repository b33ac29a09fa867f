"""Byte units, defined once for every stage: GB (10**9) for disks, files and the Hub, GiB (2**30) for
memory as drivers report it; and the one place a byte count becomes text."""

from __future__ import annotations

GB = 10**9
GiB = 2**30


def human_bytes(n: float) -> str:
    """A byte count in binary units: `512 B`, `1.5 KiB`, ... `3.0 TiB` (bytes as an integer, the rest to 0.1)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def decimal_bytes(n: float, *, digits: int = 2, gb_from: float = 1e8, bytes_below: float = 0.0) -> str:
    """A byte count in decimal GB, or MB below `gb_from`, or plain bytes below `bytes_below`:
    reports and cards print sizes the way disks and the Hub state them (10**9 bytes a GB)."""
    if n < bytes_below:
        return f"{int(n)} bytes"
    return f"{n / 1e9:.{digits}f} GB" if n >= gb_from else f"{n / 1e6:.{min(digits, 2)}f} MB"
