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

A GQA layer (Qwen3-MoE) caches each key head (after k_norm and rope) and each value head. With
`fp8_e4m3` vLLM's `reshape_and_cache_flash` (csrc/cache_kernels.cu) writes the key as
`scaled_convert(k, *k_scale)` and the value as `scaled_convert(v, *v_scale)`: two per-layer static
scales, one per tensor, loaded from `self_attn.k_scale` / `v_scale` (there, `Attention` layers do get
the KV-cache method). Its V1 FlashAttention backend attends over the paged cache for prefill and
decode alike, so every token's attention reads keys and values as stored; that is what `gqa` gives
back. With FlashAttention 3 the query is quantized too (`q_scale`, 1.0 without one in the
checkpoint); that rounding is not simulated here. convert writes k_scale = max|k| / 448 and
v_scale = max|v| / 448 over the calibration tokens (llm-compressor's static minmax observer).
`fp8_ds_mla` is MLA's layout only.

The scale convert writes: vLLM's MLA decode also quantizes the absorbed query to FP8 with
`q_scale` (`MLAAttention.forward_decode`), and q_scale defaults to k_scale when the checkpoint has
none (BaseKVCacheMethod). A k_scale fitted to the cache alone (absmax / 448) would clip the query:
on the tiny models the absorbed query's maximum is 1.5-3x the cache's. So k_scale = v_scale =
max(|kv_c|, |k_pe|, |absorbed query|) / 448 over the calibration tokens: nothing saturates, and
e4m3 keeps its relative precision (only the subnormal floor moves). The query's own rounding is
not simulated here (it is not cache storage); the cache's is.

KV dtypes here: `bf16` (the cache holds what attention computed; the baseline), `fp8_e4m3`
(per-layer static scales, the dense-MLA and GQA path), `fp8_ds_mla` (dynamic per-tile, vLLM's DSA path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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
    """How the KV cache stores values: `mla` returns what the latent/rope cache gives back, `gqa` what
    the key and value caches give back, `index` what the indexer key cache gives back. `scales`:
    "checkpoint" reads each layer's `self_attn.k_scale` (and `v_scale`) from its weights (1.0 where the
    checkpoint has none), "one" uses 1.0."""

    dtype: str = "bf16"
    scales: str = "checkpoint"

    def __post_init__(self):
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV cache dtype {self.dtype!r}; one of {', '.join(KV_DTYPES)}")

    def scale(self, w: dict[str, torch.Tensor], which: int = 0) -> float:
        """The layer's k_scale (`which` 0) or v_scale (1), as the engine would load it."""
        t = w.get(SCALE_NAMES[which]) if self.scales == "checkpoint" else None
        return float(t) if t is not None else 1.0

    def mla(self, layer: int, w, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.dtype == "fp8_e4m3":
            s = self.scale(w)
            return per_tensor(latent, s), per_tensor(k_rot, s)
        if self.dtype == "fp8_ds_mla":
            return ds_mla(latent), k_rot  # k_pe stays bf16 in that layout
        return latent, k_rot

    def gqa(self, layer: int, w, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A GQA layer's keys and values as the cache gives them back: per-tensor k_scale and v_scale."""
        if self.dtype == "fp8_e4m3":
            return per_tensor(key, self.scale(w, 0)), per_tensor(value, self.scale(w, 1))
        if self.dtype == "fp8_ds_mla":
            raise ValueError("fp8_ds_mla is vLLM's MLA (DSA) cache layout; a GQA model's FP8 cache is fp8_e4m3")
        return key, value

    def index(self, k: torch.Tensor) -> torch.Tensor:
        return indexer_keys(k) if self.dtype != "bf16" else k

    def observe_query(self, layer: int, w, q_nope: torch.Tensor, q_rot: torch.Tensor, nh: int, dn: int) -> None:
        """Calibration's hook (KVAbsmax); storing a cache looks at no query."""


@dataclass
class KVAbsmax(KVCache):
    """Calibration: stores nothing differently, records per layer the absolute maximum of what the
    cache holds (MLA: latent and rope key, one scale covers both, and the absorbed decode query;
    GQA: keys and values, a scale each)."""

    latent: dict[int, float] = field(default_factory=dict)
    k_rot: dict[int, float] = field(default_factory=dict)
    query: dict[int, float] = field(default_factory=dict)
    key: dict[int, float] = field(default_factory=dict)
    value: dict[int, float] = field(default_factory=dict)

    FIELDS = ("latent", "k_rot", "query", "key", "value")  # the per-layer maxima (combined across ranks by max)

    def mla(self, layer, w, latent, k_rot):
        _grow(self.latent, layer, latent)
        _grow(self.k_rot, layer, k_rot)
        return latent, k_rot

    def gqa(self, layer, w, key, value):
        _grow(self.key, layer, key)
        _grow(self.value, layer, value)
        return key, value

    def observe_query(self, layer: int, w, q_nope: torch.Tensor, q_rot: torch.Tensor, nh: int, dn: int) -> None:
        """The query vLLM's MLA decode quantizes with q_scale: q_nope absorbed into the latent space
        (q_nope[h] @ W_UK[h], W_UK the key half of kv_b_proj) and the rope query."""
        kv_lora = w["self_attn.kv_b_proj.weight"].shape[1]
        w_uk = w["self_attn.kv_b_proj.weight"].view(nh, -1, kv_lora)[:, :dn]  # (nh, dn, kv_lora)
        ql = torch.einsum("bhtd,hdl->bhtl", q_nope.float(), w_uk.float())  # (B, nh, T, kv_lora)
        _grow(self.query, layer, ql)
        _grow(self.query, layer, q_rot)

    def layer_scales(self) -> dict[int, tuple[float, float]]:
        """Per layer, the (k_scale, v_scale) to write. MLA: both the largest of what the cache holds
        and of the absorbed decode query (which vLLM quantizes with q_scale = k_scale), over 448.
        GQA: the keys' and the values' maxima over 448."""
        out = {i: (s, s) for i in sorted(self.latent)
               for s in [scale_from_absmax(max(self.latent[i], self.k_rot.get(i, 0.0), self.query.get(i, 0.0)))]}
        return out | {i: (scale_from_absmax(self.key[i]), scale_from_absmax(self.value.get(i, 0.0))) for i in sorted(self.key)}

    def layer_report(self, layer: int) -> dict:
        """What was measured for one layer and the scales written (convert-report.json's kv_cache)."""
        k, v = self.layer_scales()[layer]
        if layer in self.key:
            return {"key_absmax": self.key[layer], "value_absmax": self.value.get(layer), "k_scale": k, "v_scale": v}
        return {"latent_absmax": self.latent[layer], "k_rot_absmax": self.k_rot[layer], "query_absmax": self.query.get(layer),
                "k_scale": k}


def _grow(d: dict[int, float], layer: int, x: torch.Tensor) -> None:
    d[layer] = max(d.get(layer, 0.0), float(x.detach().abs().max()))


# ---- what a checkpoint holds ----------------------------------------------------------------------
def has_kv_scales(ckpt) -> bool:
    from quantkit.model.tensors import TensorClass

    return any(st.info.klass == TensorClass.KV_SCALE for st in ckpt.tensors.values())


def checkpoint_scales(ckpt) -> dict[str, float]:
    """layer -> k_scale as stored in a checkpoint (empty when it has none)."""
    from quantkit.model.tensors import TensorClass

    return {str(st.info.layer): float(ckpt.get(n, torch.float32).reshape(-1)[0]) for n, st in ckpt.tensors.items()
            if st.info.klass == TensorClass.KV_SCALE and n.endswith("k_scale")}
