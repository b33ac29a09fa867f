"""DeepSeek-V3 and the families built on its modelling code: DeepSeek-V3/R1 and Kimi K2 / K2.5 / K2.6.

MLA attention (low-rank q and kv projections, a 576-wide latent cache), a dense-MLP prefix
(`first_k_dense_replace`), then MoE layers with a sigmoid `noaux_tc` router (a correction bias,
group-limited top-k) and one shared expert; MTP layers after the last decoder layer. Kimi K2 and
K2-Thinking ship model_type `kimi_k2` with DeepSeek-V3's fields; K2.5/K2.6 wrap the text model in a
multimodal `kimi_k25` config (`text_config`, tensors under `language_model.`, a MoonViT tower).

The layer kinds DeepSeek-V3 introduced are written here and nowhere else: `MLA` (the attention kind,
quantkit.model.attention: its forward, its latent cache in bf16 / fp8_e4m3 / fp8_ds_mla, its KV
scales, its sizes and cache bytes) and the `sigmoid_group_topk` router. GLM and Kimi import them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from quantkit.errors import ConfigError
from quantkit.model.attention import Attention, Context
from quantkit.model.family import EngineModule, Family
from quantkit.model.kvcache import KVCache, ds_mla, per_tensor, scale_from_absmax
from quantkit.model.numerics import linear
from quantkit.model.ops import append, apply_rope, attention, rms_norm, softmax_scale

W = dict[str, torch.Tensor]

MLA_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLA_NORMS = (("q_a_layernorm", "q_lora_rank"), ("kv_a_layernorm", "kv_lora_rank"))
# what a cached latent means: the ranks and head widths (the cache holds kv_lora_rank + qk_rope_head_dim per token)
MLA_CACHE_CONFIG = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

# vLLM's and SGLang's deepseek_v2.py: q_a and kv_a are one fused module (SGLang: a ReplicatedLinear
# of q_lora + kv_lora + rope rows, shards concatenated on load; vLLM: a MergedColumnParallelLinear).
MLA_ENGINE = (
    EngineModule(("sglang",), "fused_qkv_a_proj_with_mqa", "ReplicatedLinear", ("q_a_proj", "kv_a_proj_with_mqa"), single=True),
    EngineModule(("vllm",), "fused_qkv_a_proj", "MergedColumnParallelLinear", ("q_a_proj", "kv_a_proj_with_mqa"),
                 tp_split="replicated"),  # built with disable_tp=True: every rank holds it whole
    EngineModule(("sglang", "vllm"), "q_b_proj", "ColumnParallelLinear", ("q_b_proj",)),
    EngineModule(("sglang", "vllm"), "kv_b_proj", "ColumnParallelLinear", ("kv_b_proj",)),
    EngineModule(("sglang", "vllm"), "o_proj", "RowParallelLinear", ("o_proj",)),
)


def mla_shapes(a: Any) -> dict[str, tuple[int, ...]]:
    """[out, in] of each MLA projection, from a ModelArch."""
    h, n, k = a.hidden_size, a.num_attention_heads, a.kv_lora_rank
    return {
        "q_a_proj": (a.q_lora_rank, h),
        "q_b_proj": (n * a.qk_head_dim, a.q_lora_rank),
        "kv_a_proj_with_mqa": (k + a.qk_rope_head_dim, h),
        "kv_b_proj": (n * (a.qk_nope_head_dim + a.v_head_dim), k),
        "o_proj": (h, n * a.v_head_dim),
    }


# ---- MLA: the attention kind (quantkit.model.attention) GLM and Kimi reuse by import ----------------
@dataclass(frozen=True)
class MLA(Attention):
    """Multi-head latent attention: q through a low-rank `q_a_proj` + norm + `q_b_proj`; keys and values
    from one cached latent (`kv_a_proj_with_mqa`, normed, expanded by `kv_b_proj`) and one rope key
    shared by every head. The cache holds the latent and the rope key, one static scale for both.

    `indexer`: DeepSeek Sparse Attention's lightning indexer (GLM, quantkit.model.families.glm), which
    cuts each query's visible keys to its top-k; None for dense MLA."""

    indexer: Callable | None = None
    kind = "mla"
    kv_read_by = {  # noqa: RUF012
        "vllm_dense_mla": "k_scale for kv_c and k_pe (concat_and_cache_mla) if loaded; 0.33.0 attaches the "
                          "KV-cache method to Attention layers only, so MLA most likely runs at 1.0",
        "vllm_dsa": "ignored: fp8_ds_mla computes per-token tile scales (and FP8 index keys always)",
        "sglang_mla": "loaded by 0.5.23 (CompressedTensorsKVCacheMethod); an earlier MLA pool casts at 1.0",
    }
    kv_scale_covers = "MLA: max |kv_c|, |k_pe| and |absorbed decode query| / 448 (vLLM's q_scale defaults to k_scale)"

    def sizes(self, text: dict[str, Any], need, source: str) -> dict[str, int]:
        """MLA's ranks and head dims."""
        if text.get("q_lora_rank") is None:
            raise ConfigError(f"{source}: q_lora_rank null (DeepSeek-V2-Lite's full-rank query projection) is not supported")
        return dict(q_lora_rank=int(need("q_lora_rank")), kv_lora_rank=int(need("kv_lora_rank")),
                    qk_nope_head_dim=int(need("qk_nope_head_dim")), qk_rope_head_dim=int(need("qk_rope_head_dim")),
                    v_head_dim=int(need("v_head_dim")))

    def forward(self, x: torch.Tensor, w: W, ctx: Context, layer: int) -> torch.Tensor:
        """MLA on the normed hidden states; with DSA the visible keys are cut to the indexer's top-k."""
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
        stored = (latent, k_rot) if ctx.kv is None else self.store(ctx.kv, layer, w, latent, k_rot)  # what the cache holds
        if cache is not None:
            old_latent, old_k = cache.latent, cache.k_rot
            cache.latent, cache.k_rot = append(old_latent, stored[0]), append(old_k, stored[1])  # (B, S, kv_lora), (B, S, dr)
            # the engines: a decode step reads its own key back from the cache; a prefill chunk attends
            # to its fresh keys and to the earlier ones as stored
            latent, k_rot = (cache.latent, cache.k_rot) if T == 1 else (append(old_latent, latent), append(old_k, k_rot))
        if ctx.kv is not None and ctx.kv.measuring:  # calibration only (the scale must cover the query)
            observe_query(ctx.kv, layer, w, q_nope, q_rot, nh, dn)
        S = latent.shape[1]

        kv = linear(latent, w["self_attn.kv_b_proj.weight"]).view(B, S, nh, dn + dv).transpose(1, 2)  # (B, nh, S, dn+dv)
        k_nope, v = kv.split([dn, dv], dim=-1)
        k = torch.cat([k_nope, k_rot[:, None].expand(B, nh, S, dr)], dim=-1)  # (B, nh, S, dn+dr)
        q = torch.cat([q_nope, q_rot], dim=-1)

        key_pos = torch.arange(S, device=x.device)
        allowed = (key_pos[None, :] <= ctx.positions[:, None])[None].expand(B, T, S)  # (B, T, S) causal
        if a.has_dsa and not ctx.dsa_dense:
            if a.indexer_layers[layer] if layer < a.num_hidden_layers else True:
                ctx.topk = self.indexer(x, q_resid, w, ctx, cache, allowed)
            selected = torch.zeros(B, T, S, dtype=torch.bool, device=x.device).scatter_(-1, ctx.topk, True)
            allowed = allowed & selected

        out = attention(q, k, v, allowed, softmax_scale(a))  # (B, nh, T, dv), in query chunks when long
        attn = out.transpose(1, 2).reshape(B, T, nh * dv)  # (B, T, nh*dv)
        return linear(attn, w["self_attn.o_proj.weight"])

    def store(self, kv: KVCache, layer: int, w: W, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent and rope key as the cache gives them back (quantkit.model.kvcache's docstring):
        fp8_e4m3 rounds both with the layer's one k_scale; fp8_ds_mla tiles the latent, k_pe stays bf16."""
        kv.observe(layer, "latent", latent)
        kv.observe(layer, "k_rot", k_rot)
        if kv.dtype == "fp8_e4m3":
            s = kv.scale(w, layer=layer)
            return per_tensor(latent, s), per_tensor(k_rot, s)
        if kv.dtype == "fp8_ds_mla":
            return ds_mla(latent), k_rot  # k_pe stays bf16 in that layout
        return latent, k_rot

    def kv_scales(self, maxima: dict[str, float]) -> tuple[float, float]:
        """k_scale = v_scale: the largest of what the cache holds and of the absorbed decode query
        (which vLLM quantizes with q_scale = k_scale), over 448."""
        s = scale_from_absmax(max(maxima["latent"], maxima.get("k_rot", 0.0), maxima.get("query", 0.0)))
        return s, s

    def kv_report(self, maxima: dict[str, float]) -> dict:
        return {"latent_absmax": maxima["latent"], "k_rot_absmax": maxima["k_rot"], "query_absmax": maxima.get("query"),
                "k_scale": self.kv_scales(maxima)[0]}

    def cache_bytes(self, arch, kv_dtype: str) -> int:
        """The latent and rope key: bf16, or (DSA) FlashMLA sparse FP8's e4m3 nope latent + an f32 scale
        per 128 + a bf16 rope key, or e4m3 with one static per-tensor scale."""
        if kv_dtype == "bf16":
            return 2 * (arch.kv_lora_rank + arch.qk_rope_head_dim)
        if arch.has_dsa:
            return arch.kv_lora_rank + 4 * math.ceil(arch.kv_lora_rank / 128) + 2 * arch.qk_rope_head_dim
        return arch.kv_lora_rank + arch.qk_rope_head_dim


def observe_query(kv: KVCache, layer: int, w: W, q_nope: torch.Tensor, q_rot: torch.Tensor, nh: int, dn: int) -> None:
    """Record the query vLLM's MLA decode quantizes with q_scale: q_nope absorbed into the latent space
    (q_nope[h] @ W_UK[h], W_UK the key half of kv_b_proj) and the rope query."""
    kv_lora = w["self_attn.kv_b_proj.weight"].shape[1]
    w_uk = w["self_attn.kv_b_proj.weight"].view(nh, -1, kv_lora)[:, :dn]  # (nh, dn, kv_lora)
    ql = torch.einsum("bhtd,hdl->bhtl", q_nope.float(), w_uk.float())  # (B, nh, T, kv_lora)
    kv.observe(layer, "query", ql)
    kv.observe(layer, "query", q_rot)

# ---- the router --------------------------------------------------------------------------------
def sigmoid_group_topk(x: torch.Tensor, w: W, arch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid `noaux_tc` (DeepSeek-V3, Kimi, GLM): bias-corrected group and top-k choice, weights
    from the raw scores."""
    E, G = arch.n_routed_experts, arch.n_group
    scores = F.linear(x.float(), w["mlp.gate.weight"].float()).sigmoid()  # (N, E)
    choice = scores + w["mlp.gate.e_score_correction_bias"].float()
    group_scores = choice.view(-1, G, E // G).topk(min(2, E // G), dim=-1)[0].sum(-1)  # (N, G)
    group_idx = group_scores.topk(arch.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    choice = choice.masked_fill(score_mask == 0, float("-inf"))
    topk_idx = choice.topk(arch.num_experts_per_tok, dim=-1, sorted=False)[1]  # (N, k)
    return topk_idx, scores.gather(1, topk_idx)


DEEPSEEK_V3 = Family(
    model_type="deepseek_v3",
    name="deepseek_v3",
    tool_calls="deepseek_fences",
    description="DeepSeek-V3/R1 (and BF16 Kimi K2 variants saved as deepseek_v3)",
    attention=MLA(),
    router=sigmoid_group_topk,
    router_bias=True,
    # forced_rope_interleave None: transformers' DeepSeek-V3 defaults to interleaved (the config says)
    attention_projections=MLA_PROJECTIONS,
    attention_norms=MLA_NORMS,
    attention_shapes=mla_shapes,
    cache_config=MLA_CACHE_CONFIG,
    replicated=("q_a_proj", "kv_a_proj_with_mqa"),  # the low-rank down projections (SGLang's ReplicatedLinear)
    engine_attention=MLA_ENGINE,
    # prefill_bf16_projections (): DeepSeek's own FP8 release stores q_a and kv_a in FP8
    mtp_embed_copies=True,  # DeepSeek's published MTP layer carries its own embedding and head
    recipe="deepseek-v3",
    presets=("deepseek-v3",),
)

KIMI_K2 = replace(
    DEEPSEEK_V3,
    model_type="kimi_k2",
    name="kimi",
    tool_calls="kimi_sections",
    description="Kimi K2 / K2-Thinking (text only, DeepSeek-V3 fields)",
    prefill_bf16_projections=("q_a_proj", "kv_a_proj_with_mqa"),  # as published Kimi FP8 conversions
    mtp_embed_copies=False,
    trust_remote_code=True,  # Kimi's tokenizer ships its own code
    recipe="kimi-k2.6",
    presets=(),
)

KIMI_K25 = replace(
    KIMI_K2,
    model_type="kimi_k25",
    description="Kimi K2.5 / K2.6 (multimodal wrapper: text_config, language_model. prefix, MoonViT)",
    text_config="text_config",
    prefix="language_model.model.",
    head_name="language_model.lm_head.weight",
    vision=True,
    presets=("kimi-k2.6",),
)
