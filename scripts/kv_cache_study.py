#!/usr/bin/env python
"""What the FP8 KV cache costs on the tiny models: the numbers in docs/serving.md.

Converts tiny:kimi-k2.6 and tiny:glm-5.2 with their recipes (or reuses --out DIR/<model> when it
is already there), then runs validate's lockstep measurement with the KV cache stored as:

    fp8_e4m3 calibrated   the checkpoint's self_attn.k_scale (what convert writes; vLLM dense MLA)
    fp8_e4m3 scale 1.0    what SGLang runs, and vLLM without scales
    fp8_e4m3 cache-only   absmax(latent, rope key) / 448 per layer, without the absorbed-query
                          headroom convert adds (what a cache-only observer would write)
    fp8_ds_mla            vLLM's layout for DSA models (dynamic per-token tiles, rope key BF16)
    GLM only: fp8_e4m3 calibrated on the latent cache alone, and on the index-key cache alone
    --sweep: fp8_e4m3 with one fixed scale for every layer (1.0, 0.5, 0.1, 0.03, 0.01), tiny Kimi

Each row: the KL the cache adds over the same decode steps with a BF16 cache (`kv_delta`), ± the
standard error over eval windows, for the INT4-only and the cross-phase path.

    python scripts/kv_cache_study.py                 # 32 held-out windows x 64 tokens, 8 greedy tokens
    python scripts/kv_cache_study.py --samples 8 --json
    python scripts/kv_cache_study.py --sweep --samples 32
    python scripts/kv_cache_study.py --pairs /tmp/rs9/glm-5.2-8x512 /tmp/rs9/kimi-k2.6-8x512 --samples 8
        # convert outputs already there (the real-shape ones of scripts/bench_realshape.py):
        # calibrated, scale 1.0 and (DSA) fp8_ds_mla only

A study that prints a table, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantkit import convert
from quantkit.checkpoint.reader import Checkpoint
from quantkit.inputs.modelspec import open_checkpoint
from quantkit.inputs.tokens import load_tokens
from quantkit.model.kvcache import E4M3_MAX, KVCache, indexer_keys
from quantkit.runtime.progress import LayerProgress
from quantkit.validation.kvrows import SCALE_1
from quantkit.validation.pipeline import measure, target


@dataclass
class CacheOnly(KVCache):
    """Per-layer scale absmax(latent, rope key) / 448: no headroom for the query vLLM scales with it."""

    per_layer: dict[int, float] = field(default_factory=dict)

    def scale(self, w, which=0, *, layer=None):
        return self.per_layer[layer]


@dataclass
class Fixed(KVCache):
    """One scale for every layer."""

    value: float = 1.0

    def scale(self, w, which=0, *, layer=None):
        return self.value


class LatentOnly(KVCache):
    def index(self, k):
        return k


class IndexOnly(KVCache):
    """A bf16 latent cache (build it with dtype "bf16") beside FP8 index keys."""

    def index(self, k):
        return indexer_keys(k)


def _setup(folder: Path, samples: int):
    t = target(folder, None)
    ckpts = {"reference": open_checkpoint(t.reference_source)} | {r: Checkpoint(p) for r, p in t.models.items()}
    report = json.loads((folder / "convert-report.json").read_text())
    tokens = load_tokens(report["recipe"]["validate"]["dataset"], tokenizer=t.reference_path, num_samples=samples, seq_len=64)
    return ckpts, report, tokens


def sweep(folder: Path, samples: int, gen_tokens: int) -> list[dict]:
    ckpts, _, tokens = _setup(folder, samples)
    out = []
    for value in (1.0, 0.5, 0.1, 0.03, 0.01):
        with LayerProgress(False, 1, "study") as bar, torch.no_grad():
            m = measure(ckpts, tokens.ids, gen_tokens, True, torch.device("cpu"), torch.float32, bar,
                         {"": Fixed("fp8_e4m3", value=value)}, False)
        r = m["rows"]["decode_kv"]
        out.append({"scale": value, "kv_delta": r["metrics"]["kv_delta"], "kv_delta_se": r["kv"]["kv_delta_se"]})
    return out


def study(folder: Path, samples: int, gen_tokens: int, few: bool = False) -> list[dict]:
    ckpts, report, tokens = _setup(folder, samples)
    layers = report["kv_cache"]["layers"]
    cache_only = {int(i): max(v["latent_absmax"], v["k_rot_absmax"]) / E4M3_MAX for i, v in layers.items()}
    variants = [("fp8_e4m3 calibrated", {"": KVCache("fp8_e4m3"), SCALE_1: KVCache("fp8_e4m3", "one")}),
                ("fp8_e4m3 cache-only absmax", {"": CacheOnly("fp8_e4m3", per_layer=cache_only)}),
                ("fp8_ds_mla", {"": KVCache("fp8_ds_mla")})]
    if few:  # calibrated (with scale 1.0), and vLLM's DSA layout where it applies
        variants = [variants[0]] + ([variants[2]] if ckpts["reference"].arch.has_dsa else [])
    elif ckpts["reference"].arch.has_dsa:
        variants += [("fp8_e4m3 calibrated, latent cache only", {"": LatentOnly("fp8_e4m3")}),
                     ("fp8_e4m3 calibrated, index keys only", {"": IndexOnly("bf16")})]
    out = []
    for label, kv in variants:
        with LayerProgress(False, 1, "study") as bar, torch.no_grad():
            m = measure(ckpts, tokens.ids, gen_tokens, True, torch.device("cpu"), torch.float32, bar, kv, True)
        base = {"decode_kv": m["rows"]["cross_phase"]["int4_only"]["kl"], "cross_phase_kv": m["rows"]["cross_phase"]["metrics"]["kl"]}
        for row in ("decode_kv", "cross_phase_kv"):
            r = m["rows"][row]
            out.append({"kv": label, "path": row, "weights_only_kl": base[row], "kl": r["metrics"]["kl"],
                        "kv_delta": r["metrics"]["kv_delta"], "kv_delta_se": r["kv"]["kv_delta_se"],
                        "greedy_agree": r["metrics"]["greedy_agree"]})
            if "scale_1" in r:
                one = r["scale_1"]
                out.append({"kv": "fp8_e4m3 scale 1.0", "path": row, "weights_only_kl": base[row], "kl": one["kl"],
                            "kv_delta": one["kv_delta"], "kv_delta_se": None, "greedy_agree": one["greedy_agree"],
                            "calibrated_minus_scale_1": one["kl_calibrated_minus_scale_1"],
                            "calibrated_minus_scale_1_se": one["kl_calibrated_minus_scale_1_se"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=32, help="held-out windows (64 tokens each)")
    ap.add_argument("--gen-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="where the pairs are (converted when missing)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="fixed scales on tiny Kimi instead of the main table")
    ap.add_argument("--pairs", type=Path, nargs="*", help="measure these convert outputs (fewer variants)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    root = a.out or Path(tempfile.mkdtemp(prefix="kv-study-"))
    results = {}
    if a.pairs:
        for folder in a.pairs:
            name = json.loads((folder / "convert-report.json").read_text())["source"]["spec"]
            results[f"{name} ({folder.name})"] = study(folder, a.samples, a.gen_tokens, few=True)
    for name in () if a.pairs else ("kimi-k2.6",) if a.sweep else ("kimi-k2.6", "glm-5.2"):
        folder = root / name
        if not (folder / "convert-report.json").is_file():
            convert(f"tiny:{name}", folder, validate=False, progress=False)
        results[f"tiny {name}"] = (sweep if a.sweep else study)(folder, a.samples, a.gen_tokens)
    if a.sweep and not a.json:
        print(f"tiny kimi-k2.6, fp8_e4m3 with one scale for every layer, INT4-only decode steps, {a.samples} windows")
        for r in results["tiny kimi-k2.6"]:
            print(f"  scale {r['scale']:<5g} KL added {r['kv_delta']:+.3g} ± {r['kv_delta_se']:.1g}")
        return
    if a.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{a.samples} held-out windows x 64 tokens, {a.gen_tokens - 1} teacher-forced decode steps each\n")
    print("| model | KV cache | path | KL, BF16 cache | KL added by the cache | ± SE | greedy agree |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name, rows in results.items():
        for r in rows:
            se = "—" if r["kv_delta_se"] is None else f"{r['kv_delta_se']:.1g}"
            print(f"| {name} | {r['kv']} | {r['path'].replace('_kv', '').replace('_', '-')} | {r['weights_only_kl']:.2g} "
                  f"| {r['kv_delta']:+.2g} | {se} | {r['greedy_agree']:.3f} |")
    print("\ncalibrated - scale 1.0 (paired per window):")
    for name, rows in results.items():
        for r in rows:
            if "calibrated_minus_scale_1" in r:
                print(f"  {name} {r['path']}: {r['calibrated_minus_scale_1']:+.2g} ± {r['calibrated_minus_scale_1_se']:.1g}")


if __name__ == "__main__":
    main()
