"""What every stage asks of an attention kind: the interface a family definition's `attention` fills.

An attention kind is an object the family that introduced it defines (quantkit.model.families:
DeepSeek-V3's MLA, which GLM and Kimi import; each other family's own), the way transformers'
modular files reuse a layer by import. The stages never branch on which kind it is:

    quantkit.model.arch         `sizes`: the attention's ModelArch fields, read from config.json
    quantkit.model.reference    `forward`: the layer's attention on the normed hidden states, reading
                                and growing its `LayerCache` and storing through `Context.kv`
    quantkit.model.kvcache      `store`: what the KV cache gives back for what was computed (bf16:
                                unchanged; fp8: rounded as the engines store it), and the maxima a
                                calibration pass records (`KVCache.observe`)
    quantkit.conversion         `kv_scales`, `kv_report`, `kv_read_by`, `kv_scale_covers`: the
                                k_scale / v_scale convert writes, and what the report says of them
    quantkit.planner            `cache_bytes`, `kv_heads`: a cached token's bytes per layer, and how
                                a tensor-parallel group splits them

The tensor names (projections, norms, engine modules, shapes) are the family definition's fields
(quantkit.model.family), since a family may add its own Linears to a kind (GLM's indexer).
"""

from __future__ import annotations

from typing import Any

import torch

# quantkit.model.reference.Context and quantkit.model.kvcache.KVCache: typed Any because both reach
# quantkit.model.arch, which imports the family definitions, which import this
Context = Any
KVCache = Any
W = dict[str, torch.Tensor]


class Attention:
    """One attention kind (module docstring). A subclass defines every method; the base only names them."""

    kind: str = ""  # short name in reports and plans ("mla", ...)
    # convert-report.json's kv_cache: engine -> whether and how it reads the scales; what a scale covers
    kv_read_by: dict[str, str] = {}  # noqa: RUF012 (a class-level constant, never mutated)
    kv_scale_covers: str = ""

    def sizes(self, text: dict[str, Any], need, source: str) -> dict[str, int]:
        """The attention's ModelArch size fields from a text config in DeepSeek-V3's field names
        (`need(key)` reads a required key, naming config.json when it is missing)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, w: W, ctx: Context, layer: int) -> torch.Tensor:
        """The layer's attention output (B, T, D) for the normed hidden states x (B, T, D)."""
        raise NotImplementedError

    def store(self, kv: KVCache, layer: int, w: W, *parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the cache gives back for each cached part under `kv` (quantkit.model.kvcache)."""
        raise NotImplementedError

    def kv_scales(self, maxima: dict[str, float]) -> tuple[float, float]:
        """(k_scale, v_scale) to write for a layer whose calibration maxima are `maxima`."""
        raise NotImplementedError

    def kv_report(self, maxima: dict[str, float]) -> dict:
        """What was measured for one layer and the scales written (convert-report.json's kv_cache)."""
        raise NotImplementedError

    def cache_bytes(self, arch, kv_dtype: str) -> int:
        """Bytes one token's attention cache costs a layer at `kv_dtype` ("bf16" or "fp8"), one copy."""
        raise NotImplementedError

    def kv_heads(self, arch) -> int:
        """The key/value heads a tensor-parallel group splits the cache over; 0 when every rank holds
        one token's cache whole (one shared head)."""
        return 0
