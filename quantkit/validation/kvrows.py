"""validate's FP8 KV-cache rows: the cache variants `--kv-cache-dtype` runs, decode and cross-phase with the
cache stored as the engines store it, the KV delta over a BF16 cache, the markdown section and the model
card's section."""

from __future__ import annotations

import torch

from quantkit.checkpoint.reader import Checkpoint
from quantkit.errors import ConfigError
from quantkit.model.families import find_family
from quantkit.model.kvcache import KV_DTYPES, KVCache
from quantkit.model.tensors import TensorClass
from quantkit.validation.metrics import agreement, window_mean_se

SCALE_1 = "_scale1"  # the variant key of the uncalibrated comparison (every layer at 1.0)


def checkpoint_scales(ckpt: Checkpoint) -> dict[str, float]:
    """layer -> k_scale as stored in a checkpoint (empty when it has none)."""
    return {str(st.info.layer): float(ckpt.get(n, torch.float32).reshape(-1)[0]) for n, st in ckpt.tensors.items()
            if st.info.klass == TensorClass.KV_SCALE and n.endswith("k_scale")}


def kv_variants(kv_cache_dtype: str, ckpts: dict[str, Checkpoint], pair: bool, gen_tokens: int) -> tuple[dict, dict]:
    """The KV cache variants to run (quantkit.model.kvcache) and what validation.json says about them."""
    if kv_cache_dtype not in KV_DTYPES:
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype}: one of {', '.join(KV_DTYPES)}")
    if kv_cache_dtype == "bf16":
        return {}, {"dtype": "bf16"}
    scales = checkpoint_scales(ckpts["decode"]) if pair else {}
    info = {"dtype": kv_cache_dtype, "calibrated": bool(scales), "scales": scales,
            "note": "KV rows: the decode steps of the INT4-only and cross-phase paths with the KV cache (MLA's "
                    "latent and rope key, GLM's index keys, or per-head keys and values) stored as the engines store "
                    "them; `kv_delta` is the KL they add over the same path with a BF16 cache. "
                    + ("scale 1.0 is what the engines run without scales (and what an SGLang MLA pool that casts without one runs)" if kv_cache_dtype == "fp8_e4m3" else
                       "fp8_ds_mla is vLLM's layout for DSA models; it ignores k_scale")
                    + ("; for this DSA model vLLM stores fp8_ds_mla instead (--kv-cache-dtype fp8_ds_mla)."
                       if ckpts["reference"].arch.has_dsa and kv_cache_dtype == "fp8_e4m3" else ".")}
    if not pair or gen_tokens < 2:
        info["note"] = "no KV rows: they need a convert output (prefill/ and decode/) and gen_tokens >= 2"
        return {}, info
    variants = {"": KVCache(kv_cache_dtype, "checkpoint")}
    if kv_cache_dtype == "fp8_e4m3" and scales:
        variants[SCALE_1] = KVCache(kv_cache_dtype, "one")
    return variants, info


def kv_rows(variants: dict[str, KVCache], decode_steps: dict, kl_each: dict, cont: dict, calibrated: bool) -> dict:
    """validate's KV rows: decode and cross-phase with the cache stored as the engines store it, against
    the reference (BF16 cache) and, as `kv_delta`, against the same path with a BF16 cache."""
    spec = variants[""]
    rows = {}
    for row, base in (("decode_kv", "int4_only"), ("cross_phase_kv", "cross_phase")):
        m = decode_steps[row]
        delta, delta_se = window_mean_se([a - b for a, b in zip(kl_each[row], kl_each[base])])
        agree, exact = agreement(cont[row], cont["reference"])
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
            diff, diff_se = window_mean_se([a - b for a, b in zip(kl_each[row], kl_each[row + SCALE_1])])
            one_delta, _ = window_mean_se([a - b for a, b in zip(kl_each[row + SCALE_1], kl_each[base])])
            r["scale_1"] = {"kl": one["kl"], "top1": one["top1"], "kv_delta": one_delta,
                            "greedy_agree": agreement(cont[row + SCALE_1], cont["reference"])[0],
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


# ---- what the model card says ------------------------------------------------------------------------
def card_section(report: dict, validation: dict) -> list[str]:
    """The model card's FP8 KV cache section: dtype assumed, scales, measured delta, who reads them."""
    kv = report.get("kv_cache") or {}
    layers = kv.get("layers") or {}
    fam = find_family(report.get("source", {}).get("model_type", ""))
    dsa = bool(fam and fam.indexer)
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
