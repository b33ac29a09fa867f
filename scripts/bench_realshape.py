#!/usr/bin/env python
"""Planner prediction vs measurement on the real-shape models, and full-scale predictions.

For each (model, calibration samples) it runs, in a child process,

    python -m quantkit.cli convert realshape:MODEL --out ROOT/MODEL-Nx512 --calib synthetic:train \
        --num-samples N --seq-len 512 --method gptq --max-host-memory 8GB --no-validate --json

(Kimi with --group-size 128, so that its INT4 g32 experts are re-quantized with GPTQ rather than
reused), then tabulates the measured peak RSS (getrusage of the convert process, also in
convert-report.json), disk of both outputs, wall and CPU time against the prediction convert
recorded (report["cost"], the same quantkit.planner.cost.plan_convert that `quantkit plan --convert`
prints; the time column is recomputed with the current model and this process's torch threads, so
run it with the OMP_NUM_THREADS the converts ran with). With --reuse, a finished ROOT/... folder is tabulated without running it again.
Then it prints the full-scale predictions (`quantkit plan MODEL --convert --gpu h200`) for the
shipped recipes.

    python scripts/bench_realshape.py                       # both models, 8 and 32 samples (long on 2 cores)
    python scripts/bench_realshape.py --models glm-5.2 --samples 8 --root /tmp/rs --reuse
    python scripts/bench_realshape.py --full-scale-only

It asserts nothing; it prints one table.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

GB = 1e9


def run(model: str, samples: int, root: Path, budget: str, reuse: bool) -> dict:
    out = root / f"{model}-{samples}x512"
    report = out / "convert-report.json"
    meta = out.parent / (out.name + ".bench.json")
    if not (reuse and report.is_file()):
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "quantkit.cli", "convert", f"realshape:{model}", "--out", str(out),
               "--calib", "synthetic:train", "--num-samples", str(samples), "--seq-len", "512", "--method", "gptq",
               "--max-host-memory", budget, "--no-validate", "--json"]
        if model == "kimi-k2.6":
            cmd += ["--group-size", "128"]
        t0 = time.time()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        meta.write_text(json.dumps({"wall": time.time() - t0,
                                    "cpu": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime}))
    r = json.loads(report.read_text())
    m = json.loads(meta.read_text()) if meta.is_file() else {"wall": r["seconds"], "cpu": None}
    c = r["cost"]
    # time: the current model (quantkit.planner.cost) for the same run and thread count; memory/disk: as recorded
    from quantkit.planner.cost import plan_convert_for

    now = plan_convert_for(f"realshape:{model}", gpu="cpu", method="gptq", num_samples=samples, seq_len=512,
                           group_size=128 if model == "kimi-k2.6" else None, max_host_memory=budget, validate=False)
    c["seconds_total"] = round(sum(now.seconds.values()), 1)
    return {"model": model, "tokens": samples * 512, "rss": r["peak_rss_bytes"], "rss_pred": c["peak_host"],
            "disk": r["outputs"]["prefill"]["bytes"] + r["outputs"]["decode"]["bytes"],
            "disk_pred": c["disk"]["prefill"] + c["disk"]["decode"], "wall": m["wall"], "cpu": m["cpu"],
            "time_pred": c["seconds_total"], "store": c["store"], "chunk": c["expert_chunk"]}


def matmul_rate() -> float:
    """Float32 matmul GFLOP/s per torch thread, in CPU time (what quantkit.planner.budgets.CPU_FLOPS_PER_THREAD
    assumes): 2048x6144 @ 6144x2048 and x^T x at D 6144, the shapes of the Hessians and experts."""
    import torch

    rates = []
    for a, b in (((2048, 6144), (6144, 2048)), ((6144, 4096), (4096, 6144))):
        x, y = torch.randn(*a), torch.randn(*b)
        x @ y
        t = time.process_time()
        for _ in range(3):
            x @ y
        rates.append(3 * 2 * a[0] * a[1] * b[1] / (time.process_time() - t) / torch.get_num_threads() / 1e9)
    return min(rates)


def full_scale() -> list[str]:
    from quantkit.planner.cost import plan_convert_for

    lines = []
    for model in ("glm-5.2", "kimi-k2.6"):
        c = plan_convert_for(model, gpu="h200", max_host_memory="1TB")
        lines.append(f"{model} (shipped recipe, one H200, host budget 1 TB):\n" + c.summary())
    lines.append("glm-5.2 sensitivity to the H200's sustained rate: " + ", ".join(
        f"{label} {_with_h200_rate(rate)}" for label, rate in
        (("40% of FP32 peak", 0.4 * 67e12), ("70%", 0.7 * 67e12), ("TF32 matmuls at 50% (494 TFLOP/s dense)", 0.5 * 494e12))))
    return lines


def _with_h200_rate(flops: float) -> str:
    """The GLM 5.2 prediction with the H200's matmul rate set to `flops` (a what-if)."""
    from quantkit.planner import cost

    c = cost.plan_convert_for("glm-5.2", gpu="h200", max_host_memory="1TB", rates={"flops": flops})
    return cost._hms(sum(c.seconds.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="glm-5.2,kimi-k2.6")
    ap.add_argument("--samples", default="8,32")
    ap.add_argument("--budget", default="8GB")
    ap.add_argument("--root", type=Path, default=Path("/tmp/quantkit-bench-realshape"))
    ap.add_argument("--reuse", action="store_true", help="tabulate finished runs under --root without rerunning")
    ap.add_argument("--full-scale-only", action="store_true")
    args = ap.parse_args()
    if not args.full_scale_only:
        rows = [run(m, int(n), args.root, args.budget, args.reuse)
                for m in args.models.split(",") for n in args.samples.split(",")]
        from quantkit.planner.budgets import CPU_FLOPS_PER_THREAD

        print(f"float32 matmul here: {matmul_rate():.0f} GFLOP/s per thread in CPU time "
              f"(quantkit.planner.budgets assumes {CPU_FLOPS_PER_THREAD / 1e9:.0f})")
        print(f"convert --method gptq --max-host-memory {args.budget}, synthetic:train, seq_len 512, --no-validate")
        print("| model | tokens | store | chunk | peak RSS GB (pred) | ratio | disk GB (pred) | wall s | CPU s | time s (pred) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            s = r["store"]
            cpu = f"{r['cpu']:.0f}" if r["cpu"] is not None else "-"
            print(f"| {r['model']} | {r['tokens']} | {s['dtype']} {s['backing']} mb{s['micro_batch']} | {r['chunk']} "
                  f"| {r['rss'] / GB:.2f} ({r['rss_pred'] / GB:.2f}) | {r['rss'] / r['rss_pred']:.2f} "
                  f"| {r['disk'] / GB:.3f} ({r['disk_pred'] / GB:.3f}) | {r['wall']:.0f} | {cpu} | {r['time_pred']:.0f} |")
        for m in args.models.split(","):
            rs = [r for r in rows if r["model"] == m]
            if len(rs) == 2:
                print(f"{m}: peak RSS at {rs[1]['tokens']} / {rs[0]['tokens']} tokens = {rs[1]['rss'] / rs[0]['rss']:.3f}")
    print()
    print("\n\n".join(full_scale()))


if __name__ == "__main__":
    main()
