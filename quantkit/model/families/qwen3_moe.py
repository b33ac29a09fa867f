"""Qwen3-MoE (`qwen3_moe`, Qwen3MoeForCausalLM): GQA attention with q/k RMSNorm, a softmax router.

Grouped-query attention (q, k, v and o projections; `num_key_value_heads` key/value heads, each
query and key head RMS-normed before rope, rope over the whole head in halves), routed experts
chosen by a softmax top-k (`norm_topk_prob` renormalises the chosen weights), no shared expert and
no router bias. Which layers are MoE: every `decoder_sparse_step`-th one not listed in
`mlp_only_layers`. No MTP layer, no indexer.

Sources: Qwen's BF16 releases (Qwen3-30B-A3B, preset `qwen3-30b-a3b`) and its fine-grained FP8
ones (Qwen3-30B-A3B-FP8: e4m3 with a float32 `weight_scale_inv` per 128x128 block, norms, router
and head BF16), the layout GLM-5.2-FP8 and DeepSeek-V3 ship, which the checkpoint reader reads.
The embedded `tiny:qwen3-moe` (quantkit.synthetic.tiny) is its test model.

Its layer kinds are written here and nowhere else (tests/model/test_families.py checks it): `GQA`
(the attention kind, quantkit.model.attention) and the `softmax_topk` router.

The KV cache. A GQA layer caches each key head (after k_norm and rope) and each value head. With
`fp8_e4m3` vLLM's `reshape_and_cache_flash` (csrc/cache_kernels.cu) writes the key as
`scaled_convert(k, *k_scale)` and the value as `scaled_convert(v, *v_scale)`: two per-layer static
scales, one per tensor, loaded from `self_attn.k_scale` / `v_scale` (there, `Attention` layers do get
the KV-cache method). Its V1 FlashAttention backend attends over the paged cache for prefill and
decode alike, so every token's attention reads keys and values as stored; that is what `store` gives
back. With FlashAttention 3 the query is quantized too (`q_scale`, 1.0 without one in the
checkpoint); that rounding is not simulated here. convert writes k_scale = max|k| / 448 and
v_scale = max|v| / 448 over the calibration tokens (llm-compressor's static minmax observer).
`fp8_ds_mla` is MLA's layout only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from quantkit.errors import ConfigError
from quantkit.model.attention import Attention, Context
from quantkit.model.family import EngineModule, Family
from quantkit.model.kvcache import KVCache, per_tensor, scale_from_absmax
from quantkit.model.numerics import linear
from quantkit.model.ops import append, apply_rope, rms_norm, softmax_scale

W = dict[str, torch.Tensor]

GQA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def gqa_shapes(a: Any) -> dict[str, tuple[int, ...]]:
    """[out, in] of each attention projection, from a ModelArch."""
    h, hd = a.hidden_size, a.size("head_dim")
    return {
        "q_proj": (a.num_attention_heads * hd, h),
        "k_proj": (a.size("num_key_value_heads") * hd, h),
        "v_proj": (a.size("num_key_value_heads") * hd, h),
        "o_proj": (h, a.num_attention_heads * hd),
    }


def qwen3_fields(text: dict) -> dict:
    """Qwen3-MoE's config in DeepSeek-V3's field names: the routed-expert count (`num_experts`, which
    transformers 5 saves as `num_local_experts`), no shared expert, and the MoE layers spelled out."""
    n = int(text["num_hidden_layers"])
    experts = int(text.get("num_experts", text.get("num_local_experts", 0)) or 0)
    step = int(text.get("decoder_sparse_step", 1) or 1)
    dense = set(text.get("mlp_only_layers") or [])
    sparse = ["sparse" if i not in dense and experts > 0 and (i + 1) % step == 0 else "dense" for i in range(n)]
    return text | {"n_routed_experts": experts, "n_shared_experts": 0, "mlp_layer_types": sparse,
                   "num_nextn_predict_layers": 0}


# ---- GQA: the attention kind (quantkit.model.attention) ----------------------------------------
@dataclass(frozen=True)
class GQA(Attention):
    """Grouped-query attention with per-head q/k RMSNorm before rope: `num_key_value_heads` key/value
    heads, each shared by num_attention_heads / num_key_value_heads query heads. The cache holds
    each key (after k_norm and rope) and value head, a static scale each (module docstring)."""

    kind = "gqa"
    kv_read_by = {  # noqa: RUF012
        "vllm_gqa": "k_scale for the keys, v_scale for the values (reshape_and_cache_flash); Attention layers load both",
    }
    kv_scale_covers = "GQA: max |k| / 448 and max |v| / 448"

    def sizes(self, text: dict[str, Any], need, source: str) -> dict[str, int]:
        """GQA's key/value heads and head width; rope turns the whole head (qk_rope_head_dim and
        v_head_dim are the head width), and MLA's ranks are 0."""
        hd = int(text.get("head_dim") or int(need("hidden_size")) // int(need("num_attention_heads")))
        heads, kv = int(need("num_attention_heads")), int(need("num_key_value_heads"))
        if heads % kv:  # checked when read: the reference forward repeats each key/value head heads // kv times
            raise ConfigError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}; "
                              "each key/value head serves a whole group of query heads; fix config.json")
        return dict(num_key_value_heads=int(need("num_key_value_heads")), head_dim=hd, q_lora_rank=0, kv_lora_rank=0,
                    qk_nope_head_dim=0, qk_rope_head_dim=hd, v_head_dim=hd)  # the first two: ModelArch.attention_sizes

    def forward(self, x: torch.Tensor, w: W, ctx: Context, layer: int) -> torch.Tensor:
        """GQA with per-head q/k RMSNorm before rope, over the cache's keys and values as stored."""
        a = ctx.arch
        B, T, _ = x.shape
        nh, nkv, hd = a.num_attention_heads, a.size("num_key_value_heads"), a.size("head_dim")
        q = rms_norm(linear(x, w["self_attn.q_proj.weight"]).view(B, T, nh, hd), w["self_attn.q_norm.weight"], a.rms_norm_eps)
        k = rms_norm(linear(x, w["self_attn.k_proj.weight"]).view(B, T, nkv, hd), w["self_attn.k_norm.weight"], a.rms_norm_eps)
        v = linear(x, w["self_attn.v_proj.weight"]).view(B, T, nkv, hd)
        cos, sin = ctx.cos[:, None, :], ctx.sin[:, None, :]  # (T, 1, hd/2): broadcast over heads
        q, k = apply_rope(q, cos, sin, a.rope_interleave), apply_rope(k, cos, sin, a.rope_interleave)  # (B, T, h, hd)
        if ctx.kv is not None:  # as the cache stores them; vLLM's FlashAttention reads prefill's keys back too
            k, v = self.store(ctx.kv, layer, w, k, v)
        cache = ctx.caches[layer] if ctx.caches is not None else None
        if cache is not None:
            k = cache.key = append(cache.key, k)  # (B, S, nkv, hd)
            v = cache.value = append(cache.value, v)
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

    def store(self, kv: KVCache, layer: int, w: W, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as the cache gives them back: per-tensor k_scale and v_scale."""
        kv.observe(layer, "key", key)
        kv.observe(layer, "value", value)
        if kv.dtype == "fp8_e4m3":
            return per_tensor(key, kv.scale(w, 0, layer=layer)), per_tensor(value, kv.scale(w, 1, layer=layer))
        if kv.dtype == "fp8_ds_mla":
            raise ValueError("fp8_ds_mla is vLLM's MLA (DSA) cache layout; a GQA model's FP8 cache is fp8_e4m3")
        return key, value

    def kv_scales(self, maxima: dict[str, float]) -> tuple[float, float]:
        """The keys' and the values' maxima over 448, apart."""
        return scale_from_absmax(maxima["key"]), scale_from_absmax(maxima.get("value", 0.0))

    def kv_report(self, maxima: dict[str, float]) -> dict:
        k, v = self.kv_scales(maxima)
        return {"key_absmax": maxima["key"], "value_absmax": maxima.get("value"), "k_scale": k, "v_scale": v}

    def cache_bytes(self, arch, kv_dtype: str) -> int:
        """The key and value heads: 2 * num_key_value_heads * head_dim values (FP8's two per-tensor
        scales are per layer, not per token)."""
        return 2 * arch.size("num_key_value_heads") * arch.size("head_dim") * (2 if kv_dtype == "bf16" else 1)

    def kv_heads(self, arch) -> int:
        """vLLM splits the key/value heads over the TP ranks (quantkit.planner.kv.tp_split)."""
        return arch.size("num_key_value_heads")

# ---- the router --------------------------------------------------------------------------------
def softmax_topk(x: torch.Tensor, w: W, arch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, then the top k (Qwen3-MoE, transformers' Qwen3MoeTopKRouter)."""
    probs = F.linear(x.float(), w["mlp.gate.weight"].float()).softmax(dim=-1)  # (N, E)
    topk_weight, topk_idx = probs.topk(arch.num_experts_per_tok, dim=-1)
    return topk_idx, topk_weight


QWEN3_MOE = Family(
    model_type="qwen3_moe",
    name="qwen3_moe",
    description="Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA with q/k norms, softmax router",
    attention=GQA(),
    router=softmax_topk,
    forced_rope_interleave=False,
    attention_projections=GQA_PROJECTIONS,
    attention_norms=(("q_norm", "head_dim"), ("k_norm", "head_dim")),
    attention_shapes=gqa_shapes,
    cache_config=("num_key_value_heads",),  # the cached key/value heads (head_dim: every family's field)
    # vLLM's and SGLang's qwen3_moe.py: q, k and v are one QKVParallelLinear
    engine_attention=(
        EngineModule(("sglang", "vllm"), "qkv_proj", "QKVParallelLinear", ("q_proj", "k_proj", "v_proj")),
        EngineModule(("sglang", "vllm"), "o_proj", "RowParallelLinear", ("o_proj",)),
    ),
    recipe="qwen3-moe",
    presets=("qwen3-30b-a3b",),
    config_view=qwen3_fields,
)
