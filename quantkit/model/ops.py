"""The small pieces every attention kind and the decoder layer share: RMSNorm, rope, the softmax
scale, and growing a cache along the token axis.

Apart from quantkit.model.reference so that an attention kind's forward (owned by the family that
introduced it, quantkit.model.families) can use them without importing the reference forward,
which reaches the definitions through quantkit.model.arch. They read a ModelArch's fields only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# a quantkit.model.arch.ModelArch; typed Any because arch imports the family definitions, which import this
ModelArch = Any


# ---- small pieces ------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


# ---- rope --------------------------------------------------------------------------------------
def rope_inv_freq(arch: ModelArch) -> tuple[torch.Tensor, float]:
    """Inverse frequencies over the rope head dim, and the cos/sin scale (YaRN's attention factor)."""
    r, dim = arch.rope, arch.qk_rope_head_dim
    base = float(r["rope_theta"])
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if r["rope_type"] == "default":
        return 1.0 / pos_freqs, 1.0
    # YaRN: interpolate low frequencies by `factor`, keep high ones, ramp in between.
    factor = float(r["factor"])
    orig = float(r["original_max_position_embeddings"])
    beta_fast, beta_slow = float(r.get("beta_fast") or 32), float(r.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if r.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    attention_factor = r.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = r.get("mscale"), r.get("mscale_all_dim")
        attention_factor = (
            _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all else _yarn_mscale(factor)
        )
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(arch: ModelArch) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)^2 when YaRN is on."""
    scale = arch.qk_head_dim**-0.5
    r = arch.rope
    if r["rope_type"] != "default" and r.get("mscale_all_dim"):
        m = _yarn_mscale(float(r["factor"]), float(r["mscale_all_dim"]))
        scale *= m * m
    return scale


def rope_tables(arch: ModelArch, positions: torch.Tensor, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, rope_dim/2) for the given absolute positions, on `device`.

    Computed on the CPU in float32 whatever the device, then moved once: a GPU's sin/cos can
    differ from the CPU's in the last bit, and the tables would then differ between machines.
    """
    inv_freq, attention_factor = rope_inv_freq(arch)  # CPU
    freqs = positions.to("cpu", torch.float32)[:, None] * inv_freq[None, :]  # (T, rope/2)
    cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
    return cos.to(device, dtype), sin.to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate the last dim of x (..., T, rope). Interleaved: pairs (x0,x1),(x2,x3)..., output de-interleaved
    (rotated evens then odds), as transformers and the engines lay it out. Otherwise: halves."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def append(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """A cache grown by the new tokens along dim 1 (a new tensor: a copied cache keeps its own)."""
    return new if old is None else torch.cat([old, new], dim=1)


# A long window's attention scores are (B, heads, T, S) float32: 8.6 GB per layer for two 4096-token
# windows of GLM 5.2 (64 heads), more than the host that holds the layer. Queries are independent rows
# of the softmax, so they are scored in chunks of at most this many bytes of scores; below it (every
# short window, every tiny model) there is one chunk and the computation is the unchunked one.
SCORE_CHUNK_BYTES = 256 * 2**20


def query_chunk(rows_per_query: int, S: int, budget: int | None = None) -> int:
    """Queries per chunk so that a chunk's float32 scores, `rows_per_query` (batch x heads) x S per query,
    stay within `budget` (SCORE_CHUNK_BYTES; at least one query)."""
    return max(1, (SCORE_CHUNK_BYTES if budget is None else budget) // (4 * rows_per_query * max(S, 1)))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T x scale, masked to `allowed`) v for q (B, h, T, d), k (B, h, S, d), v (B, h, S, dv) and
    allowed (B, T, S): (B, h, T, dv), scored in query chunks of at most SCORE_CHUNK_BYTES."""
    B, h, T, _ = q.shape
    tc = query_chunk(B * h, k.shape[-2])
    if tc >= T:
        return _attend(q, k, v, allowed, scale)
    out = q.new_empty(B, h, T, v.shape[-1])
    for t0 in range(0, T, tc):
        out[:, :, t0:t0 + tc] = _attend(q[:, :, t0:t0 + tc], k, v, allowed[:, t0:t0 + tc], scale)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, h, T, S)
    scores = scores.masked_fill(~allowed[:, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
