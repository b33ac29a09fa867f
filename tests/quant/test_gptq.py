"""quantkit.quant.gptq against its oracles: compressed-tensors (scales, quantize, dequantize) and
llm-compressor 0.14's GPTQ core (`llmcompressor.modifiers.gptq.gptq_quantize.quantize_weight`)."""

import functools

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs, dequantize, quantize

from quantkit.quant.gptq import (
    HessianError,
    QuantizedWeight,
    gptq,
    group_scales,
    hessian_from_inputs,
    quantize_rtn,
)

BF16_EPS = torch.finfo(torch.bfloat16).eps


def _args(group_size, actorder=None, scale_dtype=None):
    return QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size,
        actorder=actorder, scale_dtype=scale_dtype,
    )


@functools.cache
def _llmc():
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
    from llmcompressor.observers import Observer

    return quantize_weight, Observer


def _observer_scale(W, args):
    """The scale llm-compressor's default weight observer (memoryless min-max) computes."""
    obs = _llmc()[1].load_from_registry("memoryless_minmax", base_name="weight", args=args)
    return obs(W).get_qparams()["scale"]


def _correlated_inputs(n, d, gen):
    """Tokens with strongly correlated features of very different magnitudes (like activations)."""
    mix = torch.randn(d, d, generator=gen) / d**0.5 + torch.eye(d)
    return (torch.randn(n, d, generator=gen) @ mix) * (torch.rand(d, generator=gen) * 4 + 0.1)


def _weight(shape, gen, zero_group=None):
    W = torch.randn(*shape, generator=gen) * 0.02
    if zero_group is not None:  # (row, start, stop) of an all-zero group
        r, a, b = zero_group
        W[..., r, a:b] = 0
    return W


def _problem(E, out, d, gen, n=512):
    X = torch.stack([_correlated_inputs(n, d, gen) for _ in range(E)])  # [E, n, d]
    H = torch.stack([hessian_from_inputs(x) for x in X])  # [E, d, d]
    return X, _weight((E, out, d), gen), H


SHAPES = [(48, 96, 32), (48, 192, 64), (40, 384, 128)]  # (out, in, group_size)


@pytest.mark.parametrize("out,inp,gs", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_scales_match_llmcompressor_observer(out, inp, gs, dtype):
    gen = torch.Generator().manual_seed(out + inp)
    W = _weight((out, inp), gen, zero_group=(3, gs, 2 * gs)).to(dtype)
    # bf16 weights: the observer computes in bf16; fp32 weights: it rounds to scale_dtype=bf16.
    scale_dtype = torch.bfloat16 if dtype == torch.float32 else None
    ref = _observer_scale(W, _args(gs, scale_dtype=scale_dtype))
    s = group_scales(W, gs)
    assert s.dtype == torch.bfloat16 and s.shape == (out, inp // gs)
    assert torch.equal(s, ref.to(torch.bfloat16))
    assert s[3, 1].item() == BF16_EPS  # the all-zero group
    amax = W[:, :gs].float().abs().amax(-1)
    torch.testing.assert_close(s[:, 0].float(), amax / 7.5, rtol=4e-3, atol=0)


@pytest.mark.parametrize("out,inp,gs", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [(), (3,)])
def test_rtn_matches_compressed_tensors_bit_for_bit(out, inp, gs, dtype, batch):
    gen = torch.Generator().manual_seed(7)
    W = _weight((*batch, out, inp), gen, zero_group=(1, 0, gs)).to(dtype)
    r = quantize_rtn(W, gs)
    assert r.q.dtype == torch.int8 and r.q.shape == W.shape and r.loss is None
    assert r.q.min() == -8 and r.q.max() == 7  # the full grid is used
    zp = torch.zeros(r.scale.shape, dtype=torch.int8)
    args = _args(gs)
    assert torch.equal(r.q, quantize(W, r.scale, zp, args, dtype=torch.int8))
    ref_dq = dequantize(r.q, r.scale, zp, args, dtype=torch.float32)
    assert torch.equal(r.dequantize(), ref_dq)
    assert (r.dequantize() - W.float()).abs().max() < 0.6 * r.scale.float().max()


@pytest.mark.parametrize("gs", [32, 128])
@pytest.mark.parametrize("actorder", [False, True])
def test_gptq_matches_llmcompressor(gs, actorder):
    quantize_weight, _ = _llmc()
    gen = torch.Generator().manual_seed(gs + actorder)
    _, W, H = _problem(1, 64, 256, gen)
    W[0, 5, gs : 2 * gs] = 0  # an all-zero group
    H[0, :, 17] = H[0, 17, :] = 0  # a dead input
    args = _args(gs, actorder="weight" if actorder else None)
    ref_scale = _observer_scale(W[0], _args(gs, scale_dtype=torch.bfloat16)).to(torch.bfloat16)
    zp = torch.zeros(ref_scale.shape, dtype=torch.int8)
    ref_W, ref_loss, fallback = quantize_weight(
        W.clone(), H.clone(), ref_scale[None], zp[None], None, args, blocksize=128, percdamp=0.01
    )
    assert not fallback.any()

    r = gptq(W[0], H[0], gs, actorder=actorder)
    assert torch.equal(r.scale, ref_scale)
    ref_Wg = ref_W[0].unflatten(-1, (-1, gs))  # [out, G, gs]
    ref_q = torch.round(ref_Wg / ref_scale.float().unsqueeze(-1)).flatten(-2)
    assert (r.q == ref_q).float().mean() >= 0.999
    torch.testing.assert_close(r.dequantize(), ref_W[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(r.loss, ref_loss[0], rtol=1e-5, atol=0)
    assert (r.q != quantize_rtn(W[0], gs).q).float().mean() > 0.05  # GPTQ is not RTN here


def test_batched_gptq_equals_per_matrix_and_llmcompressor_batch():
    quantize_weight, _ = _llmc()
    gen = torch.Generator().manual_seed(3)
    _, W, H = _problem(5, 32, 128, gen, n=256)
    b = gptq(W, H, 32, block_size=64, actorder=True)
    assert b.q.shape == W.shape and b.scale.shape == (5, 32, 4) and b.loss.shape == (5,)
    for e in range(5):
        s = gptq(W[e], H[e], 32, block_size=64, actorder=True)
        assert torch.equal(b.q[e], s.q) and torch.equal(b.scale[e], s.scale)
        torch.testing.assert_close(b.loss[e], s.loss, rtol=1e-5, atol=0)
    zp = torch.zeros(b.scale.shape, dtype=torch.int8)
    ref_W, ref_loss, _ = quantize_weight(
        W.clone(), H.clone(), b.scale, zp, None, _args(32, "weight"), blocksize=64, percdamp=0.01
    )
    torch.testing.assert_close(b.dequantize(), ref_W, rtol=0, atol=1e-6)
    torch.testing.assert_close(b.loss, ref_loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize("static_groups,actorder", [(True, False), (True, True), (False, False)])
def test_gptq_beats_rtn_on_layer_output(static_groups, actorder):
    gen = torch.Generator().manual_seed(11)
    X, W, H = _problem(2, 64, 256, gen, n=1024)
    g = gptq(W, H, 32, actorder=actorder, static_groups=static_groups)
    r = quantize_rtn(W, 32)

    def out_err(Wq):  # per expert ||X W^T - X W_hat^T||
        return torch.linalg.matrix_norm(X @ W.transpose(-1, -2) - X @ Wq.transpose(-1, -2))

    e_gptq, e_rtn = out_err(g.dequantize()), out_err(r.dequantize())
    assert (e_gptq < 0.8 * e_rtn).all(), (e_gptq, e_rtn)
    # loss is the output error GPTQ predicts: sum of err^2/2, of the order of ||.||^2 / n
    assert ((g.loss > 0.2 * e_gptq**2 / 1024) & (g.loss < 5 * e_gptq**2 / 1024)).all()


@pytest.mark.parametrize("static_groups", [True, False])
def test_diagonal_hessian_reduces_to_rtn(static_groups):
    # With uncorrelated inputs nothing can be compensated: GPTQ must give exactly RTN.
    gen = torch.Generator().manual_seed(5)
    W = _weight((3, 16, 128), gen)
    H = torch.diag_embed(torch.rand(3, 128, generator=gen) + 0.5)
    g, r = gptq(W, H, 32, block_size=64, static_groups=static_groups), quantize_rtn(W, 32)
    assert torch.equal(g.q, r.q) and torch.equal(g.scale, r.scale)
    rtn_sq = ((W - r.dequantize()) ** 2 * H.diagonal(dim1=-2, dim2=-1).unsqueeze(-2)).sum((-2, -1))
    torch.testing.assert_close(g.loss, rtn_sq * 1.01 / 2, rtol=1e-3, atol=0)  # 1.01: dampening


def test_dynamic_groups_rescale_from_updated_weights():
    gen = torch.Generator().manual_seed(2)
    _, W, H = _problem(1, 32, 128, gen)
    s, d = gptq(W, H, 32), gptq(W, H, 32, static_groups=False)
    assert torch.equal(s.scale[..., 0], d.scale[..., 0])  # nothing updated before the first group
    assert not torch.equal(s.scale[..., 1:], d.scale[..., 1:])
    with pytest.raises(ValueError):
        gptq(W, H, 48, static_groups=False, block_size=128)


def test_dead_columns_and_zero_group_are_finite():
    gen = torch.Generator().manual_seed(9)
    X = _correlated_inputs(300, 128, gen)
    X[:, [0, 40, 41, 127]] = 0  # inputs that never fire
    W = _weight((24, 128), gen, zero_group=(2, 64, 96))
    for static_groups in (True, False):
        g = gptq(W, hessian_from_inputs(X), 32, static_groups=static_groups)
        assert torch.isfinite(g.dequantize()).all() and torch.isfinite(g.loss)
        assert (g.q[:, [0, 40, 41, 127]] == 0).all()  # dead columns are zeroed, like llm-compressor
    # an all-dead Hessian (no tokens routed to this expert) and an all-zero weight
    z = gptq(torch.zeros(2, 8, 64), torch.stack([hessian_from_inputs(torch.zeros(0, 64))] * 2), 32)
    assert (z.q == 0).all() and (z.loss == 0).all() and (z.scale.float() == BF16_EPS).all()


def test_non_positive_definite_hessian_raises_with_batch_index():
    gen = torch.Generator().manual_seed(4)
    _, W, H = _problem(3, 8, 64, gen, n=128)
    H[1] = -torch.eye(64)
    with pytest.raises(HessianError, match=r"\[1\]"):
        gptq(W, H, 32)
    H[1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"\[1\]"):
        gptq(W, H, 32)


def test_hessian_from_inputs():
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(2, 50, 16, generator=gen, dtype=torch.float64)
    H = hessian_from_inputs(X)
    Xf = X.reshape(100, 16)
    assert H.dtype == torch.float32 and H.shape == (16, 16)
    torch.testing.assert_close(H, (2 / 100 * Xf.T @ Xf).float())
    assert torch.equal(hessian_from_inputs(torch.zeros(0, 16)), torch.zeros(16, 16))


def test_shape_errors():
    with pytest.raises(ValueError):
        group_scales(torch.zeros(4, 96), 64)
    with pytest.raises(ValueError):
        gptq(torch.zeros(2, 4, 64), torch.zeros(3, 64, 64), 32)
    assert isinstance(quantize_rtn(torch.ones(2, 32), 32), QuantizedWeight)


def test_shared_h_equals_separate_calls_without_copying_h():
    """gate and up share one H: quantizing them row-stacked against one factored H gives what two
    separate calls with two copies of H give (GPTQ's rows are independent given Hinv)."""
    from quantkit.quant.gptq import gptq_shared_h

    g = torch.Generator().manual_seed(3)
    X = torch.randn(2, 300, 64, generator=g)  # 2 experts
    H = torch.stack([hessian_from_inputs(x) for x in X])
    Wg, Wu = torch.randn(2, 24, 64, generator=g), torch.randn(2, 40, 64, generator=g)
    sep = [gptq(W, H, 32) for W in (Wg, Wu)]
    shared = gptq_shared_h([Wg, Wu], H.clone(), 32, consume=True)
    for a, b in zip(sep, shared):
        assert a.q.shape == b.q.shape and a.scale.shape == b.scale.shape
        assert torch.equal(a.scale, b.scale)  # static groups: from the weights alone
        assert (a.q != b.q).float().mean() < 1e-3  # same computation; only float summation order may differ
    assert torch.allclose(shared[0].loss, sep[0].loss + sep[1].loss, rtol=1e-4)


def test_consume_factors_h_in_place():
    g = torch.Generator().manual_seed(4)
    X = torch.randn(200, 32, generator=g)
    H = hessian_from_inputs(X)
    W = torch.randn(8, 32, generator=g)
    want = gptq(W, H, 16)
    H2, W2 = H.clone(), W.clone()
    got = gptq(W2, H2, 16, consume=True)
    assert torch.equal(want.q, got.q) and torch.equal(want.scale, got.scale)
    assert not torch.equal(H2, H)  # damped in place: the caller's copy was used, not duplicated


def test_mse_observer_never_worse_than_minmax_and_clips_an_outlier():
    from quantkit.quant.gptq import QuantizedWeight, group_scales, mse_group_scales

    g = torch.Generator().manual_seed(0)
    W = torch.randn(16, 256, generator=g)
    W[:, 3] *= 6  # one heavy input column: min-max spends the group's grid on it

    def err(scale):
        q = torch.clamp(torch.round(W.unflatten(-1, (-1, 128)) / scale.float().unsqueeze(-1)), -8, 7)
        return (QuantizedWeight(q.flatten(-2).to(torch.int8), scale).dequantize() - W).abs().pow(2.4).unflatten(-1, (-1, 128)).sum(-1)

    mm, mse = group_scales(W, 128), mse_group_scales(W, 128)
    assert bool((err(mse) <= err(mm) + 1e-6).all())
    assert bool((mse[:, 0] < mm[:, 0]).all()) and err(mse)[:, 0].sum() < 0.9 * err(mm)[:, 0].sum()
    q = gptq(W, torch.eye(256) * 2, 128, observer="mse")  # GPTQ stores the observer's scales
    assert torch.equal(q.scale, mse)


def test_hessian_observer_weights_the_clip_search_by_the_damped_diagonal():
    """observer="hessian": each group's clip minimises sum_j d_j (w_j - q_j)^2 with d the damped diag(H).
    Flat d is the unweighted squared-error search; a column H says is busy decides its group's clip."""
    from quantkit.quant.gptq import QuantizedWeight, group_scales, mse_group_scales

    g = torch.Generator().manual_seed(0)
    W = torch.randn(16, 256, generator=g)
    W[:, 3] *= 6  # a heavy column: an unweighted search clips it to refine the other 127
    # d = 2 + 1.0 * 2 = 4 everywhere: a power of two, so each weighted sum is exactly 4x the unweighted
    # one on any CPU (no rounding can turn a near-tie between two clips)
    flat = gptq(W, torch.eye(256) * 2, 128, observer="hessian", dampening=1.0)
    assert torch.equal(flat.scale, mse_group_scales(W, 128, norm=2.0))

    d = torch.ones(256)
    d[3] = 8192 - 255  # ... unless H says column 3 carries nearly all of the input energy (mean(d) = 32)
    busy = gptq(W, torch.diag(d), 128, observer="hessian", dampening=1 / 32)  # d + 1: group 2's d is exactly 2
    mm = group_scales(W, 128)

    def col3_err(scale):
        q = torch.clamp(torch.round(W.unflatten(-1, (-1, 128)) / scale.float().unsqueeze(-1)), -8, 7)
        return (QuantizedWeight(q.flatten(-2).to(torch.int8), scale).dequantize() - W)[:, 3].abs()

    assert bool((flat.scale[:, 0] < mm[:, 0]).any())  # the flat search clips the heavy column's group
    assert col3_err(busy.scale).sum() < 0.5 * col3_err(flat.scale).sum()  # the weighted one keeps it exact(er)
    assert torch.equal(busy.scale[:, 1], mse_group_scales(W, 128, norm=2.0)[:, 1])  # group 2: flat d, same search


def test_hessian_observer_lowers_gptq_error_in_and_off_the_calibration_span():
    """The shipped real recipes' setting (act-order, dampening 0.1, observer hessian) against the same
    GPTQ with min-max scales, when calibration inputs span 1/8 of the input space (an expert's thin
    statistics): lower error on inputs like the calibration's (tr dW H dW^T) and on inputs in every
    direction (||dW||_F^2, where GPTQ's error feedback costs most). Measured margins ~7% and ~14%."""
    g = torch.Generator().manual_seed(0)
    D, k = 512, 64
    X = torch.randn(1024, k, generator=g) @ torch.randn(k, D, generator=g)  # [n, D], rank k
    H = hessian_from_inputs(X)
    W = torch.randn(4, 256, D, generator=g)

    def errors(observer):
        dW = gptq(W, H.expand(4, D, D), 128, actorder=True, dampening=0.1, observer=observer).dequantize() - W
        return torch.einsum("eoi,ij,eoj->", dW, H, dW).item(), dW.square().sum().item()

    (h_mm, f_mm), (h_h, f_h) = errors("minmax"), errors("hessian")
    assert h_h < 0.98 * h_mm and f_h < 0.95 * f_mm, (h_h / h_mm, f_h / f_mm)
