"""GLM-5.x (`glm_moe_dsa`): DeepSeek-V3's skeleton plus DeepSeek Sparse Attention.

MLA attention, dense prefix, sigmoid `noaux_tc` router with one shared expert, and an MTP layer,
as DeepSeek-V3 (quantkit.model.families.deepseek_v3); each layer adds a "lightning indexer" that
picks the top-k keys (GLM-5.2 shares one across layers: IndexShare). GLM's modelling code always
interleaves rope, whatever the config says. GLM-5.2-FP8 ships its attention projections in FP8.
"""

from __future__ import annotations

from typing import Any

from quantkit.model.families.deepseek_v3 import MLA_ENGINE, MLA_NORMS, MLA_PROJECTIONS, mla_shapes
from quantkit.model.family import EngineModule, Family

INDEXER_PROJECTIONS = ("wq_b", "wk", "weights_proj")


def dsa_shapes(a: Any) -> dict[str, tuple[int, ...]]:
    """[out, in] of each MLA projection and of the indexer's (`indexer.` leaves)."""
    ih, idim = a.index_n_heads, a.index_head_dim
    return mla_shapes(a) | {
        "indexer.wq_b": (ih * idim, a.q_lora_rank),
        "indexer.wk": (idim, a.hidden_size),
        "indexer.weights_proj": (ih, a.hidden_size),
    }


GLM_MOE_DSA = Family(
    model_type="glm_moe_dsa",
    name="glm",
    tool_calls="glm45",
    description="GLM-5 / 5.1 / 5.2 (MLA with DeepSeek Sparse Attention)",
    attention="mla",
    router="sigmoid_group_topk",
    router_bias=True,
    indexer=True,
    forced_rope_interleave=True,
    attention_projections=MLA_PROJECTIONS,
    attention_norms=MLA_NORMS,
    indexer_projections=INDEXER_PROJECTIONS,
    attention_shapes=dsa_shapes,
    replicated=("q_a_proj", "kv_a_proj_with_mqa"),
    # vLLM's and SGLang's indexer: wq_b replicated in both, wk a module of its own in SGLang only
    engine_attention=MLA_ENGINE + (
        EngineModule(("sglang", "vllm"), "indexer.wq_b", "ReplicatedLinear", ("indexer.wq_b",)),
        EngineModule(("sglang",), "indexer.wk", "ReplicatedLinear", ("indexer.wk",)),
    ),
    always_bf16=("weights_proj",),  # the indexer's head weights: BF16 in GLM-5.2-FP8 and in the engines
    recipe="glm-5.2",
    presets=("glm-5.2",),
)
