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


# a family's name (its recipe's and tiny model's: recipes/qwen3-moe.yaml, tiny:qwen3-moe) -> the preset of
# the real model its recipe is for
ALIASES = {"qwen3-moe": "qwen3-30b-a3b"}


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def is_preset(name: str) -> bool:
    return (PRESET_DIR / f"{ALIASES.get(name, name)}.json").is_file()


def load_preset(name: str) -> dict[str, Any]:
    """The published config.json of a real model, shipped so planning needs no download; a family's
    name (ALIASES) reads its recipe's model."""
    path = PRESET_DIR / f"{ALIASES.get(name, name)}.json"
    if not path.is_file():
        also = ", ".join(f"{a} (= {p})" for a, p in ALIASES.items())
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}; also {also}")
    return json.loads(path.read_text())
