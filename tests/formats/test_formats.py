"""Storage formats against their upstream definitions.

INT4: compressed-tensors 0.19 (`pack_to_int32` / `unpack_from_int32`, PackedQuantizationCompressor,
`dequantize`) is the reference, bit for bit. FP8: an independent per-block formula and
transformers' own block dequantization.
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

from quantkit.formats import fp8, int4

# (rows, cols): whole words, odd shapes, a single element, cols just under/over a word multiple.
SHAPES = [(16, 64), (3, 5), (7, 13), (1, 1), (5, 8), (9, 31), (4, 33), (2, 7)]


def rand_q(shape, seed=0) -> torch.Tensor:
    return torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


# ---- INT4 packing -------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dim", [-1, 0])
def test_int4_pack_equals_compressed_tensors(shape, dim):
    q = rand_q(shape, seed=shape[0] * 100 + shape[1])
    theirs = pack_to_int32(q, 4, packed_dim=1 if dim == -1 else 0)
    ours = int4.pack(q, dim=dim)
    assert ours.dtype == torch.int32
    assert ours.shape == theirs.shape
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dim", [-1, 0])
def test_int4_unpack_equals_compressed_tensors(shape, dim):
    q = rand_q(shape, seed=7 + shape[0] + shape[1])
    packed = pack_to_int32(q, 4, packed_dim=1 if dim == -1 else 0)
    ours = int4.unpack(packed, shape, dim=dim)
    theirs = unpack_from_int32(packed, 4, torch.Size(shape), packed_dim=1 if dim == -1 else 0)
    assert ours.dtype == torch.int8
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, q)


def test_int4_pack_layout_by_hand():
    """Value j of a word sits in bits 4j..4j+3 as q + 8; -8 and 7 in the top nibble make the sign bit."""
    q = torch.tensor([[-8, -7, -1, 0, 1, 2, 6, 7]], dtype=torch.int8)
    nibbles = [0, 1, 7, 8, 9, 10, 14, 15]
    word = sum(n << (4 * j) for j, n in enumerate(nibbles))
    expected = word - 2**32 if word >= 2**31 else word
    assert int4.pack(q).item() == expected
    assert int4.pack(q).item() < 0  # the top nibble (15) sets the sign bit
    # a partial word: the unused high nibbles are zero bits, as compressed-tensors writes them
    assert int4.pack(torch.tensor([[3, -8]], dtype=torch.int8)).item() == (3 + 8) | (0 << 4)


def test_int4_extremes_round_trip():
    q = torch.tensor([[-8] * 9, [7] * 9, [-8, 7] * 4 + [0]], dtype=torch.int8)
    assert torch.equal(int4.unpack(int4.pack(q), tuple(q.shape)), q)
    assert torch.equal(int4.pack(q), pack_to_int32(q, 4))


def test_int4_rejects_wrong_dtypes():
    with pytest.raises(TypeError):
        int4.pack(torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(TypeError):
        int4.unpack(torch.zeros(2, 1, dtype=torch.int64), (2, 8))


# ---- INT4 dequantization ------------------------------------------------------------------------
def _scheme(symmetric: bool, group: int) -> QuantizationScheme:
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
    return QuantizationScheme(targets=["Linear"], weights=args)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("out,inp,group", [(12, 64, 32), (13, 96, 32), (7, 256, 128), (9, 32, 32)])
def test_int4_dequantize_equals_compressed_tensors_decompress(symmetric, out, inp, group):
    """bf16 dequantization equals PackedQuantizationCompressor.decompress bit for bit; the
    asymmetric case packs its zero points along dim 0 (odd row counts leave a partial word)."""
    g = torch.Generator().manual_seed(out * inp + symmetric)
    q = torch.randint(-8, 8, (out, inp), generator=g, dtype=torch.int8)
    scale = (torch.rand(out, inp // group, generator=g) * 0.1 + 0.001).to(torch.bfloat16)
    state = {"weight_packed": pack_to_int32(q, 4), "weight_scale": scale, "weight_shape": torch.tensor([out, inp])}
    zp = None
    if not symmetric:
        zp = torch.randint(-8, 8, (out, inp // group), generator=g, dtype=torch.int8)
        state["weight_zero_point"] = pack_to_int32(zp, 4, packed_dim=0)
        assert torch.equal(int4.pack(zp, dim=0), state["weight_zero_point"])
    theirs = PackedQuantizationCompressor.decompress(state, _scheme(symmetric, group))["weight"]
    ours = int4.dequantize(state["weight_packed"], scale, state["weight_shape"], state.get("weight_zero_point"))
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours, theirs)
    # and the same through compressed-tensors' functional dequantize on the unpacked values
    direct = ct_dequantize(x_q=q, scale=scale, zero_point=zp, args=_scheme(symmetric, group).weights)
    assert torch.equal(ours, direct)
    if not symmetric:  # the zero point matters: ignoring it gives a different tensor
        assert not torch.equal(ours, int4.dequantize(state["weight_packed"], scale, (out, inp)))


def test_int4_store_round_trip_through_compressed_tensors():
    """int4.store writes what compressed-tensors decompresses back to (q * scale)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-8, 8, (24, 64), generator=g, dtype=torch.int8)
    scale = (torch.rand(24, 2, generator=g) + 0.01).to(torch.bfloat16)
    stored = int4.store(q, scale)
    assert stored["weight_shape"].dtype == torch.int32 and stored["weight_shape"].tolist() == [24, 64]
    theirs = PackedQuantizationCompressor.decompress(dict(stored), _scheme(True, 32))["weight"]
    expected = (q.to(torch.bfloat16).view(24, 2, 32) * scale.unsqueeze(-1)).view(24, 64)
    assert torch.equal(theirs, expected)
    assert torch.equal(int4.dequantize(stored["weight_packed"], scale, stored["weight_shape"]), expected)


def test_int4_dequantize_rejects_partial_groups():
    with pytest.raises(ValueError):
        int4.dequantize(int4.pack(rand_q((4, 40))), torch.ones(4, 3, dtype=torch.bfloat16), (4, 40))


def test_int4_quantization_config_shape():
    qc = int4.quantization_config(32, ["lm_head"])
    w = qc["config_groups"]["group_0"]["weights"]
    assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "pack-quantized")
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (4, "int", True, "group", 32)
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"] and qc["ignore"] == ["lm_head"]
    QuantizationArgs(**{k: v for k, v in w.items() if k != "observer"})  # compressed-tensors accepts it


# ---- FP8 block ----------------------------------------------------------------------------------
def dequantize_fp8_tf(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """transformers' own block dequantization (correct where the shape is whole 128-blocks)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(q, scale, torch.float32)


def fp8_by_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent formula: per block, s = amax / 448, q = e4m3(w / s), dequantized = q * s."""
    out, inp = w.shape
    rows, cols = -(-out // block), -(-inp // block)
    scale = torch.empty(rows, cols)
    deq = torch.empty(out, inp)
    for r in range(rows):
        for c in range(cols):
            blk = w[r * block:(r + 1) * block, c * block:(c + 1) * block].float()
            s = max(blk.abs().max().item() / 448.0, torch.finfo(torch.float32).tiny)
            s = torch.tensor(s, dtype=torch.float32)
            scale[r, c] = s
            deq[r * block:(r + 1) * block, c * block:(c + 1) * block] = (blk / s).to(torch.float8_e4m3fn).float() * s
    return scale, deq


def spread_weights(shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes spanning four decades across columns, so blocks get very different scales
    return torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[1])


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (64, 64), (129, 257), (576, 256)])
def test_fp8_round_trip_matches_independent_formula(shape):
    w = spread_weights(shape, seed=shape[0])
    q, s = fp8.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    ref_scale, ref_deq = fp8_by_blocks(w)
    torch.testing.assert_close(s, ref_scale, rtol=0, atol=0)
    deq = fp8.dequantize(q, s)
    torch.testing.assert_close(deq, ref_deq, rtol=0, atol=0)
    # error bound: e4m3 keeps 3 mantissa bits (relative error <= 2^-4) above its smallest normal
    # 2^-6; below it the spacing is 2^-9, so the absolute error is at most 2^-10 of the block scale.
    block_scale = s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    bound = w.abs() * 2**-4 + block_scale * 2**-10
    assert ((deq - w).abs() <= bound * (1 + 1e-6)).all()
    # and it really is lossy (the test would catch a format that stores nothing)
    assert (deq - w).abs().max() > 0


@pytest.mark.parametrize("shape", [(256, 384), (128, 128), (384, 128)])
def test_fp8_dequantize_equals_transformers(shape):
    w = spread_weights(shape, seed=1)
    q, s = fp8.quantize(w)
    assert torch.equal(fp8.dequantize(q, s), dequantize_fp8_tf(q, s))


def test_fp8_block_maximum_is_exact_and_zero_block_is_safe():
    w = torch.zeros(256, 256)
    w[0, 0], w[200, 200] = 3.5, -0.25  # blocks (0,0) and (1,1) hold one value each; (0,1), (1,0) are zero
    q, s = fp8.quantize(w)
    assert s[0, 0].item() == pytest.approx(3.5 / 448) and s[1, 1].item() == pytest.approx(0.25 / 448)
    assert q[0, 0].float().item() == 448.0 and q[200, 200].float().item() == -448.0
    d = fp8.dequantize(q, s)
    assert torch.isfinite(d).all() and torch.equal(d == 0, w == 0)
    assert d[0, 0].item() == 3.5 and d[200, 200].item() == -0.25


def test_fp8_dequantize_rejects_wrong_grid():
    q, s = fp8.quantize(torch.randn(256, 256))
    with pytest.raises(ValueError, match="scale grid"):
        fp8.dequantize(q, s[:1])


@pytest.mark.parametrize(
    "shape,ok",
    [((128, 128), True), ((7168, 2048), True), ((256, 384), True), ((576, 7168), False), ((128, 100), False),
     ((100, 128), False), ((1, 1), False)],
)
def test_can_block(shape, ok):
    assert fp8.can_block(shape) is ok
