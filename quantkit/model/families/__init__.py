"""The model families quantkit supports: config.json model_type -> its definition (quantkit.model.family).

A new family is a module here and one line in `REGISTRY`.
"""

from __future__ import annotations

from quantkit.errors import ConfigError
from quantkit.model.families.deepseek_v3 import DEEPSEEK_V3, KIMI_K2, KIMI_K25
from quantkit.model.families.glm import GLM_MOE_DSA
from quantkit.model.families.qwen3_moe import QWEN3_MOE
from quantkit.model.family import Family

REGISTRY: dict[str, Family] = {f.model_type: f for f in (DEEPSEEK_V3, KIMI_K2, KIMI_K25, GLM_MOE_DSA, QWEN3_MOE)}


def register(fam: Family) -> Family:
    """Add a definition to `REGISTRY` at run time (a family defined outside quantkit, built from the
    layer kinds quantkit already runs); a model_type already taken by another definition is refused."""
    if REGISTRY.get(fam.model_type, fam) is not fam:
        raise ConfigError(f"model_type {fam.model_type!r} is already registered ({REGISTRY[fam.model_type].name}); "
                          "give the new family its own model_type")
    REGISTRY[fam.model_type] = fam
    return fam


def family_of(model_type: str, *, source: str = "config.json") -> Family:
    """The definition of a config.json model_type; a one-line error naming the supported ones."""
    if model_type not in REGISTRY:
        raise ConfigError(f"{source}: unknown model_type {model_type!r}; quantkit supports {', '.join(sorted(REGISTRY))}")
    return REGISTRY[model_type]


def find_family(model_type: str) -> Family | None:
    """The definition of a model_type, or None for one quantkit does not know (a report's, a probe's)."""
    return REGISTRY.get(model_type)
