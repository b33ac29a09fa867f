"""Streaming a layer's routed experts in chunks computes exactly what the whole-layer forward does."""

from __future__ import annotations

import pytest
import torch

from quantkit.checkpoint.reader import Checkpoint
from quantkit.model.reference import Context, decoder_layer
from quantkit.validation.forward import layer_weights


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_streamed_layer_equals_decoder_layer(tiny_glm, chunk):
    from quantkit.validation.layerstream import streamed_layer

    ckpt = Checkpoint(tiny_glm)
    a = ckpt.arch
    g = torch.Generator().manual_seed(0)
    hs = [torch.randn(2, 7, a.hidden_size, generator=g), torch.randn(1, 7, a.hidden_size, generator=g)]
    layer = next(i for i in range(a.num_hidden_layers) if a.is_moe(i) and a.indexer_layers[i])  # owns its DSA indexer
    want = [decoder_layer(h, layer_weights(ckpt, layer, "cpu", torch.float32),
                          Context.build(a, 7, "cpu", torch.float32), layer).hidden for h in hs]
    ctxs = [Context.build(a, 7, "cpu", torch.float32) for _ in hs]
    got = streamed_layer(ckpt, layer, hs, ctxs, "cpu", torch.float32, chunk)
    for g_, w_ in zip(got, want):
        assert torch.equal(g_, w_)
