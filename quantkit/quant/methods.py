"""The quantization methods, one registered class each, and the one place a method's name is read.

A method says what it needs from the layer pass (`Inputs`), quantizes a chunk of one layer's routed
experts by delegating to its pure tensor function (named as in its paper: quantkit.quant.gptq,
quantkit.quant.awq), and states what the other stages print or count for it: its display name and
one-line help (reports, cards, the CLI), its recipe section and the card's line on its settings,
and its cost terms for the planner (quantkit.conversion.cost). Every caller asks `method_for(name)`;
a name not in METHODS is refused with the registered ones, so a new name can never run another
method's maths.

Adding a method: its class here, with its recipe section's `Settings` (quantkit.recipe adds the
section to every recipe from the registry) and its entry in METHODS, and its pure tensor function
beside the others (if it needs a new one), plus tests and docs. `RTNClip` is the worked example.

Nothing here imports torch at load: quantkit.recipe validates recipes with this module, and the CLI
lists the methods in its help.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from quantkit.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from quantkit.quant.experts import ExpertRecord
    from quantkit.quant.gptq import QuantizedWeight

__all__ = ["Inputs", "Method", "METHODS", "Settings", "method_for", "unknown_method", "quantize_experts"]


class Settings(BaseModel):
    """A recipe section (quantkit.recipe builds every section on this, a method's own included): strict,
    since YAML already gives typed values ("128" or 1.5 for an int is a mistake, not a coercion), and
    an unknown field is an error rather than a silently ignored setting."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


class Inputs(Enum):
    """What a method needs from the layer pass (quantkit.conversion.layerpass)."""

    NONE = "none"  # the weights alone: no calibration pass, and every layer (MTP included) gets the method
    LAYER = "layer inputs"  # the layer's MoE inputs x (N, D) gathered whole, and each expert's routed token ids
    # per-expert Hessians streamed one micro-batch at a time, solved by GPTQ (layerpass.gptq_experts; a
    # second Hessian method would hand that function its solver)
    HESSIANS = "streamed Hessians"


class Method:
    """One quantization method. Subclasses set the class attributes and `quantize`."""

    name: ClassVar[str]  # what recipes, --method and reports call it
    display: ClassVar[str]  # how tables and cards write it
    help: ClassVar[str]  # a few words for --method's help
    inputs: ClassVar[Inputs]
    section: ClassVar[str | None] = None  # its recipe section (a quantkit.recipe.Recipe field), if it has settings
    settings: ClassVar[type[Settings] | None] = None  # that section's fields; quantkit.recipe adds it to Recipe
    # planner (quantkit.conversion.cost): a calibrated method's quantizing phase as a multiple of GPTQ's,
    # and what the plan's notes say about it; a data-free one's work per weight entry, in FLOPs
    time_factor: ClassVar[float] = 1.0
    cost_note: ClassVar[str | None] = None
    flops_per_weight: ClassVar[float] = 20.0

    @property
    def calibrated(self) -> bool:
        """Whether it needs calibration data (then convert runs the calibration pass)."""
        return self.inputs is not Inputs.NONE

    def data_free(self) -> Method:
        """What it stores where there is no calibration path (an uncalibrated MTP layer): itself
        when it needs no data, else RTN."""
        return self if not self.calibrated else METHODS["rtn"]

    def quantize(self, w: dict[str, torch.Tensor], experts: list[int], recipe, group_size: int, layer: int, *,
                 x: torch.Tensor | None = None, tokens: dict[int, torch.Tensor] | None = None,
                 alternatives: dict | None = None, low: bool = False) -> tuple[dict[int, dict[str, QuantizedWeight]], list[ExpertRecord]]:
        """({expert: {proj: QuantizedWeight}}, [ExpertRecord]) for `experts` of one layer.

        w: the layer's expert weights (mlp.experts.{e}.{proj}.weight), read only. A calibrated
        method also takes x (N, D), the layer's MoE inputs held whole, and tokens[e], the indices of
        the tokens routed to e (the whole-layer form; GPTQ's convert streams its Hessians instead).
        `alternatives`, when a dict, receives other candidates per expert for the held-out guard;
        with low=True (a probe is there and the recipe sets gptq.low_dampening) also the expert at
        the low dampening, named quantkit.quant.experts.LOW (the guard judges it on the probe first)."""
        raise NotImplementedError

    def settings_line(self, recipe: dict) -> str | None:
        """The model card's line on this method's settings (recipe: as in convert-report.json)."""
        return None

    def recipe_problems(self, recipe) -> list[str]:
        """What is wrong between its section and the rest of a recipe (quantkit.recipe.Recipe), one line
        each, whichever method the recipe runs: checked when every recipe loads."""
        return []


class GPTQSettings(Settings):
    dampening: float = Field(0.01, gt=0, lt=1)  # fraction of mean(diag H) added to the diagonal
    block_size: int = Field(128, ge=1)  # columns per lazy batch update; a multiple of group_size
    actorder: bool = False  # static activation order (group of a column unchanged: same format)
    min_tokens: int = Field(32, ge=0)  # experts routed fewer tokens take `fallback`
    fallback: Literal["all_tokens", "rtn"] = "all_tokens"
    # GPTQ's static group scales: min-max; a clip search (mse); or the clip search weighted by the damped diag(H) (hessian)
    observer: Literal["minmax", "mse", "hessian"] = "minmax"
    prior_tokens: int = Field(0, ge=0)  # p: H_e = (n_e H_e + p H_all) / (n_e + p) (streamed GPTQ; 0: off)
    # c: each expert's H + c * (in width / fit tokens) * mean(diag H) * I on top of dampening, an
    # isotropic prior that grows as calibration thins (quantkit.quant.experts.expert_dampening; 0: off)
    width_prior: float = Field(0.0, ge=0)
    static_groups: bool = True  # group scales from the original W (llm-compressor); false: from the updated W
    # each routed token's Hessian weight (streamed GPTQ): none; gate = its router weight (MoEQuant);
    # gate2 = the weight squared (the expert's share of the layer output error), normalized per expert
    hessian_weighting: Literal["none", "gate", "gate2"] = "none"
    # which calibration tokens the guard judges on, never fitted (streamed GPTQ): every 8th of each
    # expert's routed tokens ("position"), or every token of every 8th calibration window ("window")
    holdout: Literal["position", "window"] = "position"
    # a second, lower dampening tried for every expert (null: off): a candidate only where, on probe windows
    # of token ids the calibration never contains, its output error is no higher than RTN's; then the
    # held-out guard chooses among both dampenings and RTN (quantkit.quant.experts, "Probe")
    low_dampening: float | None = Field(None, gt=0, lt=1)


class GPTQ(Method):
    name, display, help = "gptq", "GPTQ", "calibrated: per-expert Hessians, streamed"
    inputs, section, settings = Inputs.HESSIANS, "gptq", GPTQSettings

    def quantize(self, w, experts, recipe, group_size, layer, *, x=None, tokens=None, alternatives=None, low=False):
        from quantkit.quant.moe import quantize_experts_gptq

        return quantize_experts_gptq(x, w, tokens, experts, recipe, group_size, layer)

    def settings_line(self, recipe: dict) -> str | None:
        g = recipe.get("gptq") or {}
        return (f"- GPTQ: dampening {g.get('dampening')}, block {g.get('block_size')}, actorder {g.get('actorder')}, "
                f"group scales {g.get('observer', 'minmax')}, experts with fewer than {g.get('min_tokens')} routed "
                f"tokens take `{g.get('fallback')}`"
                + (f"; thin-calibration prior {g['width_prior']:g} x input width / fit tokens added to each expert's "
                   f"dampening" if g.get("width_prior") else "") + _low_line(g))

    def recipe_problems(self, recipe) -> list[str]:
        g, out = recipe.gptq, []
        if g.block_size % recipe.group_size:
            out.append(f"gptq.block_size: {g.block_size} must be a multiple of group_size {recipe.group_size}")
        if not g.static_groups and g.actorder:
            out.append("gptq.static_groups: false needs gptq.actorder: false (a group's scale is set "
                       "when its first column is reached, in the original column order)")
        if g.low_dampening is not None and g.low_dampening >= g.dampening:
            out.append(f"gptq.low_dampening: {g.low_dampening} must be below gptq.dampening {g.dampening} "
                       "(it is the candidate the probe may admit; remove it or lower it)")
        return out


def _low_line(g: dict) -> str:
    """The card's words for gptq.low_dampening (quantkit.quant.experts, "Probe"), or nothing."""
    if g.get("low_dampening") is None:
        return ""
    return (f"; dampening {g['low_dampening']} tried for every expert, a candidate where probe windows of token ids "
            "the calibration never contains show it no worse than RTN")


class AWQSettings(Settings):  # method: awq (quantkit.quant.awq)
    grid: int = Field(20, ge=1)
    duo_scaling: bool = True


class AWQ(Method):
    name, display, help = "awq", "AWQ", "calibrated: activation-aware smoothing, then GPTQ"
    inputs, section, settings = Inputs.LAYER, "awq", AWQSettings  # and GPTQ's section for its second step
    time_factor = 1.3  # the scale search on top of GPTQ (measured ~1.3x GPTQ on the tiny models)
    cost_note = ("awq: the search gathers the layer's MoE inputs and each expert's routed rows (budgeted); "
                 "time as GPTQ x 1.3")

    def quantize(self, w, experts, recipe, group_size, layer, *, x=None, tokens=None, alternatives=None, low=False):
        from quantkit.quant.awq import quantize_experts_awq

        return quantize_experts_awq(x, w, tokens, experts, recipe, group_size, layer, alternatives=alternatives, low=low)

    def settings_line(self, recipe: dict) -> str | None:
        a, g = recipe.get("awq") or {}, recipe.get("gptq") or {}
        return (f"- AWQ: grid {a.get('grid')}, duo scaling {a.get('duo_scaling')}, then GPTQ on the smoothed weights "
                f"(dampening {g.get('dampening')}, block {g.get('block_size')}, actorder {g.get('actorder')})"
                + (f"; thin-calibration prior {g['width_prior']:g} x input width / fit tokens" if g.get("width_prior") else "")
                + _low_line(g))


class RTN(Method):
    name, display, help = "rtn", "RTN", "data-free baseline: round to nearest, min-max group scales"
    inputs = Inputs.NONE

    def quantize(self, w, experts, recipe, group_size, layer, *, x=None, tokens=None, alternatives=None, low=False):
        from quantkit.quant.experts import ExpertRecord, rtn_expert

        return ({e: rtn_expert(w, e, group_size) for e in experts},
                [ExpertRecord(layer, e, len(tokens[e]) if tokens is not None else 0, self.name) for e in experts])


class RTNClipSettings(Settings):  # method: rtn-clip (quantkit.quant.gptq.quantize_rtn_clip)
    grid: int = Field(100, ge=1)  # candidate clip ratios 1, 1 - 1/grid, ...
    max_shrink: float = Field(0.2, gt=0, lt=1)  # ... down to (not below) 1 - max_shrink
    # the group error minimised: sum |w - q|^norm. 3 rather than 2: on the tiny GLM's experts (g128) it
    # lowers the expert-output error vs RTN by 24% (59 of 64 experts), 2 by 0.5% (docs/recipes.md)
    norm: float = Field(3.0, gt=0)


class RTNClip(Method):
    name, display, help = "rtn-clip", "RTN-clip", "data-free: round to nearest, group scales by a clip search"
    inputs, section, settings = Inputs.NONE, "rtn_clip", RTNClipSettings
    flops_per_weight = 20.0 * 20  # RTN's work for each of the search's candidate ranges (grid x max_shrink)

    def quantize(self, w, experts, recipe, group_size, layer, *, x=None, tokens=None, alternatives=None, low=False):
        from quantkit.quant.experts import PROJS, ExpertRecord, expert_weights
        from quantkit.quant.gptq import quantize_rtn_clip

        c = recipe.rtn_clip
        return ({e: {p: quantize_rtn_clip(t, group_size, grid=c.grid, max_shrink=c.max_shrink, norm=c.norm)
                     for p, t in zip(PROJS, expert_weights(w, e))} for e in experts},
                [ExpertRecord(layer, e, len(tokens[e]) if tokens is not None else 0, self.name) for e in experts])

    def settings_line(self, recipe: dict) -> str | None:
        c = recipe.get("rtn_clip") or {}
        return (f"- RTN-clip: each group's range max|w| x r, r in steps of 1/{c.get('grid')} from 1 down to above "
                f"{1 - c.get('max_shrink', 0):g}, for the least sum |w - q|^{c.get('norm')}; no calibration data")


# The registry: one entry per method, in the order help texts and reports list them.
METHODS: dict[str, Method] = {m.name: m() for m in (GPTQ, AWQ, RTN, RTNClip)}


def unknown_method(name: object) -> str:
    """The one-line complaint for a name that is not registered."""
    return f"unknown method {name!r}; use one of the registered methods: {', '.join(METHODS)}"


def method_for(name: str) -> Method:
    """The registered method called `name`; a ConfigError naming the registered ones otherwise."""
    m = METHODS.get(name)
    if m is None:
        raise ConfigError(unknown_method(name))
    return m


def quantize_experts(x: torch.Tensor, w: dict[str, torch.Tensor], tokens: dict[int, torch.Tensor], experts: list[int],
                     recipe, group_size: int, method: str, layer: int, alternatives: dict | None = None):
    """`method`'s whole-layer form for the given routed experts of one layer (`Method.quantize`), from
    the layer's MoE inputs held whole: the oracle of convert's streamed GPTQ
    (tests/conversion/test_layerpass.py) and what tests/runtime/test_device.py runs on a fake device."""
    return method_for(method).quantize(w, experts, recipe, group_size, layer, x=x, tokens=tokens,
                                       alternatives=alternatives)
