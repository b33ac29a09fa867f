"""AWQ's method module (quantkit.quant.methods.awq): convert's form reads each chunk's expert rows from
the layer's micro-batches and never gathers the layer's MoE inputs, with the same rows in the same
order as the whole-layer form, so the same bytes (the whole-layer form plus the guard is the oracle)."""

from __future__ import annotations

import pytest
import torch

from methods.test_gptq import E, N, T, _layer, _streamed
from quantkit.quant.experts import PROJS, guard_experts
from quantkit.quant.methods import METHODS, quantize_experts
from quantkit.recipe import load_recipe


class _NoGather:
    """StoreRows whose `gather` fails: the streamed search must not hold the layer's inputs whole."""

    def __init__(self, rows):
        self._rows = rows

    def __getattr__(self, name):
        return getattr(self._rows, name)

    def gather(self):
        raise AssertionError("AWQ's streamed form gathered the layer's MoE inputs")


@pytest.mark.parametrize(("micro_batch", "fallback"), [(N, "all_tokens"), (1, "all_tokens"), (1, "rtn")])
def test_streamed_awq_equals_whole_layer_awq_bit_for_bit_without_gathering(micro_batch, fallback):
    w, x, idx, weight = _layer()
    rec = load_recipe("tiny-glm-5.2")
    rec.gptq.fallback = fallback
    experts = list(range(E))
    q_s, rec_s = METHODS["awq"].solve(_NoGather(_streamed(x, idx, weight, N, T, micro_batch)), w, experts, rec, 32, 1)

    tokens = {e: (idx == e).any(-1).nonzero(as_tuple=True)[0] for e in experts}
    alternatives: dict = {}
    q_m, rec_m = quantize_experts(x, w, tokens, experts, rec, 32, "awq", 1, alternatives)
    guard_experts(rec_m, q_m, x, tokens, w, 32, alternatives)

    # expert 3 is starved (5 routed tokens, none held out: judged on the layer's held-out tokens)
    assert [r.fallback for r in rec_s] == [r.fallback for r in rec_m] == [None, None, None, fallback]
    assert [vars(r) for r in rec_s] == [vars(r) for r in rec_m]  # counts, errors, guard decisions
    for e in experts:
        for p in PROJS:  # the rows are copies of the same values whatever the micro-batch: the same bits
            assert torch.equal(q_s[e][p].q, q_m[e][p].q) and torch.equal(q_s[e][p].scale, q_m[e][p].scale), (e, p)
