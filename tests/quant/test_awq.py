"""AWQ per routed expert: exact folding, searches that never lose on their own objective, routing
untouched, `convert --method awq` outputs that load in transformers and match quantkit.logits,
beat RTN on held-out KL, and report starved experts like GPTQ does."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import starve_expert

from quantkit.checkpoint.reader import Checkpoint
from quantkit.conversion.pipeline import convert
from quantkit.inputs.tokens import load_tokens
from quantkit.model.moe import route, swiglu
from quantkit.model.reference import Context, decoder_layer
from quantkit.quant import awq
from quantkit.quant.experts import expert_weights
from quantkit.quant.gptq import quantize_rtn
from quantkit.quant.methods import quantize_experts
from quantkit.recipe import load_recipe
from quantkit.synthetic.tiny import batches
from quantkit.validation.forward import embed, layer_weights, logits
from quantkit.validation.metrics import paired, token_kl

IDS = torch.tensor([[1, 5, 9, 13, 40, 41, 42, 7, 8, 100, 101, 3]])
PROJS = ("gate_proj", "up_proj", "down_proj")


# ---- pure functions ------------------------------------------------------------------------------
def test_fold_up_down_is_exact_in_fp32():
    g = torch.Generator().manual_seed(0)
    D, I, n = 64, 96, 200
    gate, up = torch.randn(I, D, generator=g) * 0.1, torch.randn(I, D, generator=g) * 0.1
    down = torch.randn(D, I, generator=g) * 0.1
    x = torch.randn(n, D, generator=g)
    s = torch.exp(torch.randn(I, generator=g))  # scales spanning ~e^-3 .. e^3
    up_s, down_s = awq.fold_up_down(up, down, s)
    ref, got = swiglu(x, gate, up, down), swiglu(x, gate, up_s, down_s)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-6
    # batched over experts, as quantize_experts_awq calls it
    up_b, down_b = awq.fold_up_down(up.expand(3, -1, -1), down.expand(3, -1, -1), s.expand(3, -1))
    assert torch.equal(up_b[1], up_s) and torch.equal(down_b[2], down_s)


def test_smoothing_leaves_ups_int4_integers_alone():
    """up's groups run along its input dim: a row scale moves its group scales, not its integers
    (except where the bf16 rounding of the scale moves a value across a rounding boundary)."""
    g = torch.Generator().manual_seed(1)
    up = torch.randn(96, 128, generator=g) * 0.02
    s = torch.exp(torch.randn(96, generator=g))
    a, b = quantize_rtn(up, 32), quantize_rtn(up / s[:, None], 32)
    assert (a.q == b.q).float().mean() > 0.95


@pytest.mark.parametrize("group_size", [32, 128])
def test_clip_ratio_one_is_bit_identical_to_rtn(group_size):
    W = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(2))
    a = quantize_rtn(W, group_size)
    b = awq.quantize_clipped(W, group_size, torch.ones(2, 64, 128 // group_size))
    assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)


def test_auto_clip_never_loses_to_rtn_on_its_objective():
    g = torch.Generator().manual_seed(3)
    W = torch.randn(4, 64, 128, generator=g)
    W[:, :, ::37] *= 6  # outliers: clipping should pay off
    X = torch.randn(4, 500, 128, generator=g)
    H = X.transpose(1, 2) @ X / 500
    r = awq.auto_clip(W, H, 32, grid=20)
    assert r.shape == (4, 64, 4) and (r <= 1).all() and (r >= 0.55 - 1e-6).all() and (r < 1).any()
    Hb = awq._diag_blocks(H, 32)

    def err(q):
        d = (q.dequantize() - W).unflatten(-1, (-1, 32))
        return awq._group_errors(d, Hb)

    e_clip, e_rtn = err(awq.quantize_clipped(W, 32, r)), err(quantize_rtn(W, 32))
    assert (e_clip <= e_rtn + 1e-6).all() and e_clip.sum() < 0.9 * e_rtn.sum()
    # no tokens: nothing to gain, keep the full range (plain RTN)
    assert (awq.auto_clip(W, torch.zeros_like(H), 32) == 1).all()


def test_scale_search_never_loses_to_no_smoothing():
    g = torch.Generator().manual_seed(4)
    C, D, I, n = 3, 32, 64, 400
    down = torch.randn(C, D, I, generator=g) * 0.05
    z = torch.randn(C, n, I, generator=g) * torch.exp(2 * torch.randn(C, 1, I, generator=g))  # spiky channels
    H = z.transpose(1, 2) @ z / n
    s, alpha, best = awq.awq_smooth_scales(down, z.abs().mean(1), H, 32, grid=20, duo_scaling=True)
    ident = awq.output_error(quantize_rtn(down, 32).dequantize() - down, H)
    assert s.shape == (C, I) and (s > 0).all() and torch.isfinite(s).all()
    assert (best <= ident + 1e-9).all() and (best < 0.9 * ident).any()
    # output_error is the token-space error it stands for
    delta = quantize_rtn(down, 32).dequantize() - down
    direct = (z @ delta.transpose(1, 2)).square().sum(-1).mean(-1)
    torch.testing.assert_close(ident, direct, rtol=1e-4, atol=0)
    assert awq.scale_grid(20, True)[0] == (0.0, False) and len(awq.scale_grid(20, True)) == 20
    assert awq.scale_grid(1, True) == [(0.0, False)]


# ---- one real MoE layer --------------------------------------------------------------------------
def _moe_inputs(folder, ids) -> dict[int, tuple[torch.Tensor, dict]]:
    """{MoE layer: (x (N, D) its MoE input, its weights)} running the source model on `ids`."""
    ck = Checkpoint(folder)
    a = ck.arch
    ctx = Context.build(a, ids.shape[1], torch.device("cpu"), torch.float32)
    out = {}
    with torch.no_grad():
        h = embed(ck, ids, "cpu", torch.float32)
        for layer in range(a.num_hidden_layers):
            w = layer_weights(ck, layer, "cpu", torch.float32)
            o = decoder_layer(h, w, ctx, layer)
            if o.routing is not None:
                out[layer] = (o.routing.x, w)
            h = o.hidden
    return out


@pytest.fixture(scope="module")
def calib_ids():
    r = load_recipe("tiny-glm-5.2")
    c = r.calibration
    return load_tokens(c.dataset, tokenizer=None, num_samples=c.num_samples, seq_len=c.seq_len, seed=c.seed).ids


@pytest.fixture(scope="module")
def glm_moe_inputs(tiny_glm, calib_ids):
    return _moe_inputs(tiny_glm, calib_ids)


@pytest.fixture(scope="module")
def glm_layer(glm_moe_inputs, tiny_glm):
    x, w = glm_moe_inputs[2]
    return x, w, Checkpoint(tiny_glm).arch


def _expert_error(q, x, w, tokens, experts):
    num = den = 0.0
    for e in experts:
        xe = x[tokens[e]]
        ref = swiglu(xe, *expert_weights(w, e))
        num += (swiglu(xe, *(q[e][p].dequantize() for p in PROJS)) - ref).square().sum().item()
        den += ref.square().sum().item()
    return num / den


def test_layer_awq_keeps_shared_weights_and_routing_and_lowers_expert_error(glm_layer):
    from quantkit.quant.moe import routed_tokens

    x, w, arch = glm_layer
    rec = load_recipe("tiny-glm-5.2")
    before = {k: v.clone() for k, v in w.items()}
    idx0, wt0 = route(x, w, arch)
    tok = routed_tokens(x, w, arch)
    experts = list(range(arch.n_routed_experts))
    q_awq, records = awq.quantize_experts_awq(x, w, tok, experts, rec, 128, 2)
    assert all(torch.equal(w[k], v) for k, v in before.items())  # nothing shared (or source) was touched
    idx1, wt1 = route(x, w, arch)
    assert torch.equal(idx0, idx1) and torch.equal(wt0, wt1)
    assert [r.method for r in records] == ["awq"] * 16 and all(r.loss is not None and r.loss >= 0 for r in records)
    # the stored up/down are smoothed (differ from the source's own rounding) yet compute the expert
    q_rtn, _ = quantize_experts(x, w, tok, experts, rec, 128, "rtn", 2)
    assert any(not torch.equal(q_awq[e]["up_proj"].scale, q_rtn[e]["up_proj"].scale) for e in experts)
    q_awq_rtn, _ = awq.quantize_experts_awq(x, w, tok, experts, rec, 128, 2, quantizer="rtn")
    q_gptq, _ = quantize_experts(x, w, tok, experts, rec, 128, "gptq", 2)
    e_rtn, e_awq_rtn = _expert_error(q_rtn, x, w, tok, experts), _expert_error(q_awq_rtn, x, w, tok, experts)
    e_gptq, e_awq = _expert_error(q_gptq, x, w, tok, experts), _expert_error(q_awq, x, w, tok, experts)
    assert e_awq_rtn < 0.6 * e_rtn, (e_awq_rtn, e_rtn)  # AWQ as published: ~3x below RTN here
    assert e_awq < 1.05 * e_gptq and e_awq < 0.2 * e_rtn, (e_awq, e_gptq, e_rtn)


def test_layer_awq_rtn_fallback_for_starved_experts(glm_layer):
    x, w, arch = glm_layer
    rec = load_recipe("tiny-glm-5.2")
    rec.gptq.fallback = "rtn"
    tok = {e: torch.arange(5 if e == 3 else 100) for e in range(arch.n_routed_experts)}
    q, records = awq.quantize_experts_awq(x, w, tok, list(range(arch.n_routed_experts)), rec, 128, 2)
    r3 = next(r for r in records if r.expert == 3)
    assert (r3.method, r3.fallback, r3.tokens) == ("rtn", "rtn", 5)
    assert all(r.method == "awq" and r.fallback is None for r in records if r.expert != 3)
    plain = quantize_rtn(expert_weights(w, 3)[2], 128)
    assert torch.equal(q[3]["down_proj"].q, plain.q)


# ---- convert --method awq --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """GLM through the Python API, Kimi through the CLI (`quantkit convert ... --method awq`)."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from quantkit.cli import app

    root = tmp_path_factory.mktemp("awq")
    kw = dict(validate=False, progress=False)
    out = {
        "glm": convert("tiny:glm-5.2", root / "glm", method="awq", **kw),
        "glm-rtn": convert("tiny:glm-5.2", root / "glm-rtn", method="rtn", **kw),
        "kimi-rtn": convert("tiny:kimi-k2.6", root / "kimi-rtn", method="rtn", group_size=128, **kw),
    }
    res = CliRunner().invoke(app, ["convert", "tiny:kimi-k2.6", "--out", str(root / "kimi"), "--method", "awq",
                                   "--group-size", "128", "--no-validate", "--json"])
    assert res.exit_code == 0, res.output
    out["kimi"] = SimpleNamespace(out=root / "kimi", prefill=root / "kimi" / "prefill", decode=root / "kimi" / "decode",
                                  report=json.loads(res.stdout))
    return out


# 16384 held-out tokens (corpus seed 3000): per-token KL is heavy-tailed, so verdicts rest on the
# paired difference on these tokens and its standard error (quantkit.validation.metrics), not on two means.
EVAL = batches(256, 64, seed=3000)


def _token_kl(src, folder) -> torch.Tensor:
    return token_kl(logits(src, EVAL), logits(folder, EVAL))


# GLM's experts start from FP8, so INT4 costs real accuracy and AWQ must beat RTN clearly (scripts/
# quality.py: ~6 standard errors on three builds of the tiny GLM). Kimi's start from QAT INT4 g32,
# so g128 loses little either way: AWQ must not be worse than RTN.
@pytest.mark.parametrize("name,src,claim", [("glm", "tiny:glm-5.2", "better"), ("kimi", "tiny:kimi-k2.6", "not_worse")])
def test_awq_vs_rtn_on_heldout_kl(runs, name, src, claim):
    d = paired(_token_kl(src, runs[name].decode), _token_kl(src, runs[name + "-rtn"].decode))
    assert getattr(d, claim)(z=2.0), f"AWQ - RTN KL: {d}"


def test_report_says_awq(runs):
    for name in ("glm", "kimi"):
        r = runs[name].report
        assert r["method"] == "awq"
        calibrated = [e for e in r["experts"] if not (e["fallback"] or "").startswith("mtp")]  # an uncalibrated MTP layer: RTN, said so
        # stored as AWQ unless the held-out guard found RTN better for that expert, which it says
        assert calibrated and all(e["method"] == "awq" or e["guard"] == "rtn" for e in calibrated)
        assert all(e["heldout"] > 0 and e["err"] is not None and e["err_rtn"] is not None for e in calibrated)
        assert all(e["guard"] in (None, "awq-s1", "rtn") for e in calibrated)
        assert r["experts_summary"]["awq"] == len([e for e in r["experts"] if e["method"] == "awq"]) > 0
        assert r["shared_tensors"]["differ_classes"] == ["routed_expert"]


def test_router_norm_and_shared_expert_are_the_sources_bytes(runs, glm_moe_inputs):
    """AWQ folds nothing into shared tensors: the decode checkpoint's router, its correction bias and
    the norm before it are the source's bytes, so on the same MoE input routing is the source's.
    (Top-k on identical inputs and weights would be identical by definition; the bytes are the claim.)"""
    dec = Checkpoint(runs["glm"].decode)
    for layer, (_, w) in glm_moe_inputs.items():
        wd = layer_weights(dec, layer, "cpu", torch.float32)
        for k in ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "post_attention_layernorm.weight",
                  "mlp.shared_experts.down_proj.weight"):
            assert torch.equal(w[k], wd[k]), (layer, k)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _without_activation_quant(model):
    """As tests/conversion/test_convert.py: no dynamic FP8 activation fake-quant, everything in float32."""
    from compressed_tensors.quantization import disable_quantization

    model.apply(disable_quantization)
    for p in model.parameters():
        p.data = p.data.float()
    return model


def test_glm_awq_decode_loads_in_transformers_and_matches(runs):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    folder = runs["glm"].decode
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    with torch.no_grad():
        theirs = _without_activation_quant(model)(IDS).logits
    assert _rel(logits(folder, IDS), theirs) < 1e-4


def test_kimi_awq_decode_loads_in_transformers_and_matches(runs):
    from transformers import AutoModelForImageTextToText, CompressedTensorsConfig

    folder = runs["kimi"].decode
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32,
                                                        quantization_config=CompressedTensorsConfig(dequantize=True))
    with torch.no_grad():
        theirs = _without_activation_quant(model)(input_ids=IDS).logits
    assert _rel(logits(folder, IDS), theirs) < 1e-4


def test_prefill_is_unchanged_by_awq(runs):
    """AWQ only changes the decode experts: the FP8 prefill checkpoint is the same as with RTN, but for
    the per-layer KV scales (quantkit.model.kvcache), which only a calibrated convert measures."""
    from safetensors.torch import load_file

    def weights(folder):
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out |= {k: v for k, v in load_file(str(f)).items() if not k.endswith(("self_attn.k_scale", "self_attn.v_scale"))}
        return out

    for name in ("glm", "kimi"):
        ta, tb = weights(runs[name].prefill), weights(runs[name + "-rtn"].prefill)
        assert set(ta) == set(tb), name
        for k in ta:
            assert torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)), (name, k)


def test_cli_convert_method_awq(runs):
    report = runs["kimi"].report  # made by the CLI in the fixture
    assert report["method"] == "awq" and report["group_size"] == 128
    s = report["experts_summary"]  # 3 MoE layers x 16 experts, none reused at g128: AWQ unless the guard chose RTN
    assert s["awq"] + s["guard_kept_rtn"] == 3 * 16 and s["awq"] > 0


def test_starved_expert_takes_fallback_and_is_reported(tiny_glm, tmp_path):
    starve_expert(tiny_glm, tmp_path / "src", layer=2, expert=3)
    res = convert(tmp_path / "src", tmp_path / "out", recipe="tiny-glm-5.2", method="awq", num_samples=16,
                  validate=False, progress=False)  # 16 x 64 tokens: ~250 per expert, enough to tell starved apart
    rec = next(e for e in res.report["experts"] if e["layer"] == 2 and e["expert"] == 3)
    assert rec["tokens"] == 0 and rec["fallback"] == "all_tokens" and rec["method"] == "awq"
    assert res.report["experts_summary"]["starved"] >= 1
    ck_src, ck_dec = Checkpoint(tmp_path / "src"), Checkpoint(res.decode)
    pre = "model.layers.2.mlp.experts.3."
    src_w = [ck_src.get(pre + p + ".weight") for p in PROJS]
    dec_w = [ck_dec.get(pre + p + ".weight") for p in PROJS]
    assert dec_w[2].abs().sum() > 0  # never silently zeroed
    # smoothed, so compare the function rather than the matrices
    x = torch.randn(64, src_w[0].shape[1], generator=torch.Generator().manual_seed(0))
    ref = swiglu(x, *src_w)
    assert ((swiglu(x, *dec_w) - ref).norm() / ref.norm()).item() < 0.2
