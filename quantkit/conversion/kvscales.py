"""The FP8 KV-cache scales convert writes: per-layer `self_attn.k_scale`/`v_scale` in both outputs,
decode's compressed-tensors `kv_cache_scheme`, and convert-report.json's `kv_cache` section.

Why k_scale covers the absorbed query as well as the cache: see quantkit.model.kvcache.
"""

from __future__ import annotations

import torch

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


def write_kv_scales(pair, prefix: str, kv: KVAbsmax, layer: int) -> dict:
    """Write one layer's k_scale and v_scale (equal for MLA, whose one latent cache is keyed by
    k_scale; a scale each for GQA's keys and values) to both outputs, identical bytes, and return
    what was measured for the report."""
    for name, scale in zip(SCALE_NAMES, kv.layer_scales()[layer]):
        for out in (pair.prefill, pair.decode):
            out.add(prefix + name, torch.tensor([scale], dtype=torch.float32))  # (1,): compressed-tensors' tensor-strategy shape
    return kv.layer_report(layer)


def kv_cache_report(layers: list[dict]) -> dict:
    """convert-report.json's `kv_cache`: per-layer scales and where they are read (or not)."""
    per_layer = {str(lay["layer"]): lay["kv_cache"] for lay in layers if "kv_cache" in lay}
    return {
        "scales": "calibrated" if per_layer else "none (no calibration pass): engines run the FP8 cache at scale 1.0",
        "tensors": list(SCALE_NAMES) if per_layer else [],
        "layers": per_layer,
        "read_by": {
            "vllm_dense_mla": "k_scale for kv_c and k_pe (concat_and_cache_mla) if loaded; 0.33.0 attaches the "
                              "KV-cache method to Attention layers only, so MLA most likely runs at 1.0",
            "vllm_dsa": "ignored: fp8_ds_mla computes per-token tile scales (and FP8 index keys always)",
            "sglang_mla": "loaded by 0.5.23 (CompressedTensorsKVCacheMethod); an earlier MLA pool casts at 1.0",
            "vllm_gqa": "k_scale for the keys, v_scale for the values (reshape_and_cache_flash); Attention layers load both",
        },
        "scale_covers": "MLA: max |kv_c|, |k_pe| and |absorbed decode query| / 448 (vLLM's q_scale defaults to k_scale); "
                        "GQA: max |k| / 448 and max |v| / 448",
    }
