"""validate's gates: bounds on the measured metrics, read from a file, a dict or the recipe, and checked
against the rows.

A gate is `<metric>_max` or `<metric>_min` (`kl_max: 0.05`), optionally scoped to one row
(`cross_phase.greedy_agree_min`). An unscoped gate holds for every row that measures the metric but a
row with a scoped gate of the same metric and bound (the more specific one: `cross_phase.kl_max` beside
`kl_max`, for a row measured on fewer tokens); the
FP8-KV rows answer only to `kv_delta` and to gates scoped to them, so simulating the cache never fails
the weights' gates; the long-context rows (quantkit.validation.longctx) likewise to `indexer_overlap`.
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path

from quantkit.errors import ConfigError

__all__ = ["BY_CONSTRUCTION", "GATES_FAILED_EXIT", "KV_ROWS", "LONG_ROWS", "METRICS", "PAIR_ROWS", "STEP_ROWS", "check_gates", "identical_rows", "load_gates",
           "resolve_gates"]

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
    "indexer_overlap": "long-context rows only (DSA models): mean over indexer layers of the fraction of the source "
                       "indexer's top-k positions the checkpoint's indexer also selects, queries past index_topk",
    "kv_delta": "KV rows only: KL added by the FP8 KV cache over the same weights and steps with a BF16 cache, nats",
}
PAIR_ROWS = ("prefill", "decode", "cross_phase", "decode_kv", "cross_phase_kv")
KV_ROWS = {"decode_kv": "decode", "cross_phase_kv": "cross_phase"}  # KV row -> the weights-only path it adds to
LONG_ROWS = ("long_context_prefill", "long_context_decode", "long_context_decode_kv", "long_context_model")  # quantkit.validation.longctx
STEP_ROWS = ("cross_phase", *KV_ROWS)
_OWN_METRIC = {r: "kv_delta" for r in KV_ROWS} | {r: "indexer_overlap" for r in LONG_ROWS}  # the one unscoped gate they answer to  # rows measured on decode steps rather than the prompt pass
GATES_FAILED_EXIT = 3  # the CLI's exit code when a gate fails (1 is a usage/input error)


def resolve_gates(gates: str | Path | dict | None, default: dict[str, float], default_from: str) -> tuple[dict[str, float], str]:
    """(gates, where they came from): `default` (the recipe's) when `gates` is None, else a dict given
    in the call, else a gate file; every name checked."""
    if gates is None:
        gate_map, gates_from = dict(default), default_from
    elif isinstance(gates, dict):
        gate_map, gates_from = {str(k): _number(v, f"gate {k!r}") for k, v in gates.items()}, "argument"
    else:
        gate_map, gates_from = load_gates(gates), str(gates)
    _check_gate_names(gate_map, gates_from)
    return gate_map, gates_from


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
        if bound not in ("max", "min") or metric not in METRICS or (row is not None and row not in (*PAIR_ROWS, *LONG_ROWS, "model")):
            close = difflib.get_close_matches(name.rpartition(".")[2], known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{where}: unknown gate {name!r}; {hint}a gate is [row.]metric_max|_min with metric one of "
                              f"{', '.join(METRICS)} and row one of {', '.join(PAIR_ROWS)}")


SAME = {"prefill": ("pass",), "decode": ("pass", "reuse-int4")}  # decisions that copy the source's bytes
BY_CONSTRUCTION = "identical to the source by construction (every tensor the source's bytes): not evidence"


def identical_rows(report: dict | None) -> set[str]:
    """The rows whose checkpoint holds the source's bytes for every tensor (convert-report.json's
    `decisions` lists every tensor not passed through): prefill converted from an FP8 source, decode
    from an INT4 source with `--decode-rest bf16`. Such a row measures 0 by construction, so its
    gates are shown as such and counted as no evidence."""
    if not report or "decisions" not in report:
        return set()
    same = {w for w, ok in SAME.items() if all(d.get(w) in ok for d in report["decisions"].values())}
    return {r for w in same for r in (w, f"long_context_{w}")}


def check_gates(gates: dict[str, float], rows: dict[str, dict], identical: "set[str] | frozenset[str]" = frozenset()) -> list[dict]:
    """One entry per (gate, row it applies to); `passed` None where no row measured the metric, or
    where the row is `identical` to the source by construction (its value kept, with a note)."""
    results = []
    for name, bound in gates.items():
        scope, metric, kind = _split_gate(name)
        # unscoped gates bound the weights' rows (but a row's own scoped gate of the same metric replaces
        # them there); the FP8-KV rows answer to `kv_delta`, the long-context rows to `indexer_overlap`,
        # and both to gates scoped to them
        applies = [r for r in rows if (r == scope if scope else metric == _OWN_METRIC.get(r, metric)
                                        and f"{r}.{metric}_{kind}" not in gates)
                   and rows[r]["metrics"].get(metric) is not None]
        if not applies:
            results.append({"gate": name, "row": scope, "metric": metric, "bound": bound, "value": None, "passed": None,
                            "note": "not measured (no such row, or gen_tokens too small)"})
        for r in applies:
            v = rows[r]["metrics"][metric]
            ok = bool(v <= bound) if kind == "max" else bool(v >= bound)  # NaN fails both
            if r in identical:
                results.append({"gate": name, "row": r, "metric": metric, "bound": bound, "value": v, "passed": None,
                                "note": BY_CONSTRUCTION})
                continue
            results.append({"gate": name, "row": r, "metric": metric, "bound": bound, "value": v, "passed": ok})
    return results
