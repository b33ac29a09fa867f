"""AWQ: activation-aware smoothing of up -> down, then GPTQ on the smoothed weights (quantkit.quant.awq).

Its search reads the layer's MoE inputs gathered whole (Inputs.LAYER: Method.solve's gathered
form, budgeted by the planner); its second step is GPTQ with the recipe's gptq section, so it
takes GPTQ's probe for gptq.low_dampening too (quantkit.quant.methods.gptq).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from quantkit.quant.methods import gptq
from quantkit.quant.methods.registry import Inputs, Method, ProbeCost, Settings, register


class AWQSettings(Settings):  # method: awq (quantkit.quant.awq)
    grid: int = Field(20, ge=1)
    duo_scaling: bool = True


@dataclass(frozen=True)
class AWQOptions:
    """What AWQ runs with: its own section, and GPTQ's for its second step."""

    awq: AWQSettings
    gptq: gptq.GPTQSettings


@register
class AWQ(Method):
    name, display, help = "awq", "AWQ", "calibrated: activation-aware smoothing, then GPTQ"
    inputs, section, settings = Inputs.LAYER, "awq", AWQSettings  # and GPTQ's section for its second step
    time_factor = 1.3  # the scale search on top of GPTQ (measured ~1.3x GPTQ on the tiny models)
    cost_note = ("awq: the search gathers the layer's MoE inputs and each expert's routed rows (budgeted); "
                 "time as GPTQ x 1.3")

    def options(self, recipe) -> AWQOptions:
        return AWQOptions(awq=recipe.awq, gptq=recipe.gptq)

    def quantize(self, w, experts, options: AWQOptions, group_size, layer, *, x=None, tokens=None, alternatives=None,
                 probe=False):
        from quantkit.quant.awq import quantize_experts_awq

        g_low = gptq.low_settings(options.gptq) if probe else None  # its GPTQ step at gptq.low_dampening too
        return quantize_experts_awq(x, w, tokens, experts, options, group_size, layer, alternatives=alternatives, g_low=g_low)

    def probe_windows(self, recipe) -> int:
        return gptq.probe_windows(recipe)

    def probe_cost(self, windows: int, hidden: int, width: int) -> ProbeCost | None:
        return gptq.probe_cost(windows, hidden, width)

    def probe_report(self, recipe, windows: int, seq_len: int) -> dict:
        return gptq.probe_report(recipe, windows, seq_len)

    def kept_words(self, guard: str | None) -> str:
        from quantkit.quant.experts import LOW

        return gptq.kept_words(guard) if guard in (None, LOW) else f" (stored: AWQ's s = 1 result, {guard})"

    def settings_line(self, recipe: dict) -> str | None:
        a, g = recipe.get("awq") or {}, recipe.get("gptq") or {}
        return (f"- AWQ: grid {a.get('grid')}, duo scaling {a.get('duo_scaling')}, then GPTQ on the smoothed weights "
                f"(dampening {g.get('dampening')}, block {g.get('block_size')}, actorder {g.get('actorder')})"
                + (f"; thin-calibration prior {g['width_prior']:g} x input width / fit tokens" if g.get("width_prior") else "")
                + gptq.low_line(g))
