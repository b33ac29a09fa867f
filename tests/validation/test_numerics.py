"""validate --numerics engine: FP8 block Linears computed W8A8 as vLLM/SGLang do, checked against a W8A8
written here: activation quantization re-implemented from the engines' kernels (not quantkit's helper),
the FP8 layers picked from the stored dtypes read with safetensors (not quantkit's reader), and the
forward driven whole-layer (not validate's streamed, lockstep loop)."""

from __future__ import annotations

import json

import pytest
import torch
from oracle import read_raw

from quantkit.checkpoint.reader import Checkpoint
from quantkit.conversion.pipeline import convert
from quantkit.formats import fp8
from quantkit.model.numerics import W8A8
from quantkit.model.ops import rms_norm
from quantkit.model.reference import Context, decoder_layer, head_weight_name
from quantkit.validation.metrics import kl_top1
from quantkit.validation.pipeline import validate

SAMPLES, SEQ = 2, 16  # <= the tiny GLM's index_topk (16): DSA attends densely, no tie-breaking in play


def act_w8a8(x: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """vLLM's `_per_token_group_quant_fp8` Triton kernel (fp8_utils.py) step by step, per 128-column group
    of each token: absmax floored at eps 1e-10, scale = absmax * (1 / 448) (UE8M0: exp2(ceil(log2))),
    y / scale clamped to +-448 and cast to e4m3; then dequantized (q * scale)."""
    shape = x.shape
    g = x.float().reshape(-1, 128)
    out = torch.empty_like(g)
    for i in range(g.shape[0]):
        absmax = max(float(g[i].abs().max()), 1e-10)
        s = torch.tensor(absmax, dtype=torch.float32) * torch.tensor(1.0 / 448.0, dtype=torch.float32)
        if ue8m0:
            s = torch.exp2(torch.ceil(torch.log2(s)))
        out[i] = torch.clamp(g[i] / s, -448.0, 448.0).to(torch.float8_e4m3fn).float() * s
    return out.reshape(shape).to(x.dtype)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_activation_quantization_matches_the_kernel_restated(ue8m0):
    x = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 256)
    x[0, 0, :128] = 0  # an all-zero group: the eps floor
    assert torch.equal(fp8.quantize_activations(x, ue8m0=ue8m0), act_w8a8(x, ue8m0))
    with pytest.raises(ValueError, match="not a multiple"):
        fp8.quantize_activations(torch.zeros(2, 64))


def _independent_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    """Logits with every stored-FP8 2-D weight run W8A8 (act_w8a8), whole layers at a time."""
    fp8_names = {n for n, t in read_raw(folder).items() if t.dtype == torch.float8_e4m3fn and t.dim() == 2}
    ck = Checkpoint(folder)
    a = ck.arch
    ctx = Context.build(a, ids.shape[1], torch.device("cpu"), torch.float32)
    h = torch.nn.functional.embedding(ids, ck.get(f"{a.prefix}embed_tokens.weight"))
    for layer in range(a.num_hidden_layers):
        pre = a.layer_prefix(layer)
        w = {k: W8A8(v, act_w8a8) if pre + k in fp8_names else v for k, v in ck.layer(layer).items()}
        h = decoder_layer(h, w, ctx, layer).hidden
    h = rms_norm(h, ck.get(f"{a.prefix}norm.weight"), a.rms_norm_eps)
    return torch.nn.functional.linear(h, ck.get(head_weight_name(a)))


@pytest.fixture(scope="module")
def glm_pair(tmp_path_factory, tiny_glm):
    return convert("tiny:glm-5.2", tmp_path_factory.mktemp("numerics") / "glm", method="rtn", validate=False,
                   progress=False).out


def test_engine_numerics_kl_equals_an_independent_w8a8(glm_pair, tiny_glm):
    from quantkit.inputs.tokens import load_tokens

    kw = dict(num_samples=SAMPLES, seq_len=SEQ, gen_tokens=1, device="cpu", progress=False)
    eng = validate(glm_pair, **kw).data  # the default
    assert eng["numerics"]["mode"] == "engine" and "W8A8" in eng["numerics"]["line"]
    for which in ("prefill", "decode"):
        assert eng["numerics"]["line"] in (glm_pair / which / "README.md").read_text()
    wts = validate(glm_pair, write=False, numerics="weights", **kw).data
    assert wts["numerics"]["mode"] == "weights"

    e = eng["eval_data"]
    ids = load_tokens(e["spec"], tokenizer=tiny_glm, num_samples=SAMPLES, seq_len=SEQ).ids
    with torch.no_grad():
        src = _independent_logits(tiny_glm, ids)
        dec = _independent_logits(glm_pair / "decode", ids)
    kl, _, n = kl_top1(src, dec)
    got = eng["rows"]["decode"]["metrics"]["kl"]
    assert abs(got - kl / n) <= 1e-6 * kl / n, (got, kl / n)
    # and the numerics matter: weight-only KL is another number
    assert abs(wts["rows"]["decode"]["metrics"]["kl"] - got) > 1e-3 * got
    print(json.dumps({"kl_engine": got, "kl_independent": kl / n, "kl_weights": wts["rows"]["decode"]["metrics"]["kl"]}))


def test_transformers_runs_decode_as_stored_as_engine_numerics_do(glm_pair):
    """The upstream oracle where it computes it right: transformers loading decode/ as stored runs its FP8
    layers through compressed-tensors' dynamic 1x128 group fake-quant (W8A8) and its INT4 experts
    dequantized; quantkit's engine numerics compute the same logits, its weight numerics do not.

    Judged per position over 32 windows, not by one maximum: the two forwards sum in different orders,
    and where an activation lies within an ulp of an e4m3 rounding boundary that order flips its code, a
    step as large as the W8A8-vs-weights gap itself, in that position and every later one of its window.
    How often depends on the CPU's kernels and the trained tiny model (none in 12 positions on one machine,
    1 in 7 on another), so the bar is that most positions agree to 1e-5 under engine numerics (measured:
    86%) and none does under weights numerics (0%; the smallest gap measured is 5e-4)."""
    from transformers import AutoModelForCausalLM

    from quantkit.synthetic.tiny import batches
    from quantkit.validation.forward import run

    ids = batches(32, 12, seed=77)
    model = AutoModelForCausalLM.from_pretrained(glm_pair / "decode", dtype=torch.float32).eval()
    for p in model.parameters():
        p.data = p.data.float()
    with torch.no_grad():
        theirs = model(ids).logits  # (32, 12, vocab)
    exact = {}
    for numerics in ("engine", "weights"):
        ck = Checkpoint(glm_pair / "decode")
        ck.numerics = numerics
        gap = (run(ck, ids, device="cpu") - theirs).abs().amax(-1) / theirs.abs().amax((1, 2))[:, None]  # (32, 12)
        exact[numerics] = (gap < 1e-5).float().mean().item()
    assert exact["engine"] >= 0.5 and exact["weights"] <= 0.02, exact
