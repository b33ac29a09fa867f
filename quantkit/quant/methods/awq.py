"""AWQ: activation-aware smoothing of up -> down, then GPTQ on the smoothed weights (quantkit.quant.awq).

Its search reads each expert's fit rows whole (Inputs.EXPERT_ROWS): convert reads them for one chunk
of experts at a time from the layer's micro-batches (`expert_rows`), with their held-out rows for
the guard, and never gathers the layer's MoE inputs; the chunk is the planner's, sized by the
budget (quantkit.planner.cost). Its second step is GPTQ with the recipe's gptq section, so it
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
    inputs, section, settings = Inputs.EXPERT_ROWS, "awq", AWQSettings  # and GPTQ's section for its second step
    time_factor = 1.3  # the scale search on top of GPTQ (measured ~1.3x GPTQ on the tiny models)
    cost_note = ("awq: the search reads each expert's routed rows, one chunk of experts at a time (budgeted); "
                 "time as GPTQ x 1.3")

    def options(self, recipe) -> AWQOptions:
        return AWQOptions(awq=recipe.awq, gptq=recipe.gptq)

    # its GPTQ step takes GPTQ's probe for gptq.low_dampening, so the report says what GPTQ's would
    def record_words(self, e: dict) -> str:
        return gptq.probe_words(e)

    def summary_counts(self, experts: list[dict]) -> dict[str, int]:
        return gptq.probe_counts(experts)

    def guard_note(self, summary: dict) -> str:
        return gptq.probe_note(summary)

    def quantize(self, w, experts, options: AWQOptions, group_size, layer, *, x=None, tokens=None, alternatives=None,
                 probe=False):
        from quantkit.quant.awq import quantize_experts_awq

        g_low = gptq.low_settings(options.gptq) if probe else None  # its GPTQ step at gptq.low_dampening too
        return quantize_experts_awq(x, w, tokens, experts, options, group_size, layer, alternatives=alternatives, g_low=g_low)

    def solve(self, rows, w, experts, options: AWQOptions, group_size, layer):
        """convert's form: the chunk's rows read from the micro-batches (`expert_rows`), the search
        on them (quantkit.quant.awq.awq_experts), each calibrated expert guarded against RTN on its
        held-out rows. The bytes are the whole-layer form's (the same rows in the same order)."""
        if rows is None:
            return self.quantize(w, experts, options, group_size, layer)
        from quantkit.quant.awq import awq_experts
        from quantkit.quant.experts import LOW, guard_against_rtn, probe_inputs

        inputs, fallback, held = expert_rows(rows, experts, options.gptq)
        alternatives: dict = {}
        probe = rows.probe
        g_low = gptq.low_settings(options.gptq) if probe is not None else None
        quantized, records = awq_experts(inputs, fallback, {e: int(rows.counts[e]) for e in experts}, w, experts,
                                         options, group_size, layer, alternatives=alternatives, g_low=g_low)
        del inputs
        x_probe, probe_tokens = (probe.gather(), probe.routed(experts)) if probe is not None else (None, {})
        for r in records:  # as quantkit.quant.experts.guard_experts, on the rows read here
            if r.fallback != "rtn":
                alts = dict(alternatives.get(r.expert) or {})
                low = alts.pop(LOW, None)
                quantized[r.expert] = guard_against_rtn(
                    held[r.expert], w, r.expert, quantized[r.expert], group_size, r, alts, low,
                    probe_inputs(x_probe, probe_tokens.get(r.expert)) if probe is not None else None)
        return quantized, records

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


def expert_rows(rows, experts: list[int], g) -> tuple[dict, dict, dict]:
    """(fit rows, fallback, held-out rows) per expert of a chunk, read one micro-batch at a time
    (rows: quantkit.quant.rows.LayerRows), by quantkit.quant.experts' one policy: every HOLDOUT-th of
    an expert's routed tokens is held out; a starved expert takes gptq.fallback (rows None for
    "rtn"; every fit token of the layer for "all_tokens"); an expert with no held-out routed token
    is judged on every held-out token of the layer. The same rows in the same order as indexing the
    layer's inputs held whole (`calibration_inputs`, `heldout_inputs`), so the same bytes follow;
    only the chunk's rows are held, never the layer's inputs (beyond a starved expert's, which are
    the layer's fit tokens by definition)."""
    import torch

    from quantkit.quant.experts import HOLDOUT, is_heldout, split_rows, starved

    counts = {e: int(rows.counts[e]) for e in experts}
    hungry = {e for e in experts if starved(counts[e], g)}
    fallback = {e: (g.fallback if g.fallback == "rtn" else "all_tokens") if e in hungry else None for e in experts}
    own = [e for e in experts if fallback[e] != "rtn"]  # the experts that get rows
    want_fit = any(fallback[e] == "all_tokens" for e in own)
    want_held = any(counts[e] // HOLDOUT == 0 for e in own)
    n_layer = rows.tokens
    # every array at its final size (the policy fixes how many rows each gets: every HOLDOUT-th held
    # out), allocated at the first micro-batch (its width and device) and filled in place: pieces
    # then a cat would hold the chunk's rows twice at the cat
    fit: dict[int, torch.Tensor] = {}
    held: dict[int, torch.Tensor] = {}
    every_fit = every_held = None
    filled = {e: [0, 0] for e in own}  # fit rows, held-out rows written so far
    layer_filled = [0, 0]
    for start, xb, idx_b, _ in rows.batches():  # xb (B T, D) float32, idx_b (B T, k)
        if start == 0:  # (n, D) arrays like the micro-batch's rows
            fit = {e: xb.new_empty((counts[e] - counts[e] // HOLDOUT, xb.shape[-1])) for e in own if fallback[e] is None}
            held = {e: xb.new_empty((counts[e] // HOLDOUT, xb.shape[-1])) for e in own}
            every_fit = xb.new_empty((n_layer - n_layer // HOLDOUT, xb.shape[-1])) if want_fit else None
            every_held = xb.new_empty((n_layer // HOLDOUT, xb.shape[-1])) if want_held else None
        for e in own:
            f, h = split_rows(idx_b, e, sum(filled[e]), start, False)
            if e in fit:
                fit[e][filled[e][0]:filled[e][0] + len(f)] = xb[f]
            held[e][filled[e][1]:filled[e][1] + len(h)] = xb[h]
            filled[e][0] += len(f)
            filled[e][1] += len(h)
        if want_fit or want_held:
            out = is_heldout(start + torch.arange(len(xb), device=xb.device))
            if every_fit is not None:
                part = xb[~out]
                every_fit[layer_filled[0]:layer_filled[0] + len(part)] = part
                layer_filled[0] += len(part)
            if every_held is not None:
                part = xb[out]
                every_held[layer_filled[1]:layer_filled[1] + len(part)] = part
                layer_filled[1] += len(part)
        del xb
    inputs: dict = {e: None for e in experts}
    held_rows: dict = {}
    for e in own:
        inputs[e] = every_fit if fallback[e] == "all_tokens" else fit.pop(e)
        held_rows[e] = held[e] if counts[e] // HOLDOUT else every_held
    return inputs, fallback, held_rows
