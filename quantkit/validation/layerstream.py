"""One decoder layer straight from a checkpoint with its routed experts streamed in chunks.

`reference.decoder_layer` takes the whole layer's weights as a dict; for Kimi K2.6 that is 384
routed experts, 17G parameters, 68 GB in float32. Here the layer's other weights are loaded, the
attention half and the router run, and the routed experts are loaded `chunk` at a time, applied
to the tokens routed to them, and dropped. The arithmetic is quantkit.model.moe's, in the same order
(experts ascending, index_add_ per expert, shared expert added last), so the result is the same.
Several token streams share one load of each weight (validate's lockstep rows).

With several ranks (validate under torchrun, quantkit.runtime.distributed) each rank runs the attention
half for every token but only the routed experts `owner` gives it; every expert's weighted output
rows then go from its owner to all ranks as bytes (`share_expert_rows`), and every rank adds them
in ascending expert order, as one process does: the hidden states are one process's, bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from quantkit.checkpoint.reader import Checkpoint
from quantkit.model.moe import expert, route, shared_expert, weighted
from quantkit.model.numerics import computed_weight
from quantkit.model.ops import rms_norm
from quantkit.model.reference import attention, decoder_layer
from quantkit.model.tensors import TensorClass

if TYPE_CHECKING:
    from quantkit.runtime.distributed import Group


def streamed_layer(ckpt: Checkpoint, layer: int, hs: list[torch.Tensor], ctxs: list, device, dtype,
                   chunk: int = 16, group: Group | None = None, owner: dict[int, int] | None = None) -> list[torch.Tensor]:
    """New hidden states (B, T, D) of each stream after decoder layer `layer` of `ckpt`. `group`
    and `owner` (expert -> rank): this rank computes its own experts only (module docstring)."""
    a = ckpt.arch
    pre = a.layer_prefix(layer)
    by_expert: dict[int, list[str]] = {}
    w: dict[str, torch.Tensor] = {}
    for name in ckpt.names(layer):
        info = ckpt.tensors[name].info
        if info.klass == TensorClass.ROUTED_EXPERT:
            by_expert.setdefault(info.expert, []).append(name)
        else:
            w[name[len(pre):]] = computed_weight(ckpt, name, dtype, device)
    if not a.is_moe(layer):
        return [decoder_layer(h, w, ctx, layer).hidden for h, ctx in zip(hs, ctxs)]
    eps = a.rms_norm_eps
    hs = [h + attention(rms_norm(h, w["input_layernorm.weight"], eps), w, ctx, layer) for h, ctx in zip(hs, ctxs)]
    xs = [rms_norm(h, w["post_attention_layernorm.weight"], eps).reshape(-1, h.shape[-1]) for h in hs]  # (N, D)
    routes = [route(x, w, a) for x in xs]
    outs = [torch.zeros_like(x) for x in xs]
    present = [set(torch.unique(idx).tolist()) for idx, _ in routes]
    split = group is not None and group.distributed and owner is not None
    experts = sorted(e for e in by_expert if not split or owner[e] == group.rank)
    rows: list[dict[int, torch.Tensor]] = [{} for _ in xs]  # split: per stream, expert -> its weighted rows
    for start in range(0, len(experts), chunk):
        part = [e for e in experts[start:start + chunk] if any(e in p for p in present)]
        if not part:
            continue
        ew = {n[len(pre):]: computed_weight(ckpt, n, dtype, device) for e in part for n in by_expert[e]}
        for x, (idx, weight), out, p, mine in zip(xs, routes, outs, present, rows):
            for e in part:
                if e not in p:
                    continue
                tok, slot = (idx == e).nonzero(as_tuple=True)
                y = weighted(expert(x[tok], ew, e), weight[tok, slot])  # (n_e, D)
                if split:
                    mine[e] = y
                else:
                    out.index_add_(0, tok, y)
        del ew
    if split:
        from quantkit.runtime.distributed import check_same, share_expert_rows

        counts = [torch.bincount(idx.reshape(-1), minlength=a.n_routed_experts).tolist() for idx, _ in routes]
        check_same(group, torch.tensor(counts), f"layer {layer}: routing")  # receivers size buffers from it
        for i, ((idx, _), out, x) in enumerate(zip(routes, outs, xs)):
            every = share_expert_rows(group, rows[i], owner, counts[i], x.shape[-1], x.dtype, device,
                                      f"layer {layer}: expert outputs of stream {i}")
            for e in sorted(every):  # ascending, as one process adds them
                tok, _ = (idx == e).nonzero(as_tuple=True)
                out.index_add_(0, tok, every[e])
            rows[i] = every = None
    result = []
    for h, x, out in zip(hs, xs, outs):
        if (shared := shared_expert(x, w, a)) is not None:
            out = out + shared
        result.append(h + out.view(h.shape))
    return result
