#!/usr/bin/env python
"""Expert-parallel convert: 1 rank vs N ranks on a real-shape model, and the planner's 8xH200 figures.

For each rank count it runs, in a child process (N > 1 through torchrun, gloo on CPU),

    [torchrun --standalone --nproc-per-node N -m] quantkit convert realshape:MODEL --out ROOT/MODEL-nN \
        --calib synthetic:train --num-samples 8 --seq-len 512 --method gptq --max-host-memory 8GB --no-validate --json

with OMP_NUM_THREADS=--threads in every rank (so N ranks use N x threads cores: on the 2-core test
machine 2 ranks of 1 thread against 1 rank of 1 thread). It prints wall time, speed-up over the
first rank count, each rank's peak RSS (convert-report.json: distributed.peak_rss_bytes_per_rank),
the seconds each rank spent quantizing its own experts (the balance), the summed per-layer
attention and MoE-expert seconds of rank 0 (the expert column includes the exchange and the
redundant output pass), whether the output bytes equal the
first run's, and the planner's prediction for the same run (`quantkit plan --convert --nproc N
--gpu cpu`). Then the full-scale predictions for the shipped recipes on 8 x H200.

    python scripts/bench_distributed.py                          # realshape:glm-5.2, 1 vs 2 ranks
    python scripts/bench_distributed.py --root /tmp/bd --reuse   # tabulate finished runs again
    python scripts/bench_distributed.py --predict-only

--max-host-memory is per rank: 2 ranks may use twice the host memory of one. It asserts nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

GB = 1e9


def _digest(out: Path) -> str:
    h = hashlib.sha256()
    for which in ("prefill", "decode"):
        for p in sorted((out / which).iterdir()):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def run(model: str, nproc: int, args) -> dict:
    out = args.root / f"{model}-n{nproc}"
    report, meta = out / "convert-report.json", out.parent / (out.name + ".bench.json")
    if not (args.reuse and report.is_file() and meta.is_file()):
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        cmd = ["-m", "quantkit", "convert", f"realshape:{model}", "--out", str(out), "--calib", "synthetic:train",
               "--num-samples", str(args.samples), "--seq-len", str(args.seq_len), "--method", "gptq",
               "--max-host-memory", args.budget, "--no-validate", "--json"]
        if args.group_size:
            cmd += ["--group-size", str(args.group_size)]
        if nproc > 1:
            cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *cmd]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        t0 = time.time()
        subprocess.run([sys.executable, *cmd], check=True, stdout=subprocess.DEVNULL, env=env)
        meta.write_text(json.dumps({"wall": time.time() - t0}))
    r = json.loads(report.read_text())
    d = r.get("distributed", {"world": 1})
    moe = [lay for lay in r["layers"] if lay["kind"] == "moe"]
    calibrated = {lay["layer"] for lay in moe if lay["calibrated"]}  # the layers whose experts ranks split
    return {
        "nproc": nproc, "wall": json.loads(meta.read_text())["wall"], "digest": _digest(out),
        "rss": d.get("peak_rss_bytes_per_rank", [r["peak_rss_bytes"]]),
        "experts": d.get("experts_per_rank", [sum(1 for e in r["experts"] if e["layer"] in calibrated and e["method"] != "reused")]),
        "quantize": d.get("quantize_seconds_per_rank"),  # each rank's own experts (multi-rank only)
        "attention": sum(lay["attention_seconds"] for lay in r["layers"]),
        "moe_experts": sum(lay["seconds"] - lay["attention_seconds"] for lay in moe),
    }


def predicted(model: str, nproc: int, args) -> float:
    from quantkit.planner.cost import plan_convert_for

    c = plan_convert_for(model, gpu="cpu", method="gptq", num_samples=args.samples, seq_len=args.seq_len,
                         group_size=args.group_size, max_host_memory=args.budget, validate=False, nproc=nproc)
    return sum(c.seconds.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="glm-5.2", help="real-shape model (realshape:MODEL)")
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="rank counts; the first is the baseline")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--group-size", type=int, default=None,
                   help="INT4 group size (Kimi: 128, so that its g32 experts are quantized rather than reused)")
    p.add_argument("--budget", default="8GB", help="--max-host-memory, per rank")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every rank")
    p.add_argument("--root", type=Path, default=Path("/tmp/quantkit-bench-distributed"))
    p.add_argument("--reuse", action="store_true", help="tabulate finished runs instead of running them again")
    p.add_argument("--predict-only", action="store_true", help="only the planner's full-scale figures")
    args = p.parse_args()

    if not args.predict_only:
        args.root.mkdir(parents=True, exist_ok=True)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the predictions' thread count
        rows = [run(args.model, n, args) for n in args.nproc]
        base = rows[0]
        print(f"realshape:{args.model}, {args.samples} x {args.seq_len} tokens, gptq"
              f"{f' g{args.group_size}' if args.group_size else ''}, {args.budget} per rank, "
              f"{args.threads} thread(s) per rank")
        print("| ranks | wall s | speed-up | predicted s | peak RSS per rank GB | experts per rank | "
              "quantize s per rank | attention s | MoE expert s | bytes = first |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            rss = ", ".join(f"{b / GB:.2f}" for b in r["rss"])
            print(f"| {r['nproc']} | {r['wall']:.0f} | {base['wall'] / r['wall']:.2f}x | "
                  f"{predicted(f'realshape:{args.model}', r['nproc'], args):.0f} | {rss} | "
                  f"{', '.join(map(str, r['experts']))} | {', '.join(f'{t:.0f}' for t in r['quantize'] or [])} | "
                  f"{r['attention']:.0f} | {r['moe_experts']:.0f} | "
                  f"{'yes' if r['digest'] == base['digest'] else 'NO'} |")
        print()

    from quantkit.planner.cost import plan_convert_for

    for model in ("glm-5.2", "kimi-k2.6"):
        for n in (1, 8):  # an 8 x H200 node has about 2 TB of host memory, shared by its ranks
            c = plan_convert_for(model, gpu="h200", nproc=n, max_host_memory=f"{2000 // n}GB")
            print(f"{model} (shipped recipe, {n} x H200, host budget {2000 // n} GB per rank):")
            print(c.summary())
            print()
    peak = 67e12  # the H200's FP32 peak; the plan assumes 50% of it, and 2 GB/s of disk
    for label, rates in (("40% of FP32 peak", {"flops": 0.4 * peak}), ("70%", {"flops": 0.7 * peak}),
                         ("disk 1 GB/s", {"disk": 1e9}), ("disk 8 GB/s", {"disk": 8e9}),
                         ("40% and disk 8 GB/s", {"flops": 0.4 * peak, "disk": 8e9})):
        c = plan_convert_for("glm-5.2", gpu="h200", nproc=8, max_host_memory="250GB", rates=rates)
        print(f"glm-5.2, 8 x H200, {label}: {sum(c.seconds.values()) / 60:.1f} min")


if __name__ == "__main__":
    main()
