"""`quantkit validate`: the converted pair against its source, through quantkit's own forward pass.

What is measured, on held-out tokens (eval data the calibration never saw):

    prompt pass    every eval window through the reference, the FP8 prefill and the INT4 decode
                   checkpoint: per layer ||h - h_ref|| / ||h_ref|| of the hidden state after that
                   layer; on the final logits KL(ref || model) per token, top-1 agreement, perplexity
    generation     from the end of each window, K greedy tokens (the incremental MLA-latent /
                   DSA-index-key cache path): each checkpoint alone, and the cross-phase path the
                   servers run (the prefill checkpoint writes the caches and picks the first token,
                   the decode checkpoint decodes on top of those caches); agreement with the
                   reference's continuation and, for cross-phase, with INT4-only decoding
    decode steps   the reference's continuation fed to the cross-phase path and to INT4-only decoding
                   (teacher forcing, so every step is comparable): KL, top-1 and per-layer error at
                   the decode positions

Lockstep, one layer at a time. Every model advances through its decoder layers together: layer i
of the reference, then of the prefill checkpoint, then of the decode checkpoint, before any layer
i+1. Each checkpoint's layer is loaded once per pass for every stream that uses it (the INT4 layer
serves INT4-only and cross-phase decoding alike) and freed before the next is loaded, so peak memory
is one layer's weights plus the streams' activations and caches, whatever the depth, and no
per-layer hidden states are kept: errors are taken as the layer finishes.

Gates (`kl_max`, `top1_min`, `ppl_delta_max`, `layer_rel_err_max`, `greedy_agree_min`, ...) are
bounds on these metrics; an unscoped gate holds for every row that measures the metric, a scoped one
(`cross_phase.greedy_agree_min`) for that row only. The FP8-KV rows (`--kv-cache-dtype`) answer only
to `kv_delta_max` and to gates scoped to them (`decode_kv.kl_max`), so simulating the cache never
fails the weights' gates. The recipe recorded in convert-report.json
supplies the eval data, sizes and gates unless told otherwise.

Writes DIR/validation.json (every number, the eval data's identity, device, dtype),
DIR/validation.md, DIR/validation.png and, for a convert output, a model card README.md in each
checkpoint folder (quantkit.validation.card).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from quantkit import __version__
from quantkit.checkpoint.shards import Checkpoint, file_sha256
from quantkit.errors import ConfigError
from quantkit.model.reference import resolve_device
from quantkit.runtime import faults
from quantkit.runtime.progress import LayerProgress, rich_html
from quantkit.validation.forward import Stream, fork, heads, new_caches, step
from quantkit.validation.metrics import agreement, kl_top1, mean_nll, token_kl

__all__ = ["validate", "ValidationResult", "METRICS", "load_gates", "check_gates", "cross_phase_logits", "render_markdown"]

# metric -> what it is; a gate is `<metric>_max` or `<metric>_min`, optionally `<row>.` in front
METRICS = {
    "kl": "mean per-token KL(reference || model), nats",
    "top1": "fraction of positions whose argmax agrees with the reference",
    "ppl": "perplexity on the eval windows",
    "ppl_delta": "relative perplexity increase, model / reference - 1",
    "layer_rel_err": "largest per-layer ||h - h_ref|| / ||h_ref||",
    "greedy_agree": "mean fraction of the greedy continuation equal to the reference's (common prefix / K)",
    "greedy_exact": "fraction of prompts whose whole greedy continuation equals the reference's",
    "greedy_agree_decode": "cross-phase only: greedy_agree against INT4-only decoding instead of the reference",
    "kv_delta": "KV rows only: KL added by the FP8 KV cache over the same weights and steps with a BF16 cache, nats",
}
PAIR_ROWS = ("prefill", "decode", "cross_phase", "decode_kv", "cross_phase_kv")
KV_ROWS = {"decode_kv": "decode", "cross_phase_kv": "cross_phase"}  # KV row -> the weights-only path it adds to
STEP_ROWS = ("cross_phase", *KV_ROWS)  # rows measured on decode steps rather than the prompt pass
ROW_TITLES = {
    "prefill": "prefill (FP8)",
    "decode": "decode (INT4)",
    "cross_phase": "cross-phase (FP8 cache -> INT4)",
    "decode_kv": "decode (INT4) + FP8 KV cache",
    "cross_phase_kv": "cross-phase + FP8 KV cache",
    "model": "model",
}
SHORT_TITLES = {"prefill": "prefill FP8", "decode": "decode INT4", "cross_phase": "cross-phase",
                "decode_kv": "decode+FP8KV", "cross_phase_kv": "cross+FP8KV", "model": "model"}
GATES_FAILED_EXIT = 3  # the CLI's exit code when a gate fails (1 is a usage/input error)


# ---- what to validate ----------------------------------------------------------------------------
@dataclass
class Target:
    """The folders under test: a convert output (prefill + decode + report) or one checkpoint."""

    out: Path  # where validation.* are written
    models: dict[str, Path]  # row -> checkpoint folder: {"prefill", "decode"} or {"model"}
    report: dict | None  # convert-report.json
    reference: str  # how the reference is named in reports: its spec, or the folder
    reference_source: str | Path  # what to open: a folder, or a spec (tiny:, hf://) for models.open_checkpoint
    reference_path: Path  # a local folder with its config.json and tokenizer

    @property
    def pair(self) -> bool:
        return "decode" in self.models


def target(folder: str | Path, reference: str | Path | None) -> Target:
    from quantkit.inputs.modelspec import resolve

    def is_hub(spec) -> bool:
        return isinstance(spec, str) and spec.startswith("hf://")

    out = Path(folder)
    if not out.is_dir():
        raise ConfigError(f"{out}: no such folder; pass a `quantkit convert` output or a checkpoint folder")
    report = None
    if (out / "convert-report.json").is_file():
        try:
            report = json.loads((out / "convert-report.json").read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{out / 'convert-report.json'}: not valid JSON ({e.msg}); rerun `quantkit convert`") from None
    if (out / "prefill" / "config.json").is_file() and (out / "decode" / "config.json").is_file():
        models = {"prefill": out / "prefill", "decode": out / "decode"}
    elif (out / "config.json").is_file():
        models = {"model": out}
    else:
        raise ConfigError(f"{out}: neither a convert output (prefill/ and decode/) nor a checkpoint folder (config.json)")

    if reference is not None:
        return Target(out, models, report, str(reference), reference, resolve(reference))
    src = (report or {}).get("source") or {}
    if not src.get("spec"):
        raise ConfigError(f"{out}: no convert-report.json names the source; pass the reference with --reference")
    if src.get("path") and (Path(src["path"]) / "config.json").is_file() and not is_hub(src["spec"]):
        # the very folder convert read (tiny models: keyed by their content)
        return Target(out, models, report, src["spec"], Path(src["path"]), Path(src["path"]))
    try:
        return Target(out, models, report, src["spec"], src["spec"], resolve(src["spec"]))
    except ConfigError as e:
        raise ConfigError(f"{out}: cannot open the source convert recorded ({e}); pass it with --reference") from None


def _tiny_name(path: Path) -> str | None:
    """`glm-5.2` when `path` is an embedded tiny model's cache folder."""
    from quantkit.synthetic.tiny import TINY_NAMES, cache_dir

    try:
        path.resolve().relative_to((cache_dir() / "tiny").resolve())
    except ValueError:
        return None
    return next((n for n in TINY_NAMES if path.name.startswith(n + "-")), None)


@dataclass
class Settings:
    dataset: str
    num_samples: int
    seq_len: int
    gen_tokens: int
    gates: dict[str, float]
    gates_from: str  # where the gates came from: a file, the recipe, the call


def _settings(t: Target, arch, eval_data, num_samples, seq_len, gen_tokens, gates) -> Settings:
    """Explicit options, else the recipe recorded in the report, else the reference family's recipe."""
    from quantkit.recipe import ValidateSettings, default_recipe

    if t.report and isinstance(t.report.get("recipe"), dict) and "validate" in t.report["recipe"]:
        base, base_from = ValidateSettings(**t.report["recipe"]["validate"]), f"recipe {t.report['recipe'].get('name')}"
    else:
        tiny = _tiny_name(t.reference_path)
        try:
            rec = default_recipe(f"tiny:{tiny}" if tiny else t.reference, arch)
            base, base_from = rec.validate, f"recipe {rec.name}"
        except ConfigError:
            base, base_from = ValidateSettings(), "defaults"
    dataset = eval_data or base.dataset
    if not dataset:
        raise ConfigError("no eval data: pass --eval-data (a held-out data spec, e.g. hf:org/name@test or a .jsonl file)")
    calib = ((t.report or {}).get("recipe") or {}).get("calibration", {}).get("dataset")
    if eval_data is None and calib and dataset.strip() == calib.strip():
        raise ConfigError(f"{base_from}: validate.dataset {dataset} is the calibration data; pass held-out --eval-data")
    if gates is None:
        gate_map, gates_from = dict(base.gates), base_from
    elif isinstance(gates, dict):
        gate_map, gates_from = {str(k): _number(v, f"gate {k!r}") for k, v in gates.items()}, "argument"
    else:
        gate_map, gates_from = load_gates(gates), str(gates)
    _check_gate_names(gate_map, gates_from)
    for name, value in (("num_samples", num_samples), ("seq_len", seq_len), ("gen_tokens", gen_tokens)):
        low = 0 if name == "gen_tokens" else (2 if name == "seq_len" else 1)
        if value is not None and (not isinstance(value, int) or value < low):
            raise ConfigError(f"--{name.replace('_', '-')}: must be an integer >= {low} (got {value!r})")
    return Settings(
        dataset=dataset,
        num_samples=num_samples if num_samples is not None else base.num_samples,
        seq_len=seq_len if seq_len is not None else base.seq_len,
        gen_tokens=gen_tokens if gen_tokens is not None else base.gen_tokens,
        gates=gate_map,
        gates_from=gates_from,
    )


# ---- gates ---------------------------------------------------------------------------------------
def load_gates(path: str | Path) -> dict[str, float]:
    """Gates from a YAML or JSON file: `{kl_max: 0.05, top1_min: 0.9}`, optionally under `gates:`."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the gate file ({e.strerror or e})") from None
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not valid {'JSON' if path.suffix.lower() == '.json' else 'YAML'} "
                          f"({getattr(e, 'problem', None) or getattr(e, 'msg', None) or e}); write `kl_max: 0.05` lines") from None
    if isinstance(data, dict) and isinstance(data.get("gates"), dict) and len(data) == 1:
        data = data["gates"]
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a gate file is a mapping of gate names to numbers, e.g. `kl_max: 0.05`")
    out = {}
    for k, v in data.items():
        out[str(k)] = _number(v, f"{path}: gate {k!r}")
    _check_gate_names(out, str(path))
    return out


def _number(v, what: str) -> float:
    """A finite float; YAML 1.1 reads `1e-3` as a string, so numeric strings count too."""
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            pass
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{what} must be a finite number (got {v!r})")
    return float(v)


def _split_gate(name: str) -> tuple[str | None, str, str]:
    """`cross_phase.greedy_agree_min` -> ("cross_phase", "greedy_agree", "min")."""
    row, _, rest = name.rpartition(".")
    metric, _, bound = rest.rpartition("_")
    return (row or None), metric, bound


def _check_gate_names(gates: dict[str, float], where: str) -> None:
    known = [f"{m}_{b}" for m in METRICS for b in ("max", "min")]
    for name in gates:
        row, metric, bound = _split_gate(name)
        if bound not in ("max", "min") or metric not in METRICS or (row is not None and row not in (*PAIR_ROWS, "model")):
            close = difflib.get_close_matches(name.rpartition(".")[2], known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{where}: unknown gate {name!r}; {hint}a gate is [row.]metric_max|_min with metric one of "
                              f"{', '.join(METRICS)} and row one of {', '.join(PAIR_ROWS)}")


def check_gates(gates: dict[str, float], rows: dict[str, dict]) -> list[dict]:
    """One entry per (gate, row it applies to); `passed` None where no row measured the metric."""
    results = []
    for name, bound in gates.items():
        scope, metric, kind = _split_gate(name)
        # unscoped gates bound the weights' rows; the FP8-KV rows answer to `kv_delta` and scoped gates
        applies = [r for r in rows if (r == scope if scope else (r not in KV_ROWS or metric == "kv_delta"))
                   and rows[r]["metrics"].get(metric) is not None]
        if not applies:
            results.append({"gate": name, "row": scope, "metric": metric, "bound": bound, "value": None, "passed": None,
                            "note": "not measured (no such row, or gen_tokens too small)"})
        for r in applies:
            v = rows[r]["metrics"][metric]
            ok = bool(v <= bound) if kind == "max" else bool(v >= bound)  # NaN fails both
            results.append({"gate": name, "row": r, "metric": metric, "bound": bound, "value": v, "passed": ok})
    return results


def cross_phase_logits(prefill: Checkpoint, decode: Checkpoint, prompt: torch.Tensor, tokens: torch.Tensor, *,
                       device="cpu", dtype=torch.float32) -> torch.Tensor:
    """Logits (B, K, V) of decoding `tokens` (B, K) one at a time with the `decode` weights on top of
    the caches the `prefill` weights wrote for `prompt` (B, P): the path `validate` measures."""
    device = resolve_device(device)
    ckpts = {"prefill": prefill, "decode": decode}
    with torch.no_grad():
        pre = Stream("prefill", "prefill", new_caches(prefill), ids=prompt)
        step(ckpts, [pre], device, dtype)
        cross = Stream("cross_phase", "decode", fork(pre.caches))
        out = []
        for k in range(tokens.shape[1]):
            cross.ids = tokens[:, k: k + 1]
            step(ckpts, [cross], device, dtype)
            out.append(heads(decode, [cross.h], dtype)[0])
        return torch.cat(out, dim=1)


# ---- metrics -------------------------------------------------------------------------------------
class _LayerErr:
    """Per-layer sum of ||h - h_ref||^2 and ||h_ref||^2 (float64), over every step it is fed."""

    def __init__(self, n_layers: int):
        self.diff = [0.0] * n_layers
        self.ref = [0.0] * n_layers

    def add(self, layer: int, h: torch.Tensor, h_ref: torch.Tensor) -> None:
        self.diff[layer] += float((h.double() - h_ref.double()).pow(2).sum())
        self.ref[layer] += float(h_ref.double().pow(2).sum())

    def rel(self) -> list[float]:
        return [math.sqrt(d / r) if r > 0 else 0.0 for d, r in zip(self.diff, self.ref)]


def measure(ckpts: dict[str, Checkpoint], ids: torch.Tensor, K: int, pair: bool, device, dtype, bar,
             kv: dict[str, Any] | None = None, kv_calibrated: bool = False, chunk: int = 16, group=None,
             owners: dict[int, dict[int, int]] | None = None) -> dict:
    """Run every stream in lockstep and return the rows, per-layer curves and continuations.
    `kv`: variant -> quantkit.model.kvcache.KVCache; each adds the FP8-KV rows' streams (pairs only).
    Routed experts are loaded `chunk` at a time (quantkit.validation.layerstream); with several ranks, each
    computes those `owners` gives it (layer -> expert -> rank)."""
    L = ckpts["reference"].arch.num_hidden_layers
    models = [m for m in ckpts if m != "reference"]
    kv = kv if pair and K > 1 else {}

    # 1. prompt pass: every eval window through every checkpoint; with an FP8 KV cache, the decode and
    # prefill checkpoints once more per scale variant, storing their caches as the engines do
    prompt = {m: Stream(m, m, new_caches(ckpts[m]), ids=ids) for m in ckpts}
    for v, spec in kv.items():
        for m in ("decode", "prefill"):
            prompt[f"{m}+kv{v}"] = Stream(f"{m}+kv{v}", m, new_caches(ckpts[m]), ids=ids, kv=spec)
    errs = {m: _LayerErr(L) for m in models}

    def on_prompt_layer(layer, hs):
        faults.point("validate:layer")  # the multi-rank tests kill a rank here
        for m in models:
            errs[m].add(layer, hs[m], hs["reference"])

    step(ckpts, list(prompt.values()), device, dtype, on_prompt_layer, bar.advance, chunk, group, owners)
    (ref_logits,) = heads(ckpts["reference"], [prompt["reference"].h], dtype)
    ref_nll = mean_nll(ref_logits, ids)
    last = {"reference": ref_logits[:, -1]}
    rows: dict[str, dict] = {}
    for m in models:
        (logits,) = heads(ckpts[m], [prompt[m].h], dtype)
        kl, agree, n = kl_top1(ref_logits, logits)
        nll = mean_nll(logits, ids)
        curve = errs[m].rel()
        rows[m] = {
            "metrics": {"kl": kl / n, "top1": agree / n, "ppl": math.exp(nll),
                        "ppl_delta": math.exp(nll - ref_nll) - 1, "layer_rel_err": max(curve)},
            "layers": curve,
            "measured_on": "eval windows (prompt pass)",
        }
        last[m] = logits[:, -1]
        del logits
    for v in kv:
        for m in ("decode", "prefill"):
            s = prompt[f"{m}+kv{v}"]
            last[s.name] = heads(ckpts[m], [s.h[:, -1:]], dtype)[0][:, -1]
    for s in prompt.values():
        s.h = None
    reference = {"ppl": math.exp(ref_nll)}
    result = {"rows": rows, "reference": reference, "continuations": {}}
    if K == 0:
        return result

    # 2. generation: free-running greedy streams, plus teacher-forced ones fed the reference's tokens
    first = {m: last[m].argmax(-1).cpu() for m in last}  # the prompt pass picks the first token
    free = {"reference": Stream("reference", "reference", prompt["reference"].caches, tokens=[first["reference"]])}
    for m in models:
        free[m] = Stream(m, m, prompt[m].caches, tokens=[first[m]])
    forced: dict[str, Stream] = {}
    if pair:
        # the servers' path: the prefill pool writes the caches and samples token 1, the decode pool
        # goes on from those caches (both cross-phase streams start from this one hand-over)
        handed_over = prompt["prefill"].caches
        free["cross_phase"] = Stream("cross_phase", "decode", fork(handed_over), tokens=[first["prefill"]])
        forced = {"cross_phase": Stream("cross_phase@tf", "decode", fork(handed_over)),
                  "int4_only": Stream("int4_only@tf", "decode", fork(prompt["decode"].caches))}
        for v, spec in kv.items():  # the same two paths over caches stored in FP8, read in FP8
            dec, pre = prompt[f"decode+kv{v}"], prompt[f"prefill+kv{v}"]
            free[f"decode_kv{v}"] = Stream(f"decode_kv{v}", "decode", dec.caches, tokens=[first[dec.name]], kv=spec)
            free[f"cross_phase_kv{v}"] = Stream(f"cross_phase_kv{v}", "decode", fork(pre.caches),
                                                tokens=[first[pre.name]], kv=spec)
            forced[f"decode_kv{v}"] = Stream(f"decode_kv{v}@tf", "decode", fork(dec.caches), kv=spec)
            forced[f"cross_phase_kv{v}"] = Stream(f"cross_phase_kv{v}@tf", "decode", fork(pre.caches), kv=spec)
    step_err = {k: _LayerErr(L) for k in forced}
    kl_sum = {k: 0.0 for k in forced}
    top1_sum = {k: 0.0 for k in forced}
    kl_each: dict[str, list[torch.Tensor]] = {k: [] for k in forced}  # per-position KL, for paired differences

    def on_step_layer(layer, hs):
        for k, s in forced.items():
            step_err[k].add(layer, hs[s.name], hs["reference"])

    for _ in range(K - 1):
        for s in free.values():
            s.ids = s.tokens[-1][:, None]
        for s in forced.values():
            s.ids = free["reference"].tokens[-1][:, None]
        streams = list(free.values()) + list(forced.values())
        step(ckpts, streams, device, dtype, on_step_layer, bar.advance, chunk, group, owners)
        logits = {}
        for m, ck in ckpts.items():
            members = [s for s in streams if s.model == m]
            for s, lg in zip(members, heads(ck, [s.h for s in members], dtype)):
                logits[s.name] = lg[:, -1]  # (B, V)
        for s in free.values():
            s.tokens.append(logits[s.name].argmax(-1).cpu())
        for k, s in forced.items():
            kl, agree, _ = kl_top1(logits["reference"][:, None], logits[s.name][:, None])
            kl_sum[k] += kl
            top1_sum[k] += agree
            kl_each[k].append(token_kl(logits["reference"], logits[s.name]).cpu())

    cont = {name: torch.stack(s.tokens, dim=1) for name, s in free.items()}  # (B, K)
    for m in models:
        agree, exact = agreement(cont[m], cont["reference"])
        rows[m]["metrics"].update(greedy_agree=agree, greedy_exact=exact)
    if pair:
        n = ids.shape[0] * (K - 1)
        decode_steps = {}
        for k in forced:
            curve = step_err[k].rel()
            decode_steps[k] = {"kl": kl_sum[k] / n if n else None, "top1": top1_sum[k] / n if n else None,
                               "layer_rel_err": max(curve) if n else None, "layers": curve if n else []}
        agree, exact = agreement(cont["cross_phase"], cont["reference"])
        agree_int4, _ = agreement(cont["cross_phase"], cont["decode"])
        c = decode_steps["cross_phase"]
        rows["cross_phase"] = {
            "metrics": {"kl": c["kl"], "top1": c["top1"], "layer_rel_err": c["layer_rel_err"], "greedy_agree": agree,
                        "greedy_exact": exact, "greedy_agree_decode": agree_int4},
            "layers": c["layers"],
            "measured_on": f"{K - 1} decode steps after each eval window, fed the reference's continuation",
            "int4_only": decode_steps["int4_only"],  # the same steps over INT4's own caches: the baseline
        }
        if kv:
            from quantkit.validation.kvrows import kv_rows

            rows.update(kv_rows(kv, decode_steps, kl_each, cont, kv_calibrated))
    result["continuations"] = {name: t.tolist() for name, t in cont.items()}
    return result


# ---- the result ----------------------------------------------------------------------------------
@dataclass
class ValidationResult:
    """What `validate` measured; `data` is validation.json."""

    dir: Path
    data: dict[str, Any]
    files: dict[str, Path]

    @property
    def passed(self) -> bool:
        return self.data["passed"]

    @property
    def failed_gates(self) -> list[dict]:
        return [g for g in self.data["gates"] if g["passed"] is False]

    def to_json(self) -> dict[str, Any]:
        return self.data

    def table(self):
        from rich.table import Table

        d = self.data
        failed = {(g["row"], g["metric"]) for g in self.failed_gates}
        t = Table(title=f"quantkit validate: {d['reference']['spec']} vs {d['dir']}")
        t.add_column("path", no_wrap=True)
        t.add_column("on", no_wrap=True)
        cols = [("kl", "KL", "{:.3g}"), ("top1", "top-1", "{:.3f}"), ("ppl_delta", "ppl Δ", "{:+.2%}"),
                ("layer_rel_err", "layer err", "{:.3g}"), ("greedy_agree", "greedy", "{:.3f}")]
        for _, title, _ in cols:
            t.add_column(title, justify="right", no_wrap=True)
        for row, r in d["rows"].items():
            cells = []
            for key, _, fmt in cols:
                v = r["metrics"].get(key)
                text = "—" if v is None else fmt.format(v)
                cells.append(f"[red]{text}[/red]" if (row, key) in failed else text)
            t.add_row(SHORT_TITLES.get(row, row), "decode" if row in STEP_ROWS else "prompts", *cells)
        io = d["rows"].get("cross_phase", {}).get("int4_only")
        if io and io["kl"] is not None:
            t.add_row("INT4-only", "decode", f"{io['kl']:.3g}", f"{io['top1']:.3f}", "—",
                      f"{io['layer_rel_err']:.3g}", "—", style="dim")
        gates = d["gates"]
        n_pass = sum(1 for g in gates if g["passed"])
        verdict = "[green]PASSED[/green]" if d["passed"] else "[red]FAILED[/red]"
        fails = "; ".join(f"{g['gate']} on {g['row']}: {g['value']:.4g}" for g in self.failed_gates)
        e = d["eval_data"]
        t.caption = (f"{verdict}: {n_pass}/{sum(1 for g in gates if g['passed'] is not None)} gate checks "
                     f"({d['gates_from']}){': ' + fails if fails else ''}\n"
                     f"reference ppl {d['reference_metrics']['ppl']:.3f}; eval {e['spec']} {e['num_samples']}x{e['seq_len']} "
                     f"sha256 {e['sha256'][:12]}; {d['gen_tokens']} greedy tokens; {d['device']} {d['dtype']}; "
                     f"{d['seconds']:.1f}s" + "".join(f"\nnote: {n}" for n in d["notes"]))
        return t

    def _repr_html_(self) -> str:
        return rich_html(self.table(), width=120)


def render_markdown(d: dict) -> str:
    """validation.md: the numbers of validation.json as readable tables."""
    e = d["eval_data"]
    lines = [
        f"# Validation: {d['reference']['spec']} vs `{d['dir']}`",
        "",
        f"**{'PASSED' if d['passed'] else 'FAILED'}** ({d['gates_from']} gates). quantkit {d['quantkit_version']}, "
        f"{d['device']}, {d['dtype']}, {d['seconds']:.1f} s.",
        "",
        f"Eval data: `{e['spec']}`, {e['num_samples']} x {e['seq_len']} tokens, sha256 `{e['sha256']}`. "
        f"Greedy continuation: {d['gen_tokens']} tokens after each window. "
        f"Reference perplexity {d['reference_metrics']['ppl']:.4f}.",
        "",
        "| path | measured on | KL (nats) | top-1 | ppl | ppl delta | max layer err | greedy agree | greedy exact |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row, r in d["rows"].items():
        m = r["metrics"]
        lines.append(f"| {ROW_TITLES.get(row, row)} | {r['measured_on']} | {_f(m.get('kl'), '.4g')} | {_f(m.get('top1'), '.4f')} "
                     f"| {_f(m.get('ppl'), '.4f')} | {_f(m.get('ppl_delta'), '+.3%')} | {_f(m.get('layer_rel_err'), '.4g')} "
                     f"| {_f(m.get('greedy_agree'), '.3f')} | {_f(m.get('greedy_exact'), '.3f')} |")
    cp = d["rows"].get("cross_phase")
    if cp:
        io = cp["int4_only"]
        lines.append(f"| INT4-only decoding (baseline) | the same decode steps | {_f(io['kl'], '.4g')} | {_f(io['top1'], '.4f')} "
                     f"| — | — | {_f(io['layer_rel_err'], '.4g')} | — | — |")
        lines += ["", f"Cross-phase greedy continuation vs INT4-only decoding: agreement "
                      f"{_f(cp['metrics']['greedy_agree_decode'], '.3f')}."]
    lines += ["", "## Gates", "", "| gate | row | value | bound | result |", "|---|---|---:|---:|---|"]
    for g in d["gates"]:
        res = {True: "pass", False: "**FAIL**", None: g.get("note", "not measured")}[g["passed"]]
        lines.append(f"| `{g['gate']}` | {g['row'] or '—'} | {_f(g['value'], '.4g')} | {g['bound']:g} | {res} |")
    if not d["gates"]:
        lines.append("| (none) | | | | |")
    lines += ["", "## Per-layer relative error ||h - h_ref|| / ||h_ref||", ""]
    curves = {ROW_TITLES.get(r, r): v["layers"] for r, v in d["rows"].items() if v["layers"]}
    if cp and cp["int4_only"]["layers"]:
        curves["INT4-only (decode steps)"] = cp["int4_only"]["layers"]
    lines.append("| layer | " + " | ".join(curves) + " |")
    lines.append("|---:|" + "---:|" * len(curves))
    for i in range(d["num_layers"]):
        lines.append(f"| {i} | " + " | ".join(_f(c[i], '.4g') for c in curves.values()) + " |")
    from quantkit.validation.kvrows import kv_markdown

    lines += kv_markdown(d)
    for n in d["notes"]:
        lines += ["", f"Note: {n}"]
    lines += ["", "Metrics: " + "; ".join(f"`{k}` {v}" for k, v in METRICS.items()) + ".", ""]
    return "\n".join(lines)


def _f(v, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


# ---- the figure ----------------------------------------------------------------------------------
def plot(d: dict, report: dict | None, path: Path) -> Path:
    """validation.png: per-layer error curves (prompt pass, decode steps) and, from the convert
    report, how many calibration tokens each routed expert saw."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), constrained_layout=True)
    layers = list(range(d["num_layers"]))

    def curves(ax, series, title):
        for label, ys, style, color in series:
            ax.plot(layers, ys, style, label=label, lw=1.8, ms=5, color=color)
        ax.set_ylim(bottom=-0.03 * max(ax.get_ylim()[1], 1e-12))  # a curve at exactly 0 stays visible
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("decoder layer")
        ax.set_ylabel("||h - h_ref|| / ||h_ref||")
        ax.set_xticks(layers if len(layers) <= 16 else layers[:: max(1, len(layers) // 12)])
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=9)
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, color="grey")

    rows = d["rows"]
    colors = {"prefill": "tab:blue", "decode": "tab:orange", "model": "tab:orange", "cross_phase": "tab:green",
              "decode_kv": "tab:red", "cross_phase_kv": "tab:purple"}
    prompt_series = [(ROW_TITLES.get(r, r), rows[r]["layers"], "o-", colors[r]) for r in rows if r not in STEP_ROWS]
    curves(axes[0], prompt_series, f"Prompt pass: {d['eval_data']['num_samples']}x{d['eval_data']['seq_len']} eval tokens")
    step_series = []
    cp = rows.get("cross_phase")
    if cp and cp["layers"]:
        step_series = [(ROW_TITLES["cross_phase"], cp["layers"], "s-", colors["cross_phase"]),
                       ("INT4-only decoding", cp["int4_only"]["layers"], "^--", colors["decode"])]
        step_series += [(ROW_TITLES[r], rows[r]["layers"], "v:", colors[r]) for r in KV_ROWS if r in rows]
    curves(axes[1], step_series, f"Decode steps: {max(d['gen_tokens'] - 1, 0)} per window, teacher-forced")
    _expert_histogram(axes[2], report)
    verdict = "PASSED" if d["passed"] else "FAILED"
    fig.suptitle(f"quantkit validate: {d['reference']['spec']} — {verdict}", fontsize=12,
                 color="tab:green" if d["passed"] else "tab:red")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _expert_histogram(ax, report: dict | None) -> None:
    ax.set_title("Calibration tokens per routed expert", fontsize=11)
    experts = (report or {}).get("experts") or []
    calibrated = [e for e in experts if e["method"] != "reused"]
    if not calibrated:
        reason = (f"{len(experts)} routed experts reused from the source's INT4\n(no calibration)" if experts
                  else "no convert report")
        ax.text(0.5, 0.5, reason, ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    groups: dict[str, list[int]] = {}  # "gptq", "gptq: all_tokens", "rtn: mtp: no calibration path (RTN)", ...
    for e in calibrated:
        label = e["method"].upper() + (f", {e['fallback']}" if e["fallback"] else "")
        groups.setdefault(label, []).append(e["tokens"])
    groups = dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))
    top = max(max(v) for v in groups.values())
    bins = torch.linspace(0, max(top, 1) * 1.02, 31).tolist()
    palette = ["tab:blue", "tab:orange", "tab:purple", "tab:grey", "tab:brown"]
    ax.hist(list(groups.values()), bins=bins, stacked=True, label=[f"{k} — {len(v)}" for k, v in groups.items()],
            color=[palette[i % len(palette)] for i in range(len(groups))])
    min_tokens = ((report.get("recipe") or {}).get("gptq") or {}).get("min_tokens")
    if min_tokens is not None:
        ax.axvline(min_tokens, color="tab:red", ls="--", lw=1.2, label=f"gptq.min_tokens = {min_tokens}")
    ax.set_xlabel("tokens routed to the expert during calibration")
    ax.set_ylabel("experts")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


# ---- the entry point -----------------------------------------------------------------------------
def _owned_and_verified(fn):
    """validate's guard: one owner per folder (quantkit.checkpoint.outlock), and a convert output is checked
    against its manifests (quantkit.checkpoint.manifest.verify) before anything is measured or written."""
    import functools

    @functools.wraps(fn)
    def wrapper(dir, *args, write: bool = True, **kwargs):
        from quantkit.checkpoint.manifest import MANIFEST, REPORT, verify
        from quantkit.checkpoint.outlock import acquire
        from quantkit.runtime.distributed import from_env

        out = Path(dir)
        leader = from_env().leader  # several ranks: rank 0 owns the folder and checks it; the others wait for it
        lock = acquire(out, "validate") if write and leader and out.is_dir() else None
        try:
            ours = [out / REPORT, out / ".quantkit-convert", out / MANIFEST, out / "prefill" / MANIFEST, out / "decode" / MANIFEST]
            if leader and any(p.exists() for p in ours):  # a quantkit output (a hand-assembled pair has none of these)
                verify(out).raise_for_problems()
            return fn(dir, *args, write=write, **kwargs)
        finally:
            if lock is not None:
                lock.release()

    return wrapper


@_owned_and_verified
def validate(
    dir: str | Path,
    *,
    reference: str | Path | None = None,
    eval_data: str | None = None,
    num_samples: int | None = None,
    seq_len: int | None = None,
    gen_tokens: int | None = None,
    device: str = "auto",
    gates: str | Path | dict[str, float] | None = None,
    progress: bool = True,
    dtype: torch.dtype = torch.float32,
    write: bool = True,
    kv_cache_dtype: str = "bf16",
    max_host_memory: int | str | None = None,
    max_gpu_memory: int | str | None = None,
    weights: str = "auto",
) -> ValidationResult:
    """Measure a converted pair (or one checkpoint) against its reference, layer by layer.

    Args:
        dir: a `quantkit convert` output (prefill/, decode/, convert-report.json) or a checkpoint folder.
        reference: the model to compare with (default: the source recorded in convert-report.json).
        eval_data: held-out data spec (default: the recorded recipe's `validate.dataset`).
        num_samples, seq_len: eval windows and tokens per window (default: the recipe's).
        gen_tokens: greedy tokens generated after each window (default: the recipe's).
        gates: a YAML/JSON gate file or a dict (`{"kl_max": 0.05}`); default: the recipe's gates.
        write: write validation.json/.md/.png and the model cards (convert outputs only).
        kv_cache_dtype: `bf16` (the cache holds what attention computed), `fp8_e4m3` (the engines'
            static per-layer scale, run with the checkpoint's scales and with 1.0) or `fp8_ds_mla`
            (vLLM's DSA layout); FP8 adds the KV rows (quantkit.model.kvcache).
        max_host_memory, max_gpu_memory: budgets ("8GB", per rank); routed experts are streamed in
            chunks sized to them (quantkit.conversion.cost.validate_expert_chunk).
        weights: `auto` keeps as much of the checkpoints as fits the budget in memory, as stored,
            after its first read (this rank's share under torchrun), so greedy tokens re-read only
            the rest; `resident` insists on all of it; `stream` re-reads every layer for every pass
            (`_weights_plan`).

    Under torchrun (`quantkit validate --nproc N`) each rank runs the attention half of every
    layer and the routed experts that convert's partition gives it, and receives the others'
    expert outputs; the numbers are the single process's, bit for bit on the same device type
    (docs/distributed.md). Rank 0 writes the files.
    Returns:
        ValidationResult; `passed` is False when any gate fails (nothing is raised for that).

    Example:
        >>> res = quantkit.validate("out/glm")
        >>> res.data["rows"]["decode"]["metrics"]["kl"], res.passed
    """
    from quantkit.inputs.modelspec import open_checkpoint
    from quantkit.inputs.tokens import load_tokens
    from quantkit.planner.budgets import validate_exchange
    from quantkit.runtime import distributed
    from quantkit.runtime.machine import peak_rss

    t0 = time.time()
    if weights not in WEIGHTS:
        raise ConfigError(f"--weights {weights}: one of {', '.join(WEIGHTS)}")
    t = target(dir, reference)
    ckpts = {"reference": open_checkpoint(t.reference_source)} | {row: Checkpoint(p) for row, p in t.models.items()}
    _check_compatible(ckpts)
    arch = ckpts["reference"].arch
    s = _settings(t, arch, eval_data, num_samples, seq_len, gen_tokens, gates)
    tokens = load_tokens(s.dataset, tokenizer=t.reference_path, num_samples=s.num_samples, seq_len=s.seq_len)
    joined = distributed.joined()  # convert's ranks validate in the group they converted in
    group, dev = distributed.init(resolve_device(device))
    group = replace(group, after_failure="see the failing rank's log, then rerun the same command")
    notes = _notes(t, tokens)

    owners = _owners(arch, t.report, group)
    plan = _weights_plan(ckpts, owners, group, dev, weights, max_host_memory, max_gpu_memory,
                         validate_exchange(arch, tokens.ids.numel(), group.world))
    kv, kv_info = _kv_variants(kv_cache_dtype, ckpts, t.pair, s.gen_tokens)
    L = arch.num_hidden_layers
    loads = len(ckpts) * L * (1 + max(s.gen_tokens - 1, 0))  # a pass loads each checkpoint's layers once
    with LayerProgress(progress and group.leader, loads, "validate: layers") as bar, torch.no_grad():
        m = measure(ckpts, tokens.ids.to(dev), s.gen_tokens, t.pair, dev, dtype, bar, kv, kv_info.get("calibrated", False),
                     plan["chunk"], group, owners)
    plan["read_bytes"] = sum(ck.bytes_read for ck in ckpts.values())
    plan["peak_rss_bytes"] = peak_rss()
    ranks = group.all_gather_object(plan, "after validating")
    if not joined:
        distributed.close(group)
    for ck in ckpts.values():
        ck.close()

    gate_results = check_gates(s.gates, m["rows"])
    data = {
        "quantkit_version": __version__,
        "dir": str(t.out),
        "mode": "pair" if t.pair else "checkpoint",
        "reference": {"spec": t.reference, "path": str(t.reference_path.resolve()),
                      "config_sha256": _config_sha256(t.reference_path)},
        "models": {row: str(p) for row, p in t.models.items()},
        "eval_data": {"spec": tokens.spec, "sha256": tokens.sha256, "num_samples": int(tokens.ids.shape[0]),
                      "seq_len": int(tokens.ids.shape[1]), "source": tokens.source},
        "gen_tokens": s.gen_tokens,
        "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
        "dtype": str(dtype).removeprefix("torch."),
        "order": "lockstep: layer i of every checkpoint before layer i+1; one layer's weights in memory at a time "
                 "beyond those kept as stored (`weights`)",
        "weights": _weights_report(ranks, group),
        "num_layers": L,
        "reference_metrics": m["reference"],
        "rows": m["rows"],
        "continuations": m["continuations"],
        "kv_cache": kv_info,
        "gates_from": s.gates_from,
        "gates": gate_results,
        "passed": all(g["passed"] is not False for g in gate_results),
        "notes": notes,
        "metrics": METRICS,
        "seconds": round(time.time() - t0, 3),
    }
    result = ValidationResult(t.out, data, {})
    if write and group.leader:
        result.files = _write(t, data)
    return result


WEIGHTS = ("auto", "resident", "stream")


def _owners(arch, report: dict | None, group) -> dict[int, dict[int, int]] | None:
    """layer -> expert -> rank for every MoE layer, as convert partitions them (quantkit.runtime.distributed.
    partition over the routed calibration tokens the report records, plus GPTQ's fixed cost);
    experts with no record count 0 tokens. None for a single process."""
    if not group.distributed:
        return None
    from quantkit.planner.budgets import expert_fixed_tokens
    from quantkit.runtime.distributed import partition

    tokens = {(e["layer"], e["expert"]): e.get("tokens", 0) for e in (report or {}).get("experts") or []}
    fixed = expert_fixed_tokens(arch)
    return {layer: partition({e: tokens.get((layer, e), 0) for e in range(arch.n_routed_experts)}, group.world, fixed)
            for layer in range(arch.num_hidden_layers) if arch.is_moe(layer)}


def _weights_plan(ckpts: dict[str, Checkpoint], owners, group, dev: torch.device, weights: str, max_host_memory,
                  max_gpu_memory, exchange: int) -> dict:
    """What this rank reads and what it keeps. Its share: the decoder layers' tensors but the routed
    experts of other ranks, and the embedding, norm and head. `auto` keeps as much of the share as
    fits (the shared tensors first, then the experts layer by layer) on `dev` beside the layer
    loop's working set (quantkit.conversion.cost.validate_room), and on a GPU then in this rank's part of host
    memory; `resident` insists on all of it; `stream` keeps nothing. Kept tensors stay as stored
    from their first read (Checkpoint.keep), so a greedy token re-reads only what was not kept. The
    expert chunk is sized from what is left on `dev`."""
    from quantkit.model.tensors import TensorClass
    from quantkit.planner.budgets import validate_budget, validate_expert_chunk, validate_room

    arch = ckpts["reference"].arch
    L = arch.num_hidden_layers

    def mine(info) -> bool:
        if info.layer is None:
            return True
        if info.layer >= L:  # MTP: validate does not run it
            return False
        return info.klass != TensorClass.ROUTED_EXPERT or owners is None or owners[info.layer][info.expert] == group.rank

    def order(item) -> tuple:
        (m, n), info = item, ckpts[item[0]].tensors[item[1]].info
        return (info.klass == TensorClass.ROUTED_EXPERT, -1 if info.layer is None else info.layer, info.expert or 0, m, n)

    share = sorted(((m, n) for m, ck in ckpts.items() for n in ck.names() if mine(ck.tensors[n].info)),
                   key=lambda item: order(item))
    sizes = {(m, n): ckpts[m].storage_bytes(n) for m, n in share}
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", group.world)) if group.distributed else 1
    budget = validate_budget(dev.type, max_host_memory, max_gpu_memory, ranks_here)
    tiers = [[dev, validate_room(arch, dev.type, budget, exchange), 0]] if weights != "stream" else []
    if dev.type == "cuda" and weights != "stream":  # then this rank's part of host memory
        tiers.append([torch.device("cpu"), validate_room(arch, "cpu", validate_budget("cpu", max_host_memory, None, ranks_here)), 0])
    for item in share:
        tier = next((t for t in tiers if t[2] + sizes[item] <= t[1]), None)
        if tier is None:
            break  # keep a prefix: whole layers' shared tensors before any expert
        tier[2] += sizes[item]
        ckpts[item[0]].keep([item[1]], tier[0])
    kept = sum(t[2] for t in tiers)
    total = sum(sizes.values())
    if weights == "resident" and kept < total:
        raise ConfigError(f"--weights resident: this rank's share of the three checkpoints is {total / 1e9:.2f} GB as "
                          f"stored, but its budget keeps {kept / 1e9:.2f} GB beside the layer loop; use more ranks "
                          "(quantkit validate --nproc N), a larger --max-host-memory/--max-gpu-memory, or --weights auto")
    on_dev = tiers[0][2] if tiers else 0
    chunk = validate_expert_chunk(arch, dev.type, max_host_memory, max_gpu_memory, kept=on_dev, ranks_here=ranks_here,
                                  exchange=exchange)
    experts = sum(1 for m, n in share if ckpts[m].tensors[n].info.klass == TensorClass.ROUTED_EXPERT
                  and ckpts[m].tensors[n].info.proj == "down_proj")
    return {"share_bytes": total, "kept_bytes": kept, "kept_on_device_bytes": on_dev if dev.type == "cuda" else 0,
            "budget_bytes": budget, "chunk": chunk, "experts": experts}


def _weights_report(ranks: list[dict], group) -> dict:
    """validation.json's `weights`: how the weights were held and read, per rank."""
    mode = ("resident" if all(r["kept_bytes"] == r["share_bytes"] for r in ranks) else
            "stream" if not any(r["kept_bytes"] for r in ranks) else "partly resident")
    return {"mode": mode, "world": group.world,
            **({"backend": group.backend} if group.distributed else {}),
            "share_bytes_per_rank": [r["share_bytes"] for r in ranks],
            "kept_bytes_per_rank": [r["kept_bytes"] for r in ranks],
            "kept_on_device_bytes_per_rank": [r["kept_on_device_bytes"] for r in ranks],
            "read_bytes_per_rank": [r["read_bytes"] for r in ranks],
            "experts_per_rank": [r["experts"] for r in ranks],
            "expert_chunk_per_rank": [r["chunk"] for r in ranks],
            "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
            "note": "share: what a rank reads (its own routed experts only); kept: what it keeps in memory as stored "
                    "after the first read; every pass (the prompt pass, then each greedy token) re-reads the rest"}


def _write(t: Target, data: dict) -> dict[str, Path]:
    files = {"json": t.out / "validation.json", "md": t.out / "validation.md", "png": t.out / "validation.png"}
    from quantkit.checkpoint.manifest import atomic_write_text

    # each file whole or not at all (a full disk must not leave a 0-byte validation.json)
    atomic_write_text(files["json"], json.dumps(data, indent=2) + "\n")
    atomic_write_text(files["md"], render_markdown(data))
    png_tmp = files["png"].with_name("validation.tmp.png")
    plot(data, t.report, png_tmp)
    os.replace(png_tmp, files["png"])
    if t.pair and t.report is not None:
        from quantkit.validation.card import write_cards

        for which, path in write_cards(t.out, t.report, data).items():
            files[f"card_{which}"] = path
    return files


def _kv_variants(kv_cache_dtype: str, ckpts: dict[str, Checkpoint], pair: bool, gen_tokens: int) -> tuple[dict, dict]:
    """The KV cache variants to run (quantkit.model.kvcache) and what validation.json says about them."""
    from quantkit.model.kvcache import KV_DTYPES, KVCache, checkpoint_scales
    from quantkit.validation.kvrows import SCALE_1

    if kv_cache_dtype not in KV_DTYPES:
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype}: one of {', '.join(KV_DTYPES)}")
    if kv_cache_dtype == "bf16":
        return {}, {"dtype": "bf16"}
    scales = checkpoint_scales(ckpts["decode"]) if pair else {}
    info = {"dtype": kv_cache_dtype, "calibrated": bool(scales), "scales": scales,
            "note": "KV rows: the decode steps of the INT4-only and cross-phase paths with the latent/rope cache "
                    "(and GLM's index keys) stored as the engines store them; `kv_delta` is the KL they add over "
                    "the same path with a BF16 cache. "
                    + ("scale 1.0 is what the engines run without scales (and what an SGLang MLA pool that casts without one runs)" if kv_cache_dtype == "fp8_e4m3" else
                       "fp8_ds_mla is vLLM's layout for DSA models; it ignores k_scale")
                    + ("; for this DSA model vLLM stores fp8_ds_mla instead (--kv-cache-dtype fp8_ds_mla)."
                       if ckpts["reference"].arch.has_dsa and kv_cache_dtype == "fp8_e4m3" else ".")}
    if not pair or gen_tokens < 2:
        info["note"] = "no KV rows: they need a convert output (prefill/ and decode/) and gen_tokens >= 2"
        return {}, info
    variants = {"": KVCache(kv_cache_dtype, "checkpoint")}
    if kv_cache_dtype == "fp8_e4m3" and scales:
        variants[SCALE_1] = KVCache(kv_cache_dtype, "one")
    return variants, info


def _check_compatible(ckpts: dict[str, Checkpoint]) -> None:
    ref = ckpts["reference"].arch
    for row, ck in ckpts.items():
        a = ck.arch
        for attr in ("num_hidden_layers", "hidden_size", "vocab_size", "n_routed_experts", "kv_lora_rank"):
            if getattr(a, attr) != getattr(ref, attr):
                raise ConfigError(f"{row} ({ck.folder}): {attr} {getattr(a, attr)} differs from the reference's "
                                  f"{getattr(ref, attr)}; is --reference the model this was converted from?")


def _notes(t: Target, tokens) -> list[str]:
    """Things a reader of the numbers should know: a reference that is not the converted source,
    eval data that is the calibration data."""
    notes = []
    src = (t.report or {}).get("source") or {}
    recorded = (src.get("files") or {}).get("config.json")
    if recorded and recorded != _config_sha256(t.reference_path):
        notes.append(f"the reference's config.json differs from the source convert recorded ({src.get('spec')})")
    cal = (t.report or {}).get("calibration") or {}
    cal_spec = cal.get("spec") or (((t.report or {}).get("recipe") or {}).get("calibration") or {}).get("dataset")
    if (cal.get("sha256") and cal["sha256"] == tokens.sha256) or (cal_spec and cal_spec.strip() == tokens.spec):
        notes.append(f"the eval data {tokens.spec} is the calibration data: the numbers flatter the checkpoint")
    return notes


def _config_sha256(folder: Path) -> str | None:
    config = folder / "config.json"
    return file_sha256(config) if config.is_file() else None
