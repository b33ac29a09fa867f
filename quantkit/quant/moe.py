"""GPTQ's whole-layer form: a chunk of one layer's routed experts, batched across experts, from the
layer's MoE inputs held whole in memory. Tensors in, tensors out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.model.moe import route
from quantkit.quant.experts import ExpertRecord, Fallback, calibration_inputs, expert_weights, prior_of, rtn_expert, run_gptq
from quantkit.quant.gptq import QuantizedWeight, hessian_from_inputs
from quantkit.quant.shrinkage import fourth_moment


def quantize_experts_gptq(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    tokens: dict[int, torch.Tensor],
    experts: list[int],
    g,
    group_size: int,
    layer: int,
) -> tuple[dict[int, dict[str, QuantizedWeight]], list[ExpertRecord]]:
    """GPTQ for the given routed experts of one layer, batched across experts, from the layer's MoE
    inputs held whole in memory (quantkit.quant.methods.gptq.GPTQ.quantize).

    convert's GPTQ streams its Hessians instead (quantkit.quant.methods.gptq.gptq_experts, the same policy
    and arithmetic; tests/quant/methods/test_gptq.py holds the two equal); this whole-layer form is
    the oracle of that test, and what tests/runtime/test_device.py runs on a fake device.

    x: (N, D) the MoE input of every calibration token; tokens[e]: indices of the tokens routed to e;
    g: the recipe's gptq section.
    Which tokens an expert is fitted on, and what a starved one gets, is quantkit.quant.experts' one
    policy (held-out tokens never enter a Hessian). GPTQ: gate and up share the Hessian of their
    input; down's Hessian comes from the *quantized* gate/up output on the same tokens.
    """
    records, quantized, inputs = [], {}, {}
    fallback: dict[int, Fallback | None] = {}
    for e in experts:
        inputs[e], fallback[e] = calibration_inputs(x, tokens[e], g)
        if inputs[e] is None:
            quantized[e] = rtn_expert(w, e, group_size)
            records.append(ExpertRecord(layer, e, len(tokens[e]), "rtn", fallback="rtn"))
    run = [e for e in experts if inputs[e] is not None]

    if run:  # one batched GPTQ call; the caller bounds how many experts that is
        # gate and up: one Hessian per expert, shared by both projections
        H = torch.stack([hessian_from_inputs(inputs[e].float()) for e in run])  # (C, D, D)
        Wgu = torch.stack([torch.stack(expert_weights(w, e)[:2]) for e in run]).float()  # (C, 2, I, D)
        n_fit = [len(inputs[e]) for e in run]
        lw = g.shrinkage != "none"  # gptq.shrinkage's statistic of each Linear's fit rows
        shrunk: list = []
        qgu = run_gptq(Wgu, H[:, None].expand(-1, 2, -1, -1), group_size, g, layer, run, fit_tokens=n_fit,
                       fourth=[fourth_moment(inputs[e].float()) for e in run] if lw else None, shrunk=shrunk)
        # down: inputs are what the quantized gate/up produce on the same tokens
        gu_hat = qgu.dequantize(torch.float32)  # (C, 2, I, D)
        Z = [F.silu(inputs[e].float() @ gu_hat[i, 0].T) * (inputs[e].float() @ gu_hat[i, 1].T) for i, e in enumerate(run)]
        Hd = torch.stack([hessian_from_inputs(z) for z in Z])  # (C, I, I)
        Wd = torch.stack([expert_weights(w, e)[2] for e in run]).float()  # (C, D, I)
        qd = run_gptq(Wd, Hd, group_size, g, layer, run, fit_tokens=n_fit,
                      fourth=[fourth_moment(z) for z in Z] if lw else None)
        for i, e in enumerate(run):
            quantized[e] = {
                "gate_proj": QuantizedWeight(qgu.q[i, 0], qgu.scale[i, 0]),
                "up_proj": QuantizedWeight(qgu.q[i, 1], qgu.scale[i, 1]),
                "down_proj": QuantizedWeight(qd.q[i], qd.scale[i]),
            }
            loss = (qgu.loss[i].sum() + qd.loss[i]).item() if qgu.loss is not None else None
            records.append(ExpertRecord(layer, e, len(tokens[e]), "gptq", fallback[e], loss,
                                        prior=prior_of(g, n_fit[i], Wgu.shape[-1]),
                                        shrink=round(shrunk[i], 6) if shrunk else None))
    records.sort(key=lambda r: r.expert)
    return quantized, records


def routed_tokens(x: torch.Tensor, w: dict[str, torch.Tensor], arch) -> dict[int, torch.Tensor]:
    """For every routed expert, the indices of the tokens the router sends it."""
    topk_idx, _ = route(x, w, arch)
    return {e: (topk_idx == e).nonzero(as_tuple=True)[0] for e in range(arch.n_routed_experts)}
