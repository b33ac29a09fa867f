"""Streaming forward over a checkpoint: embed, then one decoder layer at a time, then the head.

Peak memory is one layer's weights plus the activations, whatever the depth. This is the loop
`logits`, `validate` and the incremental decode path share; `convert` has its own visible loop
because it also quantizes and writes between the two halves of each layer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantkit.checkpoint import Checkpoint
from quantkit.reference import Context, LayerCache, decoder_layer, head_weight_name, resolve_device, rms_norm


def embed(ckpt: Checkpoint, input_ids: torch.Tensor, device, dtype) -> torch.Tensor:
    """Hidden states (B, T, D) on `device`. The lookup runs on the CPU, where the checkpoint puts the
    table (vocab x D, gigabytes at full scale), so only the B x T x D result crosses to the device."""
    table = ckpt.get(f"{ckpt.arch.prefix}embed_tokens.weight", dtype)
    return torch.nn.functional.embedding(input_ids.cpu(), table).to(device)  # (B, T, D)


def head(ckpt: Checkpoint, h: torch.Tensor, dtype) -> torch.Tensor:
    a = ckpt.arch
    h = rms_norm(h, ckpt.get(f"{a.prefix}norm.weight", dtype).to(h.device), a.rms_norm_eps)
    return torch.nn.functional.linear(h, ckpt.get(head_weight_name(a), dtype).to(h.device))  # (B, T, V)


def layer_weights(ckpt: Checkpoint, layer: int, device, dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in ckpt.layer(layer, dtype).items()}


def run(
    ckpt: Checkpoint,
    input_ids: torch.Tensor,
    *,
    device: str | torch.device = "auto",
    dtype: torch.dtype = torch.float32,
    caches: list[LayerCache] | None = None,
    on_layer=None,
    **options,
) -> torch.Tensor:
    """Logits (B, T, V) for `input_ids` (B, T), continuing `caches` when given (incremental decode).

    `on_layer(layer, hidden)` is called after every decoder layer (validation records errors there).
    `options` go to the reference Context (`dsa_dense`, `dsa_ties`).
    """
    device = resolve_device(device)
    a = ckpt.arch
    input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    start = caches[0].length if caches else 0
    ctx = Context.build(a, input_ids.shape[1], device, dtype, start=start, caches=caches, **options)
    with torch.no_grad():
        h = embed(ckpt, input_ids, device, dtype)
        for layer in range(a.num_hidden_layers):
            h = decoder_layer(h, layer_weights(ckpt, layer, device, dtype), ctx, layer).hidden
            if on_layer is not None:
                on_layer(layer, h)
        return head(ckpt, h, dtype)


def logits(model: str | Path | Checkpoint, input_ids, device: str = "auto", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits of `model` (a folder or `tiny:kimi-k2.6` / `tiny:glm-5.2`) on `input_ids` (T,) or (B, T).

    Runs layer by layer from the checkpoint on CUDA when available (device="auto"), else CPU.

    Example:
        >>> import quantkit as qk, torch
        >>> qk.logits("tiny:glm-5.2", torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3, 512])
    """
    from quantkit.models import open_checkpoint

    ckpt = model if isinstance(model, Checkpoint) else open_checkpoint(model)
    return run(ckpt, input_ids, device=device, dtype=dtype)


def new_caches(ckpt: Checkpoint) -> list[LayerCache]:
    return [LayerCache() for _ in range(ckpt.arch.num_hidden_layers)]
