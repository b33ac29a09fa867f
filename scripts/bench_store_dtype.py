#!/usr/bin/env python
"""What storing the calibration hidden states in bfloat16 costs: held-out KL of the decode
checkpoint, converted with a float32 store and with a bfloat16 store, same everything else.

    python scripts/bench_store_dtype.py                 # tiny:glm-5.2 and tiny:kimi-k2.6 (g128), ~2 min
    python scripts/bench_store_dtype.py --models tiny:glm-5.2

Validation is quantkit.validate on synthetic:heldout (32 windows x 64 tokens, no generation).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from quantkit.conversion.pipeline import convert
from quantkit.validation.pipeline import validate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny:glm-5.2,tiny:kimi-k2.6")
    args = ap.parse_args()
    print("| model | store dtype | decode KL vs source | top-1 | ppl delta |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            recipe = "tiny-" + model.split(":", 1)[1]
            for dt in ("float32", "bfloat16"):
                out = Path(tmp) / f"{model.replace(':', '-')}-{dt}"
                convert(model, out, recipe=recipe, group_size=128, validate=False, progress=False, device="cpu",
                        activation_dtype=dt)
                v = validate(out, eval_data="synthetic:heldout", num_samples=32, seq_len=64, gen_tokens=0,
                             device="cpu", progress=False, write=False)
                m = v.data["rows"]["decode"]["metrics"]
                print(f"| {model} | {dt} | {m['kl']:.6f} | {m['top1']:.4f} | {m.get('ppl_delta', float('nan')):+.5f} |")


if __name__ == "__main__":
    main()
