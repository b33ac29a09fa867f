"""GPTQ's method module (quantkit.quant.methods.gptq): the streamed form against the whole-layer form, the
same policy (held-out tokens, starved experts, the guard) and the same arithmetic, only the tokens
arrive one micro-batch at a time from the layer's rows (here convert's own: the activation store and
routing as conversion.activations.StoreRows). convert runs the streamed form (GPTQ.solve); the
whole-layer one (methods.quantize_experts + experts.guard_experts) is its oracle here."""

from __future__ import annotations

import pytest
import torch

from quantkit.conversion.activations import ActivationStore, LayerRouting, StoreRows
from quantkit.planner.cost import StorePlan
from quantkit.quant.experts import PROJS, guard_experts
from quantkit.quant.methods import METHODS, quantize_experts
from quantkit.quant.methods.gptq import expert_hessians, gptq_experts
from quantkit.recipe import load_recipe

N, T, D, I, E, K = 4, 40, 64, 32, 4, 2  # samples, tokens per sample, hidden, expert width, experts, top-k


def _layer(seed: int = 0):
    """Expert weights, MoE inputs x (N*T, D) and a routing in which expert 3 is starved."""
    g = torch.Generator().manual_seed(seed)
    w = {f"mlp.experts.{e}.{p}.weight": torch.randn(*((I, D) if p != "down_proj" else (D, I)), generator=g) * 0.1
         for e in range(E) for p in PROJS}
    x = torch.randn(N * T, D, generator=g)
    first = torch.randint(0, 3, (N * T,), generator=g)
    second = (first + 1 + torch.randint(0, 2, (N * T,), generator=g)) % 3
    second[::37] = 3  # expert 3: 5 tokens, fewer than min_tokens
    idx = torch.stack([first, second], -1)  # (N*T, K), distinct per token
    weight = torch.rand(N * T, K, generator=g)
    return w, x, idx, weight


def _streamed(x, idx, weight, n, t, micro_batch):
    store = ActivationStore(n, t, x.shape[-1], StorePlan(micro_batch=micro_batch), "cpu")
    xs = store.open_x()
    per = micro_batch * t
    for sl in store.slices():
        xs.write(sl, x.view(n, t, -1)[sl])
    n_b = len(list(store.slices()))
    routing = LayerRouting([idx[i * per:(i + 1) * per] for i in range(n_b)],
                           [weight[i * per:(i + 1) * per] for i in range(n_b)],
                           [min(per, n * t - i * per) for i in range(n_b)], E)
    return StoreRows(store, routing)


@pytest.mark.parametrize(("micro_batch", "width_prior", "shrinkage"),
                         [(N, 0.0, "none"), (1, 0.0, "none"), (N, 0.5, "none"), (N, 0.0, "ledoit-wolf"),
                          (1, 0.0, "ledoit-wolf")])
def test_streamed_gptq_equals_whole_layer_gptq(micro_batch, width_prior, shrinkage):
    w, x, idx, weight = _layer()
    rec = load_recipe("tiny-glm-5.2")
    rec.gptq.width_prior = width_prior  # the thin-calibration prior: the same fit-token counts on both paths
    rec.gptq.shrinkage = shrinkage  # the Ledoit-Wolf intensity: the same fit rows' statistics on both paths
    rows = _streamed(x, idx, weight, N, T, micro_batch)
    experts = list(range(E))
    q_s, rec_s = METHODS["gptq"].solve(rows, w, experts, rec.gptq, 32, 1)  # what convert runs

    tokens = {e: (idx == e).any(-1).nonzero(as_tuple=True)[0] for e in experts}
    q_m, rec_m = quantize_experts(x, w, tokens, experts, rec, 32, "gptq", 1)
    guard_experts(rec_m, q_m, x, tokens, w, 32)

    assert [r.fallback for r in rec_s] == [r.fallback for r in rec_m] == [None, None, None, "all_tokens"]
    assert [r.heldout for r in rec_s] == [r.heldout for r in rec_m]
    assert [r.method for r in rec_s] == [r.method for r in rec_m]
    assert [r.prior for r in rec_s] == [r.prior for r in rec_m]
    assert all(r.prior for r in rec_s) if width_prior else all(r.prior is None for r in rec_s)
    if shrinkage == "none":
        assert all(r.shrink is None for r in rec_s + rec_m)
    else:  # isotropic inputs: the target itself, so the intensity is high; equal on both paths
        assert [r.shrink for r in rec_s] == pytest.approx([r.shrink for r in rec_m], rel=1e-4)
        assert all(0.5 < r.shrink <= 0.999 for r in rec_s)
    for e in experts:
        for p in PROJS:
            a, b = q_s[e][p], q_m[e][p]
            if micro_batch == N:  # one pass: the same sums in the same order, so the same bits
                assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale), (e, p)
            else:  # Hessians summed per micro-batch: rounding order differs; codes agree but for ties
                assert torch.equal(a.scale, b.scale)
                assert (a.q != b.q).float().mean() < 1e-3, (e, p)


@pytest.mark.parametrize("micro_batch", [N, 1])
def test_all_token_prior_mixes_the_layer_hessian_by_token_counts(micro_batch):
    """gptq.prior_tokens = p: H_e = (n_e H_e + p H_all) / (n_e + p) over fit tokens, streamed."""
    from quantkit.quant.experts import split_heldout

    w, x, idx, weight = _layer()
    rows = _streamed(x, idx, weight, N, T, micro_batch)
    p = 50
    H = expert_hessians(rows, [0, 1], set(), prior=p)
    x_all = x[split_heldout(torch.arange(N * T))[0]]
    H_all = 2 * x_all.T @ x_all / len(x_all)
    for j, e in enumerate([0, 1]):
        x_e = x[split_heldout((idx == e).any(-1).nonzero(as_tuple=True)[0])[0]]
        H_e = 2 * x_e.T @ x_e / len(x_e)
        want = (len(x_e) * H_e + p * H_all) / (len(x_e) + p)
        torch.testing.assert_close(H[j], want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(H[j], H_e, rtol=1e-3, atol=1e-3)  # the prior moved it


@pytest.mark.parametrize("micro_batch", [N, 1])
@pytest.mark.parametrize("weighting", ["gate", "gate2"])
def test_gate_weighted_hessian_weights_each_routed_token_by_its_router_weight(micro_batch, weighting):
    """gptq.hessian_weighting: H_e = 2 sum c_t x_t x_t^T / sum c_t over the fit tokens, c_t the token's
    router weight for e (gate) or its square (gate2), divided by the expert's mean of it."""
    from quantkit.quant.experts import split_heldout

    _, x, idx, weight = _layer()
    rows = _streamed(x, idx, weight, N, T, micro_batch)
    H = expert_hessians(rows, [0, 1], set(), weighting=weighting)
    H0 = expert_hessians(rows, [0, 1], set())
    for j, e in enumerate([0, 1]):
        tok = (idx == e).any(-1).nonzero(as_tuple=True)[0]
        fit = split_heldout(tok)[0]
        c = (weight * (idx == e)).sum(-1)
        c = c.square() if weighting == "gate2" else c
        c = c / c[tok].mean()
        x_e = x[fit]
        want = 2 * (x_e * c[fit, None]).T @ x_e / c[fit].sum()
        torch.testing.assert_close(H[j], want, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(H[j], H0[j], rtol=1e-3, atol=1e-3)  # the weighting moved it


@pytest.mark.parametrize("micro_batch", [16, 3])
def test_window_holdout_fits_on_other_windows_and_judges_on_whole_windows(micro_batch):
    """gptq.holdout: window: every token of every 8th calibration window is held out (of the Hessian,
    kept for the guard), instead of every 8th routed token; the starved check counts fit windows."""
    from quantkit.quant.experts import HOLDOUT

    n, t = 16, 10  # two held-out windows: 7 and 15
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n * t, D, generator=g)
    first = torch.randint(0, 3, (n * t,), generator=g)
    idx = torch.stack([first, (first + 1) % 3], -1)
    weight = torch.rand(n * t, K, generator=g)
    rows = _streamed(x, idx, weight, n, t, micro_batch)
    held: dict = {}
    H = expert_hessians(rows, [0, 1], set(), held=held, window=t)
    win = torch.arange(n * t) // t
    out = win % HOLDOUT == HOLDOUT - 1
    assert int(out.sum()) == 2 * t
    for j, e in enumerate([0, 1]):
        routed = (idx == e).any(-1)
        x_e = x[routed & ~out]
        torch.testing.assert_close(H[j], 2 * x_e.T @ x_e / len(x_e), rtol=1e-4, atol=1e-5)
        assert torch.equal(held[e], x[routed & out])

    # end to end: the recipe field reaches the guard (it judges on the held-out windows' tokens)
    rec = load_recipe("tiny-glm-5.2")
    rec.gptq.holdout = "window"
    w = _layer()[0]
    _, recs = gptq_experts(rows, w, [0, 1, 2], rec.gptq, 32, layer=1)
    assert [r.heldout for r in recs] == [int(((idx == e).any(-1) & out).sum()) for e in (0, 1, 2)]


def test_static_groups_recipe_field_reaches_gptq():
    from types import SimpleNamespace

    from quantkit.quant.experts import run_gptq
    from quantkit.quant.gptq import gptq

    g = torch.Generator().manual_seed(2)
    W = torch.randn(2, 16, 64, generator=g)
    X = torch.randn(200, 64, generator=g) * torch.linspace(0.1, 3, 64)
    H = (2 * X.T @ X / 200).expand(2, -1, -1).contiguous()
    base = dict(block_size=64, dampening=0.01, actorder=False, observer="minmax")
    dyn = run_gptq(W, H, 32, SimpleNamespace(**base, static_groups=False), 1, [0, 1])
    stat = run_gptq(W, H, 32, SimpleNamespace(**base, static_groups=True), 1, [0, 1])
    want = gptq(W, H, 32, block_size=64, static_groups=False)
    assert torch.equal(dyn.q, want.q) and torch.equal(dyn.scale, want.scale)
    assert not torch.equal(dyn.scale, stat.scale)
    data = load_recipe("tiny-glm-5.2").model_dump()
    data["gptq"].update(static_groups=False, actorder=True)
    with pytest.raises(ValueError, match="static_groups"):
        type(load_recipe("tiny-glm-5.2")).model_validate(data)
