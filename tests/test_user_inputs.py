"""Inputs as users have them: a DeepSeek-V3 model saved by transformers' own
`save_pretrained` (its config declares an MTP layer the shards do not hold), converted and
validated end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.errors import CheckpointError
from quantkit.synthetic import tiny

runner = CliRunner()
NO_MTP = "no MTP layer in the source: speculative decoding unavailable"
DATA = dict(calib="synthetic:train", num_samples=4, seq_len=32)


def save_transformers_deepseek(folder: Path) -> Path:
    """DeepseekV3ForCausalLM(config).save_pretrained, tiny and random: what every fine-tune saved
    with transformers looks like (num_nextn_predict_layers: 1, its default, and no MTP tensor)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=3,
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
        topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    tiny.save_tokenizer(folder, 512)  # a fine-tune ships its tokenizer; the tiny one's ids fit the vocab
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return save_transformers_deepseek(tmp_path_factory.mktemp("hf") / "ds")


def _shard_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    names = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            names |= set(h.keys())
    return names


def test_the_saved_model_declares_an_mtp_layer_it_does_not_hold(saved):
    """The premise, checked on transformers' own output (not on quantkit's idea of it)."""
    cfg = json.loads((saved / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["num_hidden_layers"] == 3
    names = _shard_names(saved)
    assert any(n.startswith("model.layers.2.mlp.experts.") for n in names)
    assert not any(n.startswith("model.layers.3.") for n in names)


def test_inspect_reads_it_without_the_mtp_layer(saved):
    res = runner.invoke(app, ["inspect", str(saved), "--json"])
    assert res.exit_code == 0, res.output
    assert "speculative decoding unavailable" in res.output


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_converts_and_validates_without_the_mtp_layer(saved, tmp_path, method, capfd):
    from quantkit.conversion.pipeline import convert
    from quantkit.validation.pipeline import validate

    res = convert(saved, tmp_path / "out", method=method, validate=False, progress=False, device="cpu", **DATA)
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "num_nextn_predict_layers is 1" in warnings[0] and NO_MTP in warnings[0], warnings
    assert res.report["mtp"] == {"layers": 0, "declared_absent": 1, "note": NO_MTP}
    assert [lay["layer"] for lay in res.report["layers"]] == [0, 1, 2]
    for which in ("prefill", "decode"):
        cfg = json.loads((tmp_path / "out" / which / "config.json").read_text())
        assert cfg["num_nextn_predict_layers"] == 0 and cfg["num_hidden_layers"] == 3
        assert not any(n.startswith("model.layers.3.") for n in _shard_names(tmp_path / "out" / which))
    v = validate(tmp_path / "out", eval_data="synthetic:heldout", num_samples=2, seq_len=32, gen_tokens=1,
                 device="cpu", progress=False, gates={"kl_max": 0.05})  # random weights: top-1 is a coin toss
    assert v.passed, v.failed_gates
    assert {"prefill", "decode"} <= set(v.data["rows"])
    for which in ("prefill", "decode"):
        card = (tmp_path / "out" / which / "README.md").read_text()
        assert NO_MTP in card and "num_nextn_predict_layers: 0" in card
    # a real client reads the decode checkpoint's config and finds no MTP layer to look for
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "out" / "decode").num_nextn_predict_layers == 0


def test_a_partly_held_mtp_layer_is_still_refused(saved, tmp_path):
    """Shards that hold some tensors of the declared MTP layer are damaged, not transformers-saved."""
    import shutil

    from safetensors.torch import load_file, save_file

    from quantkit.checkpoint.reader import Checkpoint

    folder = tmp_path / "part"
    shutil.copytree(saved, folder)
    (shard,) = folder.glob("*.safetensors")
    t = load_file(str(shard))
    t["model.layers.3.input_layernorm.weight"] = t["model.layers.2.input_layernorm.weight"].clone()
    save_file(t, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.3\..*required tensor is missing") as e:
        Checkpoint(folder)
    assert "\n" not in str(e.value)


def test_expert_width_not_a_multiple_of_the_group_is_refused_before_work(tmp_path):
    """A model whose experts' input columns (down_proj's: moe_intermediate_size 96) do not split into
    INT4 groups of 128 is refused before the first layer, in one line naming the file, the tensor and a
    group size that works; not a GPTQ traceback at that layer."""
    from conftest import small_config, write_random

    folder, _ = write_random(tmp_path / "src", small_config("deepseek_v3", moe_intermediate_size=96))
    r = runner.invoke(app, ["convert", str(folder), "--out", str(tmp_path / "out"), "--method", "rtn", "--group-size", "128"])
    assert r.exit_code != 0
    lines = [x for x in r.output.strip().splitlines() if x.strip()]
    assert len(lines) == 1, r.output
    assert "down_proj.weight has 96 input columns, not a multiple of the INT4 group size 128" in lines[0]
    assert ".safetensors:" in lines[0] and "--group-size 32" in lines[0]
    assert not (tmp_path / "out").exists()
    r = runner.invoke(app, ["convert", str(folder), "--out", str(tmp_path / "ok"), "--method", "rtn", "--group-size", "32",
                            "--no-validate"])
    assert r.exit_code == 0, r.output
