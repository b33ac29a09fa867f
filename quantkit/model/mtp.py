"""The MTP (multi-token prediction) layer's forward: DeepSeek-V3's and GLM's next-n predictor, as
vLLM's `deepseek_mtp.py` and `glm4_moe_mtp.py` run it for speculative decoding.

For position i of a sequence t_0..t_{T-1}, with h_i the main model's last decoder-layer output
(before the final norm):

    e_i    = embed(t_{i+1}), zeroed where the position is 0 (vLLM masks it: not needed by MTP)
    x_i    = eh_proj(cat[enorm(e_i), hnorm(h_i)])          the embedding first, then the hidden state
    y      = decoder_layer(x) at positions 0..T-2          attention + MoE, the layer's full residual out
    logits = head(shared_head.norm(y))                     the layer's own shared_head.head if it has
                                                           one, else the main lm_head

so the logits at i predict t_{i+2}. The embedding table is the layer's own `embed_tokens` if the
checkpoint stores one (GLM-4.5 does), else the main model's (vLLM shares the target's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.model.arch import ModelArch
from quantkit.model.numerics import linear
from quantkit.model.ops import rms_norm
from quantkit.model.reference import Context, decoder_layer

W = dict[str, torch.Tensor]


def embed_name(arch: ModelArch, layer: int, names) -> str:
    """The embedding table the MTP layer `layer` reads: its own, else the main model's."""
    own = f"{arch.layer_prefix(layer)}embed_tokens.weight"
    return own if own in names else f"{arch.prefix}embed_tokens.weight"


def head_name(arch: ModelArch, layer: int, names) -> str:
    """The head the MTP layer's logits come from: its own shared_head.head, else the main head."""
    own = f"{arch.layer_prefix(layer)}shared_head.head.weight"
    if own in names:
        return own
    return f"{arch.prefix}embed_tokens.weight" if arch.tie_word_embeddings else arch.head_name


def mtp_input(h_last: torch.Tensor, next_embeds: torch.Tensor, w: W, arch: ModelArch,
              positions: torch.Tensor) -> torch.Tensor:
    """x = eh_proj(cat[enorm(e), hnorm(h)]) (B, T', D): `h_last` the main model's last hidden states at
    positions `positions`, `next_embeds` the embeddings of the tokens one further (B, T', D)."""
    eps = arch.rms_norm_eps
    e = next_embeds.masked_fill((positions == 0)[None, :, None].to(next_embeds.device), 0.0)
    e = rms_norm(e.to(h_last.dtype), w["enorm.weight"], eps)
    h = rms_norm(h_last, w["hnorm.weight"], eps)
    return linear(torch.cat([e, h], dim=-1), w["eh_proj.weight"])


def mtp_logits(y: torch.Tensor, w: W, head: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """The MTP layer's logits (B, T', V) from its output y: shared_head.norm, then the head."""
    return linear(rms_norm(y, w["shared_head.norm.weight"], arch.rms_norm_eps), head.to(y.device))


def shifted(h_last: torch.Tensor, ids: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a sequence of T tokens: (h_0..h_{T-2}, embed(t_1..t_{T-1})), the MTP's T-1 positions."""
    e = F.embedding(ids[:, 1:].to(table.device), table).to(h_last.device, h_last.dtype)
    return h_last[:, :-1], e


def mtp_layer(h_last: torch.Tensor, next_ids: torch.Tensor, w: W, ctx: Context, layer: int, table: torch.Tensor,
              head: torch.Tensor) -> torch.Tensor:
    """The whole MTP layer on a weight dict (the layer's own names, experts included): logits (B, T', V)
    at ctx's positions, from h_last (B, T', D) and the next tokens `next_ids` (B, T')."""
    e = F.embedding(next_ids.to(table.device), table).to(h_last.device, h_last.dtype)
    x = mtp_input(h_last, e, w, ctx.arch, ctx.positions)
    return mtp_logits(decoder_layer(x, w, ctx, layer).hidden, w, head, ctx.arch)
