#!/usr/bin/env python
"""scripts/gpu_check.sh's verdict: CUDA outputs vs CPU outputs of the same conversion, per-layer
phase times, and the full-scale prediction scaled by this run's measured/predicted time.

    python scripts/gpu_compare.py OUT glm-5.2 kimi-k2.6

expects OUT/<model>-cpu and OUT/<model>-cuda (convert outputs) and OUT/<model>-cuda.json (its
--json report). Exit 1 when a tensor outside the routed experts differs in bytes, or when the
decode logits' KL(cpu || cuda) exceeds 1e-6.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

KL_MAX = 1e-6


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def compare(out: Path, m: str, preset: str | None) -> bool:
    from quantkit.validation.forward import logits

    ok = True
    print(f"\n== {m}")
    for kind in ("prefill", "decode"):
        same, differing = 0, []
        for f in sorted((out / f"{m}-cpu" / kind).glob("*.safetensors")):
            with safe_open(str(f), "pt") as a, safe_open(str(out / f"{m}-cuda" / kind / f.name), "pt") as b:
                for k in a.keys():
                    if torch.equal(_raw(a.get_tensor(k)), _raw(b.get_tensor(k))):
                        same += 1
                    else:
                        differing.append(k)
        print(f"{kind}: {same} tensors byte-identical CPU vs CUDA, {len(differing)} differ"
              + (f" (e.g. {differing[0]})" if differing else ""))
        if any(".experts." not in k for k in differing):
            ok = False
            print("  FAIL: a tensor outside the routed experts differs")
    ids = (torch.arange(64).view(1, 64) * 7) % 500 + 6
    a = logits(out / f"{m}-cpu" / "decode", ids, device="cpu").log_softmax(-1)
    b = logits(out / f"{m}-cuda" / "decode", ids, device="cpu").log_softmax(-1)
    kl = float((a.exp() * (a - b)).sum(-1).mean())
    print(f"decode KL(cpu || cuda) over 64 tokens: {kl:.2e} ({'ok' if kl <= KL_MAX else f'FAIL: > {KL_MAX:g}'})")
    ok &= kl <= KL_MAX
    r = json.loads((out / f"{m}-cuda.json").read_text())
    print("layer  kind   seconds  attention")
    for layer in r["layers"]:
        print(f"{layer['layer']:5d}  {layer['kind']:5s}  {layer['seconds']:7.2f}  {layer.get('attention_seconds', 0):9.2f}")
    pred = r["cost"]
    print(f"this run: {r['seconds']:.1f} s measured vs {pred['seconds_total']:.1f} s predicted; peak host RSS "
          f"{r['peak_rss_bytes'] / 1e9:.2f} GB vs {pred['peak_host'] / 1e9:.2f} GB predicted"
          + (f"; device {pred['peak_device'] / 1e9:.2f} GB predicted" if pred.get("peak_device") else ""))
    if preset:
        from quantkit.conversion.cost import plan_convert_for

        ratio = r["seconds"] / max(pred["seconds_total"], 1e-9)
        full = plan_convert_for(preset, gpu="h200", max_host_memory="1TB")
        total = sum(full.seconds.values())
        print(f"full {preset} (shipped recipe, one H200): predicted {total / 3600:.2f} h, peak device "
              f"{(full.peak_device or 0) / 1e9:.1f} GB; scaled by this run's measured/predicted time "
              f"({ratio:.2f}): {ratio * total / 3600:.2f} h")
    return ok


def main() -> None:
    out, models = Path(sys.argv[1]), sys.argv[2:]
    ok = True
    for m in models:
        preset = m.split(":", 1)[-1] if m.split(":", 1)[-1] in ("glm-5.2", "kimi-k2.6") else None
        ok &= compare(out, m, preset)
    print("\ngpu_check:", "PASSED" if ok else "FAILED", f"(outputs in {out})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
