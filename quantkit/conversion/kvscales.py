"""The FP8 KV-cache scales convert writes: per-layer `self_attn.k_scale`/`v_scale` in both outputs,
decode's compressed-tensors `kv_cache_scheme`, and convert-report.json's `kv_cache` section.

Why k_scale covers the absorbed query as well as the cache: see quantkit.model.kvcache.
"""

from __future__ import annotations

import torch

from quantkit.model.attention import Attention
from quantkit.model.kvcache import SCALE_NAMES, KVAbsmax


def kv_cache_scheme() -> dict:
    """compressed-tensors' `kv_cache_scheme` for a static per-tensor FP8 KV cache (what llm-compressor
    writes). vLLM's CompressedTensorsConfig then gives every attention layer a KV-cache method that
    loads `self_attn.k_scale`/`v_scale`; prefill's `quant_method: fp8` config does the same through
    Fp8KVCacheMethod, so prefill needs no config entry for the same tensors.

    Not written for DSA models (GLM-5.2): vLLM's fp8_ds_mla and SGLang's NSA cache ignore the scale,
    and transformers' compressed-tensors integration swaps in a QuantizedKVCache that has no
    `update_indexer`, so the decode checkpoint would no longer load there. Their scale tensors are
    still written (identical in both outputs) for a dense-MLA backend and for the record."""
    return {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
            "group_size": None, "block_structure": None, "observer": "minmax", "actorder": None}


def write_kv_scales(pair, prefix: str, kv: KVAbsmax, layer: int, attention: Attention) -> dict:
    """Write one layer's k_scale and v_scale, as its attention kind sets them from what calibration
    measured (`Attention.kv_scales`: MLA's one latent cache is keyed by k_scale, so both are equal),
    to both outputs, identical bytes, and return what was measured for the report."""
    for name, scale in zip(SCALE_NAMES, attention.kv_scales(kv.maxima[layer])):
        for out in (pair.prefill, pair.decode):
            out.add(prefix + name, torch.tensor([scale], dtype=torch.float32))  # (1,): compressed-tensors' tensor-strategy shape
    return attention.kv_report(kv.maxima[layer])


def kv_cache_report(layers: list[dict], attention: Attention) -> dict:
    """convert-report.json's `kv_cache`: per-layer scales and where the engines read them (or not),
    as the attention kind says."""
    per_layer = {str(lay["layer"]): lay["kv_cache"] for lay in layers if "kv_cache" in lay}
    return {
        "scales": "calibrated" if per_layer else "none (no calibration pass): engines run the FP8 cache at scale 1.0",
        "tensors": list(SCALE_NAMES) if per_layer else [],
        "layers": per_layer,
        "read_by": dict(attention.kv_read_by),
        "scale_covers": attention.kv_scale_covers,
    }
