"""What `quantkit plan` shows: a Plan as sections (title, headers, rows), printed as rich tables or
written as markdown or HTML (Jupyter), the number formats they use, and the FP8 KV capacity line
beside the KV delta a validate run measured (`--validation`).

`plan` here is a quantkit.planner.capacity.Plan; its `sections`, `to_table` and `_repr_*_`
methods call these.
"""

from __future__ import annotations

import html
from typing import Any

from quantkit.model.tensors import TensorClass
from quantkit.runtime.units import GiB

Section = tuple[str, list[str], list[list[str]]]  # title, column headers, rows

# ---- number formats -------------------------------------------------------------------------------


def gib(b: float) -> str:
    """Bytes as GiB, one decimal: 703.7."""
    return f"{b / GiB:,.1f}"


def params_b(n: float) -> str:
    """A parameter count in billions: 743.53B."""
    return f"{n / 1e9:,.2f}B"


def tokens(n: float, *, exact_small: bool = True) -> str:
    """689K / 1.38M: compact enough for an 80-column terminal (exact counts are in --json). Under
    1K the count itself, or, with `exact_small=False`, still in K."""
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e3 or not exact_small:
        return f"{n / 1e3:.0f}K"
    return str(n)


def value(x: float, unit: str) -> str:
    """A published figure or quantkit's in its unit: params in billions, counts whole, sizes to 0.1."""
    if unit == "params":
        return params_b(x)
    if unit in ("tokens", "requests"):
        return f"{x:,.0f}"
    return f"{x:,.1f}"


# ---- the sections ---------------------------------------------------------------------------------


def plan_sections(plan) -> list[Section]:
    """Every section `quantkit plan` prints, in order."""
    out = [_params(plan), _checkpoints(plan), _kinds(plan), _by_class(plan), _kv(plan)]
    if plan.article:
        out.append(_article(plan))
    out.append(("assumptions (keyword options of plan())", ["option", "value", "meaning"],
                [[k, str(v["value"]), v["meaning"]] for k, v in plan.assumptions.items()]))
    if plan.notes:
        out.append(("notes", ["note"], [[n] for n in plan.notes]))
    return out


def _params(plan) -> Section:
    counts = (plan.params_total, plan.params_text, plan.params_mtp, plan.params_vision, plan.params_active)
    return "parameters", ["total", "text", "MTP", "vision", "active/token"], [[params_b(x) for x in counts]]


def _checkpoints(plan) -> Section:
    kvd = list(next(iter(plan.checkpoints.values())).kv)
    setup = f"{plan.gpus}x {plan.gpu} ({plan.gpu_mem_gib} GiB), TP{plan.tp}, context {plan.context:,}"
    rows = [
        [
            ck.kind,
            f"{ck.total_gb:,.1f}",
            gib(ck.total_bytes),
            f"{ck.weights_gib_per_gpu:,.1f}",
            "yes" if ck.fits else "NO",
            *[tokens(ck.kv[d].tokens) for d in kvd],
            *[f"{ck.kv[d].concurrent_requests}" for d in kvd],
        ]
        for ck in plan.checkpoints.values()
    ]
    headers = ["kind", "GB", "GiB", "GiB/GPU", "fits", *[f"KV {d}" for d in kvd], *[f"req {d}" for d in kvd]]
    return f"{plan.model}: checkpoints on {setup}", headers, rows


def _kinds(plan) -> Section:
    # the long text goes in its own two-column table, so the numbers fit an 80-column terminal
    rows = [[ck.kind, ck.reason if not ck.fits else ck.description] for ck in plan.checkpoints.values()]
    return "checkpoint kinds", ["kind", "format / reason"], rows


def _by_class(plan) -> Section:
    cks = plan.checkpoints.values()
    classes = sorted({c for ck in cks for c in ck.bytes_by_class}, key=[c.value for c in TensorClass].index)
    rows = [[c, f"{plan.params_by_class.get(c, 0) / 1e9:,.3f}", *[gib(ck.bytes_by_class.get(c, 0)) for ck in cks]] for c in classes]
    rows.append(["total", f"{plan.params_total / 1e9:,.3f}", *[gib(ck.total_bytes) for ck in cks]])
    return "bytes by tensor class (GiB)", ["class", "params (B)", *plan.checkpoints], rows


def _kv(plan) -> Section:
    rows = [[d, str(v["latent"]), str(v["indexer_avg"]), f"{v['per_token']:,}"] for d, v in plan.kv_bytes_per_layer.items()]
    return f"KV cache per token ({plan.kv_layers} layers)", ["dtype", "cache B/layer", "indexer B/layer", "B/token"], rows


def _article(plan) -> Section:
    rows = [[c.figure, c.unit, value(c.article, c.unit), value(c.quantkit, c.unit), f"{c.ratio:.3f}", c.source] for c in plan.article]
    return ("quantkit vs published figures (ratio = quantkit / published)",
            ["figure", "unit", "published", "quantkit", "ratio", "source"], rows)


# ---- rich, markdown, html -------------------------------------------------------------------------

_LEFT = ("kind", "class", "figure", "option", "meaning", "note", "format / reason", "source", "dtype")


def plan_tables(plan) -> list[Any]:
    """rich Tables, one per section."""
    from rich.table import Table

    tables = []
    for title, headers, rows in plan_sections(plan):
        t = Table(title=title, title_justify="left")
        for hdr in headers:
            t.add_column(hdr, overflow="fold", no_wrap=hdr in ("kind", "class"), justify="left" if hdr in _LEFT else "right")
        for r in rows:
            t.add_row(*r, style="bold red" if "fits" in headers and r[headers.index("fits")] == "NO" else None)
        tables.append(t)
    return tables


def plan_markdown(plan) -> str:
    parts = []
    for title, headers, rows in plan_sections(plan):
        esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
        lines = [f"**{title}**", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def plan_html(plan) -> str:
    parts = []
    for title, headers, rows in plan_sections(plan):
        th = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
        trs = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
        parts.append(f"<table><caption style='text-align:left'><b>{html.escape(title)}</b></caption><tr>{th}</tr>{trs}</table>")
    return "\n".join(parts)


def render_plan(plan, console: Any) -> None:
    """Print every section of a Plan on a rich Console."""
    for table in plan.to_table():
        console.print(table)


# ---- beside a measured delta ----------------------------------------------------------------------


def capacity_beside_delta(plan, validation: dict) -> list[str]:
    """`quantkit plan --validation FILE`: FP8 KV capacity next to the KV delta validate measured,
    e.g. "FP8 KV: 1.58M tokens (2.0x), measured KL +0.0004 (decode + FP8 KV cache, ...)"."""
    kinds = [k for k in ("decode", "source", "int4-bf16") if k in plan.checkpoints and plan.checkpoints[k].fits]
    if not kinds:
        return ["FP8 KV: no checkpoint kind fits this setup"]
    ck = plan.checkpoints[kinds[0]]
    fp8, bf16 = ck.kv["fp8"].tokens, ck.kv["bf16"].tokens
    ratio = f" ({fp8 / bf16:.1f}x)" if bf16 else ""
    kv = validation.get("kv_cache") or {}
    rows = {r: validation.get("rows", {}).get(r) for r in ("decode_kv", "cross_phase_kv")}
    measured = [(r, v) for r, v in rows.items() if v and v["metrics"].get("kv_delta") is not None]
    if kv.get("dtype", "bf16") == "bf16" or not measured:
        return [f"FP8 KV: {tokens(fp8, exact_small=False)} tokens{ratio} on {kinds[0]}; not measured: "
                "run `quantkit validate DIR --kv-cache-dtype fp8_e4m3` and pass its validation.json"]
    out = []
    for r, v in measured:
        se = v["kv"].get("kv_delta_se")
        out.append(f"FP8 KV: {tokens(fp8, exact_small=False)} tokens{ratio} on {kinds[0]}, measured KL {v['metrics']['kv_delta']:+.2g}"
                   f"{f' (SE {se:.1g})' if se else ''} on {r.replace('_', ' ')} ({kv['dtype']}, "
                   f"{'calibrated scales' if kv.get('calibrated') else 'scale 1.0'}; {validation.get('dir', 'validation.json')})")
    return out
