"""The published config.json of real models (one JSON file per preset in this folder), shipped so that
`quantkit plan` and the real-shape builds need no download.

Kept apart from quantkit.model.arch (which imports the families' torch code) so that the CLI can list
the names in its --help without importing torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quantkit.errors import ConfigError

PRESET_DIR = Path(__file__).parent


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_preset(name: str) -> dict[str, Any]:
    """The published config.json of a real model, shipped so planning needs no download."""
    path = PRESET_DIR / f"{name}.json"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}")
    return json.loads(path.read_text())
