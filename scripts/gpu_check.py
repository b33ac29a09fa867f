#!/usr/bin/env python
"""The GPU check's measurements (scripts/gpu_check.sh installs quantkit, then runs `run`).

    python scripts/gpu_check.py run --out OUT --work WORK     # every step, one summary
    python scripts/gpu_check.py imports --site SITE --out F   # the install's check (gpu_check.sh)

`run` starts each measurement as its own process (`step KIND ...`: its own CUDA context, its own
peak RSS), in this order, and rewrites OUT/summary.json and OUT/summary.md after every step, so a
run stopped at any point still leaves what it measured:

  build      the two models (realshape:glm-5.2, realshape:kimi-k2.6), in parallel, and one recipe
             file per model: the shipped recipe with this check's data sizes (GPTQ; Kimi at group
             128, so that its INT4 g32 experts are re-quantized)
  cpu        the same convert on the CPU (the reference for the byte comparison), started in the
             background with the cores the device steps leave (QK_GPU_CHECK_PARALLEL=0: in turn)
  logits     the source's reference-forward logits on the device vs the CPU
  convert    GPTQ convert on the device with per-phase times (attention, hessians, gptq, guard,
             experts_out, read, fp8, pack, write, finish; exclusive, the device synchronized at each
             boundary), peak device memory (torch.cuda.max_memory_allocated/reserved) and peak host
             RSS, beside convert's own prediction (report["cost"]) and `quantkit plan MODEL
             --convert --gpu h200 --recipe R` (the same cost model from the planner's side)
  validate   validate of that pair on the device, the same measures, beside the planner's
             validate estimate
  gptq       GPTQ alone at real width (GLM 5.2: hidden 6144, moe_intermediate 2048), 64 experts
             with random Hessians, 1, 16 and 64 experts per call: seconds per expert, and whether
             the packed bytes depend on the experts per call (the premise of multi-rank byte equality)
  compare    the device's pair vs the CPU's: every tensor byte for byte by category, decode
             KL(cpu || device) (scripts/gpu_compare.py)
  predict    the full-scale GLM 5.2 / Kimi K2.6 predictions (`quantkit plan glm-5.2 --convert --gpu
             h200`), and the same scaled by this run's measured/predicted time per phase

Environment: QK_GPU_CHECK_DEVICE (cuda; cpu for the rehearsal: every device step on the CPU),
QK_GPU_CHECK_SIZE (full; small: less data and a narrower GPTQ study on the same models; tiny: the
tiny models), QK_GPU_CHECK_MODELS (a space-separated subset of the size's models),
QK_GPU_CHECK_BUDGET_S (seconds for all steps; a step that would start later is skipped and
recorded so). OUT receives summary.json (everything measured), summary.md (the same
for a person), reports.json (convert and validate reports), log.txt (every step's output).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# declared by quantkit (lm_eval: the `eval` extra, for validate --tasks) and not on the GPU machine: this run must not need them
ABSENT = ("compressed_tensors", "llmcompressor", "datasets", "lm_eval")

SIZES = {
    # GLM 5.2's real expert width for the GPTQ study (quantkit/model/presets/glm-5.2.json)
    "full": {"models": ["realshape:glm-5.2", "realshape:kimi-k2.6"], "calib": (4, 256), "validate": (2, 128, 2),
             "gptq": {"hidden": 6144, "inter": 2048, "experts": 64, "chunks": [64, 16, 1], "single": 16, "tokens": 2048},
             # explicit host budgets: the machine's MemAvailable may start below its 128 GB (a microVM
             # whose memory grows with use), and the two CPU converts run beside the device steps
             "budget_s": 420, "host_budget": {"device": "32GB", "cpu": "32GB"}},
    "small": {"models": ["realshape:glm-5.2", "realshape:kimi-k2.6"], "calib": (1, 64), "validate": (1, 32, 1),
              "gptq": {"hidden": 1024, "inter": 256, "experts": 64, "chunks": [64, 16, 1], "single": 16, "tokens": 512},
              "budget_s": 0, "host_budget": {"device": "8GB", "cpu": "8GB"}},
    "tiny": {"models": ["tiny:glm-5.2", "tiny:kimi-k2.6"], "calib": (2, 32), "validate": (1, 16, 1),
             "gptq": {"hidden": 256, "inter": 128, "experts": 16, "chunks": [16, 4, 1], "single": 4, "tokens": 256},
             "budget_s": 0, "host_budget": {"device": None, "cpu": None}},
}
GROUP = {"kimi-k2.6": 128}  # re-quantize Kimi's g32 experts with GPTQ; GLM: its recipe's 128
PRESET = {"glm-5.2": "glm-5.2", "kimi-k2.6": "kimi-k2.6"}


def tag(model: str) -> str:
    """realshape:glm-5.2 -> glm-5.2, tiny:glm-5.2 -> tiny-glm-5.2 (folder and result names)."""
    kind, _, name = model.partition(":")
    return name if kind == "realshape" else f"{kind}-{name}"


def family(model: str) -> str:
    return model.partition(":")[2]


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_json(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def absent_modules() -> list[str]:
    """The declared-but-unneeded packages this process has imported (must stay empty)."""
    return sorted({m.split(".")[0] for m in sys.modules} & set(ABSENT))


# ---- phase timing ------------------------------------------------------------------------------
class PhaseTimer:
    """Exclusive seconds per phase on the main thread: entering a phase pauses the one around it.
    On CUDA the device is synchronized at each boundary, so a phase holds its own kernels."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.stack: list[list] = []  # [phase, started]
        self.main = threading.main_thread().ident
        self.patched: list[str] = []
        self.missing: list[str] = []
        self.bound: set[str] = set()
        self.wanted: set[str] = set()

    def _now(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def wrap(self, phase: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if threading.get_ident() != self.main:
                return fn(*args, **kwargs)
            now = self._now()
            if self.stack:
                outer = self.stack[-1]
                self.seconds[outer[0]] = self.seconds.get(outer[0], 0.0) + now - outer[1]
            self.stack.append([phase, now])
            try:
                return fn(*args, **kwargs)
            finally:
                now = self._now()
                p, started = self.stack.pop()
                self.seconds[p] = self.seconds.get(p, 0.0) + now - started
                self.calls[p] = self.calls.get(p, 0) + 1
                if self.stack:
                    self.stack[-1][1] = now

        return timed

    def patch(self, phase: str, *places: str) -> None:
        """Time `phase` at every binding a caller goes through ("module:attr" or "module:Class.attr");
        the ones that do not exist in this version of quantkit are recorded, never fatal."""
        import importlib

        self.wanted.add(phase)
        for place in places:
            module, _, attr = place.partition(":")
            *owner_path, name = attr.split(".")
            try:
                owner = importlib.import_module(module)
                for part in owner_path:
                    owner = getattr(owner, part)
                fn = getattr(owner, name)
            except (ImportError, AttributeError):
                self.missing.append(place)
                continue
            setattr(owner, name, self.wrap(phase, fn))
            self.patched.append(place)
            self.bound.add(phase)

    def result(self, total: float) -> dict:
        s = {k: round(v, 3) for k, v in sorted(self.seconds.items())}
        s["other"] = round(total - sum(self.seconds.values()), 3)
        return {"seconds": s, "calls": dict(sorted(self.calls.items())), "timed_at": self.patched, "not_found": self.missing,
                "untimed": sorted(self.wanted - self.bound)}  # a phase none of whose bindings exists (in `other`)


# Where convert's and validate's phases are called from. A function imported by name is called
# through the importer's binding, so each is listed where the current layout calls it and where
# the layout before the conversion/validation split (quantkit 0.1, 2026-11) did.
CONVERT_PHASES = {
    "attention": ["quantkit.conversion.stages:attention_pass", "quantkit.conversion.pipeline:attention_pass"],
    "hessians": ["quantkit.quant.methods.gptq:expert_hessians", "quantkit.conversion.layerpass:expert_hessians"],
    # imported inside quant.methods.gptq.gptq_experts at each call (before: by name into conversion.layerpass)
    "gptq": ["quantkit.quant.experts:run_gptq", "quantkit.conversion.layerpass:run_gptq"],
    "guard": ["quantkit.quant.experts:guard_against_rtn"],  # imported inside quant.methods.gptq.gptq_experts at each call
    "experts_out": ["quantkit.conversion.layerpass:add_expert_outputs"],
    "fp8": ["quantkit.formats.fp8:quantize"],
    "pack": ["quantkit.formats.int4:store"],
    "finish": ["quantkit.conversion.pipeline:finish_pair", "quantkit.checkpoint.finish:finish_pair"],
    "read": ["quantkit.checkpoint.reader:Checkpoint.get", "quantkit.checkpoint.reader:Checkpoint.raw"],
    "write": ["quantkit.checkpoint.writer:CheckpointWriter.flush", "quantkit.checkpoint.writer:CheckpointWriter.drain"],
}
VALIDATE_PHASES = {
    "tokens": ["quantkit.inputs.tokens:load_tokens"],  # imported inside validate at each call
    "forward": ["quantkit.validation.pipeline:measure"],
    "write_files": ["quantkit.validation.pipeline:write_files", "quantkit.validation.pipeline:_write"],
    "gates": ["quantkit.validation.pipeline:check_gates"],
}


def timers(device: str, phases: dict[str, list[str]]) -> PhaseTimer:
    t = PhaseTimer(device)
    for phase, places in phases.items():
        t.patch(phase, *places)
    return t


def device_memory(device: str) -> dict:
    if not device.startswith("cuda"):
        return {}
    import torch

    return {"peak_device_allocated": torch.cuda.max_memory_allocated(), "peak_device_reserved": torch.cuda.max_memory_reserved(),
            "device_total": torch.cuda.get_device_properties(0).total_memory}


# ---- the steps (each in its own process) ---------------------------------------------------------
def step_build(a) -> dict:
    """Build (or find) the model, and write the check's recipe for it."""
    import yaml

    from quantkit.inputs.modelspec import open_checkpoint
    from quantkit.recipe import default_recipe, load_recipe, recipe_overrides

    t0 = time.time()
    ckpt = open_checkpoint(a.model)
    folder = ckpt.folder
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    built = time.time() - t0
    s = SIZES[a.size]
    rec = recipe_overrides(default_recipe(a.model, ckpt.arch), method="gptq", group_size=GROUP.get(family(a.model)),
                           num_samples=s["calib"][0], seq_len=s["calib"][1], calib="synthetic:train")
    d = rec.to_dict()
    d["name"] = f"gpu-check-{tag(a.model)}"
    n, T, gen = s["validate"]
    d["validate"].update(dataset="synthetic:heldout", num_samples=n, seq_len=T, gen_tokens=gen)
    path = Path(a.work) / "recipes" / f"{tag(a.model)}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    load_recipe(path)  # valid, as convert will read it
    return {"model": a.model, "folder": str(folder), "bytes": size, "seconds": round(built, 1), "recipe": str(path)}


def recipe_path(a) -> Path:
    return Path(a.work) / "recipes" / f"{tag(a.model)}.yaml"


def _plan(a, device: str, budget: str | None):
    """`quantkit plan MODEL --convert --gpu h200 --recipe R` (--gpu cpu on the CPU)."""
    from quantkit.planner.cost import plan_convert_for

    return plan_convert_for(a.model, recipe=str(recipe_path(a)), gpu="h200" if device.startswith("cuda") else "cpu",
                            max_host_memory=budget)


def step_convert(a) -> dict:
    """GPTQ convert with phase timers; the planner's prediction beside it."""
    import torch

    from quantkit.conversion import pipeline

    device = a.device
    if a.threads:
        torch.set_num_threads(a.threads)
    out = Path(a.work) / "outputs" / f"{tag(a.model)}-{a.which}"
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    timer = timers(device, CONVERT_PHASES)
    t0 = time.time()
    result = pipeline.convert(a.model, out, recipe=str(recipe_path(a)), device=device, validate=False, progress=False,
                              max_host_memory=a.host_budget)
    total = time.time() - t0
    report = result.report
    write_json(out.parent / f"{out.name}.report.json", report)
    cost = report["cost"]
    planned = _plan(a, device, a.host_budget)
    return {"model": a.model, "device": device, "out": str(out), "seconds": round(total, 2), "threads": torch.get_num_threads(),
            "phases": timer.result(total), "peak_rss": peak_rss(), **device_memory(device),
            "layers": report["layers"], "experts_summary": report["experts_summary"],
            "predicted_by_convert": {"seconds": cost["seconds"], "seconds_total": cost["seconds_total"],
                                     "peak_host": cost["peak_host"], "peak_device": cost["peak_device"],
                                     "expert_chunk": cost["expert_chunk"], "store": cost["store"]},
            "predicted_by_plan": {"seconds": planned.seconds, "seconds_total": round(sum(planned.seconds.values()), 1),
                                  "peak_host": planned.peak_host, "peak_device": planned.peak_device,
                                  "expert_chunk": planned.expert_chunk, "gpu_budget": planned.gpu_budget,
                                  "command": f"quantkit plan {a.model} --convert --gpu "
                                             f"{'h200' if device.startswith('cuda') else 'cpu'} --recipe {recipe_path(a)}"},
            "imported_absent": absent_modules()}


def step_validate(a) -> dict:
    import torch

    from quantkit.validation import pipeline

    out = Path(a.work) / "outputs" / f"{tag(a.model)}-device"
    timer = timers(a.device, VALIDATE_PHASES)
    t0 = time.time()
    res = pipeline.validate(out, device=a.device, progress=False, max_host_memory=a.host_budget)
    total = time.time() - t0
    write_json(out.parent / f"{out.name}.validation.json", res.data)
    planned = _plan(a, a.device, a.host_budget)
    rows = {k: {m: v["metrics"].get(m) for m in ("kl", "top1", "layer_rel_err")} for k, v in res.data["rows"].items()}
    return {"model": a.model, "device": a.device, "seconds": round(total, 2), "threads": torch.get_num_threads(),
            "phases": timer.result(total), "peak_rss": peak_rss(), **device_memory(a.device),
            "gates_passed": res.passed, "rows": rows, "weights": res.data.get("weights"),
            "predicted_by_plan": {"seconds": planned.validate_seconds, "share": planned.validate_share,
                                  "kept": planned.validate_kept},
            "imported_absent": absent_modules()}


def step_logits(a) -> dict:
    """The source's reference-forward logits on the device vs the CPU (same ids)."""
    sys.path.insert(0, str(HERE))
    from gpu_compare import kl_stats, probe_ids

    from quantkit.inputs.modelspec import open_checkpoint
    from quantkit.validation.forward import logits

    ckpt = open_checkpoint(a.model)
    ids = probe_ids(ckpt.arch.vocab_size)
    t0 = time.time()
    cpu = logits(ckpt.folder, ids, device="cpu")
    t1 = time.time()
    dev = logits(ckpt.folder, ids, device=a.device).cpu()
    t2 = time.time()
    return {"model": a.model, "device": a.device, "tokens": ids.shape[1], "cpu_seconds": round(t1 - t0, 2),
            "device_seconds": round(t2 - t1, 2), **kl_stats(cpu, dev), "passed": kl_stats(cpu, dev)["kl_mean"] <= 1e-6,
            **device_memory(a.device)}


def step_compare(a) -> dict:
    sys.path.insert(0, str(HERE))
    from gpu_compare import compare_pair

    outs = Path(a.work) / "outputs"
    t0 = time.time()
    r = compare_pair(outs / f"{tag(a.model)}-cpu", outs / f"{tag(a.model)}-device")
    return {"model": a.model, "seconds": round(time.time() - t0, 2), **r}


def _sha(t) -> str:
    import torch

    return hashlib.sha256(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def step_gptq(a) -> dict:
    """GPTQ per expert at real width for several experts per call; bytes per call size."""
    import torch

    from quantkit.formats import int4
    from quantkit.planner.budgets import CPU_FLOPS_PER_THREAD, CPU_GPTQ_EFFICIENCY, GPU_SPECS, LAUNCHES_PER_COLUMN, expert_flops
    from quantkit.quant.gptq import gptq

    s = SIZES[a.size]["gptq"]
    D, I, E, n, G = s["hidden"], s["inter"], s["experts"], s["tokens"], 128
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(0)
    t0 = time.time()
    # weights std 1/sqrt(in); Hessians 2/n X^T X of n Gaussian tokens with a few strong directions
    Wgu = torch.randn(E, 2 * I, D, generator=g, device=dev) * D**-0.5
    Wd = torch.randn(E, D, I, generator=g, device=dev) * I**-0.5

    def hessians(width: int):
        H = torch.empty(E, width, width, device=dev)
        for e in range(E):
            X = torch.randn(n, width, generator=g, device=dev)
            X[:, : width // 16] *= 4.0
            H[e] = (X.T @ X) * (2.0 / n)
        return H

    Hgu, Hd = hessians(D), hessians(I)
    # warm-up: the first call loads the solver libraries and kernels (cuSOLVER, cuBLAS; LAPACK), which
    # would otherwise count against whichever call size runs first
    for W, H in ((Wgu, Hgu), (Wd, Hd)):
        gptq(W[:1].clone(), H[:1].clone(), G, consume=True)
    sync()
    setup = time.time() - t0
    runs, hashes = {}, {}
    for chunk in s["chunks"]:
        count = E if chunk > 1 else min(s["single"], E)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        secs = {"gate_up": 0.0, "down": 0.0}
        hashes[chunk] = []
        for start in range(0, count, chunk):
            sl = slice(start, min(start + chunk, count))
            packed = {}
            for proj, W, H in (("gate_up", Wgu, Hgu), ("down", Wd, Hd)):
                sync()
                t = time.perf_counter()
                # as convert calls it: its own float32 copies, consumed (no other reference keeps H alive)
                packed[proj] = gptq(W[sl].clone(), H[sl].clone(), G, consume=True)
                sync()
                secs[proj] += time.perf_counter() - t
            for j in range(sl.stop - sl.start):
                parts = [v for p in ("gate_up", "down") for v in int4.store(packed[p].q[j], packed[p].scale[j]).values()]
                hashes[chunk].append(hashlib.sha256(b"".join(bytes.fromhex(_sha(t)) for t in parts)).hexdigest()[:16])
            del packed
        per = {k: v / count for k, v in secs.items()}
        runs[str(chunk)] = {"experts": count, "calls": -(-count // chunk), "seconds": {k: round(v, 3) for k, v in secs.items()},
                            "seconds_per_expert": round(sum(per.values()), 4),
                            **({"peak_device_allocated": torch.cuda.max_memory_allocated()} if cuda else {})}
    # the cost model's figure for the same call (quantkit.planner.cost._phase_seconds' gptq terms)
    _, per_expert_flops = expert_flops(D, I)
    if cuda:
        spec = GPU_SPECS["h200"]
        rate, launch = spec["flops"], spec["launch"]
    else:
        rate, launch = CPU_FLOPS_PER_THREAD * torch.get_num_threads() * CPU_GPTQ_EFFICIENCY, 0.0
    for chunk, r in runs.items():
        r["predicted_seconds_per_expert"] = round(per_expert_flops / rate + (D + I) * LAUNCHES_PER_COLUMN * launch / int(chunk), 4)
        r["measured_over_predicted"] = round(r["seconds_per_expert"] / max(r["predicted_seconds_per_expert"], 1e-12), 3)
    fit = _fit_gptq(runs, per_expert_flops, D + I)
    first = min(len(h) for h in hashes.values())
    ref = hashes[max(s["chunks"])]
    same = {str(c): h == ref[: len(h)] for c, h in hashes.items()}
    differ = {str(c): [j for j, (x, y) in enumerate(zip(h, ref)) if x != y][:8] for c, h in hashes.items()}
    return {"device": str(dev), "hidden": D, "moe_intermediate": I, "experts": E, "tokens_per_hessian": n, "group_size": G,
            "setup_seconds": round(setup, 2), "per_call": runs, "fit": fit, "matmul_flops": matmul_rate(dev),
            "cost_model": {"gptq_flops": rate, "launch_s": launch, "launches_per_column": LAUNCHES_PER_COLUMN},
            "bytes_independent_of_chunk": all(same.values()),
            "bytes_same_as_largest_chunk": same, "differing_experts": differ, "experts_compared_at_every_chunk": first,
            "threads": torch.get_num_threads()}


def _fit_gptq(runs: dict, per_expert_flops: float, columns: int) -> dict:
    """seconds per expert = F + L / (experts per call), least squares over the call sizes: F is the
    per-expert work (implied GPTQ FLOP/s = its FLOPs / F), L the per-call cost (the column loop's
    launches: implied seconds per launch = L / (columns x LAUNCHES_PER_COLUMN))."""
    from quantkit.planner.budgets import LAUNCHES_PER_COLUMN

    xs = [1.0 / int(c) for c in runs]
    ys = [r["seconds_per_expert"] for r in runs.values()]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    L = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if n > 1 and var else 0.0
    F = my - L * mx
    return {"per_expert_s": round(F, 5), "per_call_s": round(L, 5),
            "implied_gptq_flops": per_expert_flops / F if F > 0 else None,
            "implied_launch_s": L / (columns * LAUNCHES_PER_COLUMN) if L > 0 else None}


def matmul_rate(dev) -> float:
    """Sustained float32 matmul FLOP/s on `dev` at the Hessians' and experts' shapes (no TF32)."""
    import torch

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    best = 0.0
    for m, k, n in ((2048, 6144, 2048), (6144, 4096, 6144)):
        x, y = torch.randn(m, k, device=dev), torch.randn(k, n, device=dev)
        x @ y
        sync()
        reps = 10 if dev.type == "cuda" else 1
        t = time.perf_counter()
        for _ in range(reps):
            x @ y
        sync()
        best = max(best, reps * 2 * m * k * n / (time.perf_counter() - t))
    return best


def step_predict(a) -> dict:
    """Full-scale predictions, and the same scaled by this run's measured/predicted per phase."""
    from quantkit.planner.cost import plan_convert_for

    results = Path(a.work) / "results"
    device = a.device
    gpu = "h200" if device.startswith("cuda") else "cpu"
    out = {}
    for model in os.environ.get("QK_GPU_CHECK_MODELS", "").split() or SIZES[a.size]["models"]:
        preset = PRESET.get(family(model))
        f = results / f"convert-{tag(model)}.json"
        if preset is None or not f.is_file():
            continue
        measured = json.loads(f.read_text())
        pred = measured["predicted_by_convert"]["seconds"]
        got = measured["phases"]["seconds"]
        # measured phases as the cost model names them (gptq includes the guard; read/write as timed)
        m = {"attention": got.get("attention", 0), "hessians": got.get("hessians", 0),
             "gptq": got.get("gptq", 0) + got.get("guard", 0), "experts_out": got.get("experts_out", 0)}
        ratios = {k: round(v / pred[k], 3) for k, v in m.items() if pred.get(k)}
        full = plan_convert_for(preset, gpu=gpu, max_host_memory="1TB")
        scaled = {k: v * ratios.get(k, 1.0) for k, v in full.seconds.items()}
        out[preset] = {"command": f"quantkit plan {preset} --convert --gpu {gpu} --max-host-memory 1TB",
                       "predicted_seconds": full.seconds, "predicted_total_s": round(sum(full.seconds.values()), 1),
                       "peak_device": full.peak_device, "peak_host": full.peak_host,
                       "measured_over_predicted_per_phase": ratios,
                       "scaled_total_s": round(sum(scaled.values()), 1),
                       "validate_predicted_s": full.validate_seconds}
    return {"models": out}


STEPS = {"build": step_build, "convert": step_convert, "validate": step_validate, "logits": step_logits,
         "compare": step_compare, "gptq": step_gptq, "predict": step_predict}


def run_step(a) -> None:
    t0 = time.time()
    result = STEPS[a.kind](a)
    result["step_seconds"] = round(time.time() - t0, 2)
    result.setdefault("peak_rss", peak_rss())
    write_json(Path(a.result), result)


# ---- the orchestrator ----------------------------------------------------------------------------
class Run:
    """Starts the steps, streams their output into OUT/log.txt, keeps OUT/summary.json current."""

    def __init__(self, out: Path, work: Path, device: str, size: str, budget: float, parallel: bool, install_s: float):
        self.out, self.work, self.device, self.size = out, work, device, size
        self.t0 = time.time()
        self.deadline = self.t0 + budget if budget > 0 else float("inf")
        self.parallel = parallel
        (work / "results").mkdir(parents=True, exist_ok=True)
        self.log = open(out / "log.txt", "a", buffering=1)
        self.lock = threading.Lock()
        self.steps: dict[str, dict] = {}
        self.summary = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": device, "size": size,
                        "install_seconds": install_s, "budget_s": budget, "steps": self.steps}

    def say(self, name: str, line: str) -> None:
        with self.lock:
            self.log.write(f"[{time.time() - self.t0:7.1f}s {name}] {line.rstrip()}\n")

    def start(self, name: str, kind: str, model: str | None = None, device: str | None = None, threads: int = 0,
              host_budget: str | None = None, which: str = "device"):
        result = self.work / "results" / f"{name}.json"
        result.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "step", kind, "--work", str(self.work), "--size", self.size,
               "--device", device or self.device, "--result", str(result), "--which", which]
        if model:
            cmd += ["--model", model]
        if threads:
            cmd += ["--threads", str(threads)]
        if host_budget:
            cmd += ["--host-budget", host_budget]
        env = dict(os.environ)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self.say(name, "$ " + " ".join(cmd[1:]))
        # its own process group (killed whole at the time budget), in this session (so that whatever
        # ends this run ends the steps too)
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             preexec_fn=os.setpgrp)
        reader = threading.Thread(target=lambda: [self.say(name, ln) for ln in p.stdout], daemon=True)
        reader.start()
        self.steps[name] = {"status": "running"}
        return {"name": name, "proc": p, "reader": reader, "result": result, "t0": time.time()}

    def wait(self, job) -> dict:
        name, p = job["name"], job["proc"]
        left = self.deadline - time.time()
        timeout = None if left == float("inf") else max(1.0, left)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            rc = p.wait()
            self.say(name, f"killed after {time.time() - job['t0']:.0f} s (the check's time budget)")
        job["reader"].join(timeout=10)
        entry = {"status": "ok" if rc == 0 else f"failed (exit {rc})", "wall_s": round(time.time() - job["t0"], 2)}
        if rc == 0 and job["result"].is_file():
            entry["result"] = json.loads(job["result"].read_text())
        self.steps[name] = entry
        self.flush()
        return entry

    def run(self, name: str, kind: str, need: float = 5.0, **kw) -> dict:
        if time.time() + need > self.deadline:
            self.steps[name] = {"status": "skipped: the check's time budget was spent"}
            self.flush()
            return self.steps[name]
        return self.wait(self.start(name, kind, **kw))

    def flush(self) -> None:
        self.summary["seconds"] = round(time.time() - self.t0, 1)
        self.summary.update(verdict(self.steps))
        write_json(self.out / "summary.json", self.summary)
        try:  # a person's view; summary.json above is the record, and never waits on this
            text = render(self.summary)
        except Exception as e:
            text = f"# GPU check: summary.md could not be rendered ({type(e).__name__}: {e}); see summary.json\n"
        (self.out / "summary.md").write_text(text)


def verdict(steps: dict) -> dict:
    """passed: every CUDA-vs-CPU comparison ran and held; findings: what the other steps say."""
    problems = []
    for name, s in steps.items():
        r = s.get("result") or {}
        if name.startswith(("logits-", "compare-")):
            if s.get("status") != "ok":
                problems.append(f"{name}: {s.get('status')}")
            elif not r.get("passed"):
                problems.append(f"{name}: " + ("; ".join(r.get("problems", [])) or f"KL {r.get('kl_mean')}"))
        elif s.get("status") not in ("ok", "running") and not name.startswith("cpu-"):
            problems.append(f"{name}: {s.get('status')}")
        for m in r.get("imported_absent") or []:
            problems.append(f"{name}: imported {m}, which the GPU machine lacks")
    g = (steps.get("gptq") or {}).get("result") or {}
    findings = {}
    if g:
        findings["gptq_bytes_independent_of_experts_per_call"] = g.get("bytes_independent_of_chunk")
        findings["gptq_seconds_per_expert"] = {c: r["seconds_per_expert"] for c, r in g.get("per_call", {}).items()}
    return {"passed": not problems, "problems": problems, "findings": findings}


def _gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def render(s: dict) -> str:
    """summary.md: the numbers a person reads first."""
    lines = [f"# GPU check: {'PASSED' if s.get('passed') else 'FAILED'} ({s['device']}, size {s['size']}, "
             f"{s.get('seconds', 0):.0f} s after a {s.get('install_seconds', 0):.0f} s install, started {s['started']})", ""]
    lines += [f"- problem: {p}" for p in s.get("problems", [])]
    lines += ["", "| step | status | wall s |", "|---|---|---:|"]
    lines += [f"| {n} | {v.get('status')} | {v.get('wall_s', '')} |" for n, v in s["steps"].items()]
    for n, v in s["steps"].items():
        r = v.get("result") or {}
        if not r:
            continue
        if n.startswith("logits-"):
            lines.append(f"\n{n}: source logits, device vs CPU: KL {r['kl_mean']:.2e} (max {r['kl_max']:.2e}), "
                         f"max |diff| {r['max_abs_diff']:.2e}, top-1 {r['top1_agree']:.3f}, bytes equal {r['bytes_equal']}")
        elif n.startswith("compare-") and "tensors" in r:
            t = {k: {c: f"{x['same']}/{x['same'] + x['differ']}" for c, x in d["categories"].items()} for k, d in r["tensors"].items()}
            lines.append(f"\n{n}: identical tensors (same/all) {t}; decode KL(cpu || device) "
                         f"{r['decode_kl_cpu_vs_device']['kl_mean']:.2e} (bound {r['kl_bound']:.2e}; quantization's "
                         f"KL(source || cpu decode) {r['decode_kl_source_vs_cpu']['kl_mean']:.2e}); "
                         f"problems: {r['problems'] or 'none'}")
        elif n.startswith(("convert-", "validate-")) and r:
            p = r["predicted_by_convert"] if n.startswith("convert-") else r["predicted_by_plan"]
            pred = p.get("seconds_total", p.get("seconds"))
            lines.append(f"\n{n}: {r['seconds']:.1f} s (predicted {pred if pred is None else round(pred, 1)} s); "
                         f"peak host {_gb(r['peak_rss'])} (predicted {_gb(p.get('peak_host'))}); peak device "
                         f"{_gb(r.get('peak_device_allocated'))} allocated, {_gb(r.get('peak_device_reserved'))} reserved "
                         f"(predicted {_gb(p.get('peak_device'))}); phases {r['phases']['seconds']}")
            if n.startswith("convert-"):
                lines.append(f"  predicted phases {p['seconds']}")
        elif n == "gptq" and r:
            lines.append(f"\ngptq at hidden {r['hidden']}, moe_intermediate {r['moe_intermediate']} on {r['device']}: "
                         + "; ".join(f"{c} per call: {x['seconds_per_expert']:.3f} s/expert (predicted "
                                     f"{x['predicted_seconds_per_expert']:.3f})" for c, x in r["per_call"].items())
                         + f"; bytes independent of experts per call: {r['bytes_independent_of_chunk']}; fit "
                         f"{r['fit']}; float32 matmul {r['matmul_flops'] / 1e12:.2f} TFLOP/s (the cost model assumes "
                         f"{r['cost_model']['gptq_flops'] / 1e12:.2f} for GPTQ)")
        elif n == "predict" and r:
            for preset, x in r["models"].items():
                lines.append(f"\n{preset} full scale ({x['command']}): predicted {x['predicted_total_s'] / 3600:.2f} h; "
                             f"scaled by this run's measured/predicted per phase {x['scaled_total_s'] / 3600:.2f} h "
                             f"(ratios {x['measured_over_predicted_per_phase']})")
    return "\n".join(lines) + "\n"


def cmd_run(a) -> None:
    size = SIZES[a.size]
    budget = float(os.environ.get("QK_GPU_CHECK_BUDGET_S", size["budget_s"]))
    device = a.device
    parallel = os.environ.get("QK_GPU_CHECK_PARALLEL", "1" if device.startswith("cuda") else "0") == "1"
    work, out = Path(a.work), Path(a.out)
    os.environ.setdefault("QUANTKIT_CACHE", str(work / "cache"))  # built here, never an old cache's models
    r = Run(out, work, device, a.size, budget, parallel, a.install_seconds)
    models = os.environ.get("QK_GPU_CHECK_MODELS", "").split() or size["models"]  # e.g. "realshape:glm-5.2" alone
    hb = size["host_budget"]
    cores = os.cpu_count() or 1
    builds = [r.start(f"build-{tag(m)}", "build", model=m, device="cpu") for m in models]
    r.flush()  # a summary from the first second on
    for b in builds:
        r.wait(b)
    ready = [m for m in models if r.steps[f"build-{tag(m)}"]["status"] == "ok"]
    # the CPU reference converts: beside the device steps with the cores they leave, or in turn
    cpu_threads = max(1, (cores - 4) // len(ready)) if parallel and ready else 0
    cpu_jobs = {}
    if parallel:
        cpu_jobs = {m: r.start(f"cpu-{tag(m)}", "convert", model=m, device="cpu", threads=cpu_threads,
                               host_budget=hb["cpu"], which="cpu") for m in ready}
    for m in ready:
        r.run(f"logits-{tag(m)}", "logits", model=m)
        r.run(f"convert-{tag(m)}", "convert", model=m, host_budget=hb["device"], need=20)
        if r.steps[f"convert-{tag(m)}"]["status"] == "ok":
            r.run(f"validate-{tag(m)}", "validate", model=m, host_budget=hb["device"], need=20)
    r.run("gptq", "gptq", need=30)
    for m in ready:
        if m in cpu_jobs:
            r.wait(cpu_jobs[m])
        elif r.steps[f"convert-{tag(m)}"]["status"] == "ok":  # nothing to compare with otherwise
            r.run(f"cpu-{tag(m)}", "convert", model=m, device="cpu", host_budget=hb["cpu"], which="cpu", need=20)
        else:
            r.steps[f"cpu-{tag(m)}"] = {"status": "skipped: the device convert failed"}
        if r.steps[f"cpu-{tag(m)}"]["status"] == "ok" and r.steps[f"convert-{tag(m)}"]["status"] == "ok":
            r.run(f"compare-{tag(m)}", "compare", model=m, device="cpu", need=10)
        else:
            r.steps[f"compare-{tag(m)}"] = {"status": "skipped: a convert failed or was not run"}
    r.run("predict", "predict", device=device, need=3)
    reports = {}
    for f in sorted((work / "outputs").glob("*.json")):
        reports[f.name] = json.loads(f.read_text())
    write_json(out / "reports.json", reports)
    r.flush()
    r.log.close()
    print((out / "summary.md").read_text())
    sys.exit(0 if r.summary["passed"] else 1)


def cmd_imports(a) -> None:
    """After the install: quantkit comes from SITE, every module the run uses imports, the declared
    but unneeded packages are absent; the machine's versions into a JSON file."""
    import importlib
    import importlib.metadata as md
    import importlib.util
    import platform

    import quantkit

    here = Path(quantkit.__file__).resolve()
    if not here.is_relative_to(Path(a.site).resolve()):
        sys.exit(f"quantkit imports from {here}, not from the install in {a.site}")
    modules = ["quantkit.cli", "quantkit.conversion.pipeline", "quantkit.validation.pipeline", "quantkit.synthetic.realshape",
               "quantkit.synthetic.tiny", "quantkit.quant.gptq", "quantkit.planner.cost", "quantkit.validation.forward",
               "quantkit.recipe", "matplotlib.pyplot"]
    for m in modules:
        importlib.import_module(m)
    from quantkit.recipe import load_recipe

    load_recipe("glm-5.2")  # recipes ship with the package (package data)
    import torch

    versions = {}
    for p in ("torch", "transformers", "safetensors", "huggingface-hub", "typer", "rich", "pyyaml", "tokenizers",
              "matplotlib", "numpy", "pydantic", "pydantic-core", "setuptools", *ABSENT):
        try:
            versions[p] = md.version(p)
        except md.PackageNotFoundError:
            versions[p] = None
    env = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
           "cpus": os.cpu_count(), "quantkit": str(here.parent), "versions": versions,
           "absent": {m: importlib.util.find_spec(m) is None for m in ABSENT}, "imported_absent": absent_modules(),
           "torch_threads": torch.get_num_threads(), "cuda_available": torch.cuda.is_available(),
           "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "float32_matmul_precision": torch.get_float32_matmul_precision(),
           "cuda": torch.version.cuda, "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "pydantic_from": str(Path(importlib.import_module("pydantic").__file__).parent)}
    if os.environ.get("QK_GPU_CHECK_DEVICE", "cuda").startswith("cuda") and not env["cuda_available"]:
        write_json(Path(a.out), env)
        sys.exit("torch sees no CUDA device (QK_GPU_CHECK_DEVICE=cpu rehearses the check on the CPU)")
    if env["imported_absent"]:
        sys.exit(f"importing quantkit's modules imported {env['imported_absent']}, which the GPU machine lacks")
    write_json(Path(a.out), env)
    print(f"imports ok: python {env['python']}, torch {versions['torch']}, cuda {env['cuda']}, "
          f"device {env['device_name']}, absent {[m for m, gone in env['absent'].items() if gone]}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    device = os.environ.get("QK_GPU_CHECK_DEVICE", "cuda")
    size = os.environ.get("QK_GPU_CHECK_SIZE", "full")
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--work", required=True)
    r.add_argument("--install-seconds", type=float, default=0.0)
    r.set_defaults(device=device, size=size, fn=cmd_run)
    i = sub.add_parser("imports")
    i.add_argument("--site", required=True)
    i.add_argument("--out", required=True)
    i.set_defaults(fn=cmd_imports)
    s = sub.add_parser("step")
    s.add_argument("kind", choices=sorted(STEPS))
    s.add_argument("--work", required=True)
    s.add_argument("--result", required=True)
    s.add_argument("--model")
    s.add_argument("--device", default=device)
    s.add_argument("--size", default=size, choices=sorted(SIZES))
    s.add_argument("--threads", type=int, default=0)
    s.add_argument("--host-budget")
    s.add_argument("--which", default="device")
    s.set_defaults(fn=run_step)
    a = ap.parse_args(argv)
    if a.cmd == "run" and a.size not in SIZES:
        sys.exit(f"QK_GPU_CHECK_SIZE={a.size}: one of {', '.join(SIZES)}")
    a.fn(a)


if __name__ == "__main__":
    main()
