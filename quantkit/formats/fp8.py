"""DeepSeek-native FP8 block format: e4m3 weights with one float32 multiplier per 128x128 block.

    weight            float8_e4m3fn [out, in]
    weight_scale_inv  float32 [ceil(out/128), ceil(in/128)]   w = q * s over each block

Despite its name `weight_scale_inv` is a multiplier. Edge blocks (shapes not a multiple of 128)
are partial; the grid uses ceil. Engines need whole 128-blocks for some fused projections, which
the converter handles by keeping those projections BF16, not here.
"""

from __future__ import annotations

import torch

BLOCK = 128
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def _blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, int, int]:
    out, inp = w.shape
    po, pi = (-out) % block, (-inp) % block
    w = torch.nn.functional.pad(w, (0, pi, 0, po))
    # (out/B, B, in/B, B) -> (out/B, in/B, B, B)
    return w.view(w.shape[0] // block, block, w.shape[1] // block, block).transpose(1, 2), out, inp


def quantize(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] (any float dtype) -> (e4m3 weight [out, in], float32 scale grid)."""
    wb, out, inp = _blocks(w.float(), block)  # (R, C, B, B)
    amax = wb.abs().amax(dim=(-1, -2))  # (R, C)
    scale = (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (wb / scale[..., None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.transpose(1, 2).reshape(q.shape[0] * block, q.shape[1] * block)[:out, :inp]
    return q.contiguous(), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """(e4m3 [out, in], scale grid) -> float32 weight [out, in]."""
    out, inp = q.shape
    rows, cols = -(-out // block), -(-inp // block)
    if tuple(scale.shape) != (rows, cols):
        raise ValueError(f"scale grid {tuple(scale.shape)} does not match weight {out}x{inp} in {block}-blocks")
    s = scale.float().repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]
    return q.float() * s


def can_block(shape: tuple[int, int], block: int = BLOCK) -> bool:
    """Whether engines can run this projection with whole blocks (both dims multiples of `block`)."""
    return shape[0] % block == 0 and shape[1] % block == 0
