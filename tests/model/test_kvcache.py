"""quantkit.model.kvcache: the engines' FP8 KV cache, bit for bit against an independent e4m3 reference; the
scales convert writes (identical in both outputs, named as the loaders read them); validate's KV rows."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open

from quantkit.model.families import REGISTRY
from quantkit.model.kvcache import (
    E4M3_MAX,
    SCALE_NAMES,
    KVAbsmax,
    KVCache,
    ds_mla,
    indexer_keys,
    per_tensor,
    to_e4m3,
    ue8m0,
)
from quantkit.model.reference import Context, LayerCache, attention
from quantkit.planner.render import capacity_beside_delta


# ---- an independent e4m3 encoder: the format's definition, numpy float32 arithmetic ---------------
def _e4m3_table() -> tuple[np.ndarray, np.ndarray]:
    """Every finite non-negative e4m3 value (bias 7, 3 mantissa bits, S.1111.111 is NaN) and its code."""
    values, codes = [], []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue
            values.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
            codes.append(e << 3 | m)
    return np.array(values), np.array(codes)


VALUES, CODES = _e4m3_table()


def ref_code(v: float) -> int:
    """Round to nearest, ties to the even code, saturating at 448 (CUDA's __NV_SATFINITE)."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = min(abs(v), E4M3_MAX)
    i = int(np.searchsorted(VALUES, a))
    if i < len(VALUES) and VALUES[i] == a:
        return sign | int(CODES[i])
    lo, hi = i - 1, min(i, len(VALUES) - 1)
    d_lo, d_hi = a - VALUES[lo], VALUES[hi] - a
    pick = lo if d_lo < d_hi or (d_lo == d_hi and CODES[lo] % 2 == 0) else hi
    return sign | int(CODES[pick])


def ref_roundtrip(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """e4m3(x / scale) * scale, the division and product in float32 as the CUDA kernels do them."""
    q = (x.astype(np.float32) / scale.astype(np.float32)).astype(np.float32)
    vals = np.array([VALUES[CODES == (c & 0x7F)][0] * (-1 if c & 0x80 else 1) for c in map(ref_code, q.ravel())])
    return (vals.reshape(q.shape).astype(np.float32) * scale.astype(np.float32)).astype(np.float32)


def cache_like(shape, seed=0) -> torch.Tensor:
    """Values spanning e4m3's subnormals to beyond its saturation once scaled, exact ties included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 2)
    flat = x.view(-1)
    flat[:6] = torch.tensor([0.0, -0.0, 1.0625, 1.1875, 2.0**-9 * 3 / 2, 500.0])  # ties between codes, a subnormal tie
    return x


def test_e4m3_codes_match_the_format_definition():
    x = cache_like((4096,))
    for scale in (1.0, 0.0123, 3.7):
        got = to_e4m3(x, torch.tensor(scale)).view(torch.uint8).numpy()
        q = (x.numpy().astype(np.float32) / np.float32(scale)).astype(np.float32)
        want = np.array([ref_code(float(v)) for v in q], dtype=np.uint8)
        assert (got == want).all(), f"scale {scale}: {np.flatnonzero(got != want)[:5]}"


def test_per_tensor_cache_is_bit_exact():
    x = cache_like((3, 5, 96), seed=1)
    for scale in (1.0, 0.021):
        got = per_tensor(x, scale).numpy()
        assert np.array_equal(got.view(np.uint32), ref_roundtrip(x.numpy(), np.float32(scale)).view(np.uint32))


def test_gqa_cache_scales_keys_and_values_apart():
    """GQA (Qwen3-MoE): keys with k_scale and values with v_scale, each per tensor (vLLM's
    reshape_and_cache_flash); calibration measures the two maxima apart and writes a scale each."""
    k, v = cache_like((2, 5, 2, 64), seed=2) * 3, cache_like((2, 5, 2, 64), seed=3)
    w = {SCALE_NAMES[0]: torch.tensor([0.02]), SCALE_NAMES[1]: torch.tensor([0.005])}
    gqa = REGISTRY["qwen3_moe"].attention  # its attention kind's `store`, quantkit.model.families.qwen3_moe
    gk, gv = gqa.store(KVCache("fp8_e4m3"), 0, w, k, v)
    for got, x, s in ((gk, k, 0.02), (gv, v, 0.005)):
        assert np.array_equal(got.numpy().view(np.uint32), ref_roundtrip(x.numpy(), np.float32(s)).view(np.uint32))
    bk, bv = gqa.store(KVCache("bf16"), 0, w, k, v)
    assert bk is k and bv is v
    with pytest.raises(ValueError, match="fp8_ds_mla is vLLM's MLA"):
        gqa.store(KVCache("fp8_ds_mla"), 0, w, k, v)
    cal = KVAbsmax()
    gqa.store(cal, 3, {}, k, v)
    ks, vs = gqa.kv_scales(cal.maxima[3])
    assert (ks, vs) == (float(k.abs().max()) / E4M3_MAX, float(v.abs().max()) / E4M3_MAX) and ks != vs
    assert gqa.kv_report(cal.maxima[3]) == {"key_absmax": float(k.abs().max()), "value_absmax": float(v.abs().max()),
                                   "k_scale": ks, "v_scale": vs}


def test_ds_mla_tiles_are_bit_exact():
    x = cache_like((2, 7, 256), seed=2)  # two 128-tiles per token
    t = x.numpy().reshape(2, 7, 2, 128)
    s = np.maximum(np.abs(t).max(-1, keepdims=True).astype(np.float32) / np.float32(448), np.float32(1.1754944e-38))
    want = ref_roundtrip(t, s).reshape(2, 7, 256)
    assert np.array_equal(ds_mla(x).numpy().view(np.uint32), want.view(np.uint32))


def test_indexer_keys_are_bit_exact_with_power_of_two_scales():
    x = cache_like((2, 9, 64), seed=3)  # a head shorter than the 128-block: one scale per token
    a = np.maximum(np.abs(x.numpy()).max(-1, keepdims=True).astype(np.float32), np.float32(1e-4)) / np.float32(448)
    s = np.array([2.0 ** math.ceil(math.log2(float(v))) if float(v) != 2.0 ** round(math.log2(float(v))) else float(v)
                  for v in a.ravel()], dtype=np.float32).reshape(a.shape)
    want = ref_roundtrip(x.numpy(), s)
    assert np.array_equal(indexer_keys(x).numpy().view(np.uint32), want.view(np.uint32))


def test_ue8m0_is_the_next_power_of_two():
    s = torch.tensor([0.25, 0.2500001, 1e-6, 3.0, 2.0**-20], dtype=torch.float32)
    assert ue8m0(s).tolist() == [0.25, 0.5, 2.0**-19, 4.0, 2.0**-20]


def test_bf16_cache_leaves_the_forward_unchanged(tiny_kimi):
    """Context.kv = KVCache("bf16") must be the old forward exactly; fp8 stores quantized keys only
    in the cache (a prefill chunk attends to its fresh keys, a decode step to the stored ones)."""
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.validation.forward import layer_weights

    ck = Checkpoint(tiny_kimi)
    a = ck.arch
    w = layer_weights(ck, 1, "cpu", torch.float32)
    x = torch.randn(2, 6, a.hidden_size, generator=torch.Generator().manual_seed(0))
    outs = {}
    for name, kv in (("none", None), ("bf16", KVCache("bf16")), ("fp8", KVCache("fp8_e4m3"))):
        caches = [LayerCache() for _ in range(a.num_hidden_layers)]
        prompt = attention(x[:, :5], w, Context.build(a, 5, "cpu", torch.float32, caches=caches, kv=kv), 1)
        step = attention(x[:, 5:], w, Context.build(a, 1, "cpu", torch.float32, start=5, caches=caches, kv=kv), 1)
        outs[name] = (prompt, step, caches[1])
    assert torch.equal(outs["none"][0], outs["bf16"][0]) and torch.equal(outs["none"][1], outs["bf16"][1])
    assert torch.equal(outs["none"][0], outs["fp8"][0])  # the prompt pass reads no cache
    assert not torch.equal(outs["none"][1], outs["fp8"][1])  # the decode step does
    assert torch.equal(outs["fp8"][2].latent, per_tensor(outs["none"][2].latent, 1.0))


# ---- what convert writes -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pairs(tmp_path_factory, tiny_glm, tiny_kimi):
    from quantkit import convert

    root = tmp_path_factory.mktemp("kv")
    return {n: convert(f"tiny:{n}", root / n, validate=False, progress=False).out for n in ("kimi-k2.6", "glm-5.2")}


def _scales(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as g:
            out |= {k: g.get_tensor(k) for k in g.keys() if k.endswith(("k_scale", "v_scale"))}
    return out


@pytest.mark.parametrize("name", ["kimi-k2.6", "glm-5.2"])
def test_scales_identical_in_both_outputs_and_named_for_the_loaders(pairs, name):
    """vLLM (weight_utils.maybe_remap_kv_scale_name) and compressed-tensors read `<layer>.self_attn.k_scale`
    and `v_scale`, one float32 per layer; BaseKVCacheMethod rejects anything but one value per tensor."""
    out = pairs[name]
    pre, dec = _scales(out / "prefill"), _scales(out / "decode")
    report = json.loads((out / "convert-report.json").read_text())
    arch_layers = len(report["kv_cache"]["layers"])
    prefix = "language_model.model.layers." if name == "kimi-k2.6" else "model.layers."
    assert arch_layers > 0 and set(pre) == set(dec) == {f"{prefix}{i}.{n}" for i in range(arch_layers) for n in SCALE_NAMES}
    for k, t in pre.items():
        assert t.dtype == torch.float32 and t.shape == (1,) and torch.equal(t.view(torch.int32), dec[k].view(torch.int32))
        layer = k.split(".layers.")[1].split(".")[0]
        assert float(t) == pytest.approx(report["kv_cache"]["layers"][layer]["k_scale"], rel=1e-7)
    cfg = json.loads((out / "decode" / "config.json").read_text())["quantization_config"]
    scheme = cfg.get("kv_cache_scheme")
    if name == "kimi-k2.6":
        # vLLM 0.33.0 CompressedTensorsKVCacheMethod.validate_kv_cache_scheme: type float, num_bits 8,
        # strategy tensor or attn_head, symmetric; SGLang 0.5.23 CompressedTensorsKVCacheMethod.
        # is_supported_scheme: float, 8 bits, tensor, symmetric, not dynamic (else it ignores the scales)
        assert scheme["num_bits"] == 8 and scheme["type"] == "float" and scheme["strategy"] == "tensor"
        assert scheme["symmetric"] is True and scheme["dynamic"] is False
    else:  # DSA: vLLM's fp8_ds_mla ignores it, and transformers' QuantizedKVCache cannot run the indexer
        assert scheme is None


def test_scales_cover_cache_and_query(pairs):
    layers = json.loads((pairs["kimi-k2.6"] / "convert-report.json").read_text())["kv_cache"]["layers"]
    for v in layers.values():
        top = max(v["latent_absmax"], v["k_rot_absmax"], v["query_absmax"])
        assert v["k_scale"] == pytest.approx(top / E4M3_MAX, rel=1e-6)


# ---- validate's KV rows ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["kimi-k2.6", "glm-5.2"])
def test_calibrated_scales_no_worse_than_scale_one(pairs, name):
    """Calibrated scales against 1.0 on the same decode steps, paired per eval window. The scales only
    move e4m3's subnormal floor (relative precision is the same elsewhere), so the honest claim is
    'not worse': the mean paired KL difference stays under 4 standard errors (one-sided t with 31
    degrees of freedom: a false alarm about once in 5000 builds of the tiny model)."""
    from quantkit.validation.pipeline import validate

    res = validate(pairs[name], device="cpu", progress=False, write=False, num_samples=32, kv_cache_dtype="fp8_e4m3")
    for row in ("decode_kv", "cross_phase_kv"):
        one = res.data["rows"][row]["scale_1"]
        diff, se = one["kl_calibrated_minus_scale_1"], one["kl_calibrated_minus_scale_1_se"]
        assert diff <= 4 * se + 1e-12, (row, diff, se)
    assert res.data["kv_cache"]["calibrated"]


def test_kv_delta_gate_and_plan_line(pairs, tmp_path):
    from quantkit.planner.capacity import plan
    from quantkit.validation.pipeline import check_gates, validate

    res = validate(pairs["kimi-k2.6"], device="cpu", progress=False, write=False, num_samples=2, gen_tokens=3,
                   kv_cache_dtype="fp8_ds_mla", gates={"kv_delta_max": -1.0})
    rows = res.data["rows"]
    assert {"decode_kv", "cross_phase_kv"} <= set(rows) and "scale_1" not in rows["decode_kv"]
    failed = {(g["gate"], g["row"]) for g in res.failed_gates}
    assert failed == {("kv_delta_max", "decode_kv"), ("kv_delta_max", "cross_phase_kv")}  # only the KV rows measure it
    assert check_gates({"kv_delta_max": 1.0}, rows)[0]["passed"]
    # the weights' gates do not reach the KV rows unless scoped to them
    assert {g["row"] for g in check_gates({"kl_max": 1.0}, rows)} == {"prefill", "decode", "cross_phase"}
    assert [g["row"] for g in check_gates({"decode_kv.kl_max": 1.0}, rows)] == ["decode_kv"]
    lines = capacity_beside_delta(plan("kimi-k2.6"), res.data)
    assert lines[0].startswith("FP8 KV: 1.") and "measured KL" in lines[0] and "(2.0x)" in lines[0]


def test_unknown_kv_dtype_is_one_line_error(pairs):
    from quantkit.errors import ConfigError
    from quantkit.validation.pipeline import validate

    with pytest.raises(ConfigError, match="fp8_e4m3"):
        validate(pairs["kimi-k2.6"], device="cpu", progress=False, write=False, kv_cache_dtype="fp8")


def test_cli_writes_kv_rows_to_card_and_md_and_plan_reads_them(pairs, tmp_path):
    """`quantkit validate --kv-cache-dtype fp8_e4m3` -> validation.json/md and the cards carry the KV
    dtype, the scales and the delta; `quantkit plan --validation` prints capacity beside it."""
    import shutil

    from typer.testing import CliRunner

    from quantkit.cli import app

    folder = tmp_path / "kimi"
    shutil.copytree(pairs["kimi-k2.6"], folder)
    runner = CliRunner()
    res = runner.invoke(app, ["validate", str(folder), "--device", "cpu", "--num-samples", "2", "--gen-tokens", "3",
                              "--kv-cache-dtype", "fp8_e4m3"])
    assert res.exit_code == 0, res.output
    data = json.loads((folder / "validation.json").read_text())
    assert data["kv_cache"]["dtype"] == "fp8_e4m3" and data["kv_cache"]["calibrated"]
    assert "## FP8 KV cache (fp8_e4m3)" in (folder / "validation.md").read_text()
    card = (folder / "decode" / "README.md").read_text()
    assert "## FP8 KV cache" in card and "`self_attn.k_scale`" in card and "Measured with `--kv-cache-dtype fp8_e4m3`" in card
    assert "decoding over an FP8 KV cache" in card
    plan = runner.invoke(app, ["plan", "kimi-k2.6", "--validation", str(folder / "validation.json")])
    assert plan.exit_code == 0 and "FP8 KV: 1." in plan.output and "measured KL" in plan.output, plan.output
    bad = runner.invoke(app, ["plan", "kimi-k2.6", "--validation", str(tmp_path / "missing.json")])
    assert bad.exit_code == 1 and "validation.json" in bad.output
