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


def _preset_path(name: str) -> Path | None:
    """A preset by its name, or by its family's name (a recipe's and tiny model's name, which is the
    model_type with `-` for `_`) when exactly one preset is of that family."""
    path = PRESET_DIR / f"{name}.json"
    if path.is_file():
        return path
    of_type = [p for p in sorted(PRESET_DIR.glob("*.json"))
               if json.loads(p.read_text()).get("model_type") == name.replace("-", "_")]
    return of_type[0] if len(of_type) == 1 else None


def is_preset(name: str) -> bool:
    return _preset_path(name) is not None


def load_preset(name: str) -> dict[str, Any]:
    """The published config.json of a real model, shipped so planning needs no download; a family's
    name reads its one preset."""
    path = _preset_path(name)
    if path is None:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())} (or a family's "
                          "name where one preset is of that family)")
    return json.loads(path.read_text())
