"""RTN: round to nearest with min-max group scales, the data-free baseline (quantkit.quant.gptq.quantize_rtn).

Every calibrated method's experts are judged against it (quantkit.quant.experts' guard), and it is
what a calibrated method stores where there is no calibration path (Method.data_free).
"""

from __future__ import annotations

from quantkit.quant.methods.registry import Inputs, Method, register


@register
class RTN(Method):
    name, display, help = "rtn", "RTN", "data-free baseline: round to nearest, min-max group scales"
    inputs = Inputs.NONE

    def quantize(self, w, experts, options, group_size, layer, *, x=None, tokens=None, alternatives=None, probe=False):
        from quantkit.quant.experts import ExpertRecord, rtn_expert

        return ({e: rtn_expert(w, e, group_size) for e in experts},
                [ExpertRecord(layer, e, len(tokens[e]) if tokens is not None else 0, self.name) for e in experts])
