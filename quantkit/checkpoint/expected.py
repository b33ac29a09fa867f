"""What a model's config.json implies its checkpoint holds: every decoder layer's required tensors
and each tensor's shape. The reader checks a checkpoint against these when it opens it (a
one-line error there, not a KeyError or a shape mismatch halfway through a conversion).
"""

from __future__ import annotations

from quantkit.model.arch import ModelArch
from quantkit.model.tensors import TensorClass, TensorInfo


def required_layer_tensors(a: ModelArch, layer: int) -> list[str]:
    """Logical names (relative to the layer prefix) every decoder layer of this architecture holds."""
    fam = a.definition
    req = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    req += [f"self_attn.{p}.weight" for p in fam.attention_projections + tuple(n for n, _ in fam.attention_norms)]
    projs = ("gate_proj", "up_proj", "down_proj")
    if a.is_moe(layer):
        req.append("mlp.gate.weight")
        req += [f"mlp.experts.{e}.{p}.weight" for e in range(a.n_routed_experts) for p in projs]
        if a.n_shared_experts:
            req += [f"mlp.shared_experts.{p}.weight" for p in projs]
    else:
        req += [f"mlp.{p}.weight" for p in projs]
    return req


def expected_shape(info: TensorInfo, a: ModelArch) -> tuple[int, ...] | None:
    """The [out, in] a config implies for a projection, the length of a norm; None where the
    config does not say."""
    h, fam = a.hidden_size, a.definition
    if info.klass == TensorClass.NORM:
        sizes = {norm: (a.size(size),) for norm, size in fam.attention_norms}
        return sizes.get(info.name.rsplit(".", 2)[-2], (h,))
    if info.klass == TensorClass.MTP and info.name.endswith(("enorm.weight", "hnorm.weight", "shared_head.norm.weight")):
        return (h,)
    if info.klass == TensorClass.MTP and info.proj == "eh_proj":
        return (h, 2 * h)  # [embedding; hidden] -> hidden
    if info.klass == TensorClass.INDEXER and info.proj is None:  # k_norm weight and bias
        return (a.index_head_dim,)
    if info.klass in (TensorClass.ROUTED_EXPERT, TensorClass.SHARED_EXPERT, TensorClass.DENSE_MLP):
        inter = {
            TensorClass.ROUTED_EXPERT: a.moe_intermediate_size,
            TensorClass.SHARED_EXPERT: a.moe_intermediate_size * a.n_shared_experts,
            TensorClass.DENSE_MLP: a.intermediate_size,
        }[info.klass]
        return (h, inter) if info.proj == "down_proj" else (inter, h)
    if info.klass == TensorClass.ATTENTION and info.name.endswith(".weight"):
        return fam.attention_shapes(a).get(info.proj)
    if info.klass == TensorClass.ROUTER:
        return (a.n_routed_experts, h) if info.name.endswith(".weight") else (a.n_routed_experts,)
    if info.klass == TensorClass.INDEXER and info.proj is not None:
        return fam.attention_shapes(a)[f"indexer.{info.proj}"]
    if info.klass == TensorClass.EMBEDDING or info.klass == TensorClass.HEAD:
        return (a.vocab_size, h)
    return None


def missing_beside(a: ModelArch, unknown: str, present: set[str]) -> list[str]:
    """The required tensors of `unknown`'s layer (full names) that `present` lacks: what a name no
    rule covers most likely was before it was renamed. Expert-level names come first when the
    unknown one sits in an expert (`experts.2.uq_proj` -> `experts.2.up_proj`), so the error names
    the weight that matters rather than the first missing tensor of the layer."""
    head = f"{a.prefix}layers."
    if not unknown.startswith(head) or not unknown[len(head):].split(".", 1)[0].isdigit():
        return []
    layer = int(unknown[len(head):].split(".", 1)[0])
    if layer >= a.num_layers_with_mtp:
        return []
    pre = a.layer_prefix(layer)
    missing = [pre + rel for rel in required_layer_tensors(a, layer) if pre + rel not in present]
    owner = unknown.rsplit(".", 2)[0] + "."  # ...experts.2. for ...experts.2.uq_proj.weight
    return sorted(missing, key=lambda n: not n.startswith(owner))
