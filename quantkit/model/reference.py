"""The reference forward pass: DeepSeek-V3-family decoder layers as plain functions over weight dicts.

quantkit owns its forward pass instead of tracing someone else's model, so layer boundaries are
explicit: calibration, conversion and validation all run the model one decoder layer at a time
straight from the shards (`Checkpoint.layer(i)`), and never hold more than one layer's weights.
Tests prove these functions compute the same logits as transformers' `DeepseekV3ForCausalLM` and
`GlmMoeDsaForCausalLM` (tests/model/test_reference.py).

The MoE half (router, routed experts, shared expert) is quantkit.model.moe's, which calibration and
validate's layer stream share; the attention is the family's flavour (`ATTENTIONS`).

A layer's weights are a dict keyed by names relative to the layer prefix, exactly as stored
(`self_attn.q_a_proj.weight`, `mlp.experts.7.down_proj.weight`, ...), so the same code runs on a
checkpoint, on a dequantized copy, or on trainable tensors (the tiny models are trained with it).

Shapes: B batch, T new tokens, S cached + new tokens, nh heads, D hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from quantkit.model.arch import ModelArch
from quantkit.model.moe import Routing, mlp, moe
from quantkit.model.numerics import linear  # every Linear, as the checkpoint's numerics compute it

if TYPE_CHECKING:
    from quantkit.model.kvcache import KVCache

W = dict[str, torch.Tensor]


# ---- small pieces ------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


# ---- rope --------------------------------------------------------------------------------------
def rope_inv_freq(arch: ModelArch) -> tuple[torch.Tensor, float]:
    """Inverse frequencies over the rope head dim, and the cos/sin scale (YaRN's attention factor)."""
    r, dim = arch.rope, arch.qk_rope_head_dim
    base = float(r["rope_theta"])
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if r["rope_type"] == "default":
        return 1.0 / pos_freqs, 1.0
    # YaRN: interpolate low frequencies by `factor`, keep high ones, ramp in between.
    factor = float(r["factor"])
    orig = float(r["original_max_position_embeddings"])
    beta_fast, beta_slow = float(r.get("beta_fast") or 32), float(r.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if r.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    attention_factor = r.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = r.get("mscale"), r.get("mscale_all_dim")
        attention_factor = (
            _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all else _yarn_mscale(factor)
        )
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(arch: ModelArch) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)^2 when YaRN is on."""
    scale = arch.qk_head_dim**-0.5
    r = arch.rope
    if r["rope_type"] != "default" and r.get("mscale_all_dim"):
        m = _yarn_mscale(float(r["factor"]), float(r["mscale_all_dim"]))
        scale *= m * m
    return scale


def rope_tables(arch: ModelArch, positions: torch.Tensor, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, rope_dim/2) for the given absolute positions, on `device`.

    Computed on the CPU in float32 whatever the device, then moved once: a GPU's sin/cos can
    differ from the CPU's in the last bit, and the tables would then differ between machines.
    """
    inv_freq, attention_factor = rope_inv_freq(arch)  # CPU
    freqs = positions.to("cpu", torch.float32)[:, None] * inv_freq[None, :]  # (T, rope/2)
    cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
    return cos.to(device, dtype), sin.to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate the last dim of x (..., T, rope). Interleaved: pairs (x0,x1),(x2,x3)..., output de-interleaved
    (rotated evens then odds), as transformers and the engines lay it out. Otherwise: halves."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ---- attention ---------------------------------------------------------------------------------
@dataclass
class LayerCache:
    """What decode needs from earlier tokens of one layer: MLA's latent and rope key, DSA's index keys,
    or GQA's keys and values."""

    latent: torch.Tensor | None = None  # (B, S, kv_lora) after kv_a_layernorm
    k_rot: torch.Tensor | None = None  # (B, S, rope) after rope
    index_k: torch.Tensor | None = None  # (B, S, index_head_dim)
    key: torch.Tensor | None = None  # GQA: (B, S, n_kv, head_dim) after k_norm and rope
    value: torch.Tensor | None = None  # GQA: (B, S, n_kv, head_dim)

    def copy(self) -> "LayerCache":
        """A cache that shares what is stored so far and grows on its own (appending makes new tensors)."""
        return replace(self)

    @property
    def length(self) -> int:
        first = self.latent if self.latent is not None else self.key
        return 0 if first is None else first.shape[1]


def _append(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=1)


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


def indexer(x: torch.Tensor, q_resid: torch.Tensor, w: W, ctx: Context, cache: LayerCache | None, allowed: torch.Tensor) -> torch.Tensor:
    """DSA lightning indexer: score every visible past token per query, keep the top `index_topk`.

    Returns (B, T, k) indices into the S keys. The indexer's rope is always interleaved. Ties go
    to the earlier token (transformers' `topk` leaves them unspecified).
    """
    a = ctx.arch
    B, T, _ = x.shape
    nh, hd, rd = a.index_n_heads, a.index_head_dim, a.qk_rope_head_dim
    q = linear(q_resid, w["self_attn.indexer.wq_b.weight"]).view(B, T, nh, hd)  # (B, T, ih, hd)
    k = F.layer_norm(
        linear(x, w["self_attn.indexer.wk.weight"]), (hd,),
        w["self_attn.indexer.k_norm.weight"], w["self_attn.indexer.k_norm.bias"], eps=1e-6,
    )  # (B, T, hd)
    cos, sin = ctx.cos[:, None, :], ctx.sin[:, None, :]  # broadcast over heads
    q = torch.cat([apply_rope(q[..., :rd], cos, sin, True), q[..., rd:]], dim=-1)
    k = torch.cat([apply_rope(k[..., :rd], ctx.cos, ctx.sin, True), k[..., rd:]], dim=-1)
    if ctx.kv is not None:
        k = ctx.kv.index(k)  # vLLM scores prefill and decode alike on the stored (FP8) index keys
    if cache is not None:
        k = cache.index_k = _append(cache.index_k, k)  # (B, S, hd)
    scores = F.relu(torch.einsum("bthd,bsd->bths", q.float(), k.float()) * hd**-0.5)  # (B, T, ih, S)
    weights = linear(x, w["self_attn.indexer.weights_proj.weight"]).float() * nh**-0.5  # (B, T, ih)
    index_scores = torch.einsum("bth,bths->bts", weights, scores)  # (B, T, S)
    index_scores = index_scores.masked_fill(~allowed, float("-inf"))
    k = min(a.index_topk, index_scores.shape[-1])
    if ctx.dsa_ties == "topk":  # torch.topk's unspecified order, as transformers does it
        return index_scores.topk(k, dim=-1).indices
    # Exact ties are common (all heads' ReLU at zero); a stable sort breaks them towards earlier
    # tokens, so a token's selection is the same in a full forward and in one decode step.
    return torch.sort(index_scores, dim=-1, descending=True, stable=True).indices[..., :k]


def mla_attention(x: torch.Tensor, w: W, ctx: Context, layer: int) -> torch.Tensor:
    """Multi-head latent attention; with GLM's DSA the visible keys are cut to the indexer's top-k."""
    a = ctx.arch
    B, T, _ = x.shape
    nh, dn, dr, dv = a.num_attention_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
    cache = ctx.caches[layer] if ctx.caches is not None else None

    q_resid = rms_norm(linear(x, w["self_attn.q_a_proj.weight"]), w["self_attn.q_a_layernorm.weight"], 1e-6)
    q = linear(q_resid, w["self_attn.q_b_proj.weight"]).view(B, T, nh, dn + dr).transpose(1, 2)  # (B, nh, T, dn+dr)
    q_nope, q_rot = q.split([dn, dr], dim=-1)
    q_rot = apply_rope(q_rot, ctx.cos, ctx.sin, a.rope_interleave)

    kv = linear(x, w["self_attn.kv_a_proj_with_mqa.weight"])  # (B, T, kv_lora + dr)
    latent, k_rot = kv.split([a.kv_lora_rank, dr], dim=-1)
    latent = rms_norm(latent, w["self_attn.kv_a_layernorm.weight"], 1e-6)
    k_rot = apply_rope(k_rot, ctx.cos, ctx.sin, a.rope_interleave)  # (B, T, dr), one head shared by all
    stored = (latent, k_rot) if ctx.kv is None else ctx.kv.mla(layer, w, latent, k_rot)  # what the cache holds
    if cache is not None:
        old_latent, old_k = cache.latent, cache.k_rot
        cache.latent, cache.k_rot = _append(old_latent, stored[0]), _append(old_k, stored[1])  # (B, S, kv_lora), (B, S, dr)
        # the engines: a decode step reads its own key back from the cache; a prefill chunk attends
        # to its fresh keys and to the earlier ones as stored
        latent, k_rot = (cache.latent, cache.k_rot) if T == 1 else (_append(old_latent, latent), _append(old_k, k_rot))
    if ctx.kv is not None:
        ctx.kv.observe_query(layer, w, q_nope, q_rot, nh, dn)  # calibration only (the scale must cover the query)
    S = latent.shape[1]

    kv = linear(latent, w["self_attn.kv_b_proj.weight"]).view(B, S, nh, dn + dv).transpose(1, 2)  # (B, nh, S, dn+dv)
    k_nope, v = kv.split([dn, dv], dim=-1)
    k = torch.cat([k_nope, k_rot[:, None].expand(B, nh, S, dr)], dim=-1)  # (B, nh, S, dn+dr)
    q = torch.cat([q_nope, q_rot], dim=-1)

    key_pos = torch.arange(S, device=x.device)
    allowed = (key_pos[None, :] <= ctx.positions[:, None])[None].expand(B, T, S)  # (B, T, S) causal
    if a.has_dsa and not ctx.dsa_dense:
        if a.indexer_layers[layer] if layer < a.num_hidden_layers else True:
            ctx.topk = indexer(x, q_resid, w, ctx, cache, allowed)
        selected = torch.zeros(B, T, S, dtype=torch.bool, device=x.device).scatter_(-1, ctx.topk, True)
        allowed = allowed & selected

    scores = torch.matmul(q, k.transpose(-1, -2)) * softmax_scale(a)  # (B, nh, T, S)
    scores = scores.masked_fill(~allowed[:, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(B, T, nh * dv)  # (B, T, nh*dv)
    return linear(out, w["self_attn.o_proj.weight"])


def gqa_attention(x: torch.Tensor, w: W, ctx: Context, layer: int) -> torch.Tensor:
    """Grouped-query attention with per-head q/k RMSNorm before rope (Qwen3-MoE)."""
    a = ctx.arch
    B, T, _ = x.shape
    nh, nkv, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    q = rms_norm(linear(x, w["self_attn.q_proj.weight"]).view(B, T, nh, hd), w["self_attn.q_norm.weight"], a.rms_norm_eps)
    k = rms_norm(linear(x, w["self_attn.k_proj.weight"]).view(B, T, nkv, hd), w["self_attn.k_norm.weight"], a.rms_norm_eps)
    v = linear(x, w["self_attn.v_proj.weight"]).view(B, T, nkv, hd)
    cos, sin = ctx.cos[:, None, :], ctx.sin[:, None, :]  # (T, 1, hd/2): broadcast over heads
    q, k = apply_rope(q, cos, sin, a.rope_interleave), apply_rope(k, cos, sin, a.rope_interleave)  # (B, T, h, hd)
    if ctx.kv is not None:  # as the cache stores them; vLLM's FlashAttention reads prefill's keys back too
        k, v = ctx.kv.gqa(layer, w, k, v)
    cache = ctx.caches[layer] if ctx.caches is not None else None
    if cache is not None:
        k = cache.key = _append(cache.key, k)  # (B, S, nkv, hd)
        v = cache.value = _append(cache.value, v)
    S = k.shape[1]
    k = k.transpose(1, 2).repeat_interleave(nh // nkv, dim=1)  # (B, nh, S, hd)
    v = v.transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
    key_pos = torch.arange(S, device=x.device)
    allowed = key_pos[None, :] <= ctx.positions[:, None]  # (T, S) causal
    scores = torch.matmul(q.transpose(1, 2), k.transpose(-1, -2)) * softmax_scale(a)  # (B, nh, T, S)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(B, T, nh * hd)
    return linear(out, w["self_attn.o_proj.weight"])


# ---- decoder layer and model -------------------------------------------------------------------
@dataclass
class LayerOutput:
    hidden: torch.Tensor  # (B, T, D)
    routing: Routing | None = None  # MoE layers only
    moe_input: torch.Tensor | None = field(default=None, repr=False)  # dense layers: the MLP input


# attention flavour (a family definition's `attention`) -> its forward
ATTENTIONS = {"mla": mla_attention, "gqa": gqa_attention}


def attention(x: torch.Tensor, w: W, ctx: Context, layer: int) -> torch.Tensor:
    """The family's attention (its definition's flavour) on the normed hidden states x."""
    return ATTENTIONS[ctx.arch.definition.attention](x, w, ctx, layer)


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
