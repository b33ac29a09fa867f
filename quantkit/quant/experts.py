"""What every routed-expert quantizer shares: the record it leaves, which tokens it may fit on,
what a starved expert gets, and the guard that keeps an expert's INT4 weights never worse than
plain round-to-nearest.

One policy, in one place, for GPTQ (quantkit.quant.methods.gptq) and AWQ (quantkit.quant.awq):

* Held-out tokens. Every HOLDOUT-th calibration token of a layer (by position in the layer's
  token list) is kept out of every Hessian and every AWQ statistic. Those tokens exist only to
  judge the result: an error measured on the tokens a Hessian was fitted to is biased towards
  GPTQ (it fits them), and with few routed tokens per expert that bias is what made calibrated
  experts lose to RTN on models we had not tuned on.
* Starved experts. An expert with fewer than max(gptq.min_tokens, 1) fit tokens takes
  gptq.fallback: "all_tokens" fits on every fit token of the layer, "rtn" rounds to nearest.
  An expert is never fitted on zero tokens (H = 0 would quantize it to all zeros), whatever
  min_tokens says.
* Thin calibration. An expert fitted on n tokens of an input width d has a Hessian of rank at
  most n, estimated from n / d tokens per column: GPTQ then moves error into the directions the
  calibration never excited, which unseen inputs (other text, tool calls, random ids) do excite,
  and the held-out guard cannot see it (its tokens come from the same text). gptq.width_prior = c
  adds an isotropic prior, c * d / n times mean(diag H) on the diagonal (`expert_dampening`), on
  top of the recipe's dampening: negligible with many tokens per column, pulling towards RTN's
  objective (isotropic inputs) as they thin. The record keeps each expert's prior.
* Guard. After quantization, each expert's output error on its held-out routed tokens is
  compared with RTN's; the lower one is stored, and the record says which and both errors. So no
  expert is stored worse than RTN on data it was not fitted to (up to the noise of its held-out
  tokens), by construction rather than by tuning.
* Probe. Held-out tokens come from the calibration's own text, so they share its span: they
  cannot tell a low dampening that fits that span closely (what llm-compressor's 0.01 buys on
  trained models) from one that has moved error into directions other inputs excite (what it
  costs on random-weight ones: docs/benchmarks.md, "Tried and dropped"). With
  gptq.low_dampening set, convert also runs probe windows of token ids the calibration never
  contained through the same quantized layers (never fitted on, never judged in-distribution:
  quantkit.inputs.tokens.probe_ids), and each expert is quantized at both dampenings. The low one
  is a candidate for the guard only if its output error on the expert's probe tokens is no higher
  than the recipe dampening's; the guard then picks among the admitted ones and RTN as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from quantkit.errors import OutputError
from quantkit.model.moe import swiglu
from quantkit.quant.gptq import HessianError, QuantizedWeight, gptq, quantize_rtn  # QuantizedWeight: every method's result

__all__ = ["PROJS", "HOLDOUT", "ExpertRecord", "QuantizedWeight", "expert_weights", "is_heldout", "is_heldout_window", "split_heldout", "starved",
           "calibration_inputs",
           "expert_dampening", "prior_of", "heldout_inputs", "probe_inputs", "rtn_expert", "run_gptq", "shrinkage_dampening",
           "guard_against_rtn", "guard_experts", "LOW"]

PROJS = ("gate_proj", "up_proj", "down_proj")
HOLDOUT = 8  # every 8th calibration token of a layer is held out of fitting, to judge the result
LOW = "low-dampening"  # the record's guard value when the stored weights are gptq.low_dampening's

# Why an expert did not get its own calibrated solution (ExpertRecord.fallback), and the report's words
# for each ({method}: the display name of what was stored instead).
Fallback = Literal["rtn", "all_tokens", "mtp-later-layer", "mtp-no-path"]
MTP_FALLBACKS = ("mtp-later-layer", "mtp-no-path")  # an MTP layer the calibration does not reach
FALLBACK_WORDS: dict[str, str] = {
    "rtn": "starved: rounded to nearest",
    "all_tokens": "starved: fitted on every calibration token of the layer",
    "mtp-later-layer": "mtp: only the first MTP layer is calibrated ({method})",
    "mtp-no-path": "mtp: no calibration path ({method})",
}


def fallback_words(fallback: str, method: str) -> str:
    """The words for a record's fallback; a report written before fallbacks were named keeps its own text."""
    from quantkit.quant.methods import METHODS

    shown = METHODS[method].display if method in METHODS else method
    return FALLBACK_WORDS.get(fallback, fallback).format(method=shown)


@dataclass
class ExpertRecord:
    layer: int
    expert: int
    tokens: int  # routed calibration tokens (fit + held out)
    method: str  # what is stored: gptq | awq | rtn | reused
    fallback: Fallback | None = None  # why this expert did not get its own Hessian (FALLBACK_WORDS)
    loss: float | None = None
    guard: str | None = None  # what the held-out guard stored instead: "rtn", or an alternative's name
    heldout: int = 0  # tokens the guard judged on
    err: float | None = None  # mean squared expert-output error per held-out token, calibrated weights
    err_rtn: float | None = None  # the same for RTN
    prior: float | None = None  # gptq.width_prior's added dampening for gate/up (c * width / fit tokens)
    shrink: float | None = None  # gptq.shrinkage: gate/up's Ledoit-Wolf intensity delta (quantkit.quant.shrinkage)
    rank: int | None = None  # multi-rank convert: the rank that quantized it (quantkit.runtime.distributed)
    probe: int = 0  # gptq.low_dampening: probe tokens the low dampening was judged on
    err_probe: float | None = None  # the same error as `err` on them, at gptq.dampening
    err_probe_low: float | None = None  # ... at gptq.low_dampening (admitted to the guard when <= err_probe_rtn)
    err_probe_rtn: float | None = None  # ... RTN's
    err_low: float | None = None  # the held-out error (as `err`) at gptq.low_dampening, admitted or not


def expert_weights(w: dict[str, torch.Tensor], e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = f"mlp.experts.{e}."
    return w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"]


def is_heldout(pos: torch.Tensor) -> torch.Tensor:
    """The policy itself, for positions (n,) in an expert's routed-token list (or the layer's token
    list): True where held out. The streamed path (quantkit.quant.methods.gptq), which sees an expert's
    tokens one micro-batch at a time, applies it to running positions; `split_heldout` is the same
    rule for a whole list at once."""
    return pos % HOLDOUT == HOLDOUT - 1


def is_heldout_window(pos: torch.Tensor, seq_len: int) -> torch.Tensor:
    """gptq.holdout: window. For positions (n,) in the layer's token list (window i holds positions
    i*seq_len ... (i+1)*seq_len - 1): True for every token of every HOLDOUT-th calibration window, so
    the guard judges on whole windows no Hessian saw, not on the fitted tokens' neighbours."""
    return (pos // seq_len) % HOLDOUT == HOLDOUT - 1


def split_rows(idx_b: torch.Tensor, e: int, seen: int, start: int, use_all: bool,
               window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(fit rows, held-out rows) of this micro-batch for expert e, by this module's one policy:
    every HOLDOUT-th entry of the expert's routed-token list (or, with use_all, of the layer's
    token list) is held out; with window = seq_len > 0 (gptq.holdout: window), every token of every
    HOLDOUT-th calibration window instead. `seen`: the expert's routed tokens in earlier
    micro-batches; `start`: the micro-batch's first token in the layer."""
    if use_all:
        rows = torch.arange(len(idx_b), device=idx_b.device)
        pos = start + rows
    else:
        rows = (idx_b == e).nonzero(as_tuple=True)[0]
        pos = seen + torch.arange(len(rows), device=rows.device)
    held = is_heldout_window(start + rows, window) if window else is_heldout(pos)
    return rows[~held], rows[held]


def starved(n_routed: int, g) -> bool:
    """Whether an expert routed n_routed calibration tokens has too few fit tokens (those not held
    out) for its own Hessian: fewer than max(gptq.min_tokens, 1)."""
    return n_routed - n_routed // HOLDOUT < max(g.min_tokens, 1)


def split_heldout(tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token indices (n,) -> (fit, held out): every HOLDOUT-th entry (positions HOLDOUT-1, 2*HOLDOUT-1,
    ...) is held out (`is_heldout`). By position, with slices and views only, so the sizes follow from n alone
    (no data-dependent shapes: the same code runs under torch's FakeTensorMode, tests/runtime/test_device.py)."""
    n = len(tok)
    m = n - n % HOLDOUT
    fit = torch.cat([tok[:m].view(-1, HOLDOUT)[:, : HOLDOUT - 1].flatten(), tok[m:]])  # (n - n // HOLDOUT,)
    return fit, tok[HOLDOUT - 1 :: HOLDOUT]


def calibration_inputs(x: torch.Tensor, routed: torch.Tensor, g) -> tuple[torch.Tensor | None, Fallback | None]:
    """The inputs an expert is fitted on and the fallback taken, for x (N, D) the layer's MoE
    inputs and `routed` the indices of the tokens the router sends it.

    Returns (x[fit tokens], None) normally; (x[every fit token of the layer], "all_tokens") or
    (None, "rtn") for a starved expert, as gptq.fallback says.
    """
    if not starved(len(routed), g):
        return x[split_heldout(routed)[0]], None
    if g.fallback == "rtn":
        return None, "rtn"
    return x[split_heldout(torch.arange(len(x), device=x.device))[0]], "all_tokens"


def heldout_inputs(x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    """The tokens the guard judges an expert on: its held-out routed tokens, or, when it has none
    (a starved expert), every held-out token of the layer."""
    _, held = split_heldout(routed)
    if len(held) == 0:
        _, held = split_heldout(torch.arange(len(x), device=x.device))
    return x[held]


def probe_inputs(x_probe: torch.Tensor | None, routed: torch.Tensor | None) -> torch.Tensor | None:
    """The probe tokens an expert's low dampening is judged on: those of x_probe (P, D), the layer's
    probe inputs, that the router sends it, or all of them when it is sent none (its error on
    inputs outside the calibration's span is what is asked, routed or not). None without a probe."""
    if x_probe is None or len(x_probe) == 0:
        return None
    return x_probe[routed] if routed is not None and len(routed) else x_probe


def rtn_expert(w: dict[str, torch.Tensor], e: int, group_size: int) -> dict[str, QuantizedWeight]:
    return {p: quantize_rtn(t, group_size) for p, t in zip(PROJS, expert_weights(w, e))}


def expert_dampening(g, fit_tokens: list[int], width: int) -> float | torch.Tensor:
    """The dampening GPTQ adds to each expert's diag(H), as a fraction of its mean: the recipe's
    gptq.dampening, plus with gptq.width_prior = c > 0 the isotropic prior c * width / n for an
    expert fitted on n tokens of a Linear `width` inputs wide, one per expert (C,). With the prior
    off, the float itself (the bytes of every earlier convert)."""
    c = getattr(g, "width_prior", 0.0)
    if not c:
        return g.dampening
    return torch.tensor([g.dampening + c * width / max(n, 1) for n in fit_tokens], dtype=torch.float64)


def prior_of(g, fit_tokens: int, width: int) -> float | None:
    """An expert's gptq.width_prior term for its record (gate/up's width), None when off."""
    c = getattr(g, "width_prior", 0.0)
    return round(c * width / max(fit_tokens, 1), 6) if c else None


def shrinkage_dampening(g, H: torch.Tensor, fit_tokens: list[int] | None, fourth: list[float] | None,
                        shrunk: list | None = None) -> torch.Tensor | None:
    """gptq.shrinkage's extra dampening per expert (C,) from H (C, [2,] p, p) and the fit rows'
    statistics, or None when off (the bytes of every earlier convert). The whole-layer forms pass
    gate/up's H expanded over its two projections; one expert's copies are the same matrix."""
    if getattr(g, "shrinkage", "none") == "none":
        return None
    if fit_tokens is None or fourth is None:
        raise ValueError("gptq.shrinkage: ledoit-wolf needs each expert's fit-token count and fourth moment")
    from quantkit.quant.shrinkage import ledoit_wolf

    delta = ledoit_wolf(H if H.dim() == 3 else H[:, 0], [float(n) for n in fit_tokens], fourth, scale=0.5)
    if shrunk is not None:
        shrunk[:] = delta.tolist()
    return delta / (1 - delta)


def run_gptq(W: torch.Tensor, H: torch.Tensor, group_size: int, g, layer: int, experts,
             consume: bool = False, fit_tokens: list[int] | None = None, low=None,
             fourth: list[float] | None = None, shrunk: list | None = None):
    """`quantkit.quant.gptq.gptq` with the recipe's settings; a broken Hessian becomes a one-line error.
    consume=True lets GPTQ factor H in place and free it (the caller must hold no other reference).
    fit_tokens: each expert's (W's first batch dim) fit-token count, for gptq.width_prior.
    fourth: each expert's sum_t ||x_t||^4 over the same fit rows (quantkit.quant.shrinkage), for
    gptq.shrinkage: ledoit-wolf, which adds each expert's Ledoit-Wolf dampening computed from H
    before GPTQ factors it; `shrunk`, when a list, receives each expert's intensity delta.

    low: a gptq section at another dampening (quantkit.quant.methods.gptq.low_settings): then both are quantized in one
    batched call (W and H stacked twice along the experts, one dampening per copy; on a GPU the
    column loop's launches are the same as for one) and (at g's dampening, at low's) is returned.
    An expert's bytes do not depend on its batch (tests/runtime/test_distributed.py), so the first
    is what the call without `low` gives."""
    damp = g.dampening if fit_tokens is None else expert_dampening(g, fit_tokens, W.shape[-1])
    C = W.shape[0]
    extra = shrinkage_dampening(g, H, fit_tokens, fourth, shrunk)
    if extra is not None:
        damp = torch.as_tensor(damp, dtype=torch.float64).expand(C) + extra
    if low is not None:
        damp_low = low.dampening if fit_tokens is None else expert_dampening(low, fit_tokens, W.shape[-1])
        if extra is not None:
            damp_low = torch.as_tensor(damp_low, dtype=torch.float64).expand(C) + extra
        damp = torch.cat([torch.as_tensor(d, dtype=torch.float64).expand(C) for d in (damp, damp_low)])  # (2C,)
        W = torch.cat([W, W]).float()  # [2C, ...]
        box = [torch.cat([H, H]).float()]  # [2C, ..., in, in]
        del H  # the caller's copy stays theirs; this stacked one is consumed
        consume = True
    else:
        box = [H]
        del H  # no reference left here, so that a consumed H is freed inside gptq
    if isinstance(damp, torch.Tensor):  # (C,) -> (C, 1, ...) against W's batch dims
        damp = damp.reshape(-1, *[1] * (W.dim() - 3))
    try:
        q = gptq(W, box.pop(), group_size, block_size=g.block_size, dampening=damp, actorder=g.actorder,
                 consume=consume, observer=getattr(g, "observer", "minmax"),
                 static_groups=getattr(g, "static_groups", True))
    except HessianError as e:
        raise OutputError(f"layer {layer}, experts {experts}: {e}; raise gptq.dampening in the recipe") from None
    if low is None:
        return q
    return tuple(QuantizedWeight(q.q[k * C:(k + 1) * C], q.scale[k * C:(k + 1) * C],
                                 None if q.loss is None else q.loss[k * C:(k + 1) * C]) for k in (0, 1))


def _output_error(x: torch.Tensor, ref: torch.Tensor, q: dict[str, QuantizedWeight]) -> float:
    out = swiglu(x, *(q[p].dequantize(torch.float32).to(x.device) for p in PROJS))
    return (out - ref).square().sum(-1).mean().item()


def guard_against_rtn(x_held: torch.Tensor, w: dict[str, torch.Tensor], e: int, q: dict[str, QuantizedWeight],
                      group_size: int, record: ExpertRecord,
                      alternatives: dict[str, dict[str, QuantizedWeight]] | None = None,
                      low: dict[str, QuantizedWeight] | None = None,
                      x_probe: torch.Tensor | None = None) -> dict[str, QuantizedWeight]:
    """Keep q, one of its `alternatives` (e.g. AWQ with s = 1), `low` (q at gptq.low_dampening) or RTN
    for expert e, whichever has the lowest output error on x_held (float32); fills the record's guard
    fields, returns what is stored. record.err is q's error, record.err_rtn RTN's; record.guard names
    the winner when it is not q. `low` competes only if its error on x_probe (the expert's probe
    tokens, `probe_inputs`) is no higher than RTN's there; without probe tokens it does not compete."""
    x = x_held.float()
    ref = swiglu(x, *(t.float() for t in expert_weights(w, e)))
    rtn = {p: quantize_rtn(t, group_size) for p, t in zip(PROJS, expert_weights(w, e))}
    record.heldout = len(x)
    record.err, record.err_rtn = _output_error(x, ref, q), _output_error(x, ref, rtn)
    candidates = dict(alternatives or {})
    if low is not None and x_probe is not None and len(x_probe):
        xp = x_probe.float()
        ref_p = swiglu(xp, *(t.float() for t in expert_weights(w, e)))
        record.probe = len(xp)
        record.err_probe, record.err_probe_low = _output_error(xp, ref_p, q), _output_error(xp, ref_p, low)
        record.err_probe_rtn = _output_error(xp, ref_p, rtn)
        record.err_low = _output_error(x, ref, low)
        if record.err_probe_low <= record.err_probe_rtn:
            candidates[LOW] = low
    best, best_err, name = q, record.err, None
    for alt, qa in candidates.items():
        err = _output_error(x, ref, qa)
        if err < best_err:
            best, best_err, name = qa, err, alt
    if record.err_rtn < best_err:
        record.guard, record.method = "rtn", "rtn"
        return rtn
    record.guard = name
    return best


def guard_experts(records: list[ExpertRecord], quantized: dict[int, dict[str, QuantizedWeight]], x: torch.Tensor,
                  tokens: dict[int, torch.Tensor], w: dict[str, torch.Tensor], group_size: int,
                  alternatives: dict | None = None,
                  probe: tuple[torch.Tensor, dict[int, torch.Tensor]] | None = None) -> None:
    """`guard_against_rtn` for every calibrated expert of one `quantize_experts` result, in place:
    x (N, D) the layer's MoE inputs, tokens[e] the expert's routed token indices, alternatives[e]
    its alternatives by name; the one named LOW (gptq.low_dampening's result) is judged on probe =
    (the layer's probe inputs (P, D), each expert's routed probe-token indices) first."""
    for r in records:
        if r.fallback != "rtn":  # a starved expert that took gptq.fallback: rtn is RTN already
            alts = dict((alternatives or {}).get(r.expert) or {})
            low = alts.pop(LOW, None)
            x_probe = probe_inputs(probe[0], probe[1].get(r.expert)) if probe is not None else None
            quantized[r.expert] = guard_against_rtn(heldout_inputs(x, tokens[r.expert]), w, r.expert,
                                                    quantized[r.expert], group_size, r, alts, low, x_probe)
