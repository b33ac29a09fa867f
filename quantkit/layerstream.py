"""One decoder layer straight from a checkpoint with its routed experts streamed in chunks.

`reference.decoder_layer` takes the whole layer's weights as a dict; for Kimi K2.6 that is 384
routed experts, 17G parameters, 68 GB in float32. Here the layer's other weights are loaded, the
attention half and the router run, and the routed experts are loaded `chunk` at a time, applied
to the tokens routed to them, and dropped. The arithmetic is reference.moe's, in the same order
(experts ascending, index_add_ per expert, shared expert added last), so the result is the same.
Several token streams share one load of each weight (validate's lockstep rows).
"""

from __future__ import annotations

import torch

from quantkit.checkpoint import Checkpoint
from quantkit.reference import decoder_layer, expert, mla_attention, rms_norm, route, swiglu
from quantkit.tensors import TensorClass


def streamed_layer(ckpt: Checkpoint, layer: int, hs: list[torch.Tensor], ctxs: list, device, dtype,
                   chunk: int = 16) -> list[torch.Tensor]:
    """New hidden states (B, T, D) of each stream after decoder layer `layer` of `ckpt`."""
    a = ckpt.arch
    pre = a.layer_prefix(layer)
    by_expert: dict[int, list[str]] = {}
    w: dict[str, torch.Tensor] = {}
    for name in ckpt.names(layer):
        info = ckpt.tensors[name].info
        if info.klass == TensorClass.ROUTED_EXPERT:
            by_expert.setdefault(info.expert, []).append(name)
        else:
            w[name[len(pre):]] = ckpt.get(name, dtype).to(device)
    if not a.is_moe(layer):
        return [decoder_layer(h, w, ctx, layer).hidden for h, ctx in zip(hs, ctxs)]
    eps = a.rms_norm_eps
    hs = [h + mla_attention(rms_norm(h, w["input_layernorm.weight"], eps), w, ctx, layer) for h, ctx in zip(hs, ctxs)]
    xs = [rms_norm(h, w["post_attention_layernorm.weight"], eps).reshape(-1, h.shape[-1]) for h in hs]  # (N, D)
    routes = [route(x, w, a) for x in xs]
    outs = [torch.zeros_like(x) for x in xs]
    present = [set(torch.unique(idx).tolist()) for idx, _ in routes]
    experts = sorted(by_expert)
    for start in range(0, len(experts), chunk):
        part = [e for e in experts[start:start + chunk] if any(e in p for p in present)]
        if not part:
            continue
        ew = {n[len(pre):]: ckpt.get(n, dtype).to(device) for e in part for n in by_expert[e]}
        for x, (idx, weight), out, p in zip(xs, routes, outs, present):
            for e in part:
                if e not in p:
                    continue
                tok, slot = (idx == e).nonzero(as_tuple=True)
                out.index_add_(0, tok, (expert(x[tok], ew, e) * weight[tok, slot][:, None]).to(x.dtype))
        del ew
    result = []
    for h, x, out in zip(hs, xs, outs):
        if a.n_shared_experts:
            p = "mlp.shared_experts."
            out = out + swiglu(x, w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"])
        result.append(h + out.view(h.shape))
    return result
