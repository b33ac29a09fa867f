"""quantkit.model.ops: attention scored in query chunks computes what the unchunked form does, and
bounds the scores it holds."""

from __future__ import annotations

import torch
from test_reference import check_against_transformers, ids_for

import quantkit.model.ops as ops
from quantkit.checkpoint.reader import Checkpoint
from quantkit.validation.forward import run


def test_query_chunks_bound_the_scores():
    # GLM 5.2's long window: 2 x 64 heads x 4096 keys x 4 bytes = 2 MiB of scores per query row
    tc = ops.query_chunk(2 * 64, 4096)
    assert tc * 2 * 64 * 4096 * 4 <= ops.SCORE_CHUNK_BYTES < (tc + 1) * 2 * 64 * 4096 * 4
    assert ops.query_chunk(10**6, 10**6) == 1  # at least one query


def test_chunked_attention_equals_one_chunk(monkeypatch):
    g = torch.Generator().manual_seed(0)
    B, h, T, d, dv = 2, 3, 37, 8, 5
    q, k, v = torch.randn(B, h, T, d, generator=g), torch.randn(B, h, T, d, generator=g), torch.randn(B, h, T, dv, generator=g)
    allowed = (torch.arange(T)[None, :] <= torch.arange(T)[:, None])[None].expand(B, T, T) & (torch.rand(B, T, T, generator=g) > 0.3)
    allowed = allowed | torch.eye(T, dtype=torch.bool)[None]  # every query sees itself
    whole = ops.attention(q, k, v, allowed, 0.3)
    monkeypatch.setattr(ops, "SCORE_CHUNK_BYTES", 4 * B * h * T * 5)  # 5 queries a chunk: 8 chunks, the last short
    assert ops.query_chunk(B * h, T) == 5
    torch.testing.assert_close(ops.attention(q, k, v, allowed, 0.3), whole, rtol=1e-6, atol=1e-6)


def test_tiny_glm_in_chunks_still_matches_transformers(tiny_glm, tmp_path, monkeypatch):
    """The whole reference forward with MLA and the DSA indexer both chunked (3 queries a chunk), past
    index_topk: the same logits as unchunked and as transformers."""
    ckpt = Checkpoint(tiny_glm)
    ids = ids_for(ckpt.arch.vocab_size, 2, 40)
    whole = run(ckpt, ids, device="cpu", dsa_ties="topk")
    monkeypatch.setattr(ops, "SCORE_CHUNK_BYTES", 4 * 2 * ckpt.arch.num_attention_heads * 40 * 3)
    chunked = run(ckpt, ids, device="cpu", dsa_ties="topk")
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    check_against_transformers(tiny_glm, tmp_path, T=40)
