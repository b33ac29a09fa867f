"""What validate shows: the result object (its terminal table), validation.md, validation.png and
the files written (quantkit.validation.card writes the model cards).

Everything here reads validation.json's dict; nothing is measured.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.runtime import faults
from quantkit.runtime.files import RESULTS_PENDING
from quantkit.runtime.progress import rich_html
from quantkit.validation.gates import BY_CONSTRUCTION, KV_ROWS, METRICS, STEP_ROWS
from quantkit.validation.targets import Target

__all__ = ["ROW_TITLES", "SHORT_TITLES", "ValidationResult", "plot", "render_markdown", "write_files"]

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


@dataclass(frozen=True)
class RowMetrics:
    """One row of validate's results (a checkpoint, or a path such as cross-phase) against the source;
    None where the row does not measure the metric (see quantkit.validation.gates.METRICS)."""

    kl: float | None = None
    top1: float | None = None
    ppl: float | None = None
    ppl_delta: float | None = None
    layer_rel_err: float | None = None
    greedy_agree: float | None = None

    @classmethod
    def of(cls, metrics: dict) -> "RowMetrics":
        return cls(**{k: (float(metrics[k]) if metrics.get(k) is not None else None) for k in cls.__dataclass_fields__})


@dataclass
class ValidationResult:
    """What `validate` measured; `data` is validation.json. The headline numbers are typed
    attributes: `res.decode.kl`, `res.rows["cross_phase"].top1`, `res.passed`."""

    dir: Path
    data: dict[str, Any]
    files: dict[str, Path]

    @property
    def passed(self) -> bool:
        return self.data["passed"]

    @property
    def rows(self) -> dict[str, RowMetrics]:
        return {row: RowMetrics.of(r["metrics"]) for row, r in self.data["rows"].items()}

    @property
    def prefill(self) -> RowMetrics | None:
        return self.rows.get("prefill")

    @property
    def decode(self) -> RowMetrics | None:
        return self.rows.get("decode")

    @property
    def cross_phase(self) -> RowMetrics | None:
        return self.rows.get("cross_phase")

    @property
    def gates_passed(self) -> int:
        return sum(1 for g in self.data["gates"] if g["passed"])

    @property
    def gates_checked(self) -> int:
        """Gate checks that count (not the unmeasured ones, nor rows identical to the source by construction)."""
        return sum(1 for g in self.data["gates"] if g["passed"] is not None)

    @property
    def failed_gates(self) -> list[dict]:
        return [g for g in self.data["gates"] if g["passed"] is False]

    def to_json(self) -> dict[str, Any]:
        return self.data

    def table(self):
        from rich.table import Table

        from quantkit.validation.tasks import tasks_caption
        from quantkit.validation.toolcalls import tool_caption

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
        same = sorted({SHORT_TITLES.get(g["row"], g["row"]) for g in gates if g.get("note") == BY_CONSTRUCTION})
        t.caption = (f"{verdict}: {n_pass}/{sum(1 for g in gates if g['passed'] is not None)} gate checks "
                     + (f"(not counted: {', '.join(same)}, identical to the source by construction) " if same else "")
                     + f"({d['gates_from']}){': ' + fails if fails else ''}\n"
                     f"reference ppl {d['reference_metrics']['ppl']:.3f}; eval {e['spec']} {e['num_samples']}x{e['seq_len']} "
                     f"sha256 {e['sha256'][:12]}; {d['gen_tokens']} greedy tokens; {d['device']} {d['dtype']} "
                     f"{(d.get('numerics') or {}).get('mode', 'weights')} numerics; "
                     f"{d['seconds']:.1f}s" + tasks_caption(d) + tool_caption(d) + _mtp_caption(d)
                     + "".join(f"\nnote: {n}" for n in d["notes"]))
        return t

    def _repr_html_(self) -> str:
        return rich_html(self.table(), width=120)


def _mtp_caption(d: dict) -> str:
    """The MTP row in the terminal table's caption (nothing without an MTP layer)."""
    rows = (d.get("mtp") or {}).get("rows")
    if not rows:
        return ""
    ref = d["mtp"]["reference"]
    accept = (lambda r: f"acceptance {r['acceptance']:.3f}, " if r.get("acceptance") is not None else "")  # noqa: E731
    return "\nMTP layer: " + "; ".join(f"{SHORT_TITLES.get(k, k)} {accept(r)}KL {r['kl']:.3g}, top-1 {r['top1']:.3f}, "
                                        f"accuracy {r['accuracy']:.3f}" for k, r in rows.items()) + \
        f" (source {accept(ref)}accuracy {ref['accuracy']:.3f})"


def render_markdown(d: dict) -> str:
    """validation.md: the numbers of validation.json as readable tables."""
    e = d["eval_data"]
    lines = [
        f"# Validation: {d['reference']['spec']} vs `{d['dir']}`",
        "",
        f"**{'PASSED' if d['passed'] else 'FAILED'}** ({d['gates_from']} gates). quantkit {d['quantkit_version']}, "
        f"{d['device']}, {d['dtype']}, {d['seconds']:.1f} s. Numerics: "
        f"{(d.get('numerics') or {}).get('line', 'weights numerics')}.",
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
    from quantkit.validation.mtprow import mtp_markdown

    lines += mtp_markdown(d)
    lines += kv_markdown(d)
    from quantkit.validation.longctx import long_markdown

    lines += long_markdown(d)
    from quantkit.validation.tasks import tasks_markdown
    from quantkit.validation.toolcalls import tool_markdown

    lines += tasks_markdown(d)
    lines += tool_markdown(d)
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


# ---- the files ---------------------------------------------------------------------------------
EXPERTS_PNG = "validation-experts.png"  # the per-expert map (quantkit.validation.expertmap)
PENDING = RESULTS_PENDING  # the marker of validate's result files being made visible together


def _checkpoint_folders(t: Target) -> dict[str, Path]:
    """The pair's checkpoint folders (each gets a copy of the results beside its card)."""
    return {w: t.out / t.report["outputs"][w]["path"] for w in ("prefill", "decode")}


def write_files(t: Target, data: dict) -> dict[str, Path]:
    """Write validation.json, .md and .png into the target folder and, for a convert output, the per-expert
    map validation-experts.png, the model cards and a copy of the results beside each card (a checkpoint
    folder uploaded alone renders its card whole, figures included); returns {what: path}.

    All of them or none become visible: each is written whole under a staged name first, then
    quantkit.runtime.files.commit_renames renames them in a fixed order under a marker (PENDING),
    which the next validate or verify completes after a crash; so a card never says "all gates
    passed" beside a validation.json that failed (and a full disk leaves no 0-byte file either)."""
    from quantkit.runtime.files import atomic_write_text, commit_renames, finish_renames, staged

    files = {"json": t.out / "validation.json", "md": t.out / "validation.md", "png": t.out / "validation.png"}
    if t.report is not None and t.report.get("experts"):
        files["experts_png"] = t.out / EXPERTS_PNG
    finish_renames(t.out / PENDING)  # a crashed earlier write: completed before this one starts
    texts = {"json": (files["json"], json.dumps(data, indent=2) + "\n"), "md": (files["md"], render_markdown(data))}
    if t.pair and t.report is not None:
        from quantkit.validation.card import cards

        for which, (path, text) in cards(t.out, t.report, data).items():
            files[f"card_{which}"] = path
            texts[f"card_{which}"] = (path, text)
        for which, folder in _checkpoint_folders(t).items():  # each folder alone renders its card complete
            for kind in ("json", "md"):
                files[f"{kind}_{which}"] = folder / files[kind].name
                texts[f"{kind}_{which}"] = (files[f"{kind}_{which}"], texts[kind][1])
            files[f"png_{which}"] = folder / files["png"].name
            if "experts_png" in files:
                files[f"png_experts_{which}"] = folder / EXPERTS_PNG
    for path, text in texts.values():
        atomic_write_text(staged(path), text)
    plot(data, t.report, staged(files["png"]))
    if "experts_png" in files:
        from quantkit.validation.expertmap import input_width, plot_expert_map

        config = t.models.get("decode", t.models.get("model")) / "config.json"
        width = input_width(json.loads(config.read_text())) if config.is_file() else None
        plot_expert_map(t.report, staged(files["experts_png"]), width, data["reference"]["spec"])
    for key, path in files.items():
        if key.startswith("png_"):
            shutil.copyfile(staged(files["experts_png" if key.startswith("png_experts_") else "png"]), staged(path))
    faults.point("validate:staged")
    commit_renames(t.out / PENDING, list(files.values()))
    return files
