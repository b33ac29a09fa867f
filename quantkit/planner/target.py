"""What a planning question is about: one `resolve_target(spec)` for every estimate.

`quantkit plan`, `plan --convert`, `plan --tasks` and `inspect` all take the same kinds of model
spec, and before this module each read it its own way (a preset name read as a path in one, a tiny
id refused in another). Here, once:

  a config dict                      -> its architecture (no weights)
  a preset name (glm-5.2, kimi-k2.6) -> its shipped config.json (no weights; a folder of that name wins)
  a config.json path                 -> its folder's config (no weights)
  a folder, tiny:, realshape:, hf:// -> the checkpoint's headers (quantkit.inputs.modelspec), or with
                                        `headers=False` only its config when it is a local folder
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantkit.errors import ConfigError

if TYPE_CHECKING:
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.model.arch import ModelArch

__all__ = ["Target", "resolve_target"]


@dataclass(frozen=True)
class Target:
    spec: str  # what the user gave ("config" for a dict)
    arch: ModelArch
    checkpoint: Checkpoint | None = None  # None: the architecture only (a preset, a config)
    preset: str | None = None  # the preset's name when `spec` named one

    @property
    def source(self) -> str:
        """How the architecture was read, for messages: "preset glm-5.2", a folder, a config."""
        return f"preset {self.preset}" if self.preset else self.spec


def resolve_target(spec: str | Path | dict[str, Any], *, headers: bool = True, allow_unverified: bool = False) -> Target:
    """The architecture (and, for a checkpoint, its headers) that `spec` names; see the module docstring.
    `headers=False` reads a local folder's config.json only (a folder that holds no shards yet plans too)."""
    from quantkit.inputs.modelspec import is_hub, is_realshape, is_tiny, open_checkpoint
    from quantkit.model.arch import arch_from_config, load_arch
    from quantkit.model.presets import is_preset, load_preset, preset_names

    if isinstance(spec, dict):
        return Target("config", arch_from_config(spec, source="config dict"))
    text, path = str(spec), Path(spec)
    if isinstance(spec, str) and is_preset(spec) and not path.is_dir():
        return Target(text, arch_from_config(load_preset(spec), source=f"preset {spec}"), preset=spec)
    if path.is_file() and path.name == "config.json":
        return Target(text, load_arch(path.parent))
    if path.is_dir() and not headers:
        return Target(text, load_arch(path))
    if path.is_dir() or is_tiny(text) or is_realshape(text) or is_hub(text):
        ckpt = open_checkpoint(spec, allow_unverified=allow_unverified)
        return Target(text, ckpt.arch, ckpt)
    if "/" not in text and ":" not in text and not text.endswith(".json"):
        load_preset(text)  # a bare name is meant as a preset: its error lists the known ones
    raise ConfigError(f"{spec}: not a folder, a config.json, a tiny:<name>, realshape:<name> or hf://org/repo id, "
                      f"or a preset ({', '.join(preset_names())})")
