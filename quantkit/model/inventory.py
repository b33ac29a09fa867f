"""The tensor inventory: every logical tensor a checkpoint of an architecture holds, from config.json
alone (no weights), with its class, shape and bytes in each storage format.

quantkit plan sizes checkpoints from it, quantkit inspect labels presets with it, and the cost
model reads a layer's shapes from it. Shapes are validated with `tensors.classify`, so the
inventory and a real checkpoint's names agree.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from quantkit.model.arch import ModelArch
from quantkit.model.tensors import TensorClass, classify

FP8_BLOCK = 128

# Parameter count of a fixed-size vision tower when vision_config is absent (MoonViT + projector).
DEFAULT_VISION_PARAMS = 465_000_000


@dataclass(frozen=True)
class TensorSpec:
    """`count` tensors of one shape; `name` is the first one's logical name."""

    name: str
    klass: TensorClass
    shape: tuple[int, ...]  # [out, in] for Linears
    count: int = 1
    role: str = ""  # projection or parameter name: q_a_proj, k_norm.bias, e_score_correction_bias, ...
    linear: bool = False  # a 2-D projection weight that a format may quantize
    replicated: bool = False  # held whole on every TP rank (norms, router, q_a/kv_a, indexer, vision)

    @property
    def params(self) -> int:
        return math.prod(self.shape) * self.count


def vision_params(cfg: dict[str, Any]) -> int:
    """MoonViT tower + patch-merger projector, from vision_config; a fixed estimate without it.

    Per block: qkv and out projections with biases, a GELU MLP with biases, two LayerNorms.
    Plus patch embedding, a 64x64 learnable position grid, final LayerNorm, and the projector
    (LayerNorm(h), Linear(4h, 4h), Linear(4h, text_hidden)) over 2x2-merged patches.
    """
    vc = cfg.get("vision_config")
    if not isinstance(vc, dict) or "hidden_size" not in vc:
        return DEFAULT_VISION_PARAMS
    h, i = int(vc["hidden_size"]), int(vc.get("intermediate_size", 4 * int(vc["hidden_size"])))
    n, p = int(vc.get("num_hidden_layers", 27)), int(vc.get("patch_size", 14))
    block = (4 * h * h + 4 * h) + (2 * h * i + i + h) + 4 * h
    tower = n * block + (3 * p * p * h + h) + 64 * 64 * h + 2 * h
    text_h = int(cfg.get("text_config", cfg).get("hidden_size", h))
    merged = 4 * h
    projector = 2 * h + (merged * merged + merged) + (merged * text_h + text_h)
    return tower + projector


def tensor_inventory(
    arch: ModelArch, *, vision_params: int = 0, mtp_embed_copies: bool = False, mtp_owns_indexer: bool = True
) -> list[TensorSpec]:
    """Every logical tensor of the checkpoint, grouped by shape; classes checked with tensors.classify."""
    a, p, fam = arch, arch.prefix, arch.definition
    h = a.hidden_size
    specs: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], count: int = 1, *, linear: bool = False, replicated: bool = False) -> None:
        klass = classify(name, a).klass
        role = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ".".join(name.rsplit(".", 2)[-2:])
        specs.append(TensorSpec(name, klass, shape, count, role, linear, replicated))

    add(f"{p}embed_tokens.weight", (a.vocab_size, h))
    add(f"{p}norm.weight", (h,), replicated=True)
    if not a.tie_word_embeddings:
        add(a.head_name, (a.vocab_size, h))

    for layer in range(a.num_layers_with_mtp):
        L = a.layer_prefix(layer)
        add(f"{L}input_layernorm.weight", (h,), replicated=True)
        add(f"{L}post_attention_layernorm.weight", (h,), replicated=True)
        # attention: the family's projections and norms (quantkit.model.family)
        shapes = fam.attention_shapes(a)
        for proj in fam.attention_projections:
            add(f"{L}self_attn.{proj}.weight", shapes[proj], linear=True, replicated=proj in fam.replicated)
        for norm, size in fam.attention_norms:
            add(f"{L}self_attn.{norm}.weight", (a.size(size),), replicated=True)
        # dsa: the lightning indexer, on the layers that own one (IndexShare)
        owns = layer < a.num_hidden_layers and a.indexer_layers[layer] if a.has_dsa else False
        if a.has_dsa and (owns or (layer >= a.num_hidden_layers and mtp_owns_indexer)):
            I = f"{L}self_attn.indexer."
            for proj in fam.indexer_projections:
                add(f"{I}{proj}.weight", shapes[f"indexer.{proj}"], linear=True, replicated=True)
            add(f"{I}k_norm.weight", (a.index_head_dim,), replicated=True)
            add(f"{I}k_norm.bias", (a.index_head_dim,), replicated=True)
        # mlp
        if a.is_moe(layer):
            E, I_e = a.n_routed_experts, a.moe_intermediate_size
            add(f"{L}mlp.gate.weight", (E, h), replicated=True)
            if fam.router_bias:
                add(f"{L}mlp.gate.e_score_correction_bias", (E,), replicated=True)
            add(f"{L}mlp.experts.0.gate_proj.weight", (I_e, h), E, linear=True)
            add(f"{L}mlp.experts.0.up_proj.weight", (I_e, h), E, linear=True)
            add(f"{L}mlp.experts.0.down_proj.weight", (h, I_e), E, linear=True)
            if a.n_shared_experts:
                I_s = I_e * a.n_shared_experts
                add(f"{L}mlp.shared_experts.gate_proj.weight", (I_s, h), linear=True)
                add(f"{L}mlp.shared_experts.up_proj.weight", (I_s, h), linear=True)
                add(f"{L}mlp.shared_experts.down_proj.weight", (h, I_s), linear=True)
        else:
            add(f"{L}mlp.gate_proj.weight", (a.intermediate_size, h), linear=True)
            add(f"{L}mlp.up_proj.weight", (a.intermediate_size, h), linear=True)
            add(f"{L}mlp.down_proj.weight", (h, a.intermediate_size), linear=True)
        # mtp: the extra layer's own tensors
        if layer >= a.num_hidden_layers:
            add(f"{L}enorm.weight", (h,), replicated=True)
            add(f"{L}hnorm.weight", (h,), replicated=True)
            add(f"{L}eh_proj.weight", (h, 2 * h), linear=True, replicated=True)
            add(f"{L}shared_head.norm.weight", (h,), replicated=True)
            if mtp_embed_copies:
                add(f"{L}embed_tokens.weight", (a.vocab_size, h))
                add(f"{L}shared_head.head.weight", (a.vocab_size, h))

    if vision_params:
        specs.append(TensorSpec("vision_tower.*", TensorClass.VISION, (vision_params,), 1, "vision", False, True))
    return specs


# ----------------------------------------------------------------------------- storage formats


def bytes_bf16(s: TensorSpec) -> int:
    return 2 * s.params


def bytes_f32(s: TensorSpec) -> int:
    return 4 * s.params


def bytes_fp8_block(s: TensorSpec, block: int = FP8_BLOCK) -> int:
    """e4m3 weight + float32 multiplier per block x block tile (DeepSeek `weight_scale_inv`)."""
    out, inp = s.shape
    return s.count * (out * inp + 4 * math.ceil(out / block) * math.ceil(inp / block))


def bytes_int4_group(s: TensorSpec, group: int) -> int:
    """compressed-tensors pack-quantized, symmetric: int32 [out, in/8], bf16 scale [out, in/G], int32 shape [2]."""
    out, inp = s.shape
    return s.count * (4 * out * math.ceil(inp / 8) + 2 * out * math.ceil(inp / group) + 8)


def layer_of(name: str) -> int:
    """Decoder layer of a tensor name; -1 for embeddings, head, final norm, vision."""
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1
