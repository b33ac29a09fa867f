"""ModelArch from config.json: the shipped presets, family differences and RoPE normalisation."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import small_config

from quantkit.errors import ConfigError
from quantkit.model.arch import arch_from_config, load_arch, load_preset, preset_names


def test_preset_names():
    assert preset_names() == ["deepseek-v3", "glm-5.2", "kimi-k2.6", "qwen3-30b-a3b"]
    with pytest.raises(ConfigError, match="unknown preset 'llama'"):
        load_preset("llama")


def test_kimi_k26_preset():
    a = arch_from_config(load_preset("kimi-k2.6"))
    assert (a.model_type, a.family) == ("kimi_k25", "kimi")
    assert a.prefix == "language_model.model." and a.head_name == "language_model.lm_head.weight"
    assert a.layer_prefix(7) == "language_model.model.layers.7."
    assert a.num_hidden_layers == 61 and len(a.moe_layers) == 61
    assert sum(a.moe_layers) == 60 and not a.moe_layers[0] and all(a.moe_layers[1:])
    assert (a.n_routed_experts, a.num_experts_per_tok, a.hidden_size, a.moe_intermediate_size) == (384, 8, 7168, 2048)
    assert (a.num_attention_heads, a.q_lora_rank, a.kv_lora_rank, a.kv_cache_width) == (64, 1536, 512, 576)
    assert a.vocab_size == 163840 and a.num_mtp_layers == 0 and not a.has_dsa
    assert a.rope["rope_type"] == "yarn" and a.rope["factor"] == 64.0 and a.rope["rope_theta"] == 50000.0
    # the text model's quantization_config (inside text_config) is the one found
    qc = a.quantization_config
    assert qc["quant_method"] == "compressed-tensors" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 32


def test_qwen3_30b_a3b_preset():
    """Qwen/Qwen3-30B-A3B's config.json: GQA 32 query / 4 key-value heads of 128, 128 experts, 8 active,
    every layer MoE; the family's config view maps num_experts and adds no shared expert."""
    a = arch_from_config(load_preset("qwen3-30b-a3b"))
    assert (a.model_type, a.family, a.prefix, a.head_name) == ("qwen3_moe", "qwen3_moe", "model.", "lm_head.weight")
    assert (a.hidden_size, a.num_hidden_layers, a.vocab_size) == (2048, 48, 151936)
    assert (a.n_routed_experts, a.num_experts_per_tok, a.moe_intermediate_size, a.n_shared_experts) == (128, 8, 768, 0)
    assert (a.num_attention_heads, a.size("num_key_value_heads"), a.size("head_dim")) == (32, 4, 128)
    assert all(a.moe_layers) and a.num_mtp_layers == 0 and not a.has_dsa and a.norm_topk_prob
    assert a.rope == {"rope_theta": 1e6, "rope_type": "default"} and not a.rope_interleave


def test_glm_52_preset_indexshare():
    a = arch_from_config(load_preset("glm-5.2"))
    assert (a.model_type, a.family, a.prefix, a.head_name) == ("glm_moe_dsa", "glm", "model.", "lm_head.weight")
    assert a.num_hidden_layers == 78 and a.num_mtp_layers == 1 and a.num_layers_with_mtp == 79
    assert sum(a.moe_layers) == 75 and not any(a.moe_layers[:3])
    assert a.has_dsa and len(a.indexer_layers) == 78
    owners = [i for i, own in enumerate(a.indexer_layers) if own]
    assert owners == [0, 1, 2] + list(range(6, 75, 4))
    assert owners[:6] == [0, 1, 2, 6, 10, 14] and owners[-1] == 74 and len(owners) == 21
    assert (a.index_n_heads, a.index_head_dim, a.index_topk) == (32, 128, 2048)
    assert a.rope_interleave and a.rope == {"rope_type": "default", "rope_theta": 8e6}
    assert a.is_moe(78)  # the MTP layer
    assert a.quantization_config["weight_block_size"] == [128, 128]


def test_deepseek_v3_preset():
    a = arch_from_config(load_preset("deepseek-v3"))
    assert (a.model_type, a.family, a.prefix, a.head_name) == ("deepseek_v3", "deepseek_v3", "model.", "lm_head.weight")
    assert a.num_hidden_layers == 61 and sum(a.moe_layers) == 58 and not any(a.moe_layers[:3])
    assert (a.n_routed_experts, a.n_group, a.topk_group, a.num_attention_heads) == (256, 8, 4, 128)
    assert a.num_mtp_layers == 1 and not a.has_dsa and a.indexer_layers is None
    assert a.rope == {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert a.qk_head_dim == 192 and a.kv_cache_width == 576


def test_rope_legacy_rope_scaling_is_normalised():
    cfg = small_config("deepseek_v3", rope_theta=12345.0)
    assert cfg["rope_scaling"]["type"] == "yarn" and "rope_type" not in cfg["rope_scaling"]
    rope = arch_from_config(cfg).rope
    assert rope["rope_type"] == "yarn" and "type" not in rope
    assert rope["rope_theta"] == 12345.0 and rope["factor"] == 8.0 and rope["original_max_position_embeddings"] == 64
    # the input is not modified
    assert cfg["rope_scaling"]["type"] == "yarn" and "rope_theta" not in cfg["rope_scaling"]


def test_rope_forms_agree():
    """Legacy rope_theta + rope_scaling and the newer rope_parameters describe the same rope."""
    legacy = small_config("deepseek_v3")
    new = copy.deepcopy(legacy)
    scaling = new.pop("rope_scaling")
    theta = new.pop("rope_theta")
    new["rope_parameters"] = {"rope_type": "yarn", "rope_theta": theta, **{k: v for k, v in scaling.items() if k != "type"}}
    assert arch_from_config(legacy).rope == arch_from_config(new).rope


def test_rope_default_when_absent():
    cfg = small_config("deepseek_v3")
    del cfg["rope_scaling"]
    cfg["rope_theta"] = 777.0
    assert arch_from_config(cfg).rope == {"rope_type": "default", "rope_theta": 777.0}
    del cfg["rope_theta"]
    assert arch_from_config(cfg).rope == {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("scaling,match", [
    ({"type": "linear", "factor": 2.0}, "rope_type 'linear'"),
    ({"type": "yarn", "original_max_position_embeddings": 64}, "factor"),
    ({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
])
def test_rope_errors(scaling, match):
    with pytest.raises(ConfigError, match=match):
        arch_from_config(small_config("deepseek_v3", rope_scaling=scaling))


def test_kimi_k2_without_nesting():
    """Kimi K2 / K2-Thinking ship `kimi_k2` at top level: DeepSeek-V3 names under `model.`."""
    text = load_preset("kimi-k2.6")["text_config"]
    a = arch_from_config(text)
    assert (a.model_type, a.family, a.prefix, a.head_name) == ("kimi_k2", "kimi", "model.", "lm_head.weight")
    with pytest.raises(ConfigError, match="text_config"):
        arch_from_config({"model_type": "kimi_k25"})


def test_glm_explicit_indexer_types_and_mlp_layer_types():
    cfg = small_config("glm", indexer_types=["full", "shared", "full"], mlp_layer_types=["dense", "sparse", "dense"])
    a = arch_from_config(cfg)
    assert a.indexer_layers == (True, False, True) and a.moe_layers == (False, True, False)
    with pytest.raises(ConfigError, match="layer 0 must own"):
        arch_from_config(small_config("glm", indexer_types=["shared", "full", "full"]))
    with pytest.raises(ConfigError, match="mlp_layer_types has 2 entries"):
        arch_from_config(small_config("glm", mlp_layer_types=["dense", "sparse"]))


@pytest.mark.parametrize("change,match", [
    ({"model_type": "llama"}, "unknown model_type 'llama'"),
    ({"model_type": None}, "unknown model_type None"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"n_routed_experts": 9}, "not divisible by n_group"),
])
def test_config_errors(change, match):
    with pytest.raises(ConfigError, match=match) as info:
        arch_from_config(small_config("deepseek_v3", **change), source="x/config.json")
    assert str(info.value).startswith("x/config.json: ") and "\n" not in str(info.value)


def test_missing_field_is_named():
    cfg = small_config("deepseek_v3")
    del cfg["hidden_size"]
    with pytest.raises(ConfigError, match="missing 'hidden_size'"):
        arch_from_config(cfg)


def test_load_arch_from_folder(tmp_path):
    with pytest.raises(ConfigError, match="config.json: not found") as info:
        load_arch(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_arch(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_arch(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(load_preset("glm-5.2")))
    assert load_arch(tmp_path).num_hidden_layers == 78


def test_to_json_round_trips_through_json():
    a = arch_from_config(load_preset("glm-5.2"))
    d = json.loads(json.dumps(a.to_json()))
    assert d["indexer_layers"] == list(a.indexer_layers) and d["moe_layers"] == list(a.moe_layers)
    assert "raw" not in d and d["prefix"] == "model."


@pytest.mark.parametrize("family,change,match", [
    ("qwen3", {"num_key_value_heads": 3}, r"num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("qwen3", {"num_experts_per_tok": 99}, r"num_experts_per_tok 99 is more than n_routed_experts"),
    ("glm", {"qk_rope_head_dim": 31}, r"qk_rope_head_dim 31 is odd"),
    ("kimi", {"n_group": 2, "topk_group": 2, "num_experts_per_tok": 99}, r"more than n_routed_experts"),
])
def test_each_familys_invariants_are_checked_when_the_config_is_read(family, change, match, tiny_qwen3):
    cfg = json.loads((tiny_qwen3 / "config.json").read_text()) if family == "qwen3" else small_config(family)
    with pytest.raises(ConfigError, match=match):
        arch_from_config(cfg | change)
