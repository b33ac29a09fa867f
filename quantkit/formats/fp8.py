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
    if out % block == 0 and inp % block == 0:  # whole blocks: each scale broadcast over its block, in place
        w = q.float()
        w.view(rows, block, cols, block).mul_(scale.float()[:, None, :, None])  # [R, b, C, b]
        return w
    s = scale.float().repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]
    return q.float() * s


ACT_EPS = 1e-10  # the engines' floor on a group's amax (vLLM and SGLang: eps=1e-10)


def quantize_activations(x: torch.Tensor, block: int = BLOCK, ue8m0: bool = False) -> torch.Tensor:
    """`x` (..., K) as an engine's W8A8 FP8 Linear sees it: quantized to e4m3 per token in groups of `block`
    input columns and dequantized, in x's dtype. Per group: s = max(amax, 1e-10) / 448 in float32,
    q = clamp(x / s, -448, 448) cast to e4m3 (round to nearest even). This is vLLM 0.33.0's
    `per_token_group_quant_fp8` (model_executor/layers/quantization/utils/fp8_utils.py: `_absmax =
    max(max|y|, eps)`, `scale_raw = _absmax * (1 / fp8_max)`) and SGLang 0.5.23's
    `sglang_per_token_group_quant_fp8` (srt/layers/quantization/fp8_kernel.py). `ue8m0`: the scale
    rounded up to a power of two (`exp2(ceil(log2(s)))`), which both use only where DeepGEMM wants UE8M0
    scales (Blackwell; vLLM `is_deep_gemm_e8m0_used`, SGLang `DEEPGEMM_SCALE_UE8M0`); float32 otherwise."""
    K = x.shape[-1]
    if K % block:
        raise ValueError(f"activation width {K} is not a multiple of the FP8 group {block} (see cannot_run)")
    g = x.float().reshape(*x.shape[:-1], K // block, block)
    s = g.abs().amax(-1, keepdim=True).clamp(min=ACT_EPS) * (1.0 / E4M3_MAX)
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (g / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * s).reshape(x.shape).to(x.dtype)


def cannot_run(shape: tuple[int, ...], block: int = BLOCK) -> str | None:
    """Why no serving target can compute a Linear of this shape ([out, in]) as FP8 `block`-blocks,
    or None. Partial blocks along the output dim are fine (every engine's scale grid uses ceil; the
    tiny GLM's 160-row kv_a_proj_with_mqa and 64-row indexer wk run in compressed-tensors); along the
    input dim none is, because the activations are quantized in groups of `block` input columns:
      - vLLM 0.33.0 `per_token_group_quant_fp8` asserts `x.shape[-1] % group_size == 0`
        (model_executor/layers/quantization/utils/fp8_utils.py), so does SGLang 0.5.23's
        (`sglang_per_token_group_quant_fp8`, srt/layers/quantization/fp8_kernel.py);
      - compressed-tensors' forward (what transformers runs for the decode checkpoint) quantizes the
        input in `group_size` groups and fails ("unflatten: Provided sizes [1, 128] don't multiply up
        to the size of dim 3 (64)"; quantization/lifecycle/forward.py `forward_quantize`)
    (TP splits add their own rules per partition; quantkit.serving.checks states them.)"""
    if len(shape) != 2:
        return None
    cols = shape[1]
    if cols % block:
        return (f"its input dim {cols} is not a multiple of the {block}-column FP8 block (vLLM's and SGLang's "
                f"per-token-group activation quantization and compressed-tensors' block forward need whole groups)")
    return None


def can_block(shape: tuple[int, ...], block: int = BLOCK) -> bool:
    """Whether engines can run this projection with whole blocks (both dims multiples of `block`)."""
    return shape[0] % block == 0 and shape[1] % block == 0
