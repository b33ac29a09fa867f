"""compressed-tensors `pack-quantized` INT4: eight 4-bit values per int32, along the input dim.

A quantized Linear is stored as three tensors beside each other:
    weight_packed  int32 [out, in/8]   value j of a word in bits 4j..4j+3, stored as q + 8 (0..15)
    weight_scale   bf16  [out, in/G]   one multiplier per group of G input columns
    weight_shape   int32 [2]           the unpacked [out, in]
and, only for asymmetric schemes, weight_zero_point int32 [ceil(out/8), in/G] packed along dim 0.
Symmetric is what the engines' MoE kernels accept (SGLang asserts it), so we write symmetric
only; we read both. Dequantization happens in the scale's dtype, as compressed-tensors does it,
so our numbers are bit-identical to what a client computes.
"""

from __future__ import annotations

import torch

OFFSET = 8  # q in [-8, 7] is stored as q + 8 in [0, 15]
PER_WORD = 8  # 32 bits / 4 bits


def pack(q: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """int8 values in [-8, 7] -> int32 words, eight per word along `dim` (-1: input dim, 0: rows)."""
    if q.dtype != torch.int8:
        raise TypeError(f"pack wants int8 values, got {q.dtype}")
    if dim == 0:
        return pack(q.transpose(0, 1).contiguous(), -1).transpose(0, 1).contiguous()
    rows, cols = q.shape
    pad = (-cols) % PER_WORD
    u = (q.to(torch.int32) + OFFSET)
    if pad:
        u = torch.nn.functional.pad(u, (0, pad), value=0)  # padding nibbles are 0 bits, as compressed-tensors writes them
    u = u.view(rows, -1, PER_WORD)  # (rows, words, 8)
    # nibble k at bits 4k..4k+3, OR-ed in int32: the top nibble's shift sets the sign bit, which is the
    # two's-complement int32 word compressed-tensors writes (no int64 round trip: a real-width matrix
    # is 12M nibbles, and 8-byte temporaries made packing a visible share of a convert)
    words = u[..., 0].clone()
    for k in range(1, PER_WORD):
        words |= u[..., k] << (4 * k)
    return words


def unpack(packed: torch.Tensor, shape: tuple[int, int], dim: int = -1) -> torch.Tensor:
    """int32 words -> int8 values in [-8, 7] of the given unpacked `shape`."""
    if packed.dtype != torch.int32:
        raise TypeError(f"unpack wants int32 words, got {packed.dtype}")
    rows, cols = shape
    if dim == 0:
        return unpack(packed.transpose(0, 1).contiguous(), (cols, rows), -1).transpose(0, 1).contiguous()
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)  # (8,)
    u = (packed.unsqueeze(-1) >> shifts) & 0xF  # (rows, words, 8); arithmetic shift, masked
    return (u.reshape(rows, -1)[:, :cols] - OFFSET).to(torch.int8)


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shape: tuple[int, int] | torch.Tensor,
    zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stored tensors -> weight [out, in] in the scale's dtype: (q - zp) * scale per group."""
    out, inp = (int(x) for x in shape)
    q = unpack(packed, (out, inp))
    n_groups = scale.shape[-1]
    if inp % n_groups:
        raise ValueError(f"input dim {inp} is not a whole number of groups ({n_groups} scales)")
    g = inp // n_groups
    x = q.to(scale.dtype).view(out, n_groups, g)  # (out, groups, G)
    if zero_point is not None:
        zp = unpack(zero_point, (out, n_groups), dim=0)
        x = x - zp.to(scale.dtype).unsqueeze(-1)
    return (x * scale.unsqueeze(-1)).view(out, inp)


def store(q: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """The three stored tensors of one symmetric quantized Linear (suffixes of `<module>.`)."""
    return {
        "weight_packed": pack(q),
        "weight_scale": scale.contiguous(),
        "weight_shape": torch.tensor(list(q.shape), dtype=torch.int32, device=q.device),
    }


def quantization_config(group_size: int, ignore: list[str]) -> dict:
    """`quantization_config` for a checkpoint whose quantized Linears are all W4A16 group-G symmetric.

    One config group targets `Linear` (SGLang takes the MoE scheme from the group targeting
    Linear); everything not quantized is listed in `ignore` by exact module name.
    """
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": group_size,
                    "dynamic": False,
                    "actorder": None,
                    "observer": "minmax",
                },
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }
