"""Tensor classification: every tensor of both tiny models lands in the right class, and names no
rule covers (or that contradict config.json) are errors."""

from __future__ import annotations

import re

import pytest
from conftest import small_config

from quantkit.checkpoint.reader import Checkpoint
from quantkit.errors import CheckpointError
from quantkit.model.arch import arch_from_config
from quantkit.model.tensors import TensorClass, classify, logical_name
from quantkit.planner.inspection import inspect, storage_format

C = TensorClass


def expected_class(name: str) -> TensorClass:
    """The class a name should get, written independently of quantkit's rules (tiny models only)."""
    if name.startswith(("vision_tower.", "mm_projector.")):
        return C.VISION
    if name.endswith("lm_head.weight"):
        return C.HEAD
    if re.search(r"layers\.\d+\.embed_tokens\.weight$", name):
        return C.MTP
    if name.endswith("embed_tokens.weight"):
        return C.EMBEDDING
    if ".mlp.experts." in name:
        return C.ROUTED_EXPERT
    if ".mlp.shared_experts." in name:
        return C.SHARED_EXPERT
    if ".mlp.gate." in name:
        return C.ROUTER
    if re.search(r"\.mlp\.(gate|up|down)_proj\.", name):
        return C.DENSE_MLP
    if ".self_attn.indexer." in name:
        return C.INDEXER
    if re.search(r"\.(enorm|hnorm|eh_proj|shared_head\.\w+)\.weight$", name):
        return C.MTP
    if "norm" in name:
        return C.NORM
    if ".self_attn." in name:
        return C.ATTENTION
    raise AssertionError(f"test has no rule for {name}")


@pytest.fixture(scope="module")
def kimi(tiny_kimi) -> Checkpoint:
    return Checkpoint(tiny_kimi)


@pytest.fixture(scope="module")
def glm(tiny_glm) -> Checkpoint:
    return Checkpoint(tiny_glm)


@pytest.mark.parametrize("which", ["kimi", "glm"])
def test_every_tiny_tensor_classifies(which, kimi, glm):
    ckpt = kimi if which == "kimi" else glm
    a = ckpt.arch
    storage = list(ckpt.weight_map)
    assert {logical_name(n) for n in storage} == set(ckpt.tensors)
    for name in storage:
        info = classify(logical_name(name), a)
        assert info.klass == expected_class(info.name), name
        assert info == ckpt.tensors[info.name].info
    classes = {st.info.klass for st in ckpt.tensors.values()}
    common = {C.ROUTED_EXPERT, C.SHARED_EXPERT, C.DENSE_MLP, C.ROUTER, C.ATTENTION, C.NORM, C.EMBEDDING, C.HEAD}
    assert classes == (common | {C.VISION} if which == "kimi" else common | {C.INDEXER, C.MTP})
    # routed experts: every (MoE layer incl. MTP, expert, projection) exactly once
    experts = {(st.info.layer, st.info.expert, st.info.proj) for st in ckpt.tensors.values() if st.info.klass == C.ROUTED_EXPERT}
    moe = [L for L in range(a.num_layers_with_mtp) if a.is_moe(L)]
    assert experts == {(L, e, p) for L in moe for e in range(a.n_routed_experts) for p in ("gate_proj", "up_proj", "down_proj")}


def test_kimi_layout(kimi):
    a = kimi.arch
    assert (a.model_type, a.prefix, a.head_name) == ("kimi_k25", "language_model.model.", "language_model.lm_head.weight")
    assert kimi.tensors["language_model.lm_head.weight"].info.klass == C.HEAD
    assert kimi.tensors["language_model.model.embed_tokens.weight"].info.klass == C.EMBEDDING
    vision = [n for n in kimi.tensors if n.startswith(("vision_tower.", "mm_projector."))]
    assert vision and all(kimi.tensors[n].info.klass == C.VISION and kimi.tensors[n].info.layer is None for n in vision)
    assert kimi.names(klass=C.VISION) == sorted(vision)
    for name, st in kimi.tensors.items():
        if st.info.klass == C.ROUTED_EXPERT:
            assert st.format == "int4" and set(st.parts) == {"weight_packed", "weight_scale", "weight_shape"}
            assert storage_format(st, kimi) == "int4-g32"
        else:  # everything else BF16 (the router bias F32), as Moonshot ships it
            assert st.format == "dense" and st.dtype in ("BF16", "F32"), name
    assert not any(st.info.mtp for st in kimi.tensors.values())


def test_glm_layout_and_mtp(glm):
    a = glm.arch
    assert a.num_mtp_layers == 1
    mtp = a.num_hidden_layers
    for name, st in glm.tensors.items():
        assert st.info.mtp == (st.info.layer == mtp), name
        if st.info.klass == C.ROUTED_EXPERT:
            assert st.format == "fp8" and storage_format(st, glm) == "fp8-block128"
    mtp_names = glm.names(mtp)
    assert mtp_names and all(glm.tensors[n].info.mtp for n in mtp_names)
    own = {n.split(".")[-2] for n in glm.names(mtp, klass=C.MTP)}
    assert own == {"enorm", "hnorm", "eh_proj", "norm"}  # shared_head.norm
    assert glm.tensors[f"model.layers.{mtp}.eh_proj.weight"].info.proj == "eh_proj"
    assert glm.names(mtp, klass=C.ROUTED_EXPERT)  # the MTP layer is a MoE layer
    # indexers only on IndexShare owner layers (and the MTP layer)
    with_indexer = {glm.tensors[n].info.layer for n in glm.names(klass=C.INDEXER)}
    assert with_indexer == {L for L in range(a.num_hidden_layers) if a.indexer_layers[L]} | {mtp}
    assert with_indexer != set(range(a.num_layers_with_mtp))


def test_inspect_reports_storage_per_class(tiny_kimi, tiny_glm):
    k = inspect(tiny_kimi)
    a = Checkpoint(tiny_kimi).arch
    n_moe = sum(a.moe_layers)
    assert dict(k.classes["routed_expert"].formats) == {"int4-g32": n_moe * a.n_routed_experts * 3}
    assert set(k.classes["attention"].formats) == {"bf16"} and set(k.classes["vision"].formats) == {"bf16"}
    assert k.family == "kimi" and k.shards == 5
    g = inspect(tiny_glm)
    ga = Checkpoint(tiny_glm).arch
    n_moe = sum(ga.moe_layers) + ga.num_mtp_layers
    assert dict(g.classes["routed_expert"].formats) == {"fp8-block128": n_moe * ga.n_routed_experts * 3}
    assert g.family == "glm" and g.mtp_layers == 1
    assert g.classes["routed_expert"].bytes < g.classes["routed_expert"].params * 1.1  # ~1 byte per weight
    assert k.classes["routed_expert"].bytes < k.classes["routed_expert"].params * 0.6  # ~0.5 byte + scales


# ---- rules on a synthetic architecture -----------------------------------------------------------
@pytest.fixture(scope="module")
def ds():
    return arch_from_config(small_config("deepseek_v3"))  # 3 layers, layer 0 dense, 8 experts


@pytest.fixture(scope="module")
def glm_arch():
    return arch_from_config(small_config("glm"))  # 3 layers + 1 MTP, DSA


def test_classify_fields(ds):
    i = classify("model.layers.2.mlp.experts.7.down_proj.weight", ds)
    assert (i.klass, i.layer, i.expert, i.proj, i.mtp, i.is_linear) == (C.ROUTED_EXPERT, 2, 7, "down_proj", False, True)
    i = classify("model.layers.1.mlp.gate.e_score_correction_bias", ds)
    assert (i.klass, i.layer, i.is_linear) == (C.ROUTER, 1, False)
    i = classify("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", ds)
    assert (i.klass, i.proj) == (C.ATTENTION, "kv_a_proj_with_mqa")
    assert classify("model.layers.0.mlp.up_proj.weight", ds).klass == C.DENSE_MLP
    assert classify("model.layers.0.self_attn.kv_a_layernorm.weight", ds).klass == C.NORM
    assert classify("model.norm.weight", ds).klass == C.NORM
    assert classify("lm_head.weight", ds).klass == C.HEAD


@pytest.mark.parametrize("name,why", [
    ("model.layers.1.mlp.experts.8.up_proj.weight", "expert 8"),  # n_routed_experts is 8
    ("model.layers.1.mlp.experts.100.up_proj.weight", "expert 100"),
    ("model.layers.0.mlp.experts.0.up_proj.weight", "expert 0"),  # layer 0 is dense
    ("model.layers.3.input_layernorm.weight", "beyond"),  # 3 layers, no MTP
    ("model.layers.0.self_attn.rotary_emb.inv_freq", "cannot classify"),
    ("model.layers.0.self_attn.indexer.wk.weight", "cannot classify"),  # no DSA in DeepSeek-V3
    ("model.layers.1.enorm.weight", "holds MTP tensors.*num_hidden_layers"),  # MTP names outside an MTP layer: layer counts disagree
    ("model.rotary.weight", "cannot classify"),
    ("language_model.model.embed_tokens.weight", "cannot classify"),  # wrong prefix for this family
])
def test_classify_errors(ds, name, why):
    with pytest.raises(CheckpointError, match=why) as info:
        classify(name, ds)
    assert info.value.tensor == name and name in str(info.value) and "\n" not in str(info.value)


def test_glm_mtp_layer_and_indexer(glm_arch):
    a = glm_arch
    n = a.num_hidden_layers
    for leaf in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
                 "embed_tokens.weight"):
        i = classify(f"model.layers.{n}.{leaf}", a)
        assert i.klass == C.MTP and i.mtp and i.layer == n
    for leaf in ("mlp.experts.3.gate_proj.weight", "self_attn.q_a_proj.weight", "input_layernorm.weight"):
        assert classify(f"model.layers.{n}.{leaf}", a).mtp
        assert not classify(f"model.layers.{n - 1}.{leaf}", a).mtp
    i = classify("model.layers.0.self_attn.indexer.k_norm.bias", a)
    assert (i.klass, i.proj) == (C.INDEXER, None)
    assert classify("model.layers.0.self_attn.indexer.wq_b.weight", a).proj == "wq_b"
    with pytest.raises(CheckpointError, match="beyond"):
        classify(f"model.layers.{n + 1}.enorm.weight", a)


@pytest.mark.parametrize("storage,logical", [
    ("m.layers.1.mlp.experts.0.up_proj.weight_packed", "m.layers.1.mlp.experts.0.up_proj.weight"),
    ("m.layers.1.mlp.experts.0.up_proj.weight_scale", "m.layers.1.mlp.experts.0.up_proj.weight"),
    ("m.layers.1.mlp.experts.0.up_proj.weight_shape", "m.layers.1.mlp.experts.0.up_proj.weight"),
    ("m.layers.1.mlp.experts.0.up_proj.weight_zero_point", "m.layers.1.mlp.experts.0.up_proj.weight"),
    ("m.layers.1.self_attn.o_proj.weight_scale_inv", "m.layers.1.self_attn.o_proj.weight"),
    ("m.layers.1.mlp.gate.e_score_correction_bias", "m.layers.1.mlp.gate.e_score_correction_bias"),
    ("m.layers.1.self_attn.indexer.k_norm.bias", "m.layers.1.self_attn.indexer.k_norm.bias"),
])
def test_logical_name(storage, logical):
    assert logical_name(storage) == logical
