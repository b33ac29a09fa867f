"""RTN with a clip search (`method: rtn-clip`), the registry's worked example: never a larger group
error than RTN in its own norm, a lower weight error than RTN on every expert of the tiny GLM and an
expert-output error not worse (paired over experts), and a `convert --method rtn-clip` whose decode
checkpoint loads in transformers and matches quantkit's logits, while prefill is RTN's, byte for byte."""

from __future__ import annotations

import json

import pytest
import torch

from quantkit.checkpoint.reader import Checkpoint
from quantkit.conversion.pipeline import convert
from quantkit.model.moe import swiglu
from quantkit.quant.experts import PROJS, expert_weights
from quantkit.quant.gptq import quantize_rtn, quantize_rtn_clip
from quantkit.quant.methods import quantize_experts
from quantkit.recipe import load_recipe
from quantkit.validation.forward import logits
from quantkit.validation.metrics import paired

IDS = torch.tensor([[1, 5, 9, 13, 40, 41, 42, 7, 8, 100, 101, 3]])


@pytest.mark.parametrize("norm", [2.0, 3.0])
def test_no_group_is_worse_than_rtn_in_the_searched_norm(norm):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(3, 64, 256, generator=g)
    W[..., ::37] *= 6  # outliers: where clipping pays
    q, r = quantize_rtn_clip(W, 32, norm=norm), quantize_rtn(W, 32)

    def err(x):  # scored as the search scores it: q x scale in float32 (dequantize's bf16 product rounds)
        w_hat = x.q.float().unflatten(-1, (-1, 32)) * x.scale.float().unsqueeze(-1)
        return (w_hat - W.unflatten(-1, (-1, 32))).abs().pow(norm).sum(-1)

    assert q.q.dtype == torch.int8 and q.q.shape == W.shape and q.scale.shape == r.scale.shape
    assert q.q.min() >= -8 and q.q.max() <= 7 and q.scale.dtype == torch.bfloat16
    assert (err(q) <= err(r) * (1 + 1e-6)).all() and err(q).sum() < 0.95 * err(r).sum()


def test_a_group_with_nothing_to_clip_keeps_rtns_scale():
    W = torch.tensor([[-7.5, 7.5] * 16]) * 0.01  # every value on the min-max grid: clipping only loses
    assert torch.equal(quantize_rtn_clip(W, 32).scale, quantize_rtn(W, 32).scale)


@pytest.fixture(scope="module")
def glm_moe(tiny_glm):
    """{MoE layer: (x (N, D) its MoE inputs on a calibration batch, weights, routed token ids)}."""
    from quantkit.inputs.tokens import load_tokens
    from quantkit.model.reference import Context, decoder_layer
    from quantkit.quant.moe import routed_tokens
    from quantkit.validation.forward import embed, layer_weights

    ck = Checkpoint(tiny_glm)
    c = load_recipe("tiny-glm-5.2").calibration
    ids = load_tokens(c.dataset, tokenizer=None, num_samples=32, seq_len=c.seq_len, seed=c.seed).ids
    ctx = Context.build(ck.arch, ids.shape[1], torch.device("cpu"), torch.float32)
    out = {}
    with torch.no_grad():
        h = embed(ck, ids, "cpu", torch.float32)
        for layer in range(ck.arch.num_hidden_layers):
            w = layer_weights(ck, layer, "cpu", torch.float32)
            o = decoder_layer(h, w, ctx, layer)
            if o.routing is not None:
                out[layer] = (o.routing.x, w, routed_tokens(o.routing.x, w, ck.arch))
            h = o.hidden
    return out, ck.arch


def test_rtn_clip_beats_rtn_on_weights_and_is_not_worse_on_outputs(glm_moe):
    """Paired over the tiny GLM's experts (every MoE layer), at the recipe's group size: the weight
    error is lower on every expert (by construction), the output error on its routed tokens not
    worse (the clip search sees no inputs, so the output gain is not guaranteed)."""
    layers, arch = glm_moe
    rec = load_recipe("tiny-glm-5.2")
    d_w, d_out = [], []
    for layer, (x, w, tok) in layers.items():
        experts = list(range(arch.n_routed_experts))
        q_c, rec_c = quantize_experts(x, w, tok, experts, rec, rec.group_size, "rtn-clip", layer)
        q_r, _ = quantize_experts(x, w, tok, experts, rec, rec.group_size, "rtn", layer)
        assert [r.method for r in rec_c] == ["rtn-clip"] * len(experts)
        for e in experts:
            W = dict(zip(PROJS, expert_weights(w, e)))
            d_w.append(sum((q_c[e][p].dequantize() - W[p]).square().sum() - (q_r[e][p].dequantize() - W[p]).square().sum()
                           for p in PROJS).item())
            if len(tok[e]):
                xe = x[tok[e]]
                ref = swiglu(xe, *W.values())
                d_out.append(((swiglu(xe, *(q_c[e][p].dequantize() for p in PROJS)) - ref).square().sum(-1).mean()
                              - (swiglu(xe, *(q_r[e][p].dequantize() for p in PROJS)) - ref).square().sum(-1).mean()).item())
    assert max(d_w) <= 0 and sum(d_w) < 0, d_w
    d = torch.tensor(d_out)
    assert d.mean() <= 2 * d.std() / len(d) ** 0.5, (d.mean(), d.std())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """GLM through the CLI (`quantkit convert ... --method rtn-clip`), its RTN twin through the API."""
    from typer.testing import CliRunner

    from quantkit.cli import app

    root = tmp_path_factory.mktemp("rtnclip")
    res = CliRunner().invoke(app, ["convert", "tiny:glm-5.2", "--out", str(root / "clip"), "--method", "rtn-clip",
                                   "--no-validate", "--json"])
    assert res.exit_code == 0, res.output
    rtn = convert("tiny:glm-5.2", root / "rtn", method="rtn", validate=False, progress=False)
    return root / "clip", json.loads(res.stdout), rtn


def test_convert_reports_rtn_clip_on_every_expert(runs):
    _, report, _ = runs
    assert report["method"] == "rtn-clip" and report["calibration"] is None  # data-free: no calibration pass
    s = report["experts_summary"]
    assert s["rtn-clip"] == s["total"] - s["reused"] > 0 and s["rtn"] == 0 and s["gptq"] == 0
    assert report["recipe"]["rtn_clip"] == {"grid": 100, "max_shrink": 0.2, "norm": 3.0}


def test_prefill_is_rtns_and_decode_experts_differ(runs):
    from safetensors.torch import load_file

    out, _, rtn = runs

    def tensors(folder):
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    a, b = tensors(out / "prefill"), tensors(rtn.prefill)
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    a, b = tensors(out / "decode"), tensors(rtn.decode)
    assert a.keys() == b.keys()
    differ = {k for k in a if not torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))}
    assert differ and all(".mlp.experts." in k for k in differ)


def test_rtn_clip_decode_loads_in_transformers_and_matches(runs):
    from compressed_tensors.quantization import disable_quantization
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    folder = runs[0] / "decode"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    model.apply(disable_quantization)  # as tests/quant/test_awq.py: no dynamic FP8 activation fake-quant
    for p in model.parameters():
        p.data = p.data.float()
    with torch.no_grad():
        theirs = model(IDS).logits
    ours = logits(folder, IDS)
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-4


def test_rtn_clip_is_not_worse_than_rtn_on_heldout_kl(runs):
    from quantkit.synthetic.tiny import batches
    from quantkit.validation.metrics import token_kl

    out, _, rtn = runs
    ids = batches(64, 64, seed=3000)
    src = logits("tiny:glm-5.2", ids)
    d = paired(token_kl(src, logits(out / "decode", ids)), token_kl(src, logits(rtn.decode, ids)))
    assert d.not_worse(z=2.0), f"RTN-clip - RTN KL: {d}"
