"""GPTQ per routed expert, with its Hessians streamed from the layer's calibration rows.

convert never holds a layer's tokens beyond its activation store: GPTQ observes the rows one
micro-batch at a time (quantkit.quant.rows.LayerRows.batches) and keeps only each expert's Hessian.
Per chunk of routed experts (their count from the planner's budget):

    Hessians       per micro-batch, each expert's fit tokens (quantkit.quant.experts' policy: every
                   HOLDOUT-th routed token is held out): H_e += x_e^T x_e (gate and up share it);
                   a starved expert with fallback all_tokens uses the layer's fit tokens; the
                   held-out rows are kept for the guard
    GPTQ           gate and up as one row-stacked weight against one factored H_e
    down Hessians  per micro-batch: z = silu(x_e gate_hat^T) * (x_e up_hat^T), Hd_e += z^T z
    GPTQ           down
    guard          each expert's held-out output error vs RTN's; the lower is stored

    gptq.low_dampening: GPTQ asks for probe windows (`probe_windows`: token ids the calibration
    never contains, run through the same quantized layers, never entering a Hessian: LayerRows.probe);
    it runs at both dampenings in one batched call, and the guard admits the low one where its
    error on the expert's probe tokens is <= RTN's (quantkit.quant.experts, "Probe")

So the work space is one micro-batch of tokens plus one chunk of experts (weights, Hessians and
the GPTQ work), whatever the number of calibration tokens. The whole-layer form (`GPTQ.quantize`,
quantkit.quant.moe) is the same policy and arithmetic on tensors held whole: the streamed form's
oracle in the tests. The algorithm itself is quantkit.quant.gptq.gptq.

Torch is imported inside the functions: the registry is read by the CLI's help.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from quantkit.quant.methods.registry import Inputs, Method, ProbeCost, Settings, register
from quantkit.runtime import phases

if TYPE_CHECKING:
    import torch

    from quantkit.quant.gptq import QuantizedWeight
    from quantkit.quant.rows import LayerRows

# at most this many probe tokens: ~1000 per expert at full scale (top-8 of 256)
PROBE_TOKENS = 32768


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
    # each expert's Hessian shrunk towards a scaled identity by the Ledoit-Wolf intensity its own fit
    # tokens support: an extra dampening per expert, none with many tokens a column, RTN in effect with
    # very few (quantkit.quant.shrinkage; recorded per expert as `shrink`)
    shrinkage: Literal["none", "ledoit-wolf"] = "none"


@register
class GPTQ(Method):
    name, display, help = "gptq", "GPTQ", "calibrated: per-expert Hessians, streamed"
    inputs, section, settings = Inputs.STREAMED, "gptq", GPTQSettings

    def options(self, recipe) -> GPTQSettings:
        return recipe.gptq

    def quantize(self, w, experts, options: GPTQSettings, group_size, layer, *, x=None, tokens=None, alternatives=None,
                 probe=False):
        from quantkit.quant.moe import quantize_experts_gptq

        return quantize_experts_gptq(x, w, tokens, experts, options, group_size, layer)

    def solve(self, rows, w, experts, options: GPTQSettings, group_size, layer):
        return gptq_experts(rows, w, experts, options, group_size, layer)

    def probe_windows(self, recipe) -> int:
        return probe_windows(recipe)

    def probe_cost(self, windows: int, hidden: int, width: int) -> ProbeCost | None:
        return probe_cost(windows, hidden, width)

    def probe_report(self, recipe, windows: int, seq_len: int) -> dict:
        return probe_report(recipe, windows, seq_len)

    def guard_words(self, recipe) -> str:
        from quantkit.quant.experts import HOLDOUT

        if recipe.gptq.holdout == "window":
            return f"every token of every {HOLDOUT}th calibration window"
        return super().guard_words(recipe)

    def kept_words(self, guard: str | None) -> str:
        return kept_words(guard)

    def record_words(self, e: dict) -> str:
        return probe_words(e)

    def summary_counts(self, experts: list[dict]) -> dict[str, int]:
        return probe_counts(experts)

    def guard_note(self, summary: dict) -> str:
        return probe_note(summary)

    def settings_line(self, recipe: dict) -> str | None:
        g = recipe.get("gptq") or {}
        return (f"- GPTQ: dampening {g.get('dampening')}, block {g.get('block_size')}, actorder {g.get('actorder')}, "
                f"group scales {g.get('observer', 'minmax')}, experts with fewer than {g.get('min_tokens')} routed "
                f"tokens take `{g.get('fallback')}`"
                + (f"; thin-calibration prior {g['width_prior']:g} x input width / fit tokens added to each expert's "
                   f"dampening" if g.get("width_prior") else "")
                + ("; each expert's Hessian shrunk towards a scaled identity by its Ledoit-Wolf intensity"
                   if g.get("shrinkage", "none") != "none" else "") + low_line(g))

    def recipe_problems(self, recipe) -> list[str]:
        g, out = recipe.gptq, []
        if g.block_size % recipe.group_size:
            out.append(f"gptq.block_size: {g.block_size} must be a multiple of group_size {recipe.group_size}")
        if not g.static_groups and g.actorder:
            out.append("gptq.static_groups: false needs gptq.actorder: false (a group's scale is set "
                       "when its first column is reached, in the original column order)")
        if g.shrinkage != "none" and (g.prior_tokens or g.hessian_weighting != "none"):
            out.append("gptq.shrinkage: ledoit-wolf estimates from unweighted fit tokens alone; set "
                       "gptq.prior_tokens: 0 and gptq.hessian_weighting: none, or gptq.shrinkage: none")
        if g.low_dampening is not None and g.low_dampening >= g.dampening:
            out.append(f"gptq.low_dampening: {g.low_dampening} must be below gptq.dampening {g.dampening} "
                       "(it is the candidate the probe may admit; remove it or lower it)")
        return out


# ---- gptq.low_dampening's probe: its windows, plan terms and words (AWQ's GPTQ step takes it too)


def probe_windows(recipe) -> int:
    """The probe windows a run makes with gptq.low_dampening set: as many as the held-out share of
    the calibration windows (one in HOLDOUT), at least one, and no more than PROBE_TOKENS tokens'
    worth (judging needs tokens per expert, not a share of the calibration: at 512 x 2048 that is 16
    windows, 3% more attention work rather than 12%); else 0."""
    from quantkit.quant.experts import HOLDOUT

    if getattr(recipe.gptq, "low_dampening", None) is None:
        return 0
    c = recipe.calibration
    return max(1, min(-(-c.windows() // HOLDOUT), PROBE_TOKENS // c.seq_len))


def probe_cost(windows: int, hidden: int, width: int) -> ProbeCost:
    """GPTQ at both dampenings in one batched call: W and H stacked twice (gate/up's and down's, float32)
    per expert, GPTQ's arithmetic twice; on the CPU, where batching buys no launches, half the chunk."""
    return ProbeCost(expert_bytes=(hidden * hidden + width * width + 3 * width * hidden) * 4, work=2.0, cpu_chunk=0.5,
                     note=f"gptq.low_dampening: {windows} probe windows run beside the calibration's (no Hessian), and "
                          "every expert quantized at both dampenings in one batched call (GPTQ's arithmetic x 2)")


def probe_report(recipe, windows: int, seq_len: int) -> dict:
    return {"windows": windows, "seq_len": seq_len, "low_dampening": recipe.gptq.low_dampening,
            "ids": "drawn uniformly from the vocabulary ids the calibration never contains "
                   "(quantkit.inputs.tokens.probe_ids); never fitted on, judged only"}


def low_settings(g: GPTQSettings) -> GPTQSettings | None:
    """The gptq section with gptq.low_dampening as its dampening (the candidate the probe judges), or
    None when the recipe sets none."""
    return None if g.low_dampening is None else g.model_copy(update={"dampening": g.low_dampening})


def probe_words(e: dict) -> str:
    """What the probe decided for gptq.low_dampening (quantkit.quant.experts, "Probe") on one expert's report
    entry, or nothing."""
    shrunk = f"; its Hessian shrunk by Ledoit-Wolf delta {e['shrink']:.3g}" if e.get("shrink") is not None else ""
    if not e.get("probe"):
        return shrunk
    ok = e["err_probe_low"] <= e["err_probe_rtn"]
    return (f"; on {e['probe']} probe tokens the low dampening's error {e['err_probe_low']:.4g} "
            f"{'<=' if ok else '>'} RTN's {e['err_probe_rtn']:.4g}, so it was {'' if ok else 'not '}a candidate "
            f"(held-out error there {e['err_low']:.4g})") + shrunk


def probe_counts(experts: list[dict]) -> dict[str, int]:
    """gptq.low_dampening's counts for experts_summary: experts judged on the probe, those it admitted, those
    stored at it; none when no probe ran."""
    from quantkit.quant.experts import LOW

    shrunk = [e["shrink"] for e in experts if e.get("shrink") is not None]  # gptq.shrinkage
    lw = {"shrunk": len(shrunk), "shrunk_past_half": sum(1 for d in shrunk if d >= 0.5)} if shrunk else {}
    if not any(e.get("probe") for e in experts):
        return lw
    return {**lw, "probe_judged": sum(1 for e in experts if e.get("probe")),
            "probe_admitted_low": sum(1 for e in experts if e.get("probe") and e["err_probe_low"] <= e["err_probe_rtn"]),
            "low_dampening": sum(1 for e in experts if e.get("guard") == LOW)}


def probe_note(summary: dict) -> str:
    """The card's guard line on those counts."""
    lw = (f"; {summary['shrunk']} Hessians shrunk by their Ledoit-Wolf intensity, {summary['shrunk_past_half']} "
          "past one half (near RTN: too few tokens for their width; per expert in the report's `shrink`)"
          if summary.get("shrunk") else "")
    if not summary.get("probe_judged"):
        return lw
    return lw + (f"; probe: {summary['probe_judged']} judged at gptq.low_dampening on token ids the calibration never "
            f"contains, {summary['probe_admitted_low']} no worse than RTN there, {summary['low_dampening']} stored at it")


def kept_words(guard: str | None) -> str:
    return "" if guard is None else " (stored: gptq.low_dampening's result, lower on them)"


def low_line(g: dict) -> str:
    """The card's words for gptq.low_dampening (quantkit.quant.experts, "Probe"), or nothing."""
    if g.get("low_dampening") is None:
        return ""
    return (f"; dampening {g['low_dampening']} tried for every expert, a candidate where probe windows of token ids "
            "the calibration never contains show it no worse than RTN")


# ---- the streamed form




def _gate_norms(rows: LayerRows, run: list[int], weighting: str) -> list[float]:
    """Per expert, the mean over its routed tokens of the token weight that hessian_weighting gives
    (router weight, or its square), so that weighted tokens count as many tokens in all: the
    prior's and dampening's relative sizes do not change with the weighting."""
    out = []
    for e in run:
        w = rows.weight[rows.idx == e].double()
        w = w.square() if weighting == "gate2" else w
        out.append(float(w.mean()) if len(w) and float(w.mean()) > 0 else 1.0)
    return out


def _prior_weight(N: int, prior: int, window: int) -> float:
    """gptq.prior_tokens' weight p / n_all on each of the layer's n_all fit tokens (0 when off)."""
    from quantkit.quant.experts import HOLDOUT

    if not prior:
        return 0.0
    n_all = N - (N // window) // HOLDOUT * window if window else N - N // HOLDOUT
    return prior / max(n_all, 1)


def expert_hessians(rows: LayerRows, run: list[int], all_tokens: set[int], inputs=None, held: dict | None = None,
                    prior: int = 0, window: int = 0, weighting: str = "none", fit_rows: list | None = None,
                    fourth: list | None = None) -> torch.Tensor:
    """H_e = 2/n_e sum x x^T [len(run), in, in] over each expert's fit tokens (the layer's fit
    tokens for the experts in `all_tokens`), accumulated one micro-batch at a time; held-out tokens
    never enter. `inputs(j, x_e)` maps an expert's input rows to the rows of the Linear whose Hessian
    this is (default: x itself). `held`, when a dict, receives each expert's held-out input rows
    (the guard's data: 1/HOLDOUT of its routed tokens).

    prior = p > 0 (gptq.prior_tokens): H_e = (n_e H_e + p H_all) / (n_e + p), H_all the Hessian of
    the same Linear over every fit token of the layer: an expert with few routed tokens is pulled
    towards the layer's statistics, one with many keeps its own. Accumulated in place (the layer's
    fit-token count is known up front), so no second (C, in, in) array.

    window = seq_len > 0: hold out by calibration window (gptq.holdout: window; experts.split_rows).
    weighting (gptq.hessian_weighting): "gate" weights each routed token's x x^T by its router
    weight for the expert (MoEQuant's affinity-guided Hessian), "gate2" by that weight squared (the
    factor the token's expert-output error has in the layer output); each divided by the expert's
    mean of it (`_gate_norms`). Experts fitted on every token (`all_tokens`) stay unweighted.
    `fit_rows`, when a list, receives each expert's fit-token count (gptq.width_prior's n);
    `fourth`, when a list, each expert's sum of ||row||^4 over them (gptq.shrinkage's statistic)."""
    import torch

    from quantkit.quant.experts import split_rows
    from quantkit.quant.shrinkage import fourth_moment

    H = None
    w_all = _prior_weight(rows.tokens, prior, window)
    n = torch.zeros(len(run), dtype=torch.float64)
    counted = [0] * len(run)
    m4 = [0.0] * len(run)
    seen = {e: 0 for e in run}
    parts: dict[int, list] = {e: [] for e in run}
    norms = _gate_norms(rows, run, weighting) if weighting != "none" else None
    for start, xb, idx_b, wt_b in rows.batches():  # xb (B T, D), idx_b and wt_b (B T, k)
        for j, e in enumerate(run):
            fit, out = split_rows(idx_b, e, seen[e], start, e in all_tokens, window)
            if held is not None:  # the guard judges on the expert's own held-out routed tokens
                routed_out = split_rows(idx_b, e, seen[e], start, False, window)[1] if e in all_tokens else out
                if len(routed_out):
                    parts[e].append(xb[routed_out])
            seen[e] += int((idx_b == e).sum())
            xe = xb[fit]
            counted[j] += len(xe)
            if inputs is not None:
                xe = inputs(j, xe)
            if fourth is not None:
                m4[j] += fourth_moment(xe)
            if H is None:
                H = torch.zeros(len(run), xe.shape[-1], xe.shape[-1], device=xb.device)
            if norms is not None and e not in all_tokens:
                c = (wt_b * (idx_b == e)).sum(-1)[fit].to(xe.dtype)  # each fit token's router weight for e
                c = (c.square() if weighting == "gate2" else c) / norms[j]
                if len(xe):
                    H[j].addmm_((xe * c[:, None]).T, xe)
                n[j] += float(c.sum())
            else:
                if len(xe):
                    H[j].addmm_(xe.T, xe)
                n[j] += len(xe)
            if prior and e not in all_tokens:
                xa = xb[split_rows(idx_b, e, seen[e], start, True, window)[0]]
                xa = inputs(j, xa) if inputs is not None else xa
                H[j].addmm_(xa.T, xa, alpha=w_all)
        del xb
    if H is None:
        raise ValueError("expert_hessians: the layer's rows have no micro-batch")
    for j, e in enumerate(run):
        H[j] *= 2.0 / max(float(n[j]) + (prior if e not in all_tokens else 0), 1.0)
    if held is not None:
        for e in run:
            held[e] = torch.cat(parts[e]) if parts[e] else None
    if fit_rows is not None:
        fit_rows[:] = counted
    if fourth is not None:
        fourth[:] = m4
    return H


def _layer_heldout(rows: LayerRows, window: int = 0) -> torch.Tensor:
    """Every held-out token of the layer (the guard's data for an expert with none of its own)."""
    import torch

    from quantkit.quant.experts import is_heldout, is_heldout_window

    out = []
    for start, xb, _, _ in rows.batches():
        pos = start + torch.arange(len(xb), device=xb.device)
        out.append(xb[is_heldout_window(pos, window) if window else is_heldout(pos)])
    return torch.cat(out)


def _expert_q(qgu: QuantizedWeight, qd: QuantizedWeight, j: int, I: int) -> dict[str, QuantizedWeight]:
    """Expert j of a chunk's GPTQ results: gate and up are the row-stacked gate/up's halves."""
    from quantkit.quant.gptq import QuantizedWeight

    return {"gate_proj": QuantizedWeight(qgu.q[j, :I], qgu.scale[j, :I]),
            "up_proj": QuantizedWeight(qgu.q[j, I:], qgu.scale[j, I:]),
            "down_proj": QuantizedWeight(qd.q[j], qd.scale[j])}


def _hungry(rows: LayerRows, experts: list[int], g) -> set[int]:
    """The starved experts: too few routed tokens outside the held-out ones (gptq.min_tokens), counted
    by window with gptq.holdout: window."""
    import torch

    from quantkit.quant.experts import is_heldout_window, starved

    if g.holdout != "window":
        return {e for e in experts if starved(int(rows.counts[e]), g)}
    fit = ~is_heldout_window(torch.arange(rows.tokens, device=rows.idx.device), rows.seq_len)
    flat = rows.idx[fit].flatten().long()
    fit_counts = torch.zeros_like(rows.counts).scatter_add_(0, flat, torch.ones_like(flat))
    return {e for e in experts if int(fit_counts[e]) < max(g.min_tokens, 1)}


def gptq_experts(rows: LayerRows, ew: dict[str, torch.Tensor], experts: list[int], g: GPTQSettings, group_size: int,
                 layer: int):
    """GPTQ for a chunk of routed experts from streamed Hessians, with quantkit.quant.experts' policy:
    fit on the non-held-out tokens, starved experts take gptq.fallback, and each expert is kept
    only if its held-out output error beats RTN's (guard_against_rtn); g: the recipe's gptq section. Same contract as
    `GPTQ.quantize` followed by the guard. With probe rows (rows.probe: gptq.low_dampening) each
    expert is also quantized at the low dampening, on the same Hessians (down's from the gate/up at
    gptq.dampening), and the guard admits it by its probe error."""
    import torch
    import torch.nn.functional as F

    from quantkit.quant.experts import (
        ExpertRecord,
        guard_against_rtn,
        prior_of,
        probe_inputs,
        rtn_expert,
        run_gptq,
    )
    from quantkit.quant.gptq import QuantizedWeight

    counts = rows.counts
    window = rows.seq_len if g.holdout == "window" else 0
    hungry = _hungry(rows, experts, g)
    records, quantized = {}, {}
    for e in experts:
        if e in hungry and g.fallback == "rtn":
            quantized[e] = rtn_expert(ew, e, group_size)
            records[e] = ExpertRecord(layer, e, int(counts[e]), "rtn", fallback="rtn")
    run = [e for e in experts if e not in quantized]
    if run:
        all_tokens = hungry & set(run)
        I, Wgu_width = ew[f"mlp.experts.{run[0]}.gate_proj.weight"].shape
        # gate and up: one Hessian per expert, shared; the weights stacked by rows [C, 2I, D]
        held: dict = {}
        n_fit: list = []
        m4: list | None = [] if g.shrinkage != "none" else None  # gptq.shrinkage's statistic, gate/up's then down's
        shrunk: list = []
        with phases.timed("hessians"):
            H = expert_hessians(rows, run, all_tokens, held=held, prior=g.prior_tokens, window=window,
                                weighting=g.hessian_weighting, fit_rows=n_fit, fourth=m4)
        Wgu = torch.stack([torch.cat([ew[f"mlp.experts.{e}.gate_proj.weight"],
                                      ew[f"mlp.experts.{e}.up_proj.weight"]]) for e in run]).float()
        probe = rows.probe
        low = low_settings(g) if probe is not None else None
        box = [H]
        del H
        with phases.timed("gptq"):
            if low is not None:  # both dampenings in one call (run_gptq stacks them)
                qgu, qgu_low = run_gptq(Wgu, box.pop(), group_size, g, layer, run, fit_tokens=n_fit, low=low,
                                        fourth=m4, shrunk=shrunk)
            else:
                qgu = run_gptq(Wgu, box.pop(), group_size, g, layer, run, consume=True, fit_tokens=n_fit,
                               fourth=m4, shrunk=shrunk)
        del Wgu
        gu_hat = QuantizedWeight(qgu.q, qgu.scale).dequantize(torch.float32)  # [C, 2I, D]

        def z(j, xe):  # down's input under the quantized gate/up
            return F.silu(xe @ gu_hat[j, :I].T) * (xe @ gu_hat[j, I:].T)

        with phases.timed("hessians"):
            Hd = expert_hessians(rows, run, all_tokens, inputs=z, prior=g.prior_tokens, window=window,
                                 weighting=g.hessian_weighting, fourth=m4)
        del gu_hat
        Wd = torch.stack([ew[f"mlp.experts.{e}.down_proj.weight"] for e in run]).float()  # [C, D, I]
        box = [Hd]
        del Hd
        with phases.timed("gptq"):
            if low is not None:
                qd, qd_low = run_gptq(Wd, box.pop(), group_size, g, layer, run, fit_tokens=n_fit, low=low, fourth=m4)
            else:
                qd = run_gptq(Wd, box.pop(), group_size, g, layer, run, consume=True, fit_tokens=n_fit, fourth=m4)
        del Wd
        # the probe's MoE inputs (P T, D) and each expert's probe rows: what the low dampening is judged on
        x_probe, probe_tokens = (probe.gather(), probe.routed(run)) if probe is not None else (None, {})
        layer_held = None
        for j, e in enumerate(run):
            q = _expert_q(qgu, qd, j, I)
            r = ExpertRecord(layer, e, int(counts[e]), GPTQ.name, "all_tokens" if e in hungry else None,
                             float(qgu.loss[j] + qd.loss[j]), prior=prior_of(g, n_fit[j], Wgu_width),
                             shrink=round(shrunk[j], 6) if shrunk else None)
            x_held = held.get(e)
            if x_held is None:  # no held-out routed token: every held-out token of the layer
                layer_held = _layer_heldout(rows, window) if layer_held is None else layer_held
                x_held = layer_held
            quantized[e] = guard_against_rtn(
                x_held, ew, e, q, group_size, r, low=None if low is None else _expert_q(qgu_low, qd_low, j, I),
                x_probe=None if low is None else probe_inputs(x_probe, probe_tokens[e]))
            records[e] = r
        del held, layer_held
    return quantized, [records[e] for e in sorted(records)]
