"""AWQ per routed expert: activation-aware smoothing of up -> down, then GPTQ (or clip + RTN).

The idea (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization", arXiv:2306.00978). A few
input channels of a Linear carry much larger activations than the rest; their weights matter more
to the output, yet group-wise INT4 rounds every weight of a group to the same absolute grid. AWQ
multiplies those salient input columns by s > 1 before quantizing (their relative rounding error
shrinks) and divides the matching activations by s, folding 1/s into whatever produces them, so
the float function is unchanged:

    y = W x = (W diag(s)) (diag(s)^-1 x)          quantize W' = W diag(s), feed x' = x / s

s is searched, not solved: s = mean|x|^alpha (optionally over a weight-magnitude term, "duo
scaling") for alpha on a grid, keeping the alpha whose *quantized* output is closest to the float
one on calibration tokens. alpha = 0 (s = 1) is always a candidate, so the search never does worse
than plain RTN on the calibration objective. A second search then shrinks each group's INT4 range
("auto-clip"): clipping a few outliers buys a finer grid for the rest of the group.

Where a scale can be folded in a DeepSeek-V3 MoE. An expert computes

    z = silu(gate x) * (up x)          x: (D,) MoE input, z: (I,) down's input
    y = down z

* up -> down (what this module smooths). z is linear in up's output rows, so dividing up's row i
  by s_i divides z_i by s_i; down's column i times s_i undoes it exactly (`fold_up_down`). Both
  matrices belong to this expert alone, so the fold is private to the expert and needs no other
  tensor to change: up' = up / s (rows), down' = down * s (columns), and both are stored as INT4 -
  compressed-tensors has no separate smoothing tensor, the scale lives in the weights.
  A pleasant property: up's INT4 groups run along its *input* dim, so scaling one whole row of up
  by 1/s_i scales that row's group scales by 1/s_i and leaves its integers unchanged (up to the
  bf16 rounding of the scale). Smoothing is free for up; only down's error depends on s.
* norm -> gate/up (not done). x comes out of post_attention_layernorm and feeds *every* expert, the
  shared expert and the router. A scale folded into the norm weight would have to be undone in the
  router (gate.weight, in BF16/FP32 and shared by the FP8 prefill model) and the shared expert's FP8
  weights, changing bytes the prefill/decode pair must share, and one scale would have to serve all
  routed experts at once instead of each expert's own tokens. Routing is a top-k: rounding the
  compensated router weights can flip near-ties. We leave the norm alone: gate and up are not
  smoothed (GPTQ, or the clipping search with quantizer="rtn"), and routing is untouched by
  construction (tests check identical top-k on the calibration tokens).
* gate -> ? : silu is not positively homogeneous (silu(x / s) != silu(x) / s), so nothing folds
  through gate's output.

The trade-off against GPTQ (quantkit.quant.gptq). AWQ as published changes only per-channel scales and
clip ratios - a few numbers per row, chosen by 1-D grid searches - so it has little room to
overfit the calibration tokens, needs no Hessian inverse, and rounds every weight to nearest.
GPTQ instead feeds each rounding error back into the not-yet-quantized columns through the full
input covariance: on the tiny models it removes ~15x of an expert's output error where AWQ's
scales + clipping remove ~3x. The two are complementary - smoothing changes *what* is quantized
(down's salient columns get a finer grid), GPTQ changes *how* - and compose exactly: fold the
scales, then GPTQ the smoothed weights. That is what `method: awq` runs (quantizer="gptq"); it
measured best on both tiny models. quantizer="rtn" is AWQ as published, kept for comparison and
for when GPTQ's cost is not wanted. docs/awq.md has the numbers. (GPTQ sets its group scales from
the weights it is given, so the clipping search only applies to the RTN quantizer.)

Objective. For expert e with routed tokens X (n, D) and the float expert's z = down's input, the
search minimizes down's output error per token (AWQ's recipe: the search runs on float inputs)

    L(s) = 1/n sum_t || Q(down diag(s)) diag(s)^-1 z_t - down z_t ||^2 = <delta H, delta>

with delta = Q(down diag(s)) diag(s)^-1 - down and H = Z^T Z / n: one (I, I) statistic per
expert, independent of the token count, batched over experts. (Scoring against z_hat from the
already-quantized gate/up instead, with the cross term, measured no better on the tiny models and
costs a second quantization of up.) After the fold, down' is quantized against what the quantized
gate/up' really produce, z_hat' = silu(gate_q x) * (up'_q x).

Shapes: C experts in a batch, D hidden size, I expert intermediate size, G groups per row.
Everything is float32 on the input's device.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from quantkit.quant.experts import (
    LOW,
    ExpertRecord,
    calibration_inputs,
    expert_weights,
    prior_of,
    rtn_expert,
    run_gptq,
)
from quantkit.quant.gptq import QuantizedWeight, quantize_rtn
from quantkit.quant.shrinkage import fourth_moment

__all__ = [
    "activation_means",
    "weight_means",
    "scale_grid",
    "candidate_scales",
    "fold_up_down",
    "quantize_clipped",
    "clip_ratios",
    "auto_clip",
    "output_error",
    "awq_smooth_scales",
    "quantize_experts_awq",
    "awq_experts",
]

MAX_SHRINK = 0.5  # auto-clip tries ranges down to (1 - MAX_SHRINK) x max|w|, as llm-awq


# ---- statistics ---------------------------------------------------------------------------------
def activation_means(z: torch.Tensor) -> torch.Tensor:
    """mean |z| per channel: z (n, I) -> (I,); zeros when n = 0. AWQ's salience measure."""
    if z.shape[0] == 0:
        return torch.zeros(z.shape[-1], device=z.device)
    return z.float().abs().mean(0)


def weight_means(W: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per input channel, the mean over rows of |W| normalized by its group's max: (..., out, in) -> (..., in).

    The "duo scaling" weight term (llm-compressor's `_compute_layer_means`): channels whose weights
    are already large within their group need less boosting.
    """
    Wg = W.float().abs().unflatten(-1, (-1, group_size))  # (..., out, G, group_size)
    Wg = Wg / (Wg.amax(-1, keepdim=True) + 1e-6)
    return Wg.flatten(-2).mean(-2)  # (..., in)


BLOCK = 8192  # rows per block of the statistics: the work space is a block of rows, not an expert's whole z


def _second_moment(X: torch.Tensor, f=None) -> torch.Tensor:
    """E[f(x) f(x)^T] over the rows of X (n, in) -> (out, out), f(x) = x by default; zeros for n = 0
    (no tokens: every candidate scores 0). Accumulated BLOCK rows at a time, so f(X) (e.g. an
    expert's z, n x I) is never held whole."""
    X = X.float()
    width = X.shape[-1] if f is None else f(X[:0]).shape[-1]
    out = torch.zeros(width, width, device=X.device)
    for b in range(0, X.shape[0], BLOCK):
        xb = X[b:b + BLOCK] if f is None else f(X[b:b + BLOCK])
        out.addmm_(xb.T, xb)
    return out / X.shape[0] if X.shape[0] else out


def _z_statistics(X: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                  fourth: bool = False) -> tuple[torch.Tensor, torch.Tensor, float]:
    """For z = silu(x gate^T) * (x up^T) on the rows of X (n, D): mean|z| (I,), E[z z^T] (I, I) and
    with `fourth` sum_t ||z_t||^4 (gptq.shrinkage's statistic; else 0), a block of rows at a time."""
    I = gate.shape[0]
    absz, Hz, m4 = torch.zeros(I, device=X.device), torch.zeros(I, I, device=X.device), 0.0
    for b in range(0, X.shape[0], BLOCK):
        xb = X[b:b + BLOCK]
        z = F.silu(xb @ gate.T) * (xb @ up.T)  # (block, I)
        absz += z.abs().sum(0)
        Hz.addmm_(z.T, z)
        m4 += fourth_moment(z) if fourth else 0.0
    n = max(X.shape[0], 1)
    return absz / n, Hz / n, m4


# ---- smoothing scales ---------------------------------------------------------------------------
def scale_grid(grid: int, duo_scaling: bool) -> list[tuple[float, bool]]:
    """The (alpha, duo) candidates, as llm-compressor 0.14 enumerates them.

    duo_scaling=False: alpha = i / (grid - 1), i < grid. True: (0, no duo) - the identity, so the
    search can always decline to smooth - then alpha = i / (grid - 2), i < grid - 1, with duo.
    """
    if grid <= 1:
        return [(0.0, False)]
    if not duo_scaling:
        return [(i / (grid - 1), False) for i in range(grid)]
    if grid == 2:
        return [(0.0, False), (1.0, True)]
    return [(0.0, False)] + [(i / (grid - 2), True) for i in range(grid - 1)]


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, alpha: float, duo: bool) -> torch.Tensor:
    """s (..., I) for one grid point: mean|x|^alpha [/ w_mean^(1-alpha)], normalized to sqrt(max min) = 1.

    The normalization keeps s centred on 1 (the fold is exact for any s; this only keeps the
    numbers tame). Non-finite entries (dead channels at alpha < 0, overflow) become 1.
    """
    if duo:
        s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
    else:
        s = x_mean.pow(alpha).clamp(min=1e-4)
    s = s / (s.amax(-1, keepdim=True) * s.amin(-1, keepdim=True)).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def fold_up_down(up: torch.Tensor, down: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold smoothing scales into an expert: up (..., I, D) rows / s, down (..., D, I) columns * s.

    silu(gate x) * (up' x) = z / s, and down' (z / s) = down z: the expert is unchanged in exact
    arithmetic (tests: ~1e-7 relative in fp32). s: (..., I), positive.
    """
    s = s.to(up.dtype)
    return up / s.unsqueeze(-1), down * s.unsqueeze(-2)


# ---- clipping -----------------------------------------------------------------------------------
def _group_scale(lim: torch.Tensor) -> torch.Tensor:
    """bf16 scale for a group range lim (float32): lim / 7.5, as compressed-tensors' calculate_qparams
    computes it for weights whose max |w| is lim (all-zero groups get bf16 eps, like `group_scales`)."""
    finfo = torch.finfo(torch.bfloat16)
    scale = (lim / 7.5).clamp(finfo.min, finfo.max).to(torch.bfloat16)
    return torch.where(scale == 0, torch.tensor(finfo.eps, dtype=torch.bfloat16, device=lim.device), scale)


def _fake_quant(Wg: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantized INT4 of Wg (..., G, gs) with scale (..., G, 1), float32, as `QuantizedWeight.dequantize`."""
    return (torch.round(torch.clamp(Wg / scale, -8, 7)).to(scale.dtype) * scale).float()


def quantize_clipped(W: torch.Tensor, group_size: int, ratio: torch.Tensor | None = None) -> QuantizedWeight:
    """Symmetric INT4 of W (..., out, in) with each group's range shrunk to ratio x max|w|.

    ratio (..., out, G) in (0, 1]; None (or all ones) is bit-identical to `quantize_rtn`. The
    scale is exactly what compressed-tensors computes for the clipped weights (clipped max / 7.5,
    rounded to bf16), and weights beyond the range saturate at -8 / 7.
    """
    if ratio is None:
        return quantize_rtn(W, group_size)
    Wg = W.float().unflatten(-1, (-1, group_size))  # (..., out, G, gs)
    scale = _group_scale(Wg.abs().amax(-1) * ratio)  # (..., out, G)
    q = torch.round(torch.clamp(Wg / scale.unsqueeze(-1), -8, 7)).to(torch.int8)
    return QuantizedWeight(q=q.flatten(-2), scale=scale)


def clip_ratios(grid: int, max_shrink: float = MAX_SHRINK) -> list[float]:
    """1, 1 - 1/grid, ... down to 1 - max_shrink (exclusive), llm-awq's auto_clip grid (grid=20: 1 .. 0.55)."""
    return [1 - i / grid for i in range(max(1, int(max_shrink * grid)))]


def _diag_blocks(H: torch.Tensor, group_size: int) -> torch.Tensor:
    """H (..., in, in) -> its group-diagonal blocks (..., G, group_size, group_size)."""
    G = H.shape[-1] // group_size
    Hv = H.unflatten(-1, (G, group_size)).unflatten(-3, (G, group_size))  # (..., G, gs, G, gs)
    return torch.diagonal(Hv, dim1=-4, dim2=-2).movedim(-1, -3)  # (..., G, gs, gs)


def _group_errors(d: torch.Tensor, Hb: torch.Tensor) -> torch.Tensor:
    """d (..., out, G, gs) weight errors, Hb (..., G, gs, gs) -> d_g Hb_g d_g^T per (row, group): (..., out, G)."""
    dt = d.movedim(-3, -2)  # (..., G, out, gs): one matmul per group
    return ((dt @ Hb) * dt).sum(-1).movedim(-1, -2)


def auto_clip(W: torch.Tensor, H: torch.Tensor, group_size: int, grid: int = 20,
              max_shrink: float = MAX_SHRINK) -> torch.Tensor:
    """Best clip ratio per (row, group): W (..., out, in), H (..., in, in) = E[x x^T] -> (..., out, G).

    Each group is scored on its own output contribution, (w_g - q_g) H_gg (w_g - q_g)^T (llm-awq's
    auto_clip ignores cross-group terms the same way), so every (row, group) picks independently.
    Why clip at all: a group's scale is set by its largest |w|; one outlier coarsens the grid for
    the other group_size - 1 weights. Saturating the outlier costs its own error, weighted by how
    active its input is; the search finds the balance per group. Ties (e.g. H = 0: no tokens) keep
    the earliest candidate, ratio 1: plain RTN.
    """
    Wg = W.float().unflatten(-1, (-1, group_size))  # (..., out, G, gs)
    Hb = _diag_blocks(H.float(), group_size)  # (..., G, gs, gs), broadcast over W's batch dims
    amax = Wg.abs().amax(-1, keepdim=True)  # (..., out, G, 1)
    best_err = best = None
    for r in clip_ratios(grid, max_shrink):
        err = _group_errors(_fake_quant(Wg, _group_scale(amax * r)) - Wg, Hb)  # (..., out, G)
        if best is None:
            best_err, best = err, torch.ones_like(err)
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, torch.full_like(best, r), best)
    return best


# ---- the scale search ---------------------------------------------------------------------------
def output_error(delta: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """Mean squared output error per token of a weight error delta (..., out, in): <delta H, delta>.

    H (..., in, in) = E[x x^T] over the layer's tokens, so this is 1/n sum_t ||delta x_t||^2
    without touching the tokens. Returns (...).
    """
    return ((delta @ H) * delta).sum((-1, -2))


def awq_smooth_scales(
    down: torch.Tensor,
    z_mean: torch.Tensor,
    H: torch.Tensor,
    group_size: int,
    grid: int = 20,
    duo_scaling: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grid-search the up->down smoothing scales of C experts at once.

    down (C, D, I) float weights; z_mean (C, I) = mean|z| and H (C, I, I) = E[z z^T] on each
    expert's tokens. Candidate s = `candidate_scales` for each (alpha, duo) of `scale_grid`; the
    output error of Q(down diag(s)) diag(s)^-1 (plain RTN ranges, as AWQ's search) is scored per
    expert and the best candidate kept (the first on ties). Returns (s (C, I), alpha (C,) of the
    winner, error (C,) at the winner). The first candidate is always alpha = 0 without duo, s = 1:
    the search never scores worse than no smoothing.
    """
    w_mean = weight_means(down, group_size) if duo_scaling else None  # (C, I)
    best_err = best_s = best_alpha = None
    for alpha, duo in scale_grid(grid, duo_scaling):
        s = candidate_scales(z_mean, w_mean if duo else z_mean, alpha, duo)  # (C, I)
        A = quantize_rtn(down * s.unsqueeze(-2), group_size).dequantize() / s.unsqueeze(-2)  # (C, D, I)
        err = output_error(A - down, H)  # (C,)
        if best_err is None:
            best_err, best_s, best_alpha = err, s, torch.full_like(err, alpha)
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better.unsqueeze(-1), s, best_s)
        best_alpha = torch.where(better, torch.full_like(err, alpha), best_alpha)
    return best_s, best_alpha, best_err


# ---- one MoE layer ------------------------------------------------------------------------------
def _expert(qgu: QuantizedWeight, qd: QuantizedWeight, i: int) -> dict[str, QuantizedWeight]:
    return {"gate_proj": QuantizedWeight(qgu.q[i, 0], qgu.scale[i, 0]),
            "up_proj": QuantizedWeight(qgu.q[i, 1], qgu.scale[i, 1]),
            "down_proj": QuantizedWeight(qd.q[i], qd.scale[i])}


def _quantize_smoothed(X, Wg, Wu, Wd, s, group_size, quantizer, g, a, layer, chunk, shrunk=None):
    """Fold s into up/down, quantize gate, up' and down' (down' against what the quantized gate/up'
    really produce); returns (gate/up QuantizedWeight (C, 2, ...), down's, final mean squared
    expert-output error per token (C,) against the float experts). `shrunk`, when a list, receives
    gate/up's gptq.shrinkage intensity per expert. Every statistic is accumulated a block of rows
    at a time (`_second_moment`): X's rows are the only per-token arrays held."""
    lw = quantizer == "gptq" and g.shrinkage != "none"  # gptq.shrinkage's statistic of each Linear's rows
    up_s, down_s = fold_up_down(Wu, Wd, s)
    # gate and the smoothed up: one input statistic per expert, shared by both
    C, I, D = Wg.shape
    Hx = Wg.new_empty((C, D, D))  # (C, D, D) = E[x x^T], filled per expert: a list then a stack would hold it twice
    for i, xe in enumerate(X):
        Hx[i] = _second_moment(xe)
    Wgu = torch.stack([Wg, up_s], 1)  # (C, 2, I, D)
    if quantizer == "gptq":
        # gate and up' stacked by rows on one H per expert (as quantkit.quant.gptq.gptq_shared_h): GPTQ
        # treats rows independently given Hinv, so this is quantizing each with its own copy of H,
        # with one factorization and one (C, D, D) H instead of two
        H = Hx.mul_(2)
        del Hx
        q = run_gptq(Wgu.reshape(C, 2 * I, D), H, group_size, g, layer, chunk, consume=True,
                     fit_tokens=[len(xe) for xe in X], fourth=[fourth_moment(xe) for xe in X] if lw else None,
                     shrunk=shrunk)  # (C, 2I, D)
        del H
        qgu = QuantizedWeight(q.q.reshape(C, 2, I, D), q.scale.reshape(C, 2, I, -1), q.loss)  # (C, 2, I, D)
    else:
        qgu = quantize_clipped(Wgu, group_size, auto_clip(Wgu, Hx[:, None], group_size, a.grid))
        del Hx
    gu_hat = qgu.dequantize()  # (C, 2, I, D)
    # the smoothed down, against what the quantized gate / up' really produce: z_hat' ~ z / s
    Hz_s, m4 = [], []
    for i, xe in enumerate(X):
        H, m = _second_moment(xe, lambda xb, i=i: F.silu(xb @ gu_hat[i, 0].T) * (xb @ gu_hat[i, 1].T)), 0.0
        if lw:
            _, _, m = _z_statistics(xe, gu_hat[i, 0], gu_hat[i, 1], fourth=True)
        Hz_s.append(H)
        m4.append(m)
    if quantizer == "gptq":
        qd = run_gptq(down_s, 2 * torch.stack(Hz_s), group_size, g, layer, chunk, fit_tokens=[len(xe) for xe in X],
                      fourth=m4 if lw else None)
    else:
        qd = quantize_clipped(down_s, group_size, auto_clip(down_s, torch.stack(Hz_s), group_size, a.grid))
    del Hz_s
    d_hat = qd.dequantize()  # (C, D, I)
    err = torch.stack([_output_error_rows(xe, gu_hat[i], d_hat[i], Wg[i], Wu[i], Wd[i]) for i, xe in enumerate(X)])  # (C,)
    return qgu, qd, err


def _output_error_rows(X, gu_hat, d_hat, Wg, Wu, Wd) -> torch.Tensor:
    """Mean squared expert output error per row of X against the float expert, a block at a time."""
    total = torch.zeros((), device=X.device)
    for b in range(0, X.shape[0], BLOCK):
        xb = X[b:b + BLOCK]
        zh = F.silu(xb @ gu_hat[0].T) * (xb @ gu_hat[1].T)
        y = (F.silu(xb @ Wg.T) * (xb @ Wu.T)) @ Wd.T
        total += (zh @ d_hat.T - y).square().sum()
    return total / max(X.shape[0], 1)


def quantize_experts_awq(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    tokens: dict[int, torch.Tensor],
    experts: list[int],
    options,
    group_size: int,
    layer: int,
    *,
    quantizer: Literal["gptq", "rtn"] = "gptq",
    alternatives: dict | None = None,
    g_low=None,
):
    """AWQ for the given routed experts of one layer; the contract of `quantkit.quant.methods.Method.quantize`.

    x: (N, D) the MoE input of every calibration token (after post_attention_layernorm);
    tokens[e]: indices of the tokens routed to expert e; w: the layer's weights, read only (the
    router, norm and shared expert are never touched, so routing is unchanged); options: the awq and
    gptq sections as `.awq` and `.gptq` (quantkit.quant.methods.awq.AWQOptions; a recipe has both too).
    Returns ({expert: {proj: QuantizedWeight}}, [ExpertRecord] with method "awq"). The stored up
    and down are the *smoothed* up / s and down * s; dequantized, the expert computes the source's
    function up to INT4 error.

    quantizer: how the smoothed weights become INT4.
      "gptq" (what `method: awq` runs): AWQ smoothing, then GPTQ on the smoothed weights - gate/up
             with the Hessian of x, down' with that of what the quantized gate/up' produce.
             Measured best on both tiny models (docs/awq.md).
      "rtn":  AWQ as published: gate/up auto-clipped, down' auto-clipped, round to nearest.
             No Hessian inverse and no per-weight error feedback; docs/awq.md says why it is not
             the default.

    Per batch of 16 experts:
      1. z = silu(gate x) * (up x) on the expert's fit tokens (float) -> mean|z|, E[z z^T];
      2. `awq_smooth_scales` for up->down (scored with RTN, as AWQ's search);
      3. for the searched s and for s = 1: fold (up / s, down * s), quantize gate and up' (no
         smoothing on their input: it is the shared norm output), then down' against
         z_hat' = silu(gate_q x) * (up'_q x) on the same tokens, with `quantizer`;
      4. with `alternatives` (a dict, filled per expert), the s = 1 result too ("awq-s1"): the
         caller's held-out guard keeps whichever of AWQ, AWQ with s = 1 and RTN has the lowest
         error on tokens neither was fitted on, since the search's RTN proxy can disagree with GPTQ;
         with g_low (a gptq section at gptq.low_dampening: quantkit.quant.methods.gptq.low_settings)
         and the quantizer GPTQ, also the searched s quantized with it (LOW), which the guard admits
         by its error on the probe (quantkit.quant.experts, "Probe").

    Which tokens are fitted and what starved experts get is quantkit.quant.experts' policy, shared with
    GPTQ. ExpertRecord.loss is the final mean squared expert-output error per fit token vs the
    float expert (not GPTQ's units).
    """
    inputs, fallback = {}, {}
    for e in experts:  # quantkit.quant.experts' one policy: held-out tokens never fitted, starved experts' fallback
        inputs[e], fallback[e] = calibration_inputs(x, tokens[e], options.gptq)
    return awq_experts(inputs, fallback, {e: len(tokens[e]) for e in experts}, w, experts, options, group_size, layer,
                       quantizer=quantizer, alternatives=alternatives, g_low=g_low)


def awq_experts(
    inputs: dict,
    fallback: dict,
    routed: dict[int, int],
    w: dict[str, torch.Tensor],
    experts: list[int],
    options,
    group_size: int,
    layer: int,
    *,
    quantizer: Literal["gptq", "rtn"] = "gptq",
    alternatives: dict | None = None,
    g_low=None,
):
    """`quantize_experts_awq` from each expert's fit rows, however they were read: inputs[e] (n_e, D)
    as `quantkit.quant.experts.calibration_inputs` gives them (None: gptq.fallback rtn), fallback[e]
    its fallback, routed[e] its routed calibration tokens (the record's count). convert's streamed
    form (quantkit.quant.methods.awq) reads these rows from the layer's micro-batches, never the
    layer's inputs whole; the whole-layer form indexes x. The same rows give the same bytes."""
    g, a = options.gptq, options.awq
    records, quantized = [], {}
    for e in experts:
        if inputs[e] is None:
            quantized[e] = rtn_expert(w, e, group_size)
            records.append(ExpertRecord(layer, e, routed[e], "rtn", fallback="rtn"))
    run = [e for e in experts if inputs[e] is not None]

    batch = 16  # experts per batched call (memory: batch x (D^2 + 3 D I) floats)
    for start in range(0, len(run), batch):
        chunk = run[start: start + batch]
        X = [inputs[e].float() for e in chunk]  # C x (n_e, D)
        Wg, Wu, Wd = (torch.stack([expert_weights(w, e)[i] for e in chunk]).float() for i in range(3))  # (C, I, D) x2, (C, D, I)

        # 1. down's input z on each expert's tokens, float: mean|z| and E[z z^T], a block of rows at a time
        stats = [_z_statistics(xe, Wg[i], Wu[i]) for i, xe in enumerate(X)]
        z_mean = torch.stack([m for m, _, _ in stats])  # (C, I)
        Hz = torch.stack([h for _, h, _ in stats])  # (C, I, I)
        del stats

        # 2. smoothing scales (searched with RTN, as AWQ), then 3-4 with the quantizer that writes the
        #    weights; the same for s = 1 as an alternative the caller's held-out guard may keep
        #    (quantkit.quant.experts.guard_against_rtn): the search's RTN proxy can disagree with GPTQ
        s, _, _ = awq_smooth_scales(Wd, z_mean, Hz, group_size, a.grid, a.duo_scaling)  # (C, I)
        del Hz
        shrunk: list = []
        qgu, qd, err = _quantize_smoothed(X, Wg, Wu, Wd, s, group_size, quantizer, g, a, layer, chunk, shrunk)
        if alternatives is not None:
            qgu1, qd1, _ = _quantize_smoothed(X, Wg, Wu, Wd, torch.ones_like(s), group_size, quantizer, g, a, layer, chunk)
        low = g_low if alternatives is not None and quantizer == "gptq" else None
        if low is not None:
            qgul, qdl, _ = _quantize_smoothed(X, Wg, Wu, Wd, s, group_size, quantizer, low, a, layer, chunk)
        for i, e in enumerate(chunk):
            quantized[e] = _expert(qgu, qd, i)
            if alternatives is not None:
                alternatives[e] = {"awq-s1": _expert(qgu1, qd1, i)}
                if low is not None:
                    alternatives[e][LOW] = _expert(qgul, qdl, i)
            records.append(ExpertRecord(layer, e, routed[e], "awq", fallback[e], err[i].item(),
                                        prior=prior_of(g, len(X[i]), X[i].shape[-1]),
                                        shrink=round(shrunk[i], 6) if shrunk else None))
    records.sort(key=lambda r: r.expert)
    return quantized, records
