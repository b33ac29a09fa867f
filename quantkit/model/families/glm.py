"""GLM-5.x (`glm_moe_dsa`): DeepSeek-V3's skeleton plus DeepSeek Sparse Attention.

MLA attention, dense prefix, sigmoid `noaux_tc` router with one shared expert, and an MTP layer,
as DeepSeek-V3 (quantkit.model.families.deepseek_v3); each layer adds a "lightning indexer" that
picks the top-k keys (GLM-5.2 shares one across layers: IndexShare). GLM's modelling code always
interleaves rope, whatever the config says. GLM-5.2-FP8 ships its attention projections in FP8.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from quantkit.model.attention import Context
from quantkit.model.families.deepseek_v3 import (
    MLA,
    MLA_CACHE_CONFIG,
    MLA_ENGINE,
    MLA_NORMS,
    MLA_PROJECTIONS,
    mla_shapes,
    sigmoid_group_topk,
)
from quantkit.model.family import EngineModule, Family
from quantkit.model.numerics import linear
from quantkit.model.ops import append, apply_rope, query_chunk

LayerCache = Any  # quantkit.model.reference.LayerCache (Any: see quantkit.model.attention)

W = dict[str, torch.Tensor]

INDEXER_PROJECTIONS = ("wq_b", "wk", "weights_proj")


def dsa_shapes(a: Any) -> dict[str, tuple[int, ...]]:
    """[out, in] of each MLA projection and of the indexer's (`indexer.` leaves)."""
    ih, idim = a.index_n_heads, a.index_head_dim
    return mla_shapes(a) | {
        "indexer.wq_b": (ih * idim, a.q_lora_rank),
        "indexer.wk": (idim, a.hidden_size),
        "indexer.weights_proj": (ih, a.hidden_size),
    }


def dsa_indexer(x: torch.Tensor, q_resid: torch.Tensor, w: W, ctx: Context, cache: LayerCache | None, allowed: torch.Tensor) -> torch.Tensor:
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
        k = cache.index_k = append(cache.index_k, k)  # (B, S, hd)
    weights = linear(x, w["self_attn.indexer.weights_proj.weight"]).float() * nh**-0.5  # (B, T, ih)
    q, k = q.float(), k.float()
    tc = query_chunk(B * nh, k.shape[1])  # queries per chunk: a long window's (B, T, ih, S) scores are GBs
    if tc >= T:
        return _select(q, k, weights, allowed, a.index_topk, ctx.dsa_ties)
    return torch.cat([_select(q[:, t0:t0 + tc], k, weights[:, t0:t0 + tc], allowed[:, t0:t0 + tc], a.index_topk, ctx.dsa_ties)
                      for t0 in range(0, T, tc)], dim=1)


def _select(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, allowed: torch.Tensor, topk: int, ties: str) -> torch.Tensor:
    """The indexer's top-k for queries q (B, T, ih, hd) over keys k (B, S, hd): (B, T, min(topk, S))."""
    scores = F.relu(torch.einsum("bthd,bsd->bths", q, k) * q.shape[-1] ** -0.5)  # (B, T, ih, S)
    index_scores = torch.einsum("bth,bths->bts", weights, scores)  # (B, T, S)
    index_scores = index_scores.masked_fill(~allowed, float("-inf"))
    n = min(topk, index_scores.shape[-1])
    if ties == "topk":  # torch.topk's unspecified order, as transformers does it
        return index_scores.topk(n, dim=-1).indices
    # Exact ties are common (all heads' ReLU at zero); a stable sort breaks them towards earlier
    # tokens, so a token's selection is the same in a full forward and in one decode step.
    return torch.sort(index_scores, dim=-1, descending=True, stable=True).indices[..., :n]


GLM_MOE_DSA = Family(
    model_type="glm_moe_dsa",
    name="glm",
    tool_calls="glm45",
    description="GLM-5 / 5.1 / 5.2 (MLA with DeepSeek Sparse Attention)",
    attention=MLA(indexer=dsa_indexer),
    router=sigmoid_group_topk,
    router_bias=True,
    indexer=True,
    forced_rope_interleave=True,
    attention_projections=MLA_PROJECTIONS,
    attention_norms=MLA_NORMS,
    indexer_projections=INDEXER_PROJECTIONS,
    attention_shapes=dsa_shapes,
    # the latent's, and the indexer's: its keys are cached beside the latent, its top-k picks what is read
    cache_config=MLA_CACHE_CONFIG + ("index_n_heads", "index_head_dim", "index_topk", "index_topk_freq",
                                     "index_skip_topk_offset"),
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
