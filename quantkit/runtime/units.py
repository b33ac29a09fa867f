"""Quantities as people read them."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """A byte count in binary units: `512 B`, `1.5 KiB`, ... `3.0 TiB` (bytes as an integer, the rest to 0.1)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
