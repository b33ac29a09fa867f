"""The reference forward computes the same function as transformers' implementations (fp32)."""

from __future__ import annotations

import pytest
import torch
from conftest import small_config, write_random
from oracle import transformers_model

from quantkit.checkpoint.reader import Checkpoint
from quantkit.model.arch import arch_from_config
from quantkit.model.ops import apply_rope, rope_inv_freq
from quantkit.validation.forward import logits, new_caches, run

TOL = 1e-4


def max_rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def ids_for(vocab: int, B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def check_against_transformers(folder, tmp_path, T=24, B=2):
    model = transformers_model(folder, tmp_path / "oracle")
    ids = ids_for(model.config.vocab_size, B, T)
    with torch.no_grad():
        theirs = model(ids).logits
    # DSA ties (ReLU zeros) are broken as torch.topk breaks them, so the selection is transformers'.
    ours = run(Checkpoint(folder), ids, device="cpu", dsa_ties="topk")
    assert ours.shape == theirs.shape
    err = max_rel_err(ours, theirs)
    assert err <= TOL, f"max relative error {err:.2e} > {TOL}"
    return ours, theirs


@pytest.mark.parametrize("interleave", [True, False])
def test_deepseek_v3_yarn_groups_matches_transformers(tmp_path, interleave):
    """DeepSeek-V3 layout: YaRN rope (both layouts), grouped routing (n_group 4, topk_group 2), BF16."""
    folder, _ = write_random(tmp_path / "ds", small_config("deepseek_v3", rope_interleave=interleave))
    check_against_transformers(folder, tmp_path)


def test_kimi_int4_experts_matches_transformers(tiny_kimi, tmp_path):
    """Kimi K2.6 layout (kimi_k25, language_model. prefix, INT4 g32 experts) vs DeepseekV3ForCausalLM."""
    check_against_transformers(tiny_kimi, tmp_path, T=32)


def test_glm_fp8_dsa_matches_transformers(tiny_glm, tmp_path):
    """GLM-5.2 layout (FP8 blocks, IndexShare, MTP) vs GlmMoeDsaForCausalLM, with the sequence longer
    than index_topk (16) so the sparse selection really cuts keys."""
    ckpt = Checkpoint(tiny_glm)
    assert 40 > ckpt.arch.index_topk
    check_against_transformers(tiny_glm, tmp_path, T=40)


def test_glm_random_fp8_matches_transformers(tmp_path):
    folder, _ = write_random(tmp_path / "glm", small_config("glm"), linears="fp8", experts="fp8")
    check_against_transformers(folder, tmp_path, T=20)


def test_dsa_equals_dense_when_short(tiny_glm):
    """For sequences no longer than index_topk, DSA selects every visible token: dense MLA."""
    ckpt = Checkpoint(tiny_glm)
    T = ckpt.arch.index_topk
    ids = ids_for(ckpt.arch.vocab_size, 1, T)
    torch.testing.assert_close(run(ckpt, ids, device="cpu"), run(ckpt, ids, device="cpu", dsa_dense=True), rtol=0, atol=0)
    # with a longer sequence the selection does change the result (so the test can fail)
    ids = ids_for(ckpt.arch.vocab_size, 1, 3 * T)
    assert (run(ckpt, ids, device="cpu") - run(ckpt, ids, device="cpu", dsa_dense=True)).abs().max() > 1e-3


@pytest.mark.parametrize("which", ["kimi", "glm"])
def test_incremental_decode_equals_full_forward(which, tiny_kimi, tiny_glm):
    """Prefill + one-token-at-a-time decode through the MLA (and DSA index-key) cache equals a full forward."""
    ckpt = Checkpoint(tiny_kimi if which == "kimi" else tiny_glm)
    ids = ids_for(ckpt.arch.vocab_size, 1, 28)
    full = run(ckpt, ids, device="cpu")
    caches = new_caches(ckpt)
    steps = [run(ckpt, ids[:, :20], device="cpu", caches=caches)]
    for t in range(20, 28):
        steps.append(run(ckpt, ids[:, t:t + 1], device="cpu", caches=caches))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


def test_yarn_inv_freq_matches_transformers():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = small_config("deepseek_v3")
    arch = arch_from_config(cfg)
    tcfg = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](tcfg, "cpu")
    ours, our_factor = rope_inv_freq(arch)
    torch.testing.assert_close(ours, theirs)
    assert our_factor == pytest.approx(factor)


def test_rope_is_a_rotation():
    x = torch.randn(3, 5, 8)
    cos, sin = torch.cos(torch.ones(5, 4)), torch.sin(torch.ones(5, 4))
    for inter in (True, False):
        y = apply_rope(x, cos, sin, inter)
        torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


def test_logits_deterministic_on_tiny_glm(tiny_glm):
    ids = torch.tensor([[1, 5, 9, 13, 40, 41]])
    a, b = logits("tiny:glm-5.2", ids), logits("tiny:glm-5.2", ids)
    assert torch.equal(a, b)
    assert a.shape == (1, 6, 512)


def tiny_qwen3_moe(folder, **overrides):
    """A tiny random Qwen3MoeForCausalLM, built and saved by transformers itself: layer 0 dense
    (mlp_only_layers), then MoE layers; GQA with 2 query heads per key/value head."""
    import transformers

    fields = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=256,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**(fields | overrides)))
    with torch.no_grad():  # transformers initialises norms to one and the router near zero: make every piece count
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_matches_transformers(tmp_path, norm_topk_prob):
    """Qwen3-MoE (GQA with q/k norms, softmax router, no shared expert, a dense first layer) vs
    transformers' Qwen3MoeForCausalLM on a tiny random model it built and saved."""
    folder = tiny_qwen3_moe(tmp_path / "qwen3", norm_topk_prob=norm_topk_prob)
    ckpt = Checkpoint(folder)
    assert ckpt.arch.moe_layers == (False, True, True) and ckpt.arch.n_shared_experts == 0
    ours, theirs = check_against_transformers(folder, tmp_path)
    assert max_rel_err(ours, theirs) <= 1e-6  # measured 2.7e-7 (norm_topk_prob on)


def test_qwen3_moe_incremental_decode_equals_full_forward(tmp_path):
    """Prefill + one-token decode steps through the GQA key/value cache equal a full forward."""
    ckpt = Checkpoint(tiny_qwen3_moe(tmp_path / "qwen3"))
    ids = ids_for(ckpt.arch.vocab_size, 2, 24)
    full = run(ckpt, ids, device="cpu")
    caches = new_caches(ckpt)
    steps = [run(ckpt, ids[:, :20], device="cpu", caches=caches)]
    steps += [run(ckpt, ids[:, i:i + 1], device="cpu", caches=caches) for i in range(20, 24)]
    assert caches[0].length == 24
    assert max_rel_err(torch.cat(steps, dim=1), full) <= 1e-6
