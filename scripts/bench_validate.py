#!/usr/bin/env python
"""Validate on N ranks vs one, and weights kept vs streamed, on a convert output (a real-shape pair).

For each (ranks, weights) it validates a hard-linked copy of OUT (validate writes validation.* and
model cards; the shards are shared, never modified) in a child process,

    quantkit validate COPY --device cpu --json --eval-data synthetic:heldout --num-samples S \
        --seq-len T --gen-tokens K --weights W [--nproc N]

with OMP_NUM_THREADS=--threads in every rank, and prints wall time, each rank's share of the three
checkpoints, what it kept and read, its peak RSS, and whether every number, curve and greedy
continuation equals the first run's (they must, bit for bit: docs/distributed.md).

    python scripts/bench_validate.py /tmp/bdk/kimi-k2.6-n1                  # 1 vs 2 ranks, auto
    python scripts/bench_validate.py OUT --runs 1:stream 1:auto 2:auto      # streamed vs kept
    python scripts/bench_validate.py OUT --reuse                            # tabulate again

It asserts nothing; --max-host-memory is per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

GB = 1e9
SAME = ("rows", "continuations", "reference_metrics", "kv_cache")


def run(out: Path, nproc: int, weights: str, args) -> dict:
    copy = out.parent / f"{out.name}-v{nproc}-{weights}"
    result, meta = copy / "validation.json", copy / "bench.json"
    if not (args.reuse and result.is_file() and meta.is_file()):
        shutil.rmtree(copy, ignore_errors=True)
        subprocess.run(["cp", "-al", str(out), str(copy)], check=True)
        for stale in ("validation.json", "validation.md", "validation.png"):
            (copy / stale).unlink(missing_ok=True)
        cmd = ["-m", "quantkit", "validate", str(copy), "--device", "cpu", "--json", "--eval-data", "synthetic:heldout",
               "--num-samples", str(args.samples), "--seq-len", str(args.seq_len), "--gen-tokens", str(args.gen_tokens),
               "--kv-cache-dtype", args.kv, "--weights", weights]
        if args.budget:
            cmd += ["--max-host-memory", args.budget]
        if nproc > 1:
            cmd += ["--nproc", str(nproc)]  # launches torchrun, and exits 3 when a gate fails, as one process does
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        t0 = time.time()
        done = subprocess.run([sys.executable, *cmd], stdout=subprocess.DEVNULL, env=env)
        if done.returncode not in (0, 3):  # 3: a gate failed, the numbers are there
            sys.exit(f"{' '.join(cmd)}: exit {done.returncode}")
        meta.write_text(json.dumps({"wall": time.time() - t0}))
    d = json.loads(result.read_text())
    return {"nproc": nproc, "weights": weights, "wall": json.loads(meta.read_text())["wall"], "data": d}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="a convert output (prefill/, decode/, convert-report.json)")
    p.add_argument("--runs", nargs="+", default=["1:auto", "2:auto"], help="RANKS:WEIGHTS; the first is the baseline")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=4)
    p.add_argument("--kv", default="bf16", help="--kv-cache-dtype")
    p.add_argument("--budget", default=None, help="--max-host-memory, per rank")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every rank")
    p.add_argument("--reuse", action="store_true", help="tabulate finished runs instead of running them again")
    args = p.parse_args()

    rows = [run(args.out, int(n), w, args) for n, w in (r.split(":") for r in args.runs)]
    base = rows[0]
    print(f"{args.out}: {args.samples} x {args.seq_len} eval tokens, {args.gen_tokens} greedy tokens, "
          f"{args.threads} thread(s) per rank")
    print("| ranks | weights | wall s | speed-up | share per rank GB | kept GB | read GB | peak RSS GB | experts per rank | "
          "numbers = first |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        w = r["data"]["weights"]

        def gb(key: str) -> str:
            return ", ".join(f"{b / GB:.2f}" for b in w[key])

        same = all(r["data"][k] == base["data"][k] for k in SAME)
        print(f"| {r['nproc']} | {w['mode']} | {r['wall']:.0f} | {base['wall'] / r['wall']:.2f}x | "
              f"{gb('share_bytes_per_rank')} | {gb('kept_bytes_per_rank')} | {gb('read_bytes_per_rank')} | "
              f"{gb('peak_rss_bytes_per_rank')} | {', '.join(map(str, w['experts_per_rank']))} | "
              f"{'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
