"""Tensor classification: what every checkpoint tensor is, from its name and the architecture.

Conversion decides precision per class (routed experts go INT4 for decode, most Linears FP8 for
prefill, norms and routers stay as they are), so every tensor must land in exactly one class.
A name that fits no rule is an error, never a guess: a silently mis-classified tensor is a
silently wrong checkpoint.

Names are logical weight names: quantized storage suffixes (`weight_packed`, `weight_scale`,
`weight_shape`, `weight_zero_point`, `weight_scale_inv`) belong to their `weight`; see
`logical_name`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from quantkit.errors import CheckpointError
from quantkit.model.arch import ModelArch
from quantkit.model.family import Family


class TensorClass(str, Enum):
    ROUTED_EXPERT = "routed_expert"
    SHARED_EXPERT = "shared_expert"
    DENSE_MLP = "dense_mlp"
    ROUTER = "router"  # mlp.gate.weight and mlp.gate.e_score_correction_bias
    ATTENTION = "attention"  # MLA projections
    INDEXER = "indexer"  # DSA lightning indexer (GLM)
    NORM = "norm"
    EMBEDDING = "embedding"
    HEAD = "head"
    VISION = "vision"  # Kimi's MoonViT tower and projector: carried byte for byte
    MTP = "mtp"  # the MTP layer's own tensors: enorm, hnorm, eh_proj, shared_head
    KV_SCALE = "kv_scale"  # self_attn.k_scale / v_scale: the FP8 KV cache's per-layer scale (quantkit.model.kvcache)


@dataclass(frozen=True)
class TensorInfo:
    name: str  # logical name (".weight", never a storage suffix)
    klass: TensorClass
    layer: int | None = None  # decoder layer (MTP layers continue the numbering)
    expert: int | None = None  # routed expert index
    proj: str | None = None  # gate_proj / up_proj / down_proj / q_a_proj / ...
    mtp: bool = False  # inside an MTP layer

    @property
    def is_linear(self) -> bool:
        return self.proj is not None and self.name.endswith(".weight")


# Storage suffixes of quantized formats, mapped to the logical tensor they describe.
QUANT_SUFFIXES = (
    "weight_packed",  # compressed-tensors pack-quantized int32
    "weight_scale",  # compressed-tensors group scales
    "weight_shape",
    "weight_zero_point",
    "weight_scale_inv",  # DeepSeek FP8 block multiplier
    "weight_global_scale",
)


def logical_name(name: str) -> str:
    """`...down_proj.weight_packed` -> `...down_proj.weight`; other names unchanged."""
    head, _, leaf = name.rpartition(".")
    return f"{head}.weight" if leaf in QUANT_SUFFIXES else name


_LAYER = re.compile(r"layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARED = re.compile(r"mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$")
_DENSE = re.compile(r"mlp\.(gate_proj|up_proj|down_proj)\.weight$")
_ROUTER = re.compile(r"mlp\.gate\.(weight|e_score_correction_bias)$")
_KV_SCALE = re.compile(r"self_attn\.(k_scale|v_scale)$")
_MTP = re.compile(r"(enorm|hnorm|eh_proj|shared_head\.norm|shared_head\.head|embed_tokens)\.weight$")

VISION_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")


@lru_cache(maxsize=None)
def _attention_patterns(fam: Family) -> tuple[re.Pattern, re.Pattern, re.Pattern]:
    """(attention projections, indexer tensors, norms) of a family, from its definition's names."""
    indexer = [*fam.indexer_projections, "k_norm"]
    norms = ["input_layernorm", "post_attention_layernorm"] + [rf"self_attn\.{n}" for n, _ in fam.attention_norms]
    return (
        re.compile(rf"self_attn\.({'|'.join(fam.attention_projections)})\.(weight|bias)$"),
        re.compile(rf"self_attn\.indexer\.({'|'.join(indexer)})\.(weight|bias)$"),
        re.compile(rf"({'|'.join(norms)})\.weight$"),
    )

def classify(name: str, arch: ModelArch) -> TensorInfo:
    """Classify one logical tensor name; raises CheckpointError for a name no rule covers."""
    if name.startswith(VISION_PREFIXES):
        return TensorInfo(name, TensorClass.VISION)
    if name == arch.head_name:
        return TensorInfo(name, TensorClass.HEAD, proj="lm_head")
    p = arch.prefix
    if name == f"{p}embed_tokens.weight":
        return TensorInfo(name, TensorClass.EMBEDDING)
    if name == f"{p}norm.weight":
        return TensorInfo(name, TensorClass.NORM)
    if name.startswith(f"{p}layers."):
        m = _LAYER.match(name[len(p):])
        if m:
            return _classify_layer(name, int(m.group(1)), m.group(2), arch)
    raise CheckpointError(
        f"cannot classify tensor for model_type {arch.model_type}; "
        "if this is a new tensor kind, add a rule to quantkit/model/tensors.py",
        tensor=name,
    )


def _classify_layer(name: str, layer: int, rest: str, arch: ModelArch) -> TensorInfo:
    if layer >= arch.num_layers_with_mtp:
        raise CheckpointError(
            f"layer {layer} is beyond num_hidden_layers ({arch.num_hidden_layers}) + MTP layers ({arch.num_mtp_layers}) "
            "in config.json: the config does not match these weights; use the config.json that came with them",
            tensor=name,
        )
    mtp = layer >= arch.num_hidden_layers
    if m := _EXPERT.match(rest):
        expert = int(m.group(1))
        if expert >= arch.n_routed_experts or not arch.is_moe(layer):
            raise CheckpointError(f"expert {expert} does not exist in layer {layer} per config.json", tensor=name)
        return TensorInfo(name, TensorClass.ROUTED_EXPERT, layer, expert, m.group(2), mtp)
    if m := _SHARED.match(rest):
        return TensorInfo(name, TensorClass.SHARED_EXPERT, layer, None, m.group(1), mtp)
    if m := _DENSE.match(rest):
        return TensorInfo(name, TensorClass.DENSE_MLP, layer, None, m.group(1), mtp)
    if _ROUTER.match(rest):
        return TensorInfo(name, TensorClass.ROUTER, layer, None, None, mtp)
    attention, indexer, norm = _attention_patterns(arch.definition)
    if m := attention.match(rest):
        return TensorInfo(name, TensorClass.ATTENTION, layer, None, m.group(1), mtp)
    if (m := indexer.match(rest)) and arch.has_dsa:
        proj = None if m.group(1) == "k_norm" else m.group(1)
        return TensorInfo(name, TensorClass.INDEXER, layer, None, proj, mtp)
    if norm.match(rest):
        return TensorInfo(name, TensorClass.NORM, layer, None, None, mtp)
    if _KV_SCALE.match(rest):
        return TensorInfo(name, TensorClass.KV_SCALE, layer, None, None, mtp)
    if mtp and (m := _MTP.match(rest)):
        proj = "eh_proj" if m.group(1) == "eh_proj" else None
        return TensorInfo(name, TensorClass.MTP, layer, None, proj, True)
    if _MTP.match(rest):  # an MTP layer where config.json expects a decoder layer: the layer counts disagree
        raise CheckpointError(
            f"layer {layer} holds MTP tensors, but config.json's num_hidden_layers ({arch.num_hidden_layers}) makes it a "
            "decoder layer: the config does not match these weights; use the config.json that came with them",
            tensor=name,
        )
    raise CheckpointError(
        f"cannot classify tensor in layer {layer} for model_type {arch.model_type}; "
        "if this is a new tensor kind, add a rule to quantkit/model/tensors.py",
        tensor=name,
    )
