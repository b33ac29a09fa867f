"""Held-out KL of RTN, GPTQ and AWQ on the tiny models, as paired differences with standard errors.

    python scripts/quality.py [--model tiny:glm-5.2] [--samples 256] [--methods rtn,gptq,awq]

Converts the model once per method (no validation), then evaluates every decode checkpoint on the
same held-out windows of the generated corpus (seed 3000, never seen by training or calibration)
and prints per-method mean KL vs the source, the paired difference of each pair with its standard
error, and how often the per-expert RTN guard fired. Set QUANTKIT_TINY_SEED to check another build
of the tiny model. docs/awq.md and docs/benchmarks.md quote its output.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import quantkit as qk
from quantkit.synthetic.tiny import batches, tiny_seed
from quantkit.validation.forward import logits
from quantkit.validation.metrics import paired, token_kl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny:glm-5.2")
    ap.add_argument("--samples", type=int, default=256, help="held-out windows of 64 tokens")
    ap.add_argument("--methods", default="rtn,gptq,awq")
    ap.add_argument("--group-size", type=int, default=None)
    ap.add_argument("--validate", action="store_true",
                    help="also run quantkit validate on each pair (the recipe's eval set and gates) and print its decode "
                         "KL and worst per-layer error: what the tiny recipes' gates are set from")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    methods = args.methods.split(",")
    ids = batches(args.samples, 64, seed=3000)
    ref = logits(args.model, ids)
    kl, guard, val = {}, {}, {}
    with tempfile.TemporaryDirectory() as d:
        for m in methods:
            res = qk.convert(args.model, Path(d) / m, method=m, group_size=args.group_size, validate=False, progress=False)
            kl[m] = token_kl(ref, logits(res.decode, ids))
            s = res.report["experts_summary"]
            guard[m] = {"guarded": s["guarded"], "kept_rtn": s["guard_kept_rtn"], "awq_kept_s1": s["awq_kept_s1"]}
            if args.validate:
                rows = qk.validate(res.out, progress=False, write=False).data["rows"]
                val[m] = {row: {k: rows[row]["metrics"][k] for k in ("kl", "layer_rel_err")} for row in ("decode", "cross_phase")}
    out = {
        "model": args.model, "tiny_seed": tiny_seed(), "tokens": int(ids.numel()),
        "kl": {m: kl[m].mean().item() for m in methods}, "guard": guard, "validate": val,
        "paired": {f"{a}-{b}": vars(paired(kl[a], kl[b])) for i, a in enumerate(methods) for b in methods[i + 1:]},
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{args.model} (tiny seed {out['tiny_seed']}), {out['tokens']} held-out tokens")
    for m in methods:
        print(f"  {m:5s} KL {out['kl'][m]:.5f}   guard: {guard[m]}")
        for row, v in val.get(m, {}).items():
            print(f"        validate {row:11s} KL {v['kl']:.5f}  worst layer error {v['layer_rel_err']:.4f}")
    for k, v in out["paired"].items():
        print(f"  {k:10s} {v['mean']:+.2e} +- {v['se']:.1e}")


if __name__ == "__main__":
    main()
