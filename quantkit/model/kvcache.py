"""The FP8 KV cache as the engines store it: simulated by `validate`, calibrated by `convert`.

An MLA layer caches, per token, the compressed latent `kv_c` (after kv_a_layernorm) and the rope
key `k_pe` (after rope); GLM's DSA adds the indexer's key. With `--kv-cache-dtype fp8_e4m3` the
engines keep these in e4m3. What they do, as read in their sources:

    vLLM, dense MLA (Kimi K2.6, DeepSeek-V3)
        csrc/cache_kernels.cu `concat_and_cache_mla_kernel`, called from `MLAAttention.forward_impl`
        (vllm/attention/layer.py) with `scale=self._k_scale`: kv_c and k_pe are each written as
        `fp8::scaled_convert(x, *scale)`, which is `__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE,
        __NV_E4M3)` (csrc/quantization/.../nvidia/quant_utils.cuh `scaled_vec_conversion`): divide in
        float32, saturate to +-448, round to nearest even. One per-layer scale for both parts; the
        reader multiplies by it. `v_scale` is loaded but the joint latent cache only uses `k_scale`.
        The scale comes from `self_attn.k_scale` / `v_scale` tensors (BaseKVCacheMethod in
        vllm/model_executor/layers/quantization/kv_cache.py: -1.0 until loaded, 1.0 when the
        checkpoint has none, with the warning "Using KV cache scaling factor 1.0 for fp8_e4m3").
        But in vLLM 0.33.0 (the release quantkit.serving.engines pins) both CompressedTensorsConfig and
        Fp8Config `get_quant_method` attach that KV-cache method only to `isinstance(layer,
        Attention)`, and MLAAttention is `nn.Module, AttentionLayerBase` in the vllm/attention/
        layer.py we read, not an `Attention`: unless that changed, the MLA layer never creates the
        k_scale parameter, `maybe_remap_kv_scale_name` drops the checkpoint's tensor with "...
        not loaded", and the cache runs at scale 1.0 whatever the checkpoint says.
    vLLM, DSA models (anything with `index_topk`: DeepSeek-V3.2, GLM-5.2)
        vllm/model_executor/models/config.py `DeepseekV32ForCausalLM.verify_and_update_config`
        turns any fp8 KV dtype into `fp8_ds_mla`: `concat_and_cache_ds_mla_kernel` stores kv_c as
        e4m3 with one float32 scale per 128-value tile, `max(amax / 448, FLT_MIN)`, computed per
        token; k_pe is kept in bf16. No static scale is read: `k_scale` is ignored there.
        The indexer keys always go through `indexer_k_quant_and_cache_kernel` (whatever the KV
        dtype): per token and 128-block, `scale = max(amax, 1e-4) / 448`, rounded up to a power of
        two when `use_ue8m0` (DeepSeek's `scale_fmt: ue8m0`), e4m3 of x / scale.
    SGLang
        0.5.23 (the release quantkit.serving.engines pins) loads the scales: its CompressedTensorsConfig
        gives every RadixAttention a CompressedTensorsKVCacheMethod when `kv_cache_scheme` is static
        symmetric per-tensor FP8 (layers/quantization/compressed_tensors/compressed_tensors.py,
        `is_supported_scheme`). The MLA pool of the release we could read
        (mem_cache/memory_pool.py `MLATokenToKVPool.set_mla_kv_buffer`) casts with
        `.to(self.dtype)`, i.e. scale 1.0 without saturation; whether 0.5.23's pool divides by
        k_scale was not read here. Its NSA (DSA) backend quantizes per 128-tile like vLLM's
        fp8_ds_mla (layers/attention/nsa/quant_k_cache.py).

Another attention kind stores its own parts (quantkit.model.attention `store`), as its family's
definition says and documents (quantkit.model.families).

The scale convert writes: vLLM's MLA decode also quantizes the absorbed query to FP8 with
`q_scale` (`MLAAttention.forward_decode`), and q_scale defaults to k_scale when the checkpoint has
none (BaseKVCacheMethod). A k_scale fitted to the cache alone (absmax / 448) would clip the query:
on the tiny models the absorbed query's maximum is 1.5-3x the cache's. So k_scale = v_scale =
max(|kv_c|, |k_pe|, |absorbed query|) / 448 over the calibration tokens: nothing saturates, and
e4m3 keeps its relative precision (only the subnormal floor moves). The query's own rounding is
not simulated here (it is not cache storage); the cache's is.

KV dtypes here: `bf16` (the cache holds what attention computed; the baseline), `fp8_e4m3`
(per-layer static scales), `fp8_ds_mla` (dynamic per-tile, vLLM's DSA path). Which parts a layer
caches and how each is rounded is its attention kind's `store`; this module holds the quantizers,
the scales a layer's weights carry, and the calibration maxima.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

E4M3_MAX = 448.0
FLT_MIN = 1.1754943508222875e-38  # float32's smallest normal, the ds_mla tile scale's floor
KV_DTYPES = ("bf16", "fp8_e4m3", "fp8_ds_mla")
SCALE_NAMES = ("self_attn.k_scale", "self_attn.v_scale")  # per layer, as llm-compressor writes them
DS_MLA_TILE = 128
INDEXER_BLOCK = 128


# ---- pure quantizers -------------------------------------------------------------------------------
def to_e4m3(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """e4m3 codes of x / scale, saturating at +-448 (vLLM's `scaled_convert`; torch's own cast
    would turn an overflow into NaN). Division in float32, round to nearest even."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def per_tensor(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What a cache with one static scale gives back: e4m3(x / scale) * scale, in x's dtype."""
    s = torch.tensor(scale, dtype=torch.float32)
    return (to_e4m3(x, s).float() * s).to(x.dtype)


def ds_mla(latent: torch.Tensor, tile: int = DS_MLA_TILE) -> torch.Tensor:
    """vLLM's fp8_ds_mla latent: per token, one float32 scale per `tile` values, max(amax/448, FLT_MIN)."""
    *lead, n = latent.shape
    if n % tile:
        raise ValueError(f"fp8_ds_mla needs kv_lora_rank divisible by {tile} (got {n})")
    x = latent.float().reshape(*lead, n // tile, tile)  # (..., tiles, tile)
    s = (x.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(FLT_MIN)
    return (to_e4m3(x, s).float() * s).reshape(*lead, n).to(latent.dtype)


def ue8m0(s: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= s (s > 0), exactly: vLLM's `exp2f(ceilf(log2f(s)))` without
    depending on log2's last-ulp rounding."""
    m, e = torch.frexp(s)  # s = m * 2**e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(s), torch.where(m == 0.5, e - 1, e))


def indexer_keys(k: torch.Tensor, block: int = INDEXER_BLOCK, use_ue8m0: bool = True) -> torch.Tensor:
    """vLLM's `indexer_k_quant_and_cache`: per token and `block` values (the whole head when it is
    shorter), scale max(amax, 1e-4)/448, a power of two with ue8m0; e4m3(k / scale) * scale."""
    *lead, n = k.shape
    b = min(block, n)
    x = k.float().reshape(*lead, n // b, b)  # (..., blocks, block)
    s = x.abs().amax(-1, keepdim=True).clamp_min(torch.tensor(1e-4, dtype=torch.float32)) / E4M3_MAX
    if use_ue8m0:
        s = ue8m0(s)
    return (to_e4m3(x, s).float() * s).reshape(*lead, n).to(k.dtype)


def scale_from_absmax(absmax: float) -> float:
    """The static per-tensor scale that maps the calibration maximum onto e4m3's largest value."""
    return absmax / E4M3_MAX if absmax > 0 and math.isfinite(absmax) else 1.0


# ---- what the reference forward consults (`Context.kv`) --------------------------------------------
@dataclass
class KVCache:
    """How the KV cache stores values: an attention kind's `store` (quantkit.model.attention) asks
    `dtype` and the layer's `scale`, and rounds each cached part with the quantizers above; `index`
    is what the DSA indexer key cache gives back. `scales`: "checkpoint" reads each layer's
    `self_attn.k_scale` (and `v_scale`) from its weights (1.0 where the checkpoint has none), "one"
    uses 1.0."""

    dtype: str = "bf16"
    scales: str = "checkpoint"
    measuring: ClassVar[bool] = False  # a calibration pass (KVAbsmax): `observe` records

    def __post_init__(self):
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV cache dtype {self.dtype!r}; one of {', '.join(KV_DTYPES)}")

    def scale(self, w: dict[str, torch.Tensor], which: int = 0, *, layer: int | None = None) -> float:
        """The layer's k_scale (`which` 0) or v_scale (1), as the engine would load it from the layer's
        weights `w` (`layer`: which one, for a study that sets its own scales per layer)."""
        t = w.get(SCALE_NAMES[which]) if self.scales == "checkpoint" else None
        return float(t) if t is not None else 1.0

    def index(self, k: torch.Tensor) -> torch.Tensor:
        return indexer_keys(k) if self.dtype != "bf16" else k

    def observe(self, layer: int, name: str, x: torch.Tensor) -> None:
        """Calibration's hook (KVAbsmax): an attention kind reports each tensor its scales must cover."""


@dataclass
class KVAbsmax(KVCache):
    """Calibration: stores nothing differently, records per layer the absolute maximum of each tensor
    the attention kind reports (`observe`: what the cache holds, and for MLA the absorbed decode
    query); the kind turns them into the layer's k_scale and v_scale (`Attention.kv_scales`)."""

    maxima: dict[int, dict[str, float]] = field(default_factory=dict)  # layer -> name -> max |x|
    measuring: ClassVar[bool] = True

    def observe(self, layer: int, name: str, x: torch.Tensor) -> None:
        seen = self.maxima.setdefault(layer, {})
        seen[name] = max(seen.get(name, 0.0), float(x.detach().abs().max()))
