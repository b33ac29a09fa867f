"""KV cache: bytes each cached token costs an architecture, and how many tokens the memory left
beside the weights holds (the formulas are in quantkit.planner.capacity's docstring)."""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.errors import ConfigError
from quantkit.model.arch import ModelArch
from quantkit.runtime.units import GiB

KV_DTYPES = {"bf16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8"}


@dataclass
class KVCapacity:
    kv_dtype: str
    bytes_per_token: int  # all cached layers, one copy
    kv_gib_per_gpu: float  # room left for the KV pool on each GPU
    tokens: int  # whole GPU set
    concurrent_requests: int  # at `context` tokens each


def kv_dtype_names(names: tuple[str, ...]) -> list[str]:
    """The KV dtypes to size, each as "bf16" or "fp8" (fp8_e4m3 is fp8)."""
    try:
        return [KV_DTYPES[d] for d in names]
    except KeyError as e:
        raise ConfigError(f"kv dtype {e.args[0]!r}: use one of {', '.join(KV_DTYPES)}") from None


def kv_bytes_per_layer(arch: ModelArch, kv_dtype: str, *, indexer: bool) -> int:
    """Bytes cached per token for one layer: what its attention kind caches (`Attention.cache_bytes`,
    quantkit.model.attention), plus the DSA indexer key if `indexer` (an e4m3 key and its f32 scale)."""
    return arch.definition.attention.cache_bytes(arch, kv_dtype) + (arch.index_head_dim + 4 if indexer else 0)


def indexer_cache_layers(arch: ModelArch, kv_layers: int, indexer_cache: str) -> int:
    """Layers that cache a DSA indexer key: every cached layer ("all") or the ones owning an
    indexer ("owners"; an MTP layer owns one); 0 without DSA."""
    if not arch.has_dsa:
        return 0
    owners = list(arch.indexer_layers) + [True] * arch.num_mtp_layers
    return kv_layers if indexer_cache == "all" else sum(owners[:kv_layers])


def kv_per_token(arch: ModelArch, dtypes: list[str], kv_layers: int, idx_layers: int) -> dict[str, dict[str, int]]:
    """Per KV dtype: the latent's and the indexer key's bytes per layer, the layers caching the key,
    its average over the cached layers, and the bytes per token over all of them (one copy)."""
    kv_info: dict[str, dict[str, int]] = {}
    for d in dtypes:
        latent = kv_bytes_per_layer(arch, d, indexer=False)
        idx = kv_bytes_per_layer(arch, d, indexer=True) - latent if arch.has_dsa else 0
        per_token = latent * kv_layers + idx * idx_layers
        kv_info[d] = {"latent": latent, "indexer": idx, "indexer_layers": idx_layers, "indexer_avg": round(idx * idx_layers / kv_layers), "per_token": per_token}
        heads = arch.definition.attention.kv_heads(arch)
        if heads:  # key/value heads split over the TP ranks (tp_split)
            kv_info[d]["kv_heads"] = heads
    return kv_info


def tp_split(info: dict[str, int], tp: int, kv_replicated: bool) -> int:
    """How many ways one token's cache splits over a TP group. MLA's latent is one head every rank
    holds whole (1), unless DP attention (`kv_replicated` False) spreads requests over the ranks
    (tp). An attention kind with several key/value heads (`Attention.kv_heads`) splits them over the
    ranks, at most one head a rank: vLLM replicates a head when tp exceeds the heads, so min(tp, heads)."""
    if not kv_replicated:
        return tp
    return min(tp, info["kv_heads"]) if info.get("kv_heads") else 1


def kv_capacity(kv_info: dict[str, dict[str, int]], room: float, *, tp: int, replicas: int, kv_replicated: bool,
                context: int) -> dict[str, KVCapacity]:
    """Tokens the KV pool holds per dtype with `room` GiB left on each GPU, over the whole GPU set,
    and the requests of `context` tokens they make; the latent sits on every TP rank when
    `kv_replicated`, else it is split tp ways; key/value heads split over the ranks (`tp_split`)."""
    kv = {}
    for d, info in kv_info.items():
        per_gpu = info["per_token"] / tp_split(info, tp, kv_replicated)
        tokens = max(int(room * GiB / per_gpu), 0) * replicas if room > 0 else 0
        kv[d] = KVCapacity(d, info["per_token"], round(room, 3), tokens, tokens // context)
    return kv
