"""What convert tells: convert-report.json (what went in, what each tensor and expert became, the
outputs' sizes and digests, the plan, the ranks' shares) and ConvertResult, its table for a
terminal or a notebook.

The report is built last, once both manifests exist (quantkit.checkpoint.finish), so that it can
state their digests: a pair is complete exactly when its report is there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from quantkit import __version__
from quantkit.checkpoint.reader import Checkpoint
from quantkit.conversion.job import Job
from quantkit.conversion.kvscales import kv_cache_report
from quantkit.conversion.resume import State
from quantkit.planner.precision import PASS, precision_summary
from quantkit.quant.experts import MTP_FALLBACKS, ExpertRecord, fallback_words
from quantkit.quant.methods import METHODS, Method
from quantkit.runtime.files import file_sha256
from quantkit.runtime.machine import peak_rss
from quantkit.runtime.progress import rich_html
from quantkit.runtime.units import decimal_bytes

if TYPE_CHECKING:
    from quantkit.runtime.distributed import Group


@dataclass
class ConvertResult:
    """What `convert` made; `report` is convert-report.json."""

    out: Path
    prefill: Path
    decode: Path
    report: dict[str, Any]
    validation: Any = None  # quantkit.validation.pipeline.ValidationResult when convert ran validate
    rank: int = 0  # a multi-rank convert's other ranks (> 0) return an empty report: rank 0 has the real one

    @property
    def method(self) -> str:
        return self.report["method"]

    @property
    def experts(self) -> dict[str, int]:
        """The routed experts' counts by method and outcome (the report's `experts_summary`)."""
        return self.report["experts_summary"]

    @property
    def prefill_bytes(self) -> int:
        return self.report["outputs"]["prefill"]["bytes"]

    @property
    def decode_bytes(self) -> int:
        return self.report["outputs"]["decode"]["bytes"]

    @property
    def seconds(self) -> float:
        return self.report["seconds"]

    def to_json(self) -> dict[str, Any]:
        return self.report

    def table(self):
        from rich.table import Table

        r = self.report
        t = Table(title=f"quantkit convert: {r['source']['spec']} -> {self.out}")
        t.add_column("")
        t.add_column("prefill")
        t.add_column("decode")
        for cls in sorted(set(r["outputs"]["prefill"]["precision"]) | set(r["outputs"]["decode"]["precision"])):
            t.add_row(cls, r["outputs"]["prefill"]["precision"].get(cls, ""), r["outputs"]["decode"]["precision"].get(cls, ""))
        t.add_row("size", _gb(r["outputs"]["prefill"]["bytes"]), _gb(r["outputs"]["decode"]["bytes"]), style="bold")
        e = r["experts_summary"]
        t.caption = (
            f"{e['total']} routed experts: {made_by(e)}; {e['fallbacks']} fallbacks; "
            f"{r['seconds']:.1f}s, peak RSS {_gb(r['peak_rss_bytes'])}"
        )
        return t

    def _repr_html_(self) -> str:
        return rich_html(self.table())


def _gb(n: int) -> str:
    return decimal_bytes(n, digits=3)


def made_by(summary: dict) -> str:
    """'16 GPTQ, 2 RTN, 48 reused': the experts' counts by method (display names), those present."""
    return ", ".join(f"{summary[m]} {METHODS[m].display if m in METHODS else m}" for m in (*METHODS, "reused")
                     if summary.get(m))


def expert_entry(r: ExpertRecord, method: Method) -> dict:
    """An expert's report entry; `rank` (who quantized it) only in a multi-rank convert. `decision`
    and `why` say in words what the record's fields say: whether the stored weights are the
    calibrated ones, a fallback, data-free or reused, and what decided it (method: the run's, whose own
    options may add words: Method.record_words)."""
    entry = {k: v for k, v in vars(r).items() if k != "rank" or v is not None}
    return entry | dict(zip(("decision", "why"), decision(entry, method)))


# What an expert's stored weights are, in the report's `decision`.
Decision = Literal["calibrated", "fallback", "data-free", "reused"]


def decision(e: dict, method: Method | None = None) -> tuple[Decision, str]:
    """(calibrated | fallback | data-free | reused, why) for an expert's report entry.

    fallback: the expert was starved (too few routed calibration tokens for its own Hessian, so
    gptq.fallback applied: RTN, or a fit on every token of the layer), or the held-out guard found
    RTN's output error no higher than the calibrated weights' and stored RTN."""
    held = f"on {e.get('heldout', 0)} held-out tokens"
    probe = method.record_words(e) if method is not None else ""
    if e["method"] == "reused":
        return "reused", "the source's INT4 weights, bit for bit"
    starved = f"starved: {e['tokens']} routed calibration tokens, below gptq.min_tokens; "
    if e.get("fallback") == "rtn":
        return "fallback", starved + "rounded to nearest"
    if e.get("guard") == "rtn":
        lead = starved + "fitted on every calibration token of the layer, then " if e.get("fallback") == "all_tokens" else ""
        return "fallback", f"{lead}guard: RTN's output error {e['err_rtn']:.4g} <= the calibrated {e['err']:.4g} {held}{probe}"
    if e.get("fallback") == "all_tokens":
        judged = f"; output error {e['err']:.4g} < RTN's {e['err_rtn']:.4g} {held}" if e.get("err") is not None else ""
        return "fallback", starved + f"fitted on every calibration token of the layer{judged}{probe}"
    if e.get("fallback"):
        return "fallback", fallback_words(e["fallback"], e["method"])
    stored = METHODS.get(e["method"])
    if stored is None or not stored.calibrated:
        return "data-free", f"method {e['method']}"
    if e.get("err") is not None and e.get("err_rtn") is not None:
        kept = stored.kept_words(e.get("guard"))  # the method's words for an alternative it stored
        return "calibrated", f"output error {e['err']:.4g} < RTN's {e['err_rtn']:.4g} {held}{kept}{probe}"
    return "calibrated", "not judged (no held-out tokens)"


def reason(e: dict) -> str:
    """The short name of why an expert's report entry holds what it stores, for counting (the card's
    coverage table): the `decision` with the one cause that decided it, without its numbers."""
    d = decision(e)[0]
    if d in ("reused", "data-free"):
        return d
    if e.get("fallback") == "rtn":
        return "starved, rounded to nearest"
    if e.get("fallback") == "all_tokens":
        return "starved, then guard kept RTN" if e.get("guard") == "rtn" else "starved, fitted on the layer's tokens"
    if e.get("guard") == "rtn":
        return "guard kept RTN"
    if d == "fallback":
        return decision(e)[1]
    if e.get("err") is None:
        return "calibrated, not judged"
    return f"calibrated ({e['guard']})" if e.get("guard") else "calibrated"


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile of `values` with linear interpolation between order statistics (numpy's
    default), so a layer's p10 and median read the same whatever the expert count."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _calibration_fed(e: dict) -> bool:
    """Whether the calibration reached this expert's layer for it (its routed tokens, however few)."""
    return reason(e) not in ("reused", "data-free") and e.get("fallback") not in MTP_FALLBACKS


def coverage(experts: list[dict], width: int) -> list[dict]:
    """Per layer: how many routed calibration tokens its experts saw (min, p10, median), the same per
    input column of gate/up (`width` inputs: the evidence one expert's Hessian has per entry of its
    diagonal), and how many experts fell under each `reason`. An expert reused from the source's
    INT4, made by a data-free method or in an MTP layer without a calibration path saw no
    calibration and is counted only under its reason."""
    out = []
    for layer in sorted({e["layer"] for e in experts}):
        mine = [e for e in experts if e["layer"] == layer]
        seen = [e["tokens"] for e in mine if _calibration_fed(e)]
        row: dict = {"layer": layer, "experts": len(mine)}
        if seen:
            stats = {"min": min(seen), "p10": _quantile(seen, 0.1), "median": _quantile(seen, 0.5)}
            row["routed_tokens"] = {k: round(v, 1) for k, v in stats.items()}
            row["tokens_per_column"] = {k: round(v / width, 4) for k, v in stats.items()}
            row["under_one_per_column"] = sum(1 for t in seen if t < width)
        reasons: dict[str, int] = {}
        for e in mine:
            reasons[reason(e)] = reasons.get(reason(e), 0) + 1
        row["reasons"] = dict(sorted(reasons.items(), key=lambda kv: -kv[1]))
        out.append(row)
    return out


def source_identity(ckpt: Checkpoint) -> dict[str, str]:
    """sha256 per source file: from the Hub's LFS metadata for a streamed source (git blob id for
    small files), hashed locally otherwise."""
    if ckpt.remote is not None:
        return {name: rf.sha256 or f"git-blob:{rf.blob_id}" for name, rf in sorted(ckpt.remote.files.items())}
    return {p.name: file_sha256(p) for p in sorted(ckpt.folder.iterdir()) if p.is_file()}


def distributed_report(group: Group, state: State, used: list[dict]) -> dict:
    """The job's shape, each rank's share of the experts over all layers, the parts it wrote (this
    run) and its peak RSS (quantkit.runtime.distributed)."""
    if not group.distributed:
        return {"world": 1}
    shares = [lay["ranks"] for lay in state.layers if "ranks" in lay]
    world = max([group.world] + [len(s["experts"]) for s in shares])  # a resumed run may have had more ranks
    experts, tokens, seconds = [0] * world, [0] * world, [0.0] * world
    for share in shares:
        for r, (n, t, sec) in enumerate(zip(share["experts"], share["tokens"], share["seconds"])):
            experts[r] += n
            tokens[r] += t
            seconds[r] += sec
    return {"world": group.world, "backend": group.backend, "experts_per_rank": experts, "tokens_per_rank": tokens,
            "quantize_seconds_per_rank": [round(s, 3) for s in seconds],
            "parts_written_per_rank": [u["parts"] for u in used],
            "peak_rss_bytes_per_rank": [u["peak_rss"] for u in used],
            "redundant": "every rank runs attention, routing and the routed outputs for all calibration tokens, "
                         "and computes every stored tensor; each writes the parts it owns"}


def convert_report(model, job: Job, tokens, source_files: dict[str, str], out: Path, t_start: float,
                   used: list[dict], manifests: dict[str, str] | None = None) -> dict:
    """convert-report.json: the pair's own part, then the KV cache's scales, the plan and the ranks."""
    return (_pair_report(model, job, tokens, source_files, out, t_start, manifests)
            | {"kv_cache": kv_cache_report(job.state.layers, job.arch.definition.attention), "cost": job.cost.to_json(),
               "distributed": distributed_report(job.group, job.state, used),
               "reproducibility": reproducibility(job.dev, used)})


def reproducibility(dev, used: list[dict]) -> dict:
    """What the output bytes depend on besides the inputs (GPTQ's Hessians and the KV scales are
    float sums whose order the BLAS and the thread count decide): the torch build, its BLAS/LAPACK
    as torch reports them, the threads of each rank, the device. A rerun reproduces the bytes only
    with all of these equal (docs/reliability.md)."""
    import platform

    import torch

    config = torch.__config__.show()
    settings = dict(kv.strip().split("=", 1) for kv in config.split("Build settings:", 1)[-1].split(",") if "=" in kv)
    libraries = [line.strip()[2:] for line in config.splitlines()
                 if line.strip().startswith("- ") and any(k in line for k in ("Math Kernel", "OpenBLAS", "BLIS", "MKL-DNN",
                                                                              "OpenMP", "LAPACK", "CPU capability"))]
    return {
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "blas": settings.get("BLAS_INFO"), "lapack": settings.get("LAPACK_INFO"), "libraries": libraries,
        "parallel_backend": next((line.split(":", 1)[1].strip() for line in torch.__config__.parallel_info().splitlines()
                                  if line.startswith("ATen parallel backend")), None),
        "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
        "threads_per_rank": [u.get("threads") for u in used],
        "device": dev.type, "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor(),
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if dev.type == "cuda" else None,
        "must_match": "torch build (version, BLAS/LAPACK), threads per rank, device type and name, ranks (nproc); "
                      "with these equal the bytes are reproduced (docs/reliability.md)",
    }


def mtp_report(ckpt, method: Method, state: State | None = None) -> dict:
    """The MTP layers converted, and those config.json declared that the shards did not hold
    (dropped: the outputs' configs say num_nextn_predict_layers 0, and the cards say so); with the
    state, how the MTP layers' routed experts were made (method counts, fallbacks, guard) and which
    MTP layers were calibrated on their serving inputs (quantkit.conversion.stages.mtp_inputs)."""
    from quantkit.model.arch import NO_MTP

    absent = getattr(ckpt, "absent_mtp_layers", 0)
    out = {"layers": ckpt.arch.num_mtp_layers, "declared_absent": absent, "note": NO_MTP if absent else None}
    if state is None or not ckpt.arch.num_mtp_layers:
        return out
    first = ckpt.arch.num_hidden_layers
    experts = [e for e in state.experts if e["layer"] >= first]
    summary = _experts_summary(experts, method)
    made = made_by(summary)
    return out | {"calibrated_layers": [lay["layer"] for lay in state.layers if lay["kind"] == "mtp" and lay["calibrated"]],
                  "experts": made or "none", "experts_summary": summary,
                  "input": "calibrated on the quantized decode model's last hidden state h_i and the next calibration "
                           "token's embedding, x_i = eh_proj(cat[enorm(embed(t_{i+1})), hnorm(h_i)]) at positions "
                           "0..T-2 (vLLM's deepseek_mtp), then the layer's attention and experts like a main MoE layer"}


def _experts_summary(experts: list[dict], method: Method) -> dict:
    """The experts' counts by method, fallback and guard outcome."""
    counts = {m: sum(1 for e in experts if e["method"] == m) for m in (*METHODS, "reused")}
    fallbacks = [e for e in experts if e["fallback"]]
    return {"total": len(experts), **counts, "fallbacks": len(fallbacks),
            "starved": sum(1 for e in experts if e["fallback"] == "all_tokens" or e["fallback"] == "rtn"),
            "guarded": sum(1 for e in experts if e.get("heldout")),
            "guard_kept_rtn": sum(1 for e in experts if e.get("guard") == "rtn"),
            "awq_kept_s1": sum(1 for e in experts if e.get("guard") == "awq-s1"),
            "width_prior": sum(1 for e in experts if e.get("prior")),
            **method.summary_counts(experts),  # what the method's own options decided (Method.summary_counts)
            "decisions": {d: n for d in ("calibrated", "fallback", "data-free", "reused")
                          if (n := sum(1 for e in experts if decision(e)[0] == d))}}


def _pair_report(model, job: Job, tokens, source_files: dict[str, str], out: Path, t_start: float,
                 manifests: dict[str, str] | None) -> dict:
    ckpt, rec, decisions, state, G = job.ckpt, job.rec, job.decisions, job.state, job.G
    block = rec.prefill.fp8_block
    width = job.arch.hidden_size  # every routed expert's gate/up input width
    experts = [e | {"tokens_per_column": round(e["tokens"] / width, 4), "reason": reason(e)} for e in state.experts]
    sizes = {which: sum(p.stat().st_size for p in (out / which).glob("*.safetensors")) for which in ("prefill", "decode")}
    differ = sorted(state.differ)
    return {
        "quantkit_version": __version__,
        "source": {"spec": str(model), "path": str(Path(ckpt.folder).resolve()), "model_type": ckpt.arch.model_type,
                   "repo": ckpt.remote.repo_id if ckpt.remote else None,
                   "revision": ckpt.remote.revision if ckpt.remote else None,
                   "commit": ckpt.remote.commit if ckpt.remote else None,
                   "unverified_files": ckpt.remote.unverified if ckpt.remote else [],
                   "files": source_files},
        "mtp": mtp_report(ckpt, job.method, state),
        "recipe": rec.model_dump(mode="json"),
        "method": rec.method,
        "group_size": G,
        "calibration": None if tokens is None else {
            "spec": tokens.spec, "num_samples": int(tokens.ids.shape[0]), "seq_len": int(tokens.ids.shape[1]),
            "tokens": int(tokens.ids.numel()), "sha256": tokens.sha256, "source": tokens.source,
            **({"sources": [{k: x[k] for k in ("spec", "windows", "tokens")} for x in tokens.source["sources"]]}
               if tokens.source.get("kind") == "mix" else {}),  # a mix's per-source counts (quantkit.inputs.mix)
            **({"probe": job.method.probe_report(rec, n, int(tokens.ids.shape[1]))}
               if (n := job.method.probe_windows(rec)) else {}),  # the windows the method asked for
        },
        "calibration_choice": "each layer calibrated on the hidden states of the quantized decode model (sequential)",
        "layers": state.layers,
        "experts": experts,
        "experts_summary": _experts_summary(experts, job.method),
        "coverage": coverage(experts, width),
        "guard": f"each calibrated expert is compared with RTN on its held-out routed tokens ({job.method.guard_words(rec)}, "
                 "never fitted on); the lower output error is stored",
        "outputs": {
            "prefill": {"path": "prefill", "bytes": sizes["prefill"], "manifest_sha256": (manifests or {}).get("prefill"),
                        "precision": precision_summary(ckpt, decisions, "prefill", G, block)},
            "decode": {"path": "decode", "bytes": sizes["decode"], "manifest_sha256": (manifests or {}).get("decode"),
                       "precision": precision_summary(ckpt, decisions, "decode", G, block)},
        },
        "shared_tensors": {
            "identical": len(ckpt.tensors) - len(differ),
            "differ": len(differ),
            "differ_classes": sorted({ckpt.tensors[n].info.klass.value for n in differ}),
            "renamed": "FP8 block multipliers are `weight_scale_inv` in prefill (DeepSeek layout) and "
                       "`weight_scale` in decode (compressed-tensors); the bytes are identical",
        },
        "decisions": {n: {"prefill": d.prefill, "decode": d.decode, **({"why": d.why} if d.why else {})}
                      for n, d in decisions.items() if d.prefill != PASS or d.decode != PASS or d.why},
        "seconds": round(time.time() - t_start, 3),
        "peak_rss_bytes": peak_rss(),
    }
