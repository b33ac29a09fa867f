"""quantkit.conversion.layerpass's streamed GPTQ against the whole-layer form: the same policy (held-out
tokens, starved experts, the guard) and the same arithmetic, only the tokens arrive one
micro-batch at a time. convert runs the streamed form; the whole-layer one (conversion.
quantize_experts + experts.guard_experts) is its oracle here."""

from __future__ import annotations

import pytest
import torch

from quantkit.conversion.activations import ActivationStore, StorePlan
from quantkit.conversion.layerpass import LayerRouting, gptq_experts
from quantkit.quant.experts import PROJS, guard_experts
from quantkit.quant.moe import quantize_experts
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


@pytest.mark.parametrize("micro_batch", [N, 1])
def test_streamed_gptq_equals_whole_layer_gptq(micro_batch):
    w, x, idx, weight = _layer()
    rec = load_recipe("tiny-glm-5.2")
    store = ActivationStore(N, T, D, StorePlan(micro_batch=micro_batch), "cpu")
    xs = store.open_x()
    per = micro_batch * T
    for sl in store.slices():
        xs.write(sl, x.view(N, T, D)[sl])
    n_b = len(list(store.slices()))
    routing = LayerRouting([idx[i * per:(i + 1) * per] for i in range(n_b)],
                           [weight[i * per:(i + 1) * per] for i in range(n_b)],
                           [min(per, N * T - i * per) for i in range(n_b)], E)
    experts = list(range(E))
    q_s, rec_s = gptq_experts(store, routing, w, experts, rec, 32, layer=1)

    tokens = {e: (idx == e).any(-1).nonzero(as_tuple=True)[0] for e in experts}
    q_m, rec_m = quantize_experts(x, w, tokens, experts, rec, 32, "gptq", 1)
    guard_experts(rec_m, q_m, x, tokens, w, 32)

    assert [r.fallback for r in rec_s] == [r.fallback for r in rec_m] == [None, None, None, "all_tokens"]
    assert [r.heldout for r in rec_s] == [r.heldout for r in rec_m]
    assert [r.method for r in rec_s] == [r.method for r in rec_m]
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
    from quantkit.conversion.layerpass import expert_hessians
    from quantkit.quant.experts import split_heldout

    w, x, idx, weight = _layer()
    store = ActivationStore(N, T, D, StorePlan(micro_batch=micro_batch), "cpu")
    xs = store.open_x()
    per = micro_batch * T
    for sl in store.slices():
        xs.write(sl, x.view(N, T, D)[sl])
    n_b = len(list(store.slices()))
    routing = LayerRouting([idx[i * per:(i + 1) * per] for i in range(n_b)],
                           [weight[i * per:(i + 1) * per] for i in range(n_b)],
                           [min(per, N * T - i * per) for i in range(n_b)], E)
    p = 50
    H = expert_hessians(store, routing, [0, 1], set(), prior=p)
    x_all = x[split_heldout(torch.arange(N * T))[0]]
    H_all = 2 * x_all.T @ x_all / len(x_all)
    for j, e in enumerate([0, 1]):
        x_e = x[split_heldout((idx == e).any(-1).nonzero(as_tuple=True)[0])[0]]
        H_e = 2 * x_e.T @ x_e / len(x_e)
        want = (len(x_e) * H_e + p * H_all) / (len(x_e) + p)
        torch.testing.assert_close(H[j], want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(H[j], H_e, rtol=1e-3, atol=1e-3)  # the prior moved it
