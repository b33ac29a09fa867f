#!/usr/bin/env python
"""Benchmark `quantkit convert` against llm-compressor's `oneshot` GPTQ on the same model and tokens.

One invocation measures, each in its own process (wall time, CPU time and peak RSS of that process
alone, via os.wait4 in a small launcher), with the same thread count (--threads, default 1):

  1. quantkit GPTQ   `python -m quantkit.cli convert MODEL --method gptq --no-validate --json`
  2. quantkit RTN    the same with `--method rtn`, and quantkit AWQ with `--method awq`
     (and quantkit GPTQ with num_samples x experts/experts-per-token, the tokens per expert
     llm-compressor's all-experts calibration sees; --no-scaled-calib skips it)
  3. llm-compressor  `oneshot` with a GPTQModifier on the routed expert Linears only (W4A16,
                     symmetric int4, group G, quantkit's recipe GPTQ settings), on transformers'
                     model of the same source weights (dequantized into a plain folder first,
                     untimed; experts unfused by llm-compressor's `linearize_moe`), with the same
                     calibration ids; its default all-experts calibration, and routed-only
                     (--no-llmc-routed skips it)
  4. memory vs depth quantkit GPTQ on random-weight checkpoints of the same architecture at two
                     depths (default 4 and 16 layers), same calibration (--depth-llmc: also
                     llm-compressor)

Arithmetic: quantkit GPTQ's time per phase (convert-report.json's layers[*].phases, CPU seconds)
beside the planner's FLOPs for that phase of that run (its cost.flops) and this machine's float32
matmul rate measured in the same run: how close each phase comes to the machine's limit.

Quality: KL(source || output) and top-1 agreement on held-out corpus tokens (quantkit.synthetic.tiny
seeds >= 2000), with quantkit's reference forward (`quantkit.validation.forward.logits`) on every output
folder. The "experts-only" columns compare against the dequantized copy llm-compressor started
from, with quantkit's INT4 experts spliced into that copy, so both tools differ from their
reference only in the routed experts (docs/benchmarks.md explains the choices).

    python scripts/bench_convert.py                       # tiny:glm-5.2, ~2 minutes on 2 cores
    python scripts/bench_convert.py --json > bench.json
    python scripts/bench_convert.py --figure rss.png      # also each tool's resident memory over its run
    python scripts/bench_convert.py --model tiny:kimi-k2.6 --group-size 128 --no-depth

This is a benchmark that prints a table, not a test: it asserts nothing about the targets.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"wall": 0.5, "rss": 0.5, "kl": 1.05, "depth_rss": 1.15}
EVAL_SEED = 2000  # quantkit.synthetic.tiny corpus seeds >= 1000 are held out from training and calibration


# ---- measuring a child process -------------------------------------------------------------------
# Launched with `python -S`: a small process that spawns the measured command and reports its rusage.
# Linux carries a process's RSS high-water mark across fork and exec, so a command forked straight
# from this (large) benchmark process would report at least this process's RSS; spawned from the
# launcher it inherits only the launcher's few MB.
# While it waits, the launcher samples the child's resident set (VmRSS in /proc/PID/status) every
# RSS_INTERVAL_S: `rss_samples`, [[seconds since start, bytes], ...], the curve plot_rss draws.
RSS_INTERVAL_S = 0.1
_LAUNCHER = """
import json, os, sys, time
out, cmd = sys.argv[1], sys.argv[2:]
t0 = time.perf_counter()
pid = os.posix_spawn(cmd[0], cmd, os.environ)
samples = []
while True:
    done, status, ru = os.wait4(pid, os.WNOHANG)
    if done:
        break
    try:
        with open(f"/proc/{pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        samples.append([round(time.perf_counter() - t0, 3), kb * 1024])
    except (OSError, StopIteration, ValueError):
        pass
    time.sleep(%s)
wall = time.perf_counter() - t0
with open(out, "w") as f:
    json.dump({"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss_bytes": ru.ru_maxrss * 1024,
               "rss_samples": samples}, f)
sys.exit(os.waitstatus_to_exitcode(status))
""" % RSS_INTERVAL_S


def measured(cmd: list[str], log: Path, *, env: dict | None = None) -> dict:
    """Run `cmd` to completion (stdout to `log`, stderr to `log`.err): its wall and CPU seconds and peak
    RSS, of that command alone (os.wait4 in a small launcher; not RUSAGE_CHILDREN, which keeps the
    maximum over every child so far)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    err, stats = log.with_suffix(".err"), log.with_suffix(".rusage.json")
    with open(log, "wb") as f, open(err, "wb") as e:
        rc = subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, str(stats), *cmd], stdout=f, stderr=e, cwd=ROOT,
                            env=env).returncode
    if rc != 0:
        tail = err.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exited {rc}; log {log}:\n{tail}")
    return json.loads(stats.read_text())


def quantkit_convert(src: Path | str, out: Path, method: str, args, recipe: str | None, logs: Path, env: dict) -> dict:
    cmd = [sys.executable, "-m", "quantkit.cli", "convert", str(src), "--out", str(out), "--method", method,
           "--calib", "synthetic:train", "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
           "--group-size", str(args.group_size), "--device", "cpu", "--no-validate", "--json"]
    if recipe:
        cmd += ["--recipe", recipe]
    log = logs / f"{out.name}.log"
    m = measured(cmd, log, env=env)
    report = json.loads(log.read_text())  # --json prints only the report on stdout
    m["report"] = {k: report[k] for k in ("seconds", "peak_rss_bytes", "experts_summary", "calibration", "layers", "cost")}
    return m


# ---- the llm-compressor worker (runs in its own process) -----------------------------------------
def llmc_worker(spec: dict) -> None:
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM

    ids = torch.load(spec["ids"])
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    # Plain from_pretrained (transformers 5 fuses the experts into 3-D params), then llm-compressor's
    # own post-load linearization into per-expert nn.Linear. `load_quantizable_moe` would load them
    # linear directly but goes through transformers' monkey-patching, which imports torchvision.
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"]))
    linearize_moe(model)
    scheme = QuantizationScheme(
        targets=[r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],  # routed experts only
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=spec["group_size"]),
    )
    gptq = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"], block_size=spec["block_size"],
                        dampening_frac=spec["dampening"], actorder="static" if spec["actorder"] else None)
    oneshot(model=model, dataset=ds, recipe=[gptq], num_calibration_samples=ids.shape[0],
            max_seq_length=ids.shape[1], shuffle_calibration_samples=False,
            moe_calibrate_all_experts=spec["all_experts"], output_dir=spec["out"], save_compressed=True)


# ---- folders: dequantized reference copy, spliced experts, random depth checkpoints ---------------
def _text_name(name: str, kimi: bool) -> str | None:
    """Name of a source tensor in transformers' text-only model (None: not part of it)."""
    if not kimi:
        return name
    return name[len("language_model."):] if name.startswith("language_model.") else None


def reference_copy(src: Path, dst: Path, dtype_name: str) -> Path:
    """The source's text model, dequantized to `dtype_name`, MTP layers dropped, no quantization_config:
    what llm-compressor starts from (Kimi's text model becomes a plain deepseek_v3 folder)."""
    import torch
    from safetensors.torch import save_file

    from quantkit.checkpoint.reader import Checkpoint

    dtype = getattr(torch, dtype_name)
    ck = Checkpoint(src)
    a = ck.arch
    cfg = json.loads((src / "config.json").read_text())
    kimi = cfg["model_type"] == "kimi_k25"
    if kimi:
        cfg = dict(cfg["text_config"], model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])
    elif cfg["model_type"] == "kimi_k2":
        cfg = dict(cfg, model_type="deepseek_v3")
    cfg.pop("quantization_config", None)
    cfg["num_nextn_predict_layers"] = 0
    sd = {}
    for n in ck.names():
        info = ck.tensors[n].info
        new = _text_name(n, kimi)
        if new is None or (info.layer is not None and info.layer >= a.num_hidden_layers):
            continue
        t = ck.get(n, torch.float32)
        sd[new] = t if n.endswith("e_score_correction_bias") else t.to(dtype)
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for p in ck.other_files():
        if p.is_file():
            shutil.copy2(p, dst / p.name)
    return dst


def splice_experts(ref: Path, decode: Path, dst: Path) -> Path:
    """`ref` with its routed experts replaced by quantkit's dequantized INT4 decode experts."""
    import torch
    from safetensors.torch import load_file, save_file

    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.model.tensors import TensorClass

    sd = load_file(str(ref / "model.safetensors"))
    ck = Checkpoint(decode)
    kimi = ck.arch.model_type == "kimi_k25"
    n_done = 0
    for n in ck.names(klass=TensorClass.ROUTED_EXPERT):
        new = _text_name(n, kimi)
        if new in sd:
            sd[new] = ck.get(n, torch.float32).to(sd[new].dtype)
            n_done += 1
    if n_done == 0:
        raise RuntimeError(f"no routed experts of {decode} found in {ref}")
    shutil.copytree(ref, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def random_checkpoint(folder: Path, src: Path, layers: int, args) -> Path:
    """Random BF16 weights (quantkit.synthetic.tiny.init_weights) of the source's text architecture at `layers`
    depth and the --depth-* sizes, one shard per layer, the source's tokenizer files."""
    import torch

    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.checkpoint.writer import CheckpointWriter
    from quantkit.model.arch import arch_from_config
    from quantkit.synthetic.tiny import init_weights

    cfg = json.loads((src / "config.json").read_text())
    if cfg["model_type"] == "kimi_k25":  # the text model alone, as Kimi K2 ships it
        cfg = dict(cfg["text_config"], model_type="kimi_k2")
    cfg.pop("quantization_config", None)
    text = cfg
    text.update(num_hidden_layers=layers, hidden_size=args.depth_hidden, n_routed_experts=args.depth_experts,
                moe_intermediate_size=args.depth_moe_inter, intermediate_size=3 * args.depth_moe_inter)
    if "index_topk" in text:
        text["index_topk"] = min(text["index_topk"], args.seq_len)
    arch = arch_from_config(cfg)
    t = init_weights(arch, torch.Generator().manual_seed(0))
    w = CheckpointWriter(folder, digits=5)
    for L in [None, *range(arch.num_layers_with_mtp)]:
        pre = None if L is None else arch.layer_prefix(L)
        for name in sorted(t):
            in_layer = ".layers." in name
            if (L is None and in_layer) or (L is not None and not name.startswith(pre)):
                continue
            x = t.pop(name)
            w.add(name, x.float() if name.endswith("e_score_correction_bias") else x.to(torch.bfloat16))
        w.flush()  # one shard per layer, as the real checkpoints roughly are
    return w.finish(cfg, files=[p for p in Checkpoint(src).other_files() if p.is_file()])


# ---- quality -------------------------------------------------------------------------------------
def calibration_tokens(rec, src: Path):
    """The windows quantkit convert calibrates on with recipe `rec` (its dataset, or its mix and random
    share), read by convert's own function, so llm-compressor is handed the same ids."""
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.conversion.pipeline import _calibration_tokens

    return _calibration_tokens(rec, None, Checkpoint(src), False)


def log_probs(folder: Path | str, ids, chunk: int = 16):
    """log-softmax of quantkit's reference-forward logits, (N, T, V), computed `chunk` windows at a time."""
    import torch

    from quantkit.validation.forward import logits

    with torch.no_grad():
        return torch.cat([logits(folder, ids[i:i + chunk], device="cpu").log_softmax(-1) for i in range(0, len(ids), chunk)])


def compare(ref, lp) -> dict:
    """Mean per-token KL(ref || lp) in nats with its standard error over windows, and top-1 agreement."""
    kl_win = (ref.exp() * (ref - lp)).sum(-1).mean(-1)  # (N,) per window
    n = kl_win.numel()
    return {"kl": kl_win.mean().item(), "kl_se": (kl_win.std().item() / n ** 0.5) if n > 1 else 0.0,
            "top1": (ref.argmax(-1) == lp.argmax(-1)).float().mean().item(), "kl_windows": kl_win.tolist()}


def paired(a: dict, b: dict) -> dict:
    """Mean of a's minus b's per-window KL, with the standard error of that paired difference."""
    import torch

    d = torch.tensor(a["kl_windows"]) - torch.tensor(b["kl_windows"])
    return {"diff": d.mean().item(), "diff_se": d.std().item() / d.numel() ** 0.5 if d.numel() > 1 else 0.0}


# ---- machine ---------------------------------------------------------------------------------------
def machine() -> dict:
    import torch

    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()[:10]
    except OSError:
        lscpu = []
    mem = next((ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")), "0")
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("transformers", "llmcompressor", "compressed-tensors", "quantkit"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = "?"
    return {"lscpu": lscpu, "ram_gib": round(int(mem) / 2**20, 1), "cpus": os.cpu_count(), "versions": versions,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "loadavg_start": os.getloadavg()}


# ---- figure ----------------------------------------------------------------------------------------
RSS_RUNS = ("qk-gptq", "qk-awq", "qk-rtn", "llmc", "llmc-routed")  # drawn when present, in this order


def rss_curves(res: dict) -> dict:
    """The memory figure's data: for each measured run that has RSS samples, {label: {"t": seconds,
    "rss_mib": MiB, "peak_mib": the process's own peak (getrusage), "wall_s": ...}}."""
    out = {}
    for key in RSS_RUNS:
        m = res["runs"].get(key)
        if not m or not m.get("rss_samples"):
            continue
        t, rss = zip(*m["rss_samples"], strict=True)
        out[res["labels"].get(key, key)] = {"t": list(t), "rss_mib": [b / 2**20 for b in rss],
                                            "peak_mib": m["peak_rss_bytes"] / 2**20, "wall_s": m["wall_s"]}
    return out


def plot_rss(res: dict, path: Path) -> dict:
    """rss.png: each tool's resident memory over its run (sampled by the launcher), its peak marked;
    returns the plotted data (rss_curves')."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    curves = rss_curves(res)
    fig, ax = plt.subplots(figsize=(9, 4.2), constrained_layout=True)
    for label, c in curves.items():
        (line,) = ax.plot(c["t"], c["rss_mib"], lw=1.6, label=f"{label}: peak {c['peak_mib']:.0f} MiB, {c['wall_s']:.0f} s")
        ax.axhline(c["peak_mib"], color=line.get_color(), ls=":", lw=1)
    floor = res["runs"].get("floor-torch")
    if floor:
        ax.axhline(floor["peak_rss_bytes"] / 2**20, color="grey", ls="--", lw=1, label="python -c 'import torch'")
    ax.set_xlabel("seconds since the process started")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(textwrap.fill(f"{res['model']}; calibration {res['calibration']}", 100), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return curves


# ---- table -----------------------------------------------------------------------------------------
def matmul_rate(threads: int) -> dict:
    """This machine's float32 matmul rate, FLOP/s in CPU time per thread (best of 3 at 2048^3, after a warm-up),
    the limit the arithmetic table holds each phase against."""
    import time

    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = float("inf")
    for _ in range(3):
        t = time.process_time()
        a @ b
        best = min(best, time.process_time() - t)
    return {"flops_per_thread": 2 * 2048**3 / best, "threads": threads, "shape": "2048x2048 @ 2048x2048"}


# the compute phases the planner counts FLOPs for (ConvertCost.flops), by the names convert times them
# under (quantkit.runtime.phases)
PHASES = {"attention": "attention, dense MLP and shared experts (calibration forward)",
          "hessians": "Hessian accumulation (X^T X per expert, down's on the quantized gate/up)",
          "gptq": "the GPTQ solve (Cholesky, column loop, lazy updates)",
          "experts_out": "routed experts' outputs under the decode weights"}


def arithmetic(run: dict, rate: dict) -> list[dict]:
    """Per compute phase of one quantkit run: measured CPU and wall seconds (summed over layers), the planner's
    FLOPs and seconds for it, the FLOP/s reached and its fraction of the measured matmul rate."""
    rep = run["report"]
    measured: dict[str, dict[str, float]] = {}
    for layer in rep["layers"]:
        for k, v in layer.get("phases", {}).items():
            m = measured.setdefault(k, {"wall": 0.0, "cpu": 0.0})
            m["wall"] += v["wall"]
            m["cpu"] += v["cpu"]
    flops, predicted = rep["cost"]["flops"], rep["cost"]["seconds"]
    limit = rate["flops_per_thread"] * rate["threads"]
    rows = []
    for phase, what in PHASES.items():
        m, f = measured.get(phase), flops.get(phase, 0.0)
        if m is None or not f:
            continue
        cpu = max(m["cpu"], 1e-9)
        rows.append({"phase": phase, "what": what, "cpu_s": m["cpu"], "wall_s": m["wall"], "gflop": f / 1e9,
                     "gflops": f / cpu / 1e9, "of_rate": f / cpu / limit, "predicted_s": predicted.get(phase)})
    q = measured.get("quantize")
    if q is not None:  # the method's solve beyond the Hessians and GPTQ: the guard against RTN, stacking
        rest = {k: q[k] - sum(measured.get(p, {}).get(k, 0.0) for p in ("hessians", "gptq")) for k in ("wall", "cpu")}
        rows.append({"phase": "guard", "what": "the rest of the solve: the held-out guard against RTN, stacking",
                     "cpu_s": rest["cpu"], "wall_s": rest["wall"], "gflop": None, "gflops": None, "of_rate": None,
                     "predicted_s": None})
    return rows


def render_arithmetic(res: dict) -> list[str]:
    rate = res["matmul"]
    lines = ["", f"arithmetic of quantkit GPTQ per phase (CPU seconds over all layers; FLOPs: the planner's for this run; "
             f"matmul here: {rate['flops_per_thread'] / 1e9:.0f} GFLOP/s per thread, {rate['shape']}, x{rate['threads']} thread(s))"]
    hdr = f"  {'phase':<12} {'cpu s':>8} {'wall s':>8} {'GFLOP':>9} {'GFLOP/s':>8} {'of matmul':>9} {'planner s':>9}"
    lines += [hdr, "  " + "-" * (len(hdr) - 2)]
    for r in res["arithmetic"]:
        num = (f"{r['gflop']:9.1f} {r['gflops']:8.1f} {r['of_rate']:9.2f}" if r["gflop"] is not None else f"{'':9} {'':8} {'':9}")
        pred = f"{r['predicted_s']:9.2f}" if r["predicted_s"] is not None else ""
        lines.append(f"  {r['phase']:<12} {r['cpu_s']:8.2f} {r['wall_s']:8.2f} {num} {pred}")
    return lines


def _mb(b: float) -> str:
    return f"{b / 2**20:.0f}"


def _kl(q: dict | None, width: int) -> str:
    return f"{q['kl']:.5f}±{q['kl_se']:.5f}".rjust(width) if q else " " * width


def render(res: dict) -> str:
    r, q = res["runs"], res["quality"]
    lines = [f"model {res['model']} ({res['model_type']}); calibration {res['calibration']}; INT4 group {res['group_size']}; "
             f"held-out {res['eval']}; {res['threads']} thread(s) per process"]
    hdr = (f"{'run':<44} {'wall s':>7} {'cpu s':>7} {'peak RSS MiB':>12}   {'KL vs source':>17} {'top-1':>6}   "
           f"{'KL experts-only':>17} {'top-1':>6}")
    lines += [hdr, "-" * len(hdr)]
    for key, label in res["labels"].items():
        m = r.get(key)
        qs, qe = q["vs_source"].get(key), q["experts_only"].get(key)
        cols = [f"{m['wall_s']:7.1f}", f"{m['cpu_s']:7.1f}", f"{_mb(m['peak_rss_bytes']):>12}"] if m else [" " * 7, " " * 7, " " * 12]
        cols += ["", _kl(qs, 17), f"{qs['top1']:6.3f}" if qs else " " * 6]
        cols += ["", _kl(qe, 17), f"{qe['top1']:6.3f}" if qe else " " * 6]
        lines.append(f"{label:<44} " + " ".join(cols).rstrip())
    lines.append("")
    lines.append("ratios quantkit GPTQ / llm-compressor GPTQ (all-experts calibration, its default):")
    for name, v in res["ratios"].items():
        target = f"target <= {v['target']:<5} {'met' if v['met'] else 'NOT met'}" if v.get("target") else "(context)"
        if "diff" in v:
            target += f"   paired KL difference {v['diff']:+.5f} ± {v['diff_se']:.5f}"
        lines.append(f"  {name:<52} {v['value']:6.3f}   {target}")
    if res.get("arithmetic"):
        lines += render_arithmetic(res)
    if res.get("depth"):
        d = res["depth"]
        lines.append("")
        lines.append(f"peak RSS vs depth (random {d['model_type']} weights, {d['shape']}; same calibration)")
        for tool, rows in d["runs"].items():
            for row in rows:
                lines.append(f"  {tool:<15} {row['layers']:>3} layers   source {row['source_mb']:6.0f} MB   "
                             f"wall {row['wall_s']:6.1f} s   cpu {row['cpu_s']:6.1f} s   peak RSS {_mb(row['peak_rss_bytes']):>6} MB")
        for tool, v in d["ratios"].items():
            lines.append(f"  {tool + ' peak RSS ' + d['label']:<52} {v['value']:6.3f}   "
                         + (f"target <= {v['target']:<5} {'met' if v['met'] else 'NOT met'}" if v.get("target") else "(context)"))
    return "\n".join(lines)


def _ratio(v: float, target: float | None = None) -> dict:
    return {"value": v, "target": target, "met": None if target is None else v <= target}


# ---- main ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny:glm-5.2", help="tiny:glm-5.2 (default), tiny:kimi-k2.6, or a model folder")
    ap.add_argument("--recipe", default=None, help="quantkit recipe (default: the tiny model's; tiny-<family> for folders)")
    ap.add_argument("--num-samples", type=int, default=64, help="calibration windows (synthetic:train)")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per calibration window")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--eval-samples", type=int, default=128, help="held-out windows for KL / top-1")
    ap.add_argument("--eval-seq-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1,
                    help="OMP/MKL threads of every measured process (0: torch's default). Default 1: on a small shared "
                         "machine, torch's default intra-op threads spin in OpenMP barriers on GPTQ's many small ops")
    ap.add_argument("--llmc-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="dtype of the dequantized copy llm-compressor loads (float32: exactly the source's values)")
    ap.add_argument("--no-llmc-routed", action="store_true",
                    help="skip the llm-compressor run with moe_calibrate_all_experts=False (experts see only routed tokens)")
    ap.add_argument("--methods", default="gptq,awq,rtn",
                    help="quantkit methods to run (gptq always; e.g. --methods gptq for the GPTQ-vs-llm-compressor "
                         "ratios alone, which is what the memory and wall targets are)")
    ap.add_argument("--no-scaled-calib", action="store_true",
                    help="skip the quantkit GPTQ run with num_samples x (experts / experts-per-token)")
    ap.add_argument("--depth", default="4,16", help="layer counts for the memory-vs-depth runs")
    ap.add_argument("--no-depth", action="store_true", help="skip the memory-vs-depth runs")
    ap.add_argument("--depth-llmc", action="store_true", help="also measure llm-compressor's peak RSS at those depths")
    ap.add_argument("--depth-hidden", type=int, default=256)
    ap.add_argument("--depth-experts", type=int, default=32)
    ap.add_argument("--depth-moe-inter", type=int, default=256)
    ap.add_argument("--random", metavar="LAYERS,HIDDEN,EXPERTS,MOE_INTER", default=None,
                    help="benchmark a random-weight checkpoint of --model's architecture at this size instead "
                         "(e.g. 6,1024,32,256 for the DeepSeek-V3-layout model of docs/benchmarks.md with "
                         "--model tiny:kimi-k2.6): a router near uniform, where few-token Hessians mislead")
    ap.add_argument("--out", type=Path, default=None, help="work folder, kept (default: a temporary one, removed)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    ap.add_argument("--figure", type=Path, default=None, metavar="PNG",
                    help="also draw each tool's resident memory over its run (plot_rss) into PNG")
    ap.add_argument("--plot", type=Path, default=None, metavar="RESULTS_JSON",
                    help="draw --figure from an earlier run's results.json and exit (runs nothing)")
    args = ap.parse_args(argv)
    if args.plot:
        if not args.figure:
            ap.error("--plot needs --figure PNG")
        plot_rss(json.loads(args.plot.read_text()), args.figure)
        return 0

    import torch

    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.inputs.modelspec import is_tiny, resolve
    from quantkit.recipe import default_recipe, load_recipe, recipe_overrides
    from quantkit.synthetic.tiny import batches

    if args.out and args.out.exists() and any(args.out.iterdir()):
        ap.error(f"--out {args.out}: not empty")
    work = args.out or Path(tempfile.mkdtemp(prefix="quantkit-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
        torch.set_num_threads(args.threads)

    def say(*a):
        print(*a, file=sys.stderr, flush=True)

    res: dict = {"machine": machine(), "model": args.model, "group_size": args.group_size, "threads": args.threads or "default",
                 "eval": f"corpus seed {EVAL_SEED}, {args.eval_samples}x{args.eval_seq_len}", "runs": {}}
    src = resolve(args.model)  # builds a tiny model once, outside any timing
    if args.random:
        L, H, E, I = (int(v) for v in args.random.split(","))
        size = argparse.Namespace(**{**vars(args), "depth_hidden": H, "depth_experts": E, "depth_moe_inter": I})
        src = random_checkpoint(work / "random-source", src, L, size)
        res["model"] = f"random {args.model} architecture, {L} layers, hidden {H}, {E} experts, moe_inter {I}"
    arch = Checkpoint(src).arch
    res["model_type"] = arch.model_type
    family_recipe = {"glm": "tiny-glm-5.2", "kimi": "tiny-kimi-k2.6"}.get(arch.family, "tiny-glm-5.2")
    recipe = args.recipe or (None if is_tiny(args.model) else family_recipe)
    rec = load_recipe(recipe) if recipe else default_recipe(args.model, arch)
    rec = recipe_overrides(rec, group_size=args.group_size, num_samples=args.num_samples, seq_len=args.seq_len,
                           calib="synthetic:train")
    tokens = calibration_tokens(rec, src)
    res["calibration"] = f"{tokens.spec} {tokens.ids.shape[0]}x{tokens.ids.shape[1]}"
    ids_path = work / "calib-ids.pt"
    torch.save(tokens.ids, ids_path)

    def llmc(key: str, model: Path, all_experts: bool) -> dict:
        spec = {"model": str(model), "out": str(work / key), "ids": str(ids_path), "group_size": args.group_size,
                "block_size": rec.gptq.block_size, "dampening": rec.gptq.dampening, "actorder": rec.gptq.actorder,
                "dtype": args.llmc_dtype, "all_experts": all_experts}
        return measured([sys.executable, str(Path(__file__).resolve()), "_llmc", json.dumps(spec)], logs / f"{key}.log", env=env)

    # 1-2. quantkit, same calibration; 3. llm-compressor on a dequantized copy of the same weights
    scale = arch.n_routed_experts // arch.num_experts_per_tok
    methods = ["gptq"] + [m for m in args.methods.split(",") if m in ("awq", "rtn")]
    runs = [(f"qk-{m}", m, args.num_samples) for m in methods]
    if not args.no_scaled_calib:
        runs.append(("qk-gptq-scaled", "gptq", args.num_samples * scale))
    for key, method, n in runs:
        say(f"{key} ...")
        a = argparse.Namespace(**{**vars(args), "num_samples": n})
        res["runs"][key] = quantkit_convert(src, work / key, method, a, recipe, logs, env)
        say(f"  {res['runs'][key]['wall_s']:.1f} s")
    sha = res["runs"]["qk-gptq"]["report"]["calibration"]["sha256"]
    if sha != tokens.sha256:
        raise RuntimeError(f"calibration ids differ: quantkit used {sha}, llm-compressor gets {tokens.sha256}")

    say("dequantized copy for llm-compressor ...")
    ref = reference_copy(src, work / f"ref-{args.llmc_dtype}", args.llmc_dtype)
    variants = {"llmc": True} | ({} if args.no_llmc_routed else {"llmc-routed": False})
    for key, all_experts in variants.items():
        say(f"{key} ...")
        res["runs"][key] = llmc(key, ref, all_experts)
        say(f"  {res['runs'][key]['wall_s']:.1f} s")

    # floors: what importing the libraries alone costs (RSS, seconds)
    res["runs"]["floor-torch"] = measured([sys.executable, "-c", "import torch"], logs / "floor-torch.log", env=env)
    res["runs"]["floor-llmc"] = measured([sys.executable, "-c", "import llmcompressor, transformers, datasets"],
                                         logs / "floor-llmc.log", env=env)

    # quality: every folder's log-probs once, then KL against the source and against the copy
    say("quality ...")
    ids = batches(args.eval_samples, args.eval_seq_len, EVAL_SEED)
    qk_keys = [k for k, _, _ in runs]
    for k in qk_keys:
        splice_experts(ref, work / k / "decode", work / f"{k}-spliced")
    lp = {"src": log_probs(src, ids), "ref": log_probs(ref, ids)}
    for k in qk_keys:
        lp[k] = log_probs(work / k / "decode", ids)
        lp[k + "-spliced"] = log_probs(work / f"{k}-spliced", ids)
    for k in variants:
        lp[k] = log_probs(work / k, ids)
    res["quality"] = {
        "vs_source": {k: compare(lp["src"], lp[k]) for k in ["ref", *qk_keys, *variants]},
        "experts_only": {**{k: compare(lp["ref"], lp[k + "-spliced"]) for k in qk_keys},
                         **{k: compare(lp["ref"], lp[k]) for k in variants}},
    }
    del lp
    G = args.group_size
    res["labels"] = {
        "qk-gptq": f"quantkit GPTQ g{G} (decode)",
        **({"qk-rtn": f"quantkit RTN g{G} (decode)"} if "qk-rtn" in qk_keys else {}),
        **({"qk-awq": f"quantkit AWQ+GPTQ g{G} (decode)"} if "qk-awq" in qk_keys else {}),
        **({"qk-gptq-scaled": f"quantkit GPTQ g{G}, {scale}x calib samples"} if "qk-gptq-scaled" in qk_keys else {}),
        "llmc": f"llm-compressor GPTQ g{G} (all-experts calib)",
        **({"llmc-routed": f"llm-compressor GPTQ g{G} (routed-only calib)"} if "llmc-routed" in variants else {}),
        "ref": f"dequantized {args.llmc_dtype} copy (no quant)",
        "floor-torch": "floor: python -c 'import torch'",
        "floor-llmc": "floor: import llmcompressor, transformers",
    }

    res["matmul"] = matmul_rate(args.threads or torch.get_num_threads())
    res["arithmetic"] = arithmetic(res["runs"]["qk-gptq"], res["matmul"])
    qk, lc = res["runs"]["qk-gptq"], res["runs"]["llmc"]
    qs, qe = res["quality"]["vs_source"], res["quality"]["experts_only"]
    floor = res["runs"]["floor-torch"]["peak_rss_bytes"]
    res["ratios"] = {
        "wall time": _ratio(qk["wall_s"] / lc["wall_s"], TARGETS["wall"]),
        "CPU time": _ratio(qk["cpu_s"] / lc["cpu_s"]),
        "peak RSS": _ratio(qk["peak_rss_bytes"] / lc["peak_rss_bytes"], TARGETS["rss"]),
        "peak RSS above the import-torch floor": _ratio((qk["peak_rss_bytes"] - floor) / (lc["peak_rss_bytes"] - floor)),
        "KL vs source": _ratio(qs["qk-gptq"]["kl"] / qs["llmc"]["kl"], TARGETS["kl"]),
        "KL experts-only": _ratio(qe["qk-gptq"]["kl"] / qe["llmc"]["kl"], TARGETS["kl"]) | paired(qe["qk-gptq"], qe["llmc"]),
    }
    if "qk-awq" in qk_keys:
        res["ratios"]["KL experts-only, quantkit AWQ"] = (
            _ratio(qe["qk-awq"]["kl"] / qe["llmc"]["kl"], TARGETS["kl"]) | paired(qe["qk-awq"], qe["llmc"]))
        res["ratios"]["wall time, quantkit AWQ"] = _ratio(res["runs"]["qk-awq"]["wall_s"] / lc["wall_s"], TARGETS["wall"])
    if "llmc-routed" in variants:
        res["ratios"]["KL experts-only vs llm-compressor routed-only"] = (
            _ratio(qe["qk-gptq"]["kl"] / qe["llmc-routed"]["kl"]) | paired(qe["qk-gptq"], qe["llmc-routed"]))
    if "qk-gptq-scaled" in qk_keys:
        res["ratios"][f"KL experts-only, quantkit at {scale}x samples"] = (
            _ratio(qe["qk-gptq-scaled"]["kl"] / qe["llmc"]["kl"]) | paired(qe["qk-gptq-scaled"], qe["llmc"]))

    # 4. memory vs depth
    if not args.no_depth:
        depths = [int(x) for x in args.depth.split(",")]
        d = {"model_type": None, "shape": f"hidden {args.depth_hidden}, {args.depth_experts} experts x {args.depth_moe_inter}",
             "label": f"{depths[-1]}/{depths[0]} layers", "runs": {"quantkit": []} | ({"llm-compressor": []} if args.depth_llmc else {})}
        for L in depths:
            say(f"depth {L}: random checkpoint ...")
            folder = random_checkpoint(work / f"rand-{L}", src, L, args)
            d["model_type"] = Checkpoint(folder).arch.model_type
            size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**20
            say(f"depth {L}: quantkit gptq ...")
            m = quantkit_convert(folder, work / f"qk-depth-{L}", "gptq", args, recipe or family_recipe, logs, env)
            d["runs"]["quantkit"].append({"layers": L, "source_mb": size, **m})
            shutil.rmtree(work / f"qk-depth-{L}", ignore_errors=True)
            if args.depth_llmc:
                say(f"depth {L}: llm-compressor ...")
                m = llmc(f"llmc-depth-{L}", folder, True)
                d["runs"]["llm-compressor"].append({"layers": L, "source_mb": size, **m})
                shutil.rmtree(work / f"llmc-depth-{L}", ignore_errors=True)
            shutil.rmtree(folder, ignore_errors=True)
        d["ratios"] = {tool: _ratio(rows[-1]["peak_rss_bytes"] / rows[0]["peak_rss_bytes"],
                                    TARGETS["depth_rss"] if tool == "quantkit" else None) for tool, rows in d["runs"].items()}
        res["depth"] = d

    res["machine"]["loadavg_end"] = os.getloadavg()
    res["table"] = render(res)
    (work / "results.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    if args.figure:
        plot_rss(res, args.figure)
    if args.json:
        print(json.dumps(res, indent=2, default=str))
    else:
        print(res["table"])
        la, lb = res["machine"]["loadavg_start"], res["machine"]["loadavg_end"]
        print(f"\nload average (1 min) at start {la[0]:.2f}, at end {lb[0]:.2f}; work folder {work}"
              + ("" if args.out else " (removed)"))
    if args.out is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_llmc":
        llmc_worker(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
