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
"""

from __future__ import annotations

from typing import Any

from quantkit.model.family import EngineModule, Family

GQA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def gqa_shapes(a: Any) -> dict[str, tuple[int, ...]]:
    """[out, in] of each attention projection, from a ModelArch."""
    h, hd = a.hidden_size, a.head_dim
    return {
        "q_proj": (a.num_attention_heads * hd, h),
        "k_proj": (a.num_key_value_heads * hd, h),
        "v_proj": (a.num_key_value_heads * hd, h),
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


QWEN3_MOE = Family(
    model_type="qwen3_moe",
    name="qwen3_moe",
    description="Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA with q/k norms, softmax router",
    attention="gqa",
    router="softmax_topk",
    forced_rope_interleave=False,
    attention_projections=GQA_PROJECTIONS,
    attention_norms=(("q_norm", "head_dim"), ("k_norm", "head_dim")),
    attention_shapes=gqa_shapes,
    # vLLM's and SGLang's qwen3_moe.py: q, k and v are one QKVParallelLinear
    engine_attention=(
        EngineModule(("sglang", "vllm"), "qkv_proj", "QKVParallelLinear", ("q_proj", "k_proj", "v_proj")),
        EngineModule(("sglang", "vllm"), "o_proj", "RowParallelLinear", ("o_proj",)),
    ),
    recipe="qwen3-moe",
    presets=("qwen3-30b-a3b",),
    config_view=qwen3_fields,
)
