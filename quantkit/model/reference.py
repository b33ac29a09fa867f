"""The reference forward pass: DeepSeek-V3-family decoder layers as plain functions over weight dicts.

quantkit owns its forward pass instead of tracing someone else's model, so layer boundaries are
explicit: calibration, conversion and validation all run the model one decoder layer at a time
straight from the shards (`Checkpoint.layer(i)`), and never hold more than one layer's weights.
Tests prove these functions compute the same logits as transformers' `DeepseekV3ForCausalLM` and
`GlmMoeDsaForCausalLM` (tests/model/test_reference.py).

The MoE half (router, routed experts, shared expert) is quantkit.model.moe's, which calibration and
validate's layer stream share; the attention is the family's kind (`definition.attention.forward`,
quantkit.model.attention), defined with the family that introduced it (quantkit.model.families).

A layer's weights are a dict keyed by names relative to the layer prefix, exactly as stored
(`self_attn.q_a_proj.weight`, `mlp.experts.7.down_proj.weight`, ...), so the same code runs on a
checkpoint, on a dequantized copy, or on trainable tensors (the tiny models are trained with it).

Shapes: B batch, T new tokens, S cached + new tokens, nh heads, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from quantkit.model.arch import ModelArch
from quantkit.model.moe import Routing, mlp, moe
from quantkit.model.ops import rms_norm, rope_tables

if TYPE_CHECKING:
    from quantkit.model.kvcache import KVCache

W = dict[str, torch.Tensor]


# ---- attention ---------------------------------------------------------------------------------
@dataclass
class LayerCache:
    """What decode needs from earlier tokens of one layer, in the slots its attention kind fills
    (quantkit.model.attention): a latent and a rope key (MLA), DSA's index keys, or keys and values
    per key/value head. Each slot is (B, S, ...) and grows along S."""

    latent: torch.Tensor | None = None  # (B, S, kv_lora) after kv_a_layernorm
    k_rot: torch.Tensor | None = None  # (B, S, rope) after rope
    index_k: torch.Tensor | None = None  # (B, S, index_head_dim)
    key: torch.Tensor | None = None  # (B, S, n_kv, head_dim) as rope left them
    value: torch.Tensor | None = None  # (B, S, n_kv, head_dim)

    def copy(self) -> "LayerCache":
        """A cache that shares what is stored so far and grows on its own (appending makes new tensors)."""
        return replace(self)

    @property
    def length(self) -> int:
        first = self.latent if self.latent is not None else self.key
        return 0 if first is None else first.shape[1]


@dataclass
class Context:
    """Per-forward state shared by all layers: positions, rope tables, caches, DSA selection."""

    arch: ModelArch
    positions: torch.Tensor  # (T,) absolute positions of the new tokens
    cos: torch.Tensor
    sin: torch.Tensor
    caches: list[LayerCache] | None = None  # one per layer when decoding incrementally
    topk: torch.Tensor | None = None  # (B, T, k) last DSA selection, reused by IndexShare layers
    dsa_dense: bool = False  # force dense attention (for the equality test)
    dsa_ties: str = "earliest"  # "earliest" (deterministic) or "topk" (torch.topk's order, as transformers)
    kv: "KVCache | None" = None  # how the KV cache stores values (quantkit.model.kvcache); None: as computed

    @classmethod
    def build(cls, arch: ModelArch, T: int, device, dtype, *, start: int = 0, caches=None, **options) -> "Context":
        positions = torch.arange(start, start + T)  # CPU: the rope tables are computed there
        cos, sin = rope_tables(arch, positions, device, dtype)
        return cls(arch, positions.to(device), cos, sin, caches, **options)


# ---- decoder layer and model -------------------------------------------------------------------
@dataclass
class LayerOutput:
    hidden: torch.Tensor  # (B, T, D)
    routing: Routing | None = None  # MoE layers only
    moe_input: torch.Tensor | None = field(default=None, repr=False)  # dense layers: the MLP input


def attention(x: torch.Tensor, w: W, ctx: Context, layer: int) -> torch.Tensor:
    """The family's attention (its definition's kind, quantkit.model.attention) on the normed hidden states x."""
    return ctx.arch.definition.attention.forward(x, w, ctx, layer)


def decoder_layer(h: torch.Tensor, w: W, ctx: Context, layer: int) -> LayerOutput:
    a = ctx.arch
    h = h + attention(rms_norm(h, w["input_layernorm.weight"], a.rms_norm_eps), w, ctx, layer)
    x = rms_norm(h, w["post_attention_layernorm.weight"], a.rms_norm_eps)
    if a.is_moe(layer):
        out, routing = moe(x, w, a)
        return LayerOutput(h + out, routing)
    return LayerOutput(h + mlp(x, w, "mlp."), moe_input=x)


def head_weight_name(arch: ModelArch) -> str:
    return f"{arch.prefix}embed_tokens.weight" if arch.tie_word_embeddings else arch.head_name
