"""The FP8 KV cache as the engines store it: simulated by `validate`, calibrated by `convert`.

An MLA layer caches, per token, the compressed latent `kv_c` (after kv_a_layernorm) and the rope
key `k_pe` (after rope); GLM's DSA adds the indexer's key. With `--kv-cache-dtype fp8_e4m3` the
engines keep these in e4m3. What they do, as read in their sources:

    vLLM, dense MLA (Kimi K2.6, DeepSeek-V3)
        csrc/cache_kernels.cu `concat_and_cache_mla_kernel`, called from `MLAAttention.forward_impl`
        (vllm/attention/layer.py) with `scale=self._k_scale`: kv_c and k_pe are each written as
        `fp8::scaled_convert(x, *scale)`, which is `__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE,
        __NV_E4M3)` (csrc/quantization/.../nvidia/quant_utils.cuh `scaled_vec_conversion`): divide in
        float32, saturate to +-448, round to nearest even. One per-layer scale for both parts; the
        reader multiplies by it. `v_scale` is loaded but the joint latent cache only uses `k_scale`.
        The scale comes from `self_attn.k_scale` / `v_scale` tensors (BaseKVCacheMethod in
        vllm/model_executor/layers/quantization/kv_cache.py: -1.0 until loaded, 1.0 when the
        checkpoint has none, with the warning "Using KV cache scaling factor 1.0 for fp8_e4m3").
        But in vLLM 0.33.0 (the release quantkit.engines pins) both CompressedTensorsConfig and
        Fp8Config `get_quant_method` attach that KV-cache method only to `isinstance(layer,
        Attention)`, and MLAAttention is `nn.Module, AttentionLayerBase` in the vllm/attention/
        layer.py we read, not an `Attention`: unless that changed, the MLA layer never creates the
        k_scale parameter, `maybe_remap_kv_scale_name` drops the checkpoint's tensor with "...
        not loaded", and the cache runs at scale 1.0 whatever the checkpoint says.
    vLLM, DSA models (anything with `index_topk`: DeepSeek-V3.2, GLM-5.2)
        vllm/model_executor/models/config.py `DeepseekV32ForCausalLM.verify_and_update_config`
        turns any fp8 KV dtype into `fp8_ds_mla`: `concat_and_cache_ds_mla_kernel` stores kv_c as
        e4m3 with one float32 scale per 128-value tile, `max(amax / 448, FLT_MIN)`, computed per
        token; k_pe is kept in bf16. No static scale is read: `k_scale` is ignored there.
        The indexer keys always go through `indexer_k_quant_and_cache_kernel` (whatever the KV
        dtype): per token and 128-block, `scale = max(amax, 1e-4) / 448`, rounded up to a power of
        two when `use_ue8m0` (DeepSeek's `scale_fmt: ue8m0`), e4m3 of x / scale.
    SGLang
        0.5.23 (the release quantkit.engines pins) loads the scales: its CompressedTensorsConfig
        gives every RadixAttention a CompressedTensorsKVCacheMethod when `kv_cache_scheme` is static
        symmetric per-tensor FP8 (layers/quantization/compressed_tensors/compressed_tensors.py,
        `is_supported_scheme`). The MLA pool of the release we could read
        (mem_cache/memory_pool.py `MLATokenToKVPool.set_mla_kv_buffer`) casts with
        `.to(self.dtype)`, i.e. scale 1.0 without saturation; whether 0.5.23's pool divides by
        k_scale was not read here. Its NSA (DSA) backend quantizes per 128-tile like vLLM's
        fp8_ds_mla (layers/attention/nsa/quant_k_cache.py).

The scale convert writes: vLLM's MLA decode also quantizes the absorbed query to FP8 with
`q_scale` (`MLAAttention.forward_decode`), and q_scale defaults to k_scale when the checkpoint has
none (BaseKVCacheMethod). A k_scale fitted to the cache alone (absmax / 448) would clip the query:
on the tiny models the absorbed query's maximum is 1.5-3x the cache's. So k_scale = v_scale =
max(|kv_c|, |k_pe|, |absorbed query|) / 448 over the calibration tokens: nothing saturates, and
e4m3 keeps its relative precision (only the subnormal floor moves). The query's own rounding is
not simulated here (it is not cache storage); the cache's is.

KV dtypes here: `bf16` (the cache holds what attention computed; the baseline), `fp8_e4m3`
(per-layer static scale, the dense-MLA path), `fp8_ds_mla` (dynamic per-tile, vLLM's DSA path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

E4M3_MAX = 448.0
FLT_MIN = 1.1754943508222875e-38  # float32's smallest normal, the ds_mla tile scale's floor
KV_DTYPES = ("bf16", "fp8_e4m3", "fp8_ds_mla")
SCALE_NAMES = ("self_attn.k_scale", "self_attn.v_scale")  # per layer, as llm-compressor writes them
DS_MLA_TILE = 128
INDEXER_BLOCK = 128


# ---- pure quantizers -------------------------------------------------------------------------------
def to_e4m3(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """e4m3 codes of x / scale, saturating at +-448 (vLLM's `scaled_convert`; torch's own cast
    would turn an overflow into NaN). Division in float32, round to nearest even."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def per_tensor(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What a cache with one static scale gives back: e4m3(x / scale) * scale, in x's dtype."""
    s = torch.tensor(scale, dtype=torch.float32)
    return (to_e4m3(x, s).float() * s).to(x.dtype)


def ds_mla(latent: torch.Tensor, tile: int = DS_MLA_TILE) -> torch.Tensor:
    """vLLM's fp8_ds_mla latent: per token, one float32 scale per `tile` values, max(amax/448, FLT_MIN)."""
    *lead, n = latent.shape
    if n % tile:
        raise ValueError(f"fp8_ds_mla needs kv_lora_rank divisible by {tile} (got {n})")
    x = latent.float().reshape(*lead, n // tile, tile)  # (..., tiles, tile)
    s = (x.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(FLT_MIN)
    return (to_e4m3(x, s).float() * s).reshape(*lead, n).to(latent.dtype)


def ue8m0(s: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= s (s > 0), exactly: vLLM's `exp2f(ceilf(log2f(s)))` without
    depending on log2's last-ulp rounding."""
    m, e = torch.frexp(s)  # s = m * 2**e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(s), torch.where(m == 0.5, e - 1, e))


def indexer_keys(k: torch.Tensor, block: int = INDEXER_BLOCK, use_ue8m0: bool = True) -> torch.Tensor:
    """vLLM's `indexer_k_quant_and_cache`: per token and `block` values (the whole head when it is
    shorter), scale max(amax, 1e-4)/448, a power of two with ue8m0; e4m3(k / scale) * scale."""
    *lead, n = k.shape
    b = min(block, n)
    x = k.float().reshape(*lead, n // b, b)  # (..., blocks, block)
    s = x.abs().amax(-1, keepdim=True).clamp_min(torch.tensor(1e-4, dtype=torch.float32)) / E4M3_MAX
    if use_ue8m0:
        s = ue8m0(s)
    return (to_e4m3(x, s).float() * s).reshape(*lead, n).to(k.dtype)


def scale_from_absmax(absmax: float) -> float:
    """The static per-tensor scale that maps the calibration maximum onto e4m3's largest value."""
    return absmax / E4M3_MAX if absmax > 0 and math.isfinite(absmax) else 1.0


# ---- what the reference forward consults (`Context.kv`) --------------------------------------------
@dataclass
class KVCache:
    """How the KV cache stores values: `mla` returns what the latent/rope cache gives back, `index`
    what the indexer key cache gives back. `scales`: "checkpoint" reads each layer's
    `self_attn.k_scale` from its weights (1.0 where the checkpoint has none), "one" uses 1.0."""

    dtype: str = "bf16"
    scales: str = "checkpoint"

    def __post_init__(self):
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV cache dtype {self.dtype!r}; one of {', '.join(KV_DTYPES)}")

    def scale(self, w: dict[str, torch.Tensor]) -> float:
        t = w.get(SCALE_NAMES[0]) if self.scales == "checkpoint" else None
        return float(t) if t is not None else 1.0

    def mla(self, layer: int, w, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.dtype == "fp8_e4m3":
            s = self.scale(w)
            return per_tensor(latent, s), per_tensor(k_rot, s)
        if self.dtype == "fp8_ds_mla":
            return ds_mla(latent), k_rot  # k_pe stays bf16 in that layout
        return latent, k_rot

    def index(self, k: torch.Tensor) -> torch.Tensor:
        return indexer_keys(k) if self.dtype != "bf16" else k

    def observe_query(self, layer: int, w, q_nope: torch.Tensor, q_rot: torch.Tensor, nh: int, dn: int) -> None:
        """Calibration's hook (KVAbsmax); storing a cache looks at no query."""


@dataclass
class KVAbsmax(KVCache):
    """Calibration: stores nothing differently, records per layer the absolute maximum of what the
    cache holds (latent and rope key; one scale covers both) and of the absorbed decode query."""

    latent: dict[int, float] = field(default_factory=dict)
    k_rot: dict[int, float] = field(default_factory=dict)
    query: dict[int, float] = field(default_factory=dict)

    def mla(self, layer, w, latent, k_rot):
        _grow(self.latent, layer, latent)
        _grow(self.k_rot, layer, k_rot)
        return latent, k_rot

    def observe_query(self, layer: int, w, q_nope: torch.Tensor, q_rot: torch.Tensor, nh: int, dn: int) -> None:
        """The query vLLM's MLA decode quantizes with q_scale: q_nope absorbed into the latent space
        (q_nope[h] @ W_UK[h], W_UK the key half of kv_b_proj) and the rope query."""
        kv_lora = w["self_attn.kv_b_proj.weight"].shape[1]
        w_uk = w["self_attn.kv_b_proj.weight"].view(nh, -1, kv_lora)[:, :dn]  # (nh, dn, kv_lora)
        ql = torch.einsum("bhtd,hdl->bhtl", q_nope.float(), w_uk.float())  # (B, nh, T, kv_lora)
        _grow(self.query, layer, ql)
        _grow(self.query, layer, q_rot)

    def layer_scales(self) -> dict[int, float]:
        """Per layer, the k_scale (= v_scale) to write: the largest of what the cache holds and of the
        absorbed decode query (which vLLM quantizes with q_scale = k_scale), over 448."""
        return {i: scale_from_absmax(max(self.latent[i], self.k_rot.get(i, 0.0), self.query.get(i, 0.0)))
                for i in sorted(self.latent)}


def _grow(d: dict[int, float], layer: int, x: torch.Tensor) -> None:
    d[layer] = max(d.get(layer, 0.0), float(x.detach().abs().max()))


# ---- what convert writes -----------------------------------------------------------------------------
def kv_cache_scheme() -> dict:
    """compressed-tensors' `kv_cache_scheme` for a static per-tensor FP8 KV cache (what llm-compressor
    writes). vLLM's CompressedTensorsConfig then gives every attention layer a KV-cache method that
    loads `self_attn.k_scale`/`v_scale`; prefill's `quant_method: fp8` config does the same through
    Fp8KVCacheMethod, so prefill needs no config entry for the same tensors.

    Not written for DSA models (GLM-5.2): vLLM's fp8_ds_mla and SGLang's NSA cache ignore the scale,
    and transformers' compressed-tensors integration swaps in a QuantizedKVCache that has no
    `update_indexer`, so the decode checkpoint would no longer load there. Their scale tensors are
    still written (identical in both outputs) for a dense-MLA backend and for the record."""
    return {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
            "group_size": None, "block_structure": None, "observer": "minmax", "actorder": None}


def write_kv_scales(pair, prefix: str, kv: KVAbsmax, layer: int) -> dict:
    """Write one layer's k_scale and v_scale (equal: MLA's one latent cache is keyed by k_scale) to
    both outputs, identical bytes, and return what was measured for the report."""
    scale = kv.layer_scales()[layer]
    for name in SCALE_NAMES:
        for out in (pair.prefill, pair.decode):
            out.add(prefix + name, torch.tensor([scale], dtype=torch.float32))  # (1,): compressed-tensors' tensor-strategy shape
    return {"latent_absmax": kv.latent[layer], "k_rot_absmax": kv.k_rot[layer], "query_absmax": kv.query.get(layer),
            "k_scale": scale}


def kv_cache_report(layers: list[dict]) -> dict:
    """convert-report.json's `kv_cache`: per-layer scales and where they are read (or not)."""
    per_layer = {str(lay["layer"]): lay["kv_cache"] for lay in layers if "kv_cache" in lay}
    return {
        "scales": "calibrated" if per_layer else "none (no calibration pass): engines run the FP8 cache at scale 1.0",
        "tensors": list(SCALE_NAMES) if per_layer else [],
        "layers": per_layer,
        "read_by": {
            "vllm_dense_mla": "k_scale for kv_c and k_pe (concat_and_cache_mla) if loaded; 0.33.0 attaches the "
                              "KV-cache method to Attention layers only, so MLA most likely runs at 1.0",
            "vllm_dsa": "ignored: fp8_ds_mla computes per-token tile scales (and FP8 index keys always)",
            "sglang_mla": "loaded by 0.5.23 (CompressedTensorsKVCacheMethod); an earlier MLA pool casts at 1.0",
        },
        "scale_covers": "max |kv_c|, |k_pe| and |absorbed decode query| / 448 (vLLM's q_scale defaults to k_scale)",
    }


# ---- what validate reports ---------------------------------------------------------------------------
SCALE_1 = "_scale1"  # the variant key of the uncalibrated comparison (every layer at 1.0)


def has_kv_scales(ckpt) -> bool:
    from quantkit.tensors import TensorClass

    return any(st.info.klass == TensorClass.KV_SCALE for st in ckpt.tensors.values())


def checkpoint_scales(ckpt) -> dict[str, float]:
    """layer -> k_scale as stored in a checkpoint (empty when it has none)."""
    from quantkit.tensors import TensorClass

    return {str(st.info.layer): float(ckpt.get(n, torch.float32).reshape(-1)[0]) for n, st in ckpt.tensors.items()
            if st.info.klass == TensorClass.KV_SCALE and n.endswith("k_scale")}


def _window_mean_se(steps: list[torch.Tensor]) -> tuple[float, float | None]:
    """Mean and standard error of per-position values (steps of (B,)), windows as the independent
    units: positions of one window are correlated, so the SE is over per-window means."""
    per_window = torch.stack(steps).double().mean(0)  # (B,)
    B = per_window.numel()
    se = float(per_window.std(unbiased=True) / math.sqrt(B)) if B > 1 else None
    return float(per_window.mean()), se


def kv_rows(variants: dict[str, KVCache], decode_steps: dict, kl_each: dict, cont: dict, calibrated: bool) -> dict:
    """validate's KV rows: decode and cross-phase with the cache stored as the engines store it, against
    the reference (BF16 cache) and, as `kv_delta`, against the same path with a BF16 cache."""
    from quantkit.validation import _agreement

    spec = variants[""]
    rows = {}
    for row, base in (("decode_kv", "int4_only"), ("cross_phase_kv", "cross_phase")):
        m = decode_steps[row]
        delta, delta_se = _window_mean_se([a - b for a, b in zip(kl_each[row], kl_each[base])])
        agree, exact = _agreement(cont[row], cont["reference"])
        scales = ("calibrated (the checkpoint's self_attn.k_scale)" if calibrated else "1.0 (the checkpoint has none)") \
            if spec.dtype == "fp8_e4m3" else "dynamic per-token tiles (fp8_ds_mla)"
        r = {
            "metrics": {"kl": m["kl"], "top1": m["top1"], "layer_rel_err": m["layer_rel_err"], "greedy_agree": agree,
                        "greedy_exact": exact, "kv_delta": delta},
            "layers": m["layers"],
            "measured_on": f"the {ROW_BASE[row]} row's decode steps with the KV cache stored as {spec.dtype}",
            "kv": {"dtype": spec.dtype, "scales": scales, "kv_delta_se": delta_se, "weights_only_kl": decode_steps[base]["kl"]},
        }
        if SCALE_1 in variants:
            one = decode_steps[row + SCALE_1]
            diff, diff_se = _window_mean_se([a - b for a, b in zip(kl_each[row], kl_each[row + SCALE_1])])
            one_delta, _ = _window_mean_se([a - b for a, b in zip(kl_each[row + SCALE_1], kl_each[base])])
            r["scale_1"] = {"kl": one["kl"], "top1": one["top1"], "kv_delta": one_delta,
                            "greedy_agree": _agreement(cont[row + SCALE_1], cont["reference"])[0],
                            "kl_calibrated_minus_scale_1": diff, "kl_calibrated_minus_scale_1_se": diff_se}
        rows[row] = r
    return rows


ROW_BASE = {"decode_kv": "INT4-only", "cross_phase_kv": "cross-phase"}


def kv_markdown(d: dict) -> list[str]:
    """validation.md's KV section: dtype, scales, the delta over BF16, scale 1.0 vs calibrated."""
    kv = d.get("kv_cache") or {}
    if kv.get("dtype", "bf16") == "bf16":
        return ["", "KV cache: BF16 (as computed; `--kv-cache-dtype fp8_e4m3` simulates the engines' FP8 cache)."]
    lines = ["", f"## FP8 KV cache ({kv['dtype']})", "", kv.get("note", ""), ""]
    if kv.get("scales"):
        lines.append("Per-layer k_scale (= v_scale): " + ", ".join(f"{i}: {s:.4g}" for i, s in kv["scales"].items()) + ".")
        lines.append("")
    lines += ["| path | KL vs source | KV delta (KL added by the cache) | ± SE | top-1 | greedy agree | at scale 1.0: KL | KV delta | calibrated - 1.0 | ± SE |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in ("decode_kv", "cross_phase_kv"):
        r = d["rows"].get(row)
        if not r:
            continue
        m, one = r["metrics"], r.get("scale_1") or {}
        lines.append(f"| {row.replace('_', ' ')} | {_g(m['kl'])} | {_g(m['kv_delta'], '+.3g')} | {_g(r['kv']['kv_delta_se'])} "
                     f"| {_g(m['top1'], '.4f')} | {_g(m['greedy_agree'], '.3f')} | {_g(one.get('kl'))} "
                     f"| {_g(one.get('kv_delta'), '+.3g')} | {_g(one.get('kl_calibrated_minus_scale_1'), '+.3g')} "
                     f"| {_g(one.get('kl_calibrated_minus_scale_1_se'))} |")
    return lines


def _g(v, fmt: str = ".3g") -> str:
    return "—" if v is None else format(v, fmt)


# ---- what plan shows ---------------------------------------------------------------------------------
def capacity_beside_delta(plan, validation: dict) -> list[str]:
    """`quantkit plan --validation FILE`: FP8 KV capacity next to the KV delta validate measured,
    e.g. "FP8 KV: 1.58M tokens (2.0x), measured KL +0.0004 (decode + FP8 KV cache, ...)"."""
    kinds = [k for k in ("decode", "source", "int4-bf16") if k in plan.checkpoints and plan.checkpoints[k].fits]
    if not kinds:
        return ["FP8 KV: no checkpoint kind fits this setup"]
    ck = plan.checkpoints[kinds[0]]
    fp8, bf16 = ck.kv["fp8"].tokens, ck.kv["bf16"].tokens
    ratio = f" ({fp8 / bf16:.1f}x)" if bf16 else ""
    kv = validation.get("kv_cache") or {}
    rows = {r: validation.get("rows", {}).get(r) for r in ("decode_kv", "cross_phase_kv")}
    measured = [(r, v) for r, v in rows.items() if v and v["metrics"].get("kv_delta") is not None]
    if kv.get("dtype", "bf16") == "bf16" or not measured:
        return [f"FP8 KV: {_short_tokens(fp8)} tokens{ratio} on {kinds[0]}; not measured: "
                "run `quantkit validate DIR --kv-cache-dtype fp8_e4m3` and pass its validation.json"]
    out = []
    for r, v in measured:
        se = v["kv"].get("kv_delta_se")
        out.append(f"FP8 KV: {_short_tokens(fp8)} tokens{ratio} on {kinds[0]}, measured KL {v['metrics']['kv_delta']:+.2g}"
                   f"{f' (SE {se:.1g})' if se else ''} on {r.replace('_', ' ')} ({kv['dtype']}, "
                   f"{'calibrated scales' if kv.get('calibrated') else 'scale 1.0'}; {validation.get('dir', 'validation.json')})")
    return out


def _short_tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


# ---- what the model card says ------------------------------------------------------------------------
def card_section(report: dict, validation: dict) -> list[str]:
    """The model card's FP8 KV cache section: dtype assumed, scales, measured delta, who reads them."""
    kv = report.get("kv_cache") or {}
    layers = kv.get("layers") or {}
    dsa = report.get("source", {}).get("model_type") == "glm_moe_dsa"
    out = ["## FP8 KV cache", ""]
    if layers:
        scales = ", ".join(f"{i}: {v['k_scale']:.4g}" for i, v in layers.items())
        out.append(f"Both folders carry identical per-layer `self_attn.k_scale` = `v_scale` ({scales}): the largest "
                   "|latent|, |rope key| and |absorbed decode query| over the calibration tokens, over 448"
                   + ("." if dsa else "; decode's config declares them as compressed-tensors `kv_cache_scheme`."))
    else:
        out.append("No KV scales (no calibration pass): engines run the FP8 latent cache at scale 1.0.")
    out.append("vLLM's dense-MLA cache quantizes the latent and the rope key with `k_scale` when it is loaded, but "
               "vLLM 0.33.0 attaches the KV-cache method to `Attention` layers only, not to MLA's, so it most likely "
               "runs at 1.0 (look for \"k_scale ... not loaded\" in its log); SGLang 0.5.23 loads the scales "
               "(an earlier SGLang MLA pool cast at scale 1.0)."
               + (" For this DSA model vLLM stores `fp8_ds_mla` (dynamic per-token tile scales, rope key in BF16) "
                  "and ignores `k_scale`; its indexer key cache is FP8 with per-token power-of-two scales whatever "
                  "the KV dtype." if dsa else ""))
    vkv = validation.get("kv_cache") or {}
    rows = {r: validation.get("rows", {}).get(r) for r in ("decode_kv", "cross_phase_kv")}
    if vkv.get("dtype", "bf16") == "bf16" or not any(rows.values()):
        out += ["", "Not measured here: the numbers above are with a BF16 cache. "
                    "`quantkit validate DIR --kv-cache-dtype fp8_e4m3` adds the FP8 KV rows."]
        return out
    out += ["", f"Measured with `--kv-cache-dtype {vkv['dtype']}` (KL added by the cache over the same path with a BF16 "
                "cache, ± standard error over eval windows):", ""]
    for r, v in rows.items():
        if not v:
            continue
        one = v.get("scale_1")
        out.append(f"- {ROW_BASE[r]} path: KL {v['metrics']['kv_delta']:+.2g} ± {_g(v['kv']['kv_delta_se'], '.1g')} "
                   f"({v['kv']['scales']})" + (f"; at scale 1.0: {one['kv_delta']:+.2g}" if one else ""))
    return out
