"""The model card's calibration coverage: per MoE layer, how many routed calibration tokens its
experts saw (min, p10, median; also per input column of gate/up, the evidence one expert's Hessian
has per diagonal entry) and how many experts fell under each decision and why.

Read from convert-report.json's `coverage` (quantkit.conversion.report.coverage); each expert's own
statistics and decision stay in the report's `experts`. A report written before `coverage` existed
gives no section.
"""

from __future__ import annotations

__all__ = ["coverage_card"]


def _counts(reasons: dict[str, int]) -> str:
    return ", ".join(f"{n} {why}" for why, n in reasons.items())


def _triple(stats: dict | None, fmt: str) -> str:
    if not stats:
        return "—"
    return " / ".join(format(stats[k], fmt) for k in ("min", "p10", "median"))


def coverage_card(report: dict) -> list[str]:
    """The card's lines: the totals over every layer, then the per-layer table (folded, as a real
    model has ~60-90 MoE layers)."""
    rows = report.get("coverage")
    if not rows:
        return []
    total: dict[str, int] = {}
    for row in rows:
        for why, n in row["reasons"].items():
            total[why] = total.get(why, 0) + n
    thin = sum(row.get("under_one_per_column", 0) for row in rows)
    seen = [row for row in rows if row.get("routed_tokens")]
    lowest = min((row["tokens_per_column"]["min"] for row in seen), default=None)
    out = ["", "### Calibration coverage of the routed experts", "",
           f"- decisions over {sum(r['experts'] for r in rows)} routed experts in {len(rows)} MoE layers: "
           + _counts(dict(sorted(total.items(), key=lambda kv: -kv[1])))]
    if seen:
        out.append(f"- {thin} of the experts not reused from the source saw under one routed token per input column; "
                   f"the fewest per column in any layer: {lowest:.3g}")
    out += ["- each expert's routed tokens, tokens per input column, held-out errors (its own and RTN's) and "
            "decision with why: convert-report.json `experts`", "",
            "<details><summary>per layer</summary>", "",
            "| layer | experts | routed tokens min / p10 / median | per input column min / p10 / median | decisions |",
            "|---:|---:|---|---|---|"]
    out += [f"| {r['layer']} | {r['experts']} | {_triple(r.get('routed_tokens'), 'g')} | "
            f"{_triple(r.get('tokens_per_column'), '.3g')} | {_counts(r['reasons'])} |" for r in rows]
    out += ["", "</details>"]
    return out
