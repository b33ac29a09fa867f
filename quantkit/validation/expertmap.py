"""validation-experts.png: every routed expert at a glance, decoder layers x experts.

A model of 256-384 routed experts a layer hides one broken or undersampled expert in any per-layer
curve; this map shows each one. The numbers are convert-report.json's: for each expert, the mean
squared output error of the weights the decode checkpoint stores, measured against the source
expert on held-out calibration tokens (the guard's measurement; RTN's when RTN was stored), and the
same error relative to RTN's (below 1: calibration paid). Marked on both panels: the experts that
fell back (too few routed tokens for their own Hessian, or the guard kept RTN) and those that saw
fewer routed calibration tokens than their input width (their Hessian is rank-deficient, so
dampening, not data, fills the rest).

`expert_map` returns the arrays the figure plots, so tests check the data rather than pixels.
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["expert_map", "input_width", "plot_expert_map"]

NAN = float("nan")


def input_width(config: dict) -> int | None:
    """The routed experts' input width (hidden size) from a checkpoint's config.json (a multimodal
    wrapper keeps it in text_config)."""
    for c in (config, config.get("text_config") or {}):
        if isinstance(c.get("hidden_size"), int):
            return c["hidden_size"]
    return None


def stored_error(e: dict) -> float | None:
    """The output error of the weights the decode checkpoint stores for expert entry `e`."""
    kept_rtn = e.get("guard") == "rtn" or e.get("fallback") == "rtn"  # a data-free method records err_rtn alone
    v = e.get("err_rtn") if kept_rtn or e.get("err") is None else e.get("err")
    return None if v is None else float(v)


def expert_map(report: dict, width: int | None = None) -> dict:
    """The map's data from convert-report.json's `experts`.

    Returns {"layers": [layer ids, rows], "labels": [row labels, MTP marked], "experts": n (columns), "error": rows x n (NaN where
    nothing was measured, e.g. reused experts), "vs_rtn": rows x n (stored error / RTN's),
    "fallback": [(row, col)], "few_tokens": [(row, col)], "tokens": rows x n, "width": width,
    "reused": count}."""
    experts = report.get("experts") or []
    layers = sorted({e["layer"] for e in experts})
    n = max((e["expert"] for e in experts), default=-1) + 1
    row = {layer: i for i, layer in enumerate(layers)}
    error = [[NAN] * n for _ in layers]
    vs_rtn = [[NAN] * n for _ in layers]
    tokens = [[NAN] * n for _ in layers]
    fallback, few = [], []
    for e in experts:
        i, j = row[e["layer"]], e["expert"]
        if e["method"] == "reused":
            continue
        err = stored_error(e)
        if err is not None:
            error[i][j] = err
            if e.get("err_rtn"):
                vs_rtn[i][j] = err / e["err_rtn"]
        if e.get("tokens") is not None:
            tokens[i][j] = float(e["tokens"])
        if e.get("decision") == "fallback" or e.get("fallback") or e.get("guard") == "rtn":
            fallback.append((i, j))
        if width is not None and e.get("tokens") is not None and e["tokens"] < width:
            few.append((i, j))
    mtp = set(((report.get("mtp") or {}).get("calibrated_layers")) or [])
    return {"layers": layers, "labels": [f"{x} (MTP)" if x in mtp else str(x) for x in layers], "experts": n, "error": error, "vs_rtn": vs_rtn, "tokens": tokens,
            "fallback": fallback, "few_tokens": few, "width": width,
            "reused": sum(1 for e in experts if e["method"] == "reused")}


def _panel(fig, ax, m: dict, key: str, title: str, cmap: str, log: bool, center_one: bool = False) -> None:
    import matplotlib.colors as mcolors

    values = [v for r in m[key] for v in r if not math.isnan(v) and v > 0]
    ax.set_title(title, fontsize=11)
    if not values:
        ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    lo, hi = min(values), max(values)
    if center_one:  # stored / RTN: blue below 1 (calibration paid), red above
        span = max(abs(math.log10(lo)), abs(math.log10(hi)), 0.05)
        norm = mcolors.LogNorm(10 ** -span, 10 ** span)
    else:
        norm = mcolors.LogNorm(lo, max(hi, lo * 1.0001)) if log else None
    image = ax.imshow(m[key], aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
    fig.colorbar(image, ax=ax, fraction=0.05)
    for (i, j) in m["fallback"]:
        ax.plot(j, i, "x", color="black", ms=7, mew=1.6)
    for (i, j) in m["few_tokens"]:
        ax.plot(j, i, "o", mfc="none", mec="magenta", ms=9, mew=1.2)
    ax.set_yticks(range(len(m["layers"])))
    ax.set_yticklabels(m["labels"])
    ax.set_ylabel("decoder layer")
    ax.set_xlabel("routed expert")


def plot_expert_map(report: dict, path: Path, width: int | None = None, title: str = "") -> dict:
    """Write the map to `path`; returns the plotted data (expert_map's)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    m = expert_map(report, width)
    cols = max(m["experts"], 1)
    fig, axes = plt.subplots(1, 2, figsize=(min(9 + cols * 0.12, 40), 2.4 + 0.35 * max(len(m["layers"]), 1)),
                             constrained_layout=True)
    _panel(fig, axes[0], m, "error", "Stored expert's output error\n(mean squared, held-out calibration tokens)", "viridis", True)
    _panel(fig, axes[1], m, "vs_rtn", "Stored error / RTN's\n(below 1: calibration paid)", "coolwarm", True, True)
    few = f"fewer routed tokens than the input width ({width})" if width else "few routed tokens (width unknown)"
    handles = [Line2D([], [], ls="", marker="x", color="black", mew=1.6, label=f"fell back ({len(m['fallback'])})"),
               Line2D([], [], ls="", marker="o", mfc="none", mec="magenta", label=f"{few} ({len(m['few_tokens'])})")]
    fig.legend(handles=handles, loc="outside lower center", ncol=2, fontsize=9)
    note = f"; {m['reused']} experts reused from the source's INT4, not measured" if m["reused"] else ""
    fig.suptitle(f"Routed experts, layers x experts{(': ' + title) if title else ''}{note}", fontsize=12)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return m
