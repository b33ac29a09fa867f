#!/usr/bin/env python
"""Where a `quantkit` command's peak RSS goes: its RSS and the phase it is in, sampled every 20 ms.

Runs the command in this process (`quantkit.cli`), with a thread that reads VmRSS from
/proc/self/status and the main thread's innermost quantkit frames, then prints the peak with its
stack and, per phase of a calibrated convert, the highest RSS seen in it:

    python scripts/profile_rss.py -- convert MODEL --out DIR --method gptq --no-validate
    python scripts/profile_rss.py --json samples.json -- convert ...   # also every sample

Phases are named by the function the main thread is in (`PHASES`, first match from the innermost
frame). Linux only (reads /proc). It found where the random DeepSeek-V3-layout benchmark's peak
went (docs/benchmarks.md, "Peak memory"). The sampler's own cost is a list of samples (a few MB).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

# innermost function -> phase; the first match walking out from the innermost quantkit frame
PHASES = {
    "attention_pass": "attention (and dense MLP / shared expert)",
    "expert_hessians": "expert Hessians",
    "run_gptq": "GPTQ",
    "quantize_experts_awq": "AWQ search",
    "guard_against_rtn": "held-out guard",
    "guard_experts": "held-out guard",
    "add_expert_outputs": "expert outputs (h update)",
    "write_expert": "writing experts",
    "gptq_experts": "expert chunk: stacking, dequantizing",
    "convert_experts": "expert chunk: loading the source weights",
    "outside_layers": "embeddings / head",
    "save_state": "resume state",
    "finish_pair": "finishing outputs",
}


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _stack(frame) -> list[str]:
    """quantkit frames of `frame`'s stack, outermost first, as 'module/file.py:function:line'."""
    out = []
    while frame is not None:
        code = frame.f_code
        if "quantkit" in code.co_filename:
            out.append(f"{code.co_filename.split('quantkit/')[-1]}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return out[::-1]


def phase_of(stack: list[str]) -> str:
    for entry in reversed(stack):
        name = entry.split(":")[1]
        if name in PHASES:
            return PHASES[name]
    return "other (imports, loading, planning)"


def run(argv: list[str], every: float = 0.02) -> list[tuple[float, int, list[str]]]:
    """Run `quantkit argv` here, sampling (seconds, RSS bytes, stack) every `every` seconds."""
    samples: list = []
    main, done = threading.get_ident(), threading.Event()

    def sample() -> None:
        t0 = time.perf_counter()
        while not done.is_set():
            samples.append((time.perf_counter() - t0, _rss(), _stack(sys._current_frames().get(main))))
            done.wait(every)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    from quantkit.cli import app

    try:
        app(argv, prog_name="quantkit", standalone_mode=False)
    finally:
        done.set()
        thread.join()
    return samples


def report(samples: list) -> str:
    peak = max(samples, key=lambda s: s[1])
    lines = [f"peak RSS {peak[1] / 1e6:.0f} MB at {peak[0]:.1f} s, in {phase_of(peak[2])}:"]
    lines += [f"    {s}" for s in peak[2]]
    by: dict[str, list] = {}
    for t, rss, stack in samples:
        p = by.setdefault(phase_of(stack), [0, 0.0])
        p[0] = max(p[0], rss)
        p[1] += 1
    lines.append(f"{'phase':45s} {'max RSS MB':>10s} {'samples':>8s}")
    for name, (rss, n) in sorted(by.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{name:45s} {rss / 1e6:10.0f} {int(n):8d}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="also write every sample (seconds, RSS bytes, stack) to this file")
    ap.add_argument("--every", type=float, default=0.02, help="seconds between samples")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the quantkit command and its options")
    args = ap.parse_args()
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    samples = run(argv, args.every)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(samples, f)
    print(report(samples), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
