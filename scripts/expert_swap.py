"""Which experts carry the difference between two conversions of one bench_calibration class?

Takes a class folder of a finished `scripts/bench_calibration.py` run: its float32 reference copy
(`ref`), run A's spliced checkpoint (`A-spliced`: the reference with A's dequantized INT4 experts) and
run B's experts (a quantkit decode folder or llm-compressor's output). It replaces one expert of A at
a time by B's and prints, per expert, the in-distribution KL change paired over the held-out windows
(z = mean / SE), beside what A's convert-report.json says of that expert (routed tokens, decision,
held-out errors). The sum of the per-expert changes against the whole swap says whether the experts
act alone.

    python scripts/expert_swap.py RUN/two-domain-dsv3 "GPTQ mix" --other LLMC_RUN/two-domain-dsv3/llmc

It found where the previous settings' gap to llm-compressor sat (docs/benchmarks.md, "Tried and dropped") on
two-domain-dsv3 at 32x64.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _script(name: str):
    sys.path.insert(0, str(HERE))
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a class folder of a bench_calibration --out run (has ref/)")
    ap.add_argument("run", help="run A's row name, e.g. 'GPTQ mix' (its spliced copy and report are used)")
    ap.add_argument("--other", type=Path, required=True, help="run B's experts: a decode folder or llmc output")
    ap.add_argument("--eval-samples", type=int, default=128)
    ap.add_argument("--eval-seq-len", type=int, default=64)
    args = ap.parse_args(argv)

    import torch
    from safetensors.torch import load_file, save_file

    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.validation.metrics import paired

    bc, bcal = _script("bench_convert"), _script("bench_calibration")
    ref, key = args.folder / "ref", args.run.replace(" ", "-")
    report = json.loads((args.folder / key / "convert-report.json").read_text())
    work = Path(tempfile.mkdtemp(prefix="quantkit-swap-"))
    a = load_file(str(args.folder / f"{key}-spliced" / "model.safetensors"))
    b = load_file(str(bc.splice_experts(ref, args.other, work / "other") / "model.safetensors"))
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    ids = bcal.eval_sets(args.eval_samples, args.eval_seq_len, Checkpoint(ref).arch.vocab_size)["in-dist"]
    ref_lp = bc.log_probs(ref, ids)

    def kl(sd: dict):  # per-window KL(ref || sd), one folder rewritten each time
        folder = work / "swap"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(ref, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return bcal.window_kl(ref_lp, bc.log_probs(folder, ids))

    base, whole = kl(a), kl(b)
    print(f"{args.run}: in-dist KL {base.mean():.4e}; with every expert from {args.other}: {whole.mean():.4e}")
    rows = []
    for e in report["experts"]:
        tag = (f"layers.{e['layer']}.", f".experts.{e['expert']}.")
        sd = dict(a) | {k: b[k] for k in differ if tag[0] in k and tag[1] in k}
        rows.append((paired(kl(sd), base), e))
    rows.sort(key=lambda r: r[0].mean)
    for p, e in rows:
        low = "" if e.get("err_low") is None else f", low dampening {e['err_low']:.4g}"
        if e.get("err_probe") is not None:
            low += f"; on the probe {e['err_probe']:.4g}, low {e['err_probe_low']:.4g}, RTN {e['err_probe_rtn']:.4g}"
        print(f"layer {e['layer']} expert {e['expert']:3d}: tokens {e['tokens']:5d} {e['decision']:10s} "
              f"held-out err {e['err']:.4g} (RTN {e['err_rtn']:.4g}{low}); "
              f"swapped: dKL {p.mean:+.3e} ± {p.se:.1e} ({p.mean / p.se if p.se else 0:+.1f})")
    print(f"sum of the per-expert changes {sum(p.mean for p, _ in rows):+.3e}; "
          f"the whole swap {(whole - base).mean().item():+.3e}")
    shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
