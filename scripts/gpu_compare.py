#!/usr/bin/env python
"""CUDA outputs vs CPU outputs of the same conversion: every tensor byte for byte, and the decode
logits' KL(cpu || cuda). scripts/gpu_check.py calls `compare_pair`; standalone:

    python scripts/gpu_compare.py OUT glm-5.2 kimi-k2.6

expects OUT/<model>-cpu and OUT/<model>-cuda (convert outputs), prints the verdict as JSON. Exit 1
when a weight tensor outside the routed experts differs in bytes, when a KV-cache scale (measured
on the calibration activations, so computed on the device) differs by more than KV_SCALE_RTOL, or
when the decode logits' KL(cpu || cuda) exceeds its bound. Routed experts may differ: their GPTQ
float reductions run in another order on the GPU, and the KL bounds what that costs.

The bound: KL_MAX, or KL_REL (1%) of what quantization itself costs on the same ids (KL(source ||
the CPU's decode)), whichever is larger: the device may change the model by at most a hundredth of
what converting it did. The float order alone moves the KL close to KL_MAX: on the CPU, the same
tiny Kimi convert with 1 and with 2 torch threads gives decode checkpoints 6.3e-7 apart on these
ids (62 of 432 expert tensors differ), while quantization costs 1.3e-2 there; a broken device path
costs as much as quantization or more.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

KL_MAX = 1e-6
KL_REL = 0.01
KV_SCALE_RTOL = 1e-4
KV_SCALES = ("self_attn.k_scale", "self_attn.v_scale")  # quantkit.model.kvcache.SCALE_NAMES


def category(name: str) -> str:
    """routed_expert (may differ), kv_scale (measured on activations: close), weight (identical)."""
    if ".experts." in name:  # not shared_experts: its name has `_experts.`
        return "routed_expert"
    if name.endswith(KV_SCALES):
        return "kv_scale"
    return "weight"


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _tensors(folder: Path) -> dict[str, Path]:
    where = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            where.update({k: f for k in h.keys()})
    return where


def compare_tensors(a_dir: Path, b_dir: Path) -> dict:
    """Every tensor of checkpoint a_dir against b_dir's tensor of the same name, by category."""
    a_names, b_names = _tensors(a_dir), _tensors(b_dir)
    cats = {c: {"same": 0, "differ": 0, "examples": []} for c in ("weight", "kv_scale", "routed_expert")}
    kv_rel = 0.0
    handles: dict[Path, object] = {}

    def get(path: Path, name: str) -> torch.Tensor:
        if path not in handles:
            handles[path] = safe_open(str(path), "pt")
        return handles[path].get_tensor(name)

    for name in sorted(a_names):
        c = cats[category(name)]
        if name not in b_names:
            c["differ"] += 1
            c["examples"].append(f"{name} (missing)")
            continue
        x, y = get(a_names[name], name), get(b_names[name], name)
        if x.dtype == y.dtype and x.shape == y.shape and torch.equal(_raw(x), _raw(y)):
            c["same"] += 1
            continue
        c["differ"] += 1
        if len(c["examples"]) < 5:
            c["examples"].append(name)
        if category(name) == "kv_scale":
            kv_rel = max(kv_rel, float(((x.float() - y.float()).abs() / y.float().abs().clamp_min(1e-30)).max()))
    extra = sorted(set(b_names) - set(a_names))
    return {"categories": cats, "kv_scale_max_rel_diff": kv_rel, "only_in_second": extra[:5], "n_only_in_second": len(extra)}


def probe_ids(vocab: int, tokens: int = 64) -> torch.Tensor:
    """Fixed token ids (1, tokens) inside the vocabulary, away from the special ids."""
    return (torch.arange(tokens).view(1, tokens) * 7) % (vocab - 6) + 6


def kl_stats(a_logits: torch.Tensor, b_logits: torch.Tensor) -> dict:
    """KL(a || b) per position (mean and max), max |a - b|, argmax agreement, bytes equal."""
    a, b = a_logits.double().log_softmax(-1), b_logits.double().log_softmax(-1)
    kl = (a.exp() * (a - b)).sum(-1)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "max_abs_diff": float((a_logits.float() - b_logits.float()).abs().max()),
            "top1_agree": float((a_logits.argmax(-1) == b_logits.argmax(-1)).float().mean()),
            "bytes_equal": bool(a_logits.dtype == b_logits.dtype and torch.equal(a_logits, b_logits))}


def compare_pair(cpu_out: Path, dev_out: Path) -> dict:
    """Verdict for one model: convert output on the CPU (cpu_out) vs on the device (dev_out)."""
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.validation.forward import logits

    result = {"tensors": {kind: compare_tensors(cpu_out / kind, dev_out / kind) for kind in ("prefill", "decode")}}
    vocab = Checkpoint(cpu_out / "decode").arch.vocab_size
    ids = probe_ids(vocab)
    # both decode checkpoints through the CPU reference forward: the difference is the bytes' alone
    a = logits(cpu_out / "decode", ids, device="cpu")
    b = logits(dev_out / "decode", ids, device="cpu")
    result["decode_kl_cpu_vs_device"] = kl_stats(a, b)
    source = json.loads((cpu_out / "convert-report.json").read_text())["source"]["path"]
    result["decode_kl_source_vs_cpu"] = kl_stats(logits(source, ids, device="cpu"), a)  # what quantization costs
    quant = result["decode_kl_source_vs_cpu"]["kl_mean"]
    result["kl_bound"] = max(KL_MAX, KL_REL * quant)
    result["kl_over_quantization"] = result["decode_kl_cpu_vs_device"]["kl_mean"] / quant if quant > 0 else None
    problems = []
    for kind, t in result["tensors"].items():
        w = t["categories"]["weight"]
        if w["differ"] or t["n_only_in_second"]:
            problems.append(f"{kind}: {w['differ']} weight tensor(s) outside the routed experts differ "
                            f"(e.g. {(w['examples'] or t['only_in_second'])[:2]})")
        if t["kv_scale_max_rel_diff"] > KV_SCALE_RTOL:
            problems.append(f"{kind}: KV-cache scales differ by {t['kv_scale_max_rel_diff']:.2e} relative (> {KV_SCALE_RTOL:g})")
    kl = result["decode_kl_cpu_vs_device"]["kl_mean"]
    if not kl <= result["kl_bound"]:
        problems.append(f"decode KL(cpu || device) {kl:.2e} > {result['kl_bound']:.2e} (the larger of {KL_MAX:g} and "
                        f"{KL_REL:g} x quantization's {result['decode_kl_source_vs_cpu']['kl_mean']:.2e})")
    result["problems"] = problems
    result["passed"] = not problems
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="folder holding <model>-cpu and <model>-cuda convert outputs")
    ap.add_argument("models", nargs="+", help="model names, e.g. glm-5.2 kimi-k2.6")
    args = ap.parse_args()
    out, models = args.out, args.models
    verdicts = {m: compare_pair(out / f"{m}-cpu", out / f"{m}-cuda") for m in models}
    print(json.dumps(verdicts, indent=1))
    ok = all(v["passed"] for v in verdicts.values())
    print("\ngpu_compare:", "PASSED" if ok else "FAILED", f"(outputs in {out})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
