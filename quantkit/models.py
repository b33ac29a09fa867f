"""Model specs: what users may pass wherever a model is expected.

- a folder with config.json and safetensors shards;
- `tiny:kimi-k2.6` / `tiny:glm-5.2`: the embedded tiny models (built on first use);
- `hf://org/repo@rev`: a Hugging Face repo (see quantkit.hub).
"""

from __future__ import annotations

from pathlib import Path

from quantkit.checkpoint import Checkpoint
from quantkit.errors import ConfigError


def is_tiny(spec: str) -> bool:
    return isinstance(spec, str) and spec.startswith("tiny:")


def resolve(spec: str | Path) -> Path:
    """A local folder for `spec`; tiny models are generated into the cache on first use."""
    if is_tiny(spec):
        from quantkit.tiny import tiny_path

        return tiny_path(spec[len("tiny:"):])
    if isinstance(spec, str) and spec.startswith("hf://"):
        raise ConfigError(f"{spec}: pull it first with `quantkit pull`, or pass the hf:// id to `quantkit convert`")
    path = Path(spec)
    if not path.is_dir():
        raise ConfigError(f"{spec}: not a folder, a tiny:<name> id or an hf://org/repo id")
    return path


def open_checkpoint(spec: str | Path) -> Checkpoint:
    return Checkpoint(resolve(spec))
