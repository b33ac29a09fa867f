"""The MoE layer, written once: router, routed experts, shared expert.

Three places run a MoE layer, each its own way for memory's sake: the reference forward holds the
whole layer (`moe`), validate's layer stream loads the routed experts a chunk at a time
(quantkit.validation.layerstream) and calibration reads its tokens a micro-batch at a time from the
activation store (quantkit.conversion.layerpass). The arithmetic they share is here: the router
(the family's, from its definition: scores -> top-k, then normalised and scaled weights here), one
expert's weighted output rows, and the shared expert. Each caller keeps its own order of additions
(experts ascending, `index_add_` per expert; the reference adds the shared expert last,
calibration first), which the converted bytes depend on.

A layer's weights are a dict keyed by names relative to the layer prefix (`mlp.gate.weight`,
`mlp.experts.7.down_proj.weight`, ...), as in quantkit.model.reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantkit.model.arch import ModelArch
from quantkit.model.numerics import linear

W = dict[str, torch.Tensor]


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The gated MLP of every dense layer and every expert: down(silu(gate x) * up x)."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def mlp(x: torch.Tensor, w: W, prefix: str) -> torch.Tensor:
    """The gated MLP whose projections are stored under `prefix` (`mlp.`, `mlp.shared_experts.`, ...)."""
    return swiglu(x, w[prefix + "gate_proj.weight"], w[prefix + "up_proj.weight"], w[prefix + "down_proj.weight"])


def route(x: torch.Tensor, w: W, arch: ModelArch) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids (N, k) and float32 weights (N, k) of the tokens x (N, D): the family's router,
    then `norm_topk_prob` and `routed_scaling_factor`."""
    topk_idx, topk_weight = arch.definition.router(x, w, arch)  # the family's router (quantkit.model.family.Router)
    if arch.norm_topk_prob:
        topk_weight = topk_weight / (topk_weight.sum(-1, keepdim=True) + 1e-20)
    return topk_idx, topk_weight * arch.routed_scaling_factor


@dataclass
class Routing:
    """Which experts each token went to and with what weight; what calibration needs per expert."""

    x: torch.Tensor  # (N, D) the MoE input (after post_attention_layernorm), flattened tokens
    topk_idx: torch.Tensor  # (N, k)
    topk_weight: torch.Tensor  # (N, k) float32, normalised and scaled

    def tokens_of(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token indices, router weights) of the tokens routed to `expert`."""
        tok, slot = (self.topk_idx == expert).nonzero(as_tuple=True)
        return tok, self.topk_weight[tok, slot]

    def counts(self, n_experts: int) -> torch.Tensor:
        return torch.bincount(self.topk_idx.flatten(), minlength=n_experts)


# ---- experts ------------------------------------------------------------------------------------
def expert(x: torch.Tensor, w: W, e: int) -> torch.Tensor:
    """Routed expert `e` on the rows x."""
    return mlp(x, w, f"mlp.experts.{e}.")


def weighted(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """An expert's output rows (n, D) times their router weights (n,), in the rows' dtype: what
    each token gets added from that expert."""
    return (y * weight[:, None]).to(y.dtype)


def shared_expert(x: torch.Tensor, w: W, arch: ModelArch) -> torch.Tensor | None:
    """The shared expert's output on every token, or None for a family (or config) without one."""
    return mlp(x, w, "mlp.shared_experts.") if arch.n_shared_experts else None


def moe(x: torch.Tensor, w: W, arch: ModelArch) -> tuple[torch.Tensor, Routing]:
    """The whole layer at once (the reference forward): routed experts ascending, then the shared one."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # (N, D)
    topk_idx, topk_weight = route(x, w, arch)
    routing = Routing(x, topk_idx, topk_weight)
    out = torch.zeros_like(x)
    for e in torch.unique(topk_idx).tolist():
        tok, weight = routing.tokens_of(e)
        out.index_add_(0, tok, weighted(expert(x[tok], w, e), weight))
    if (shared := shared_expert(x, w, arch)) is not None:
        out = out + shared
    return out.view(shape), routing
