"""Shapes a block format cannot run: a GLM-layout model with kv_lora_rank 64 (kv_b_proj's input dim 64,
half an FP8 block). Its source stores kv_b_proj as FP8 blocks; the decode checkpoint quantkit wrote from
it used to keep them, and transformers could not run decode/ as stored (compressed-tensors: "unflatten:
Provided sizes [1, 128] don't multiply up to the size of dim 3 (64)"). convert now decides up front to
store such a Linear BF16 in both outputs and says why; check-serving names the tensor each target refuses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import small_config, write_random

from quantkit.conversion.pipeline import convert
from quantkit.serving.checks import block_shape_problems, compressed_tensors_problems
from quantkit.serving.stored import inventory, read_stored

KV_B = "model.layers.0.self_attn.kv_b_proj"
IDS = torch.tensor([[1, 5, 9, 13, 40, 41, 42, 7]])


@pytest.fixture(scope="module")
def kv64(tmp_path_factory, tiny_glm):
    """A random 3-layer + MTP GLM in GLM-5.2's FP8 layout with kv_lora_rank 64, and its RTN pair."""
    root = tmp_path_factory.mktemp("kv64")
    src, _ = write_random(root / "src", small_config("glm", kv_lora_rank=64), linears="fp8", experts="fp8")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}  # as GLM-5.2 publishes it
    (src / "config.json").write_text(json.dumps(cfg))
    for f in tiny_glm.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, src / f.name)
    return src, convert(src, root / "out", method="rtn", validate=False, progress=False)


def test_kv_b_proj_is_stored_bf16_in_both_outputs_with_the_reason(kv64):
    src, res = kv64
    d = res.report["decisions"][f"{KV_B}.weight"]
    assert d["prefill"] == d["decode"] == "bf16"
    assert "input dim 64 is not a multiple of the 128-column FP8 block" in d["why"]
    # only the shapes that cannot run moved: the other FP8 Linears pass through as stored
    moved = {n for n, x in res.report["decisions"].items() if "input dim" in x.get("why", "")}
    assert moved == {f"model.layers.{i}.self_attn.kv_b_proj.weight" for i in range(4)}
    assert res.report["decisions"]["model.layers.0.self_attn.q_b_proj.weight"]["why"] == "source FP8"
    for which in ("prefill", "decode"):
        assert "weight_scale" not in str([n for n in read_stored(getattr(res, which)).tensors if n.startswith(KV_B)])


def test_decode_as_stored_runs_in_transformers(kv64):
    """decode/ loads as stored (compressed-tensors' forward, W8A8 on its FP8 Linears) and generates; with
    the activation fake-quant off it computes what quantkit's reference does."""
    from compressed_tensors.quantization import disable_quantization
    from transformers import AutoModelForCausalLM

    from quantkit.validation.forward import logits

    _, res = kv64
    model = AutoModelForCausalLM.from_pretrained(res.decode, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(IDS, max_new_tokens=4, do_sample=False)
        assert out.shape == (1, IDS.shape[1] + 4)
        model.apply(disable_quantization)
        for p in model.parameters():
            p.data = p.data.float()
        theirs = model(IDS).logits
    ours = logits(res.decode, IDS, device="cpu")
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-4


def test_check_serving_names_the_tensor_each_target_refuses(kv64):
    """The source as stored (FP8 kv_b_proj over 64 input columns): each engine's rule and compressed-
    tensors' forward name the tensor; the converted pair has nothing to refuse."""
    src, res = kv64
    st = read_stored(src)
    for engine in ("vllm", "sglang"):
        problems = block_shape_problems(engine, st, inventory(st, engine))
        assert len(problems) == 4 and problems[0].startswith(f"{KV_B}.weight [256, 64]: FP8 blocks over an input dim of 64")
        assert ("per_token_group_quant_fp8" in problems[0]) and "store it BF16" in problems[0]
    assert compressed_tensors_problems(st) == []  # DeepSeek-native FP8: not compressed-tensors' forward
    ct = json.loads((res.decode / "config.json").read_text())["quantization_config"]
    st.qc = ct  # the same tensors under the compressed-tensors config decode/ used to be written with
    assert "unflatten" in compressed_tensors_problems(st)[0]
    for which in ("prefill", "decode"):
        out = read_stored(getattr(res, which))
        assert not compressed_tensors_problems(out)
        for engine in ("vllm", "sglang"):
            assert not block_shape_problems(engine, out, inventory(out, engine))


@pytest.mark.parametrize("spec", ["tiny:glm-5.2", "tiny:kimi-k2.6"])
def test_tiny_models_have_no_shape_fallback(spec):
    """The tiny models' Linears all have input dims that are multiples of 128: no decision (and no
    output byte) moves for them."""
    from quantkit.inputs.modelspec import open_checkpoint
    from quantkit.planner.precision import decide_all
    from quantkit.recipe import load_recipe

    ckpt = open_checkpoint(spec)
    rec = load_recipe("tiny-" + spec.split(":")[1])
    assert not [n for n, d in decide_all(ckpt, rec).items() if "input dim" in d.why]
