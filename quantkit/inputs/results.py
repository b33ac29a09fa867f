"""What an earlier quantkit command wrote, read back for a later one: `quantkit validate`'s
validation.json (plan shows its measured FP8 KV delta; a torchrun'd validate's verdict is in it,
since torchrun exits 1 whatever rank 0's status was).
"""

from __future__ import annotations

import json
from pathlib import Path

from quantkit.errors import ConfigError


def load_validation(path: str | Path) -> dict:
    """validation.json as `quantkit validate` wrote it; a file that cannot be read or is not JSON is
    a ConfigError naming it (the user passed the wrong file)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read a validation.json ({e}); pass the file `quantkit validate` wrote") from None


def gates_failed_since(path: str | Path, since: float) -> bool:
    """Whether `path` is a validation.json written at or after `since` (a time.time()) that records a
    failed gate: the verdict of a validate this process launched, not an older run's."""
    path = Path(path)
    return path.is_file() and path.stat().st_mtime >= since and not json.loads(path.read_text()).get("passed", True)
