"""DeepSeek-V3 and the families built on its modelling code: DeepSeek-V3/R1 and Kimi K2 / K2.5 / K2.6.

MLA attention (low-rank q and kv projections, a 576-wide latent cache), a dense-MLP prefix
(`first_k_dense_replace`), then MoE layers with a sigmoid `noaux_tc` router (a correction bias,
group-limited top-k) and one shared expert; MTP layers after the last decoder layer. Kimi K2 and
K2-Thinking ship model_type `kimi_k2` with DeepSeek-V3's fields; K2.5/K2.6 wrap the text model in a
multimodal `kimi_k25` config (`text_config`, tensors under `language_model.`, a MoonViT tower).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from quantkit.model.family import EngineModule, Family

MLA_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLA_NORMS = (("q_a_layernorm", "q_lora_rank"), ("kv_a_layernorm", "kv_lora_rank"))

# vLLM's and SGLang's deepseek_v2.py: q_a and kv_a are one fused module (SGLang: a ReplicatedLinear
# of q_lora + kv_lora + rope rows, shards concatenated on load; vLLM: a MergedColumnParallelLinear).
MLA_ENGINE = (
    EngineModule(("sglang",), "fused_qkv_a_proj_with_mqa", "ReplicatedLinear", ("q_a_proj", "kv_a_proj_with_mqa"), single=True),
    EngineModule(("vllm",), "fused_qkv_a_proj", "MergedColumnParallelLinear", ("q_a_proj", "kv_a_proj_with_mqa")),
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


DEEPSEEK_V3 = Family(
    model_type="deepseek_v3",
    name="deepseek_v3",
    tool_calls="deepseek_fences",
    description="DeepSeek-V3/R1 (and BF16 Kimi K2 variants saved as deepseek_v3)",
    attention="mla",
    router="sigmoid_group_topk",
    router_bias=True,
    # forced_rope_interleave None: transformers' DeepSeek-V3 defaults to interleaved (the config says)
    attention_projections=MLA_PROJECTIONS,
    attention_norms=MLA_NORMS,
    attention_shapes=mla_shapes,
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
