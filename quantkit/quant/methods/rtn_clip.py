"""RTN-clip: round to nearest with each group's range chosen by a clip search, no calibration data
(quantkit.quant.gptq.quantize_rtn_clip). The worked example of a method with its own recipe section.
"""

from __future__ import annotations

from pydantic import Field

from quantkit.quant.methods.registry import Inputs, Method, Settings, register


class RTNClipSettings(Settings):  # method: rtn-clip (quantkit.quant.gptq.quantize_rtn_clip)
    grid: int = Field(100, ge=1)  # candidate clip ratios 1, 1 - 1/grid, ...
    max_shrink: float = Field(0.2, gt=0, lt=1)  # ... down to (not below) 1 - max_shrink
    # the group error minimised: sum |w - q|^norm. 3 rather than 2: on the tiny GLM's experts (g128) it
    # lowers the expert-output error vs RTN by 24% (59 of 64 experts), 2 by 0.5% (docs/recipes.md)
    norm: float = Field(3.0, gt=0)


@register
class RTNClip(Method):
    name, display, help = "rtn-clip", "RTN-clip", "data-free: round to nearest, group scales by a clip search"
    inputs, section, settings = Inputs.NONE, "rtn_clip", RTNClipSettings
    flops_per_weight = 20.0 * 20  # RTN's work for each of the search's candidate ranges (grid x max_shrink)

    def options(self, recipe) -> RTNClipSettings:
        return recipe.rtn_clip

    def quantize(self, w, experts, options: RTNClipSettings, group_size, layer, *, x=None, tokens=None, alternatives=None,
                 probe=False):
        from quantkit.quant.experts import PROJS, ExpertRecord, expert_weights
        from quantkit.quant.gptq import quantize_rtn_clip

        c = options
        return ({e: {p: quantize_rtn_clip(t, group_size, grid=c.grid, max_shrink=c.max_shrink, norm=c.norm)
                     for p, t in zip(PROJS, expert_weights(w, e))} for e in experts},
                [ExpertRecord(layer, e, len(tokens[e]) if tokens is not None else 0, self.name) for e in experts])

    def settings_line(self, recipe: dict) -> str | None:
        c = recipe.get("rtn_clip") or {}
        return (f"- RTN-clip: each group's range max|w| x r, r in steps of 1/{c.get('grid')} from 1 down to above "
                f"{1 - c.get('max_shrink', 0):g}, for the least sum |w - q|^{c.get('norm')}; no calibration data")
