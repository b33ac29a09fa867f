"""The device a command runs on: `--device auto|cpu|cuda|cuda:N` turned into a torch.device.

A process-level choice, made once at the start of convert, validate and probe, before any work:
so it lives here with the other machine facts, not with the model's layers.
"""

from __future__ import annotations

import torch

from quantkit.errors import ConfigError


def resolve_device(device: str | torch.device) -> torch.device:
    """auto, cpu, cuda or cuda:N, checked against this machine (a one-line error, before any work)."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"--device {device!r}: not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ConfigError(f"--device {device}: no CUDA device on this machine (torch {torch.__version__}); "
                              "use --device cpu or auto")
        if dev.index is not None and dev.index >= n:
            raise ConfigError(f"--device {device}: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1}); pick one of them")
    elif dev.type != "cpu":
        raise ConfigError(f"--device {device}: quantkit runs on cpu or cuda; use auto, cpu, cuda or cuda:N")
    return dev
