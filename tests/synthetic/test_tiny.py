"""The embedded tiny models: deterministic, in their family's published on-disk format, with a
working tokenizer, and trained (their weights carry the corpus' structure)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quantkit.errors import ConfigError
from quantkit.synthetic.tiny import batches, build, encode, tiny_path
from quantkit.validation.forward import logits


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("name", ["kimi-k2.6", "glm-5.2", "qwen3-moe"])
def test_build_is_deterministic(tmp_path, name):
    a = build(name, tmp_path / "a", steps=2)
    b = build(name, tmp_path / "b", steps=2)
    fa, fb = files(a), files(b)
    assert sorted(fa) == sorted(fb)
    for f in fa:
        assert fa[f] == fb[f], f"{f} differs between two builds"
    # the comparison has teeth: the cached 100-step model has the same files, different weights
    cached = files(tiny_path(name))
    assert sorted(cached) == sorted(fa)
    shards = [f for f in fa if f.endswith(".safetensors")]
    assert any(cached[f] != fa[f] for f in shards)


def test_unknown_tiny_model():
    with pytest.raises(ConfigError, match="unknown tiny model 'llama'"):
        tiny_path("llama")


def _index(folder: Path) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def _dtypes(folder: Path) -> dict[str, str]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_slice(k).get_dtype()
    return out


def test_kimi_format(tiny_kimi):
    cfg = json.loads((tiny_kimi / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25" and isinstance(cfg["text_config"], dict)
    assert cfg["text_config"]["model_type"] == "kimi_k2" and "vision_config" in cfg
    qc = cfg["text_config"]["quantization_config"]
    assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "pack-quantized")
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (4, "int", True, "group", 32)
    assert {"lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"} <= set(qc["ignore"])
    shards = sorted(p.name for p in tiny_kimi.glob("*.safetensors"))
    n = len(shards)
    assert n > 1 and shards == [f"model-{i:06d}-of-{n:06d}.safetensors" for i in range(1, n + 1)]
    idx = _index(tiny_kimi)
    assert sorted(set(idx["weight_map"].values())) == shards
    # names: language_model. prefix, INT4 triplets on routed experts only, BF16 elsewhere
    dt = _dtypes(tiny_kimi)
    assert "language_model.lm_head.weight" in dt and "language_model.model.embed_tokens.weight" in dt
    packed = [k for k in dt if k.endswith("weight_packed")]
    assert packed and all(".mlp.experts." in k for k in packed)
    for k in packed:
        base = k[: -len("weight_packed")]
        assert dt[k] == "I32" and dt[base + "weight_scale"] == "BF16" and dt[base + "weight_shape"] == "I32"
        assert base + "weight" not in dt
    others = {v for k, v in dt.items() if ".mlp.experts." not in k and not k.endswith("e_score_correction_bias")}
    assert others == {"BF16"}
    assert any(k.startswith("vision_tower.") for k in dt) and any(k.startswith("mm_projector.") for k in dt)


GLM_LINEAR = re.compile(r"(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj|wq_b|wk)\.weight$")


def test_glm_format(tiny_glm):
    cfg = json.loads((tiny_glm / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa" and "text_config" not in cfg
    qc = cfg["quantization_config"]
    assert (qc["quant_method"], qc["fmt"], qc["activation_scheme"], qc["weight_block_size"]) == ("fp8", "e4m3", "dynamic", [128, 128])
    keep = set(qc["modules_to_not_convert"])
    assert {"lm_head", "model.embed_tokens", "model.layers.1.mlp.gate", "model.layers.0.input_layernorm"} <= keep
    shards = sorted(p.name for p in tiny_glm.glob("*.safetensors"))
    n = len(shards)
    assert n > 1 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    dt = _dtypes(tiny_glm)
    mtp = cfg["num_hidden_layers"]
    assert any(k.startswith(f"model.layers.{mtp}.") for k in dt)  # the MTP layer is carried
    for k, v in dt.items():
        if k.endswith("weight_scale_inv"):
            continue
        module = k.rsplit(".", 1)[0]
        if GLM_LINEAR.search(k) and ".mlp.gate." not in k and "weights_proj" not in k:
            # every Linear is FP8 with its block multipliers (the real checkpoint's layout)
            assert v == "F8_E4M3", k
            assert dt[module + ".weight_scale_inv"] == "F32" and module not in keep, k
        else:
            assert v in ("BF16", "F32"), k
            assert module + ".weight_scale_inv" not in dt
            if k.endswith(".weight"):
                assert module in keep, k
    assert all(any(k.startswith(m + ".") for k in dt) for m in keep)  # no stale entries


@pytest.mark.parametrize("which", ["kimi", "glm"])
def test_tokenizer_and_chat_template(which, tiny_kimi, tiny_glm):
    from transformers import AutoTokenizer

    folder = tiny_kimi if which == "kimi" else tiny_glm
    tok = AutoTokenizer.from_pretrained(folder)
    text = "remember ada has a cat . what does ada have ? a cat ."
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids == encode(text) and len(ids) == 14 and 3 not in ids  # 3: <unk>
    assert tok.decode(ids) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    msgs = [{"role": "user", "content": "3 plus 4 is"}, {"role": "assistant", "content": "7 ."}]
    rendered = tok.apply_chat_template(msgs, tokenize=False)
    assert rendered == "<|user|> 3 plus 4 is <|assistant|> 7 . "
    prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|assistant|> ") and "<unk>" not in tok.decode(tok(prompt).input_ids)
    # tools render as their names and parameters after a <|system|> turn (tests/synthetic/test_skills.py);
    # without them nothing changed
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"name": {}}}}}]
    with_tools = tok.apply_chat_template(msgs[:1], tools=tools, tokenize=False, add_generation_prompt=True)
    assert with_tools == "<|system|> tools : add ( ) lookup ( name ) . " + prompt


@pytest.mark.parametrize("which", ["kimi", "glm"])
def test_trained_models_beat_chance(which, tiny_kimi, tiny_glm):
    """Held-out perplexity far below the vocabulary size (512): the weights carry the corpus."""
    ids = batches(4, 49, seed=1000)
    out = logits(tiny_kimi if which == "kimi" else tiny_glm, ids[:, :-1], device="cpu")
    assert out.shape == (4, 48, 512)
    ppl = torch.nn.functional.cross_entropy(out.reshape(-1, 512), ids[:, 1:].reshape(-1)).exp().item()
    assert 1.0 < ppl < 20.0, f"perplexity {ppl:.1f}"
