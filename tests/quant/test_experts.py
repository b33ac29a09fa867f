"""quantkit.quant.experts: the one policy every expert quantizer follows (held-out tokens, starved
experts, the guard against RTN)."""

from __future__ import annotations

import torch

from quantkit.quant.experts import (
    HOLDOUT,
    LOW,
    PROJS,
    ExpertRecord,
    calibration_inputs,
    expert_dampening,
    guard_against_rtn,
    heldout_inputs,
    split_heldout,
)
from quantkit.quant.gptq import quantize_rtn
from quantkit.quant.methods import quantize_experts
from quantkit.recipe import load_recipe

D, I, E = 64, 32, 3


def _layer(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = {f"mlp.experts.{e}.{p}.weight": torch.randn(*((I, D) if p != "down_proj" else (D, I)), generator=g) * 0.1
         for e in range(E) for p in PROJS}
    x = torch.randn(400, D, generator=g)
    return x, w


def test_split_heldout_partitions_and_holds_out_every_nth():
    tok = torch.arange(100)
    fit, held = split_heldout(tok)
    assert sorted(torch.cat([fit, held]).tolist()) == tok.tolist()
    assert held.tolist() == list(range(HOLDOUT - 1, 100, HOLDOUT))


def test_starved_expert_is_never_fitted_on_nothing():
    x, _ = _layer()
    g = load_recipe("tiny-glm-5.2").gptq
    g.min_tokens = 0  # the schema allows it; an expert with no tokens must still not get H = 0
    inp, fb = calibration_inputs(x, torch.empty(0, dtype=torch.long), g)
    assert fb == "all_tokens" and len(inp) == len(split_heldout(torch.arange(len(x)))[0])
    g.fallback = "rtn"
    assert calibration_inputs(x, torch.empty(0, dtype=torch.long), g) == (None, "rtn")
    inp, fb = calibration_inputs(x, torch.arange(7), g)  # 7 tokens, none held out: fitted on all 7
    assert fb is None and len(inp) == 7


def test_gptq_with_min_tokens_zero_never_zeroes_an_expert():
    x, w = _layer()
    rec = load_recipe("tiny-glm-5.2")
    rec.gptq.min_tokens = 0
    tokens = {0: torch.arange(200), 1: torch.empty(0, dtype=torch.long), 2: torch.tensor([7])}
    q, records = quantize_experts(x, w, tokens, [0, 1, 2], rec, 32, "gptq", 1)
    for e in (1, 2):
        assert all(q[e][p].dequantize().abs().sum() > 0 for p in PROJS)
    assert records[1].fallback == "all_tokens" and records[2].fallback is None  # one token is something to fit


def test_guard_picks_the_best_alternative():
    x, w = _layer()
    xh = heldout_inputs(x, torch.arange(200))
    bad = {p: quantize_rtn(-w[f"mlp.experts.0.{p}.weight"], 32) for p in PROJS}
    fine = {p: quantize_rtn(w[f"mlp.experts.0.{p}.weight"], 16) for p in PROJS}  # finer groups beat RTN g32
    r = ExpertRecord(1, 0, 200, "awq")
    kept = guard_against_rtn(xh, w, 0, bad, 32, r, {"awq-s1": fine})
    assert kept is fine and r.guard == "awq-s1" and r.method == "awq"


def test_guard_keeps_whichever_is_better_on_heldout_tokens():
    x, w = _layer()
    xh = heldout_inputs(x, torch.arange(200))
    good = {p: quantize_rtn(w[f"mlp.experts.0.{p}.weight"], 32) for p in PROJS}
    r = ExpertRecord(1, 0, 200, "gptq")
    assert guard_against_rtn(xh, w, 0, good, 32, r) is good and r.guard is None and r.err == r.err_rtn
    bad = {p: quantize_rtn(-w[f"mlp.experts.0.{p}.weight"], 32) for p in PROJS}  # sign-flipped: far off
    r = ExpertRecord(1, 0, 200, "gptq")
    kept = guard_against_rtn(xh, w, 0, bad, 32, r)
    assert r.guard == "rtn" and r.method == "rtn" and r.err > r.err_rtn and r.heldout == len(xh) == 25
    assert all(torch.equal(kept[p].q, good[p].q) for p in PROJS)


def test_low_dampening_competes_only_where_the_probe_admits_it():
    """guard_against_rtn's `low`: held-out tokens live in the first half of the input dims, probe
    tokens in the second. A candidate exact on the first half and wrecked on the second beats q on
    held-out tokens but is worse than RTN on the probe: refused. Exact everywhere: admitted and
    stored. No probe tokens: never a candidate."""
    x, w = _layer()
    half = torch.zeros(D)
    half[: D // 2] = 1
    xh, xp = x[:40] * half, x[40:80] * (1 - half)
    src = {p: w[f"mlp.experts.0.{p}.weight"] for p in PROJS}
    q = {p: quantize_rtn(t, 16) for p, t in src.items()}  # finer groups: better than RTN g32 everywhere
    exact = {p: quantize_rtn(t, 1) for p, t in src.items()}  # one scale per weight: near exact
    wrecked = dict(exact, gate_proj=quantize_rtn(src["gate_proj"] * torch.cat([torch.ones(D // 2), -torch.ones(D // 2)]), 1))
    r = ExpertRecord(1, 0, 200, "gptq")
    assert guard_against_rtn(xh, w, 0, q, 32, r, low=wrecked, x_probe=xp) is q
    assert r.guard is None and r.probe == 40 and r.err_probe_low > r.err_probe_rtn and r.err_low < r.err
    r = ExpertRecord(1, 0, 200, "gptq")
    assert guard_against_rtn(xh, w, 0, q, 32, r, low=exact, x_probe=xp) is exact
    assert r.guard == LOW and r.method == "gptq" and r.err_probe_low <= r.err_probe_rtn
    r = ExpertRecord(1, 0, 200, "gptq")
    assert guard_against_rtn(xh, w, 0, q, 32, r, low=exact, x_probe=xp[:0]) is q and r.probe == 0


def test_width_prior_grows_as_calibration_thins_and_is_off_by_default():
    """gptq.width_prior: each expert's dampening + c * width / fit tokens; off, the recipe's float
    (so every earlier convert's bytes), and the record keeps each expert's prior."""
    g = load_recipe("tiny-glm-5.2").gptq
    assert expert_dampening(g, [10, 1000], D) == g.dampening
    g.width_prior = 0.5
    d = expert_dampening(g, [16, 64, 0], D)
    assert torch.allclose(d, torch.tensor([g.dampening + 0.5 * D / 16, g.dampening + 0.5 * D / 64,
                                           g.dampening + 0.5 * D]).double())
    x, w = _layer()
    rec = load_recipe("tiny-glm-5.2")
    tokens = {0: torch.arange(400), 1: torch.arange(40), 2: torch.arange(40)}
    q0, _ = quantize_experts(x, w, tokens, [0, 1], rec, 32, "gptq", 1)
    rec.gptq.width_prior = 1.0
    q1, records = quantize_experts(x, w, tokens, [0, 1], rec, 32, "gptq", 1)
    assert records[0].prior == round(D / 350, 6) and records[1].prior == round(D / 35, 6)
    # the thin expert moves towards RTN, the well-fed one barely moves
    rtn = quantize_rtn(w["mlp.experts.1.gate_proj.weight"], 32).dequantize()
    dist = [q[1]["gate_proj"].dequantize().sub(rtn).norm() for q in (q0, q1)]
    assert dist[1] < dist[0]
