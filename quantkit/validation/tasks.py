"""Task-level deltas through lm-evaluation-harness: `quantkit validate DIR --tasks t1,t2`.

KL and top-1 say how far a checkpoint's distribution moved; users decide on task accuracy. Here the
same lm-eval tasks run on the source, the FP8 prefill and the INT4 decode checkpoint (and, with
`--kv-cache-dtype`, on the decode checkpoint with its KV cache stored as the engines store it),
each through quantkit's streaming forward as an lm-eval model (quantkit.validation.lmmodel), so a
full-scale checkpoint needs one layer's memory. Per task: each score with lm-eval's standard error,
and against the source the paired delta over the same items with its standard error (the SE of the
per-item differences, much smaller than either score's when the checkpoints agree on most items),
and the items that flipped. Task versions, shot counts and item counts are recorded so a reader can
rerun it. Everything here is lm-eval's own machinery (TaskManager, simple_evaluate, its metrics):
tasks are lm-eval task names or local task YAMLs (`--task-dir`, e.g. `dataset_path: json` with
`data_files`), and nothing of the harness is re-implemented.

lm-eval is optional (`pip install -e ".[eval]"`) and imported only when --tasks is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.errors import ConfigError

__all__ = ["INSTALL", "TaskSpec", "paired", "prepare", "run_tasks", "summarize_task", "tasks_markdown", "tasks_card", "tasks_caption"]

INSTALL = 'pip install -e ".[eval]"  (or: pip install "lm-eval[hf]>=0.4.9,<0.5")'
ROWS = {"reference": "source", "prefill": "prefill (FP8)", "decode": "decode (INT4)", "model": "model",
        "decode_kv": "decode (INT4) + FP8 KV cache"}
MAX_FLIPS = 50  # items listed per row and task in validation.json (the count is always whole)


@dataclass
class TaskSpec:
    """What to run: lm-eval task names (or local task YAMLs under `task_dir`), items per task, shots."""

    names: list[str]
    task_dir: Path | None = None
    limit: int | None = None
    num_fewshot: int | None = None
    manager: object = None  # lm_eval.tasks.TaskManager, set by prepare


def lm_eval_module():
    """lm_eval, or one line saying how to install it."""
    try:
        import lm_eval
    except ImportError:
        raise ConfigError(f"--tasks needs lm-evaluation-harness, which is not installed: {INSTALL}") from None
    return lm_eval


def prepare(tasks: str | list[str] | None, task_dir=None, limit=None, num_fewshot=None) -> TaskSpec | None:
    """Check everything the task runs need before validate starts (lm-eval installed, every task name
    known, the numbers sane); None without tasks."""
    if not tasks:
        return None
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    if task_dir is not None and not Path(task_dir).is_dir():
        raise ConfigError(f"--task-dir {task_dir}: no such folder; pass the folder holding the task YAMLs")
    for name, value in (("limit", limit), ("num-fewshot", num_fewshot)):
        if value is not None and (not isinstance(value, int) or value < (1 if name == "limit" else 0)):
            raise ConfigError(f"--{name}: must be an integer >= {1 if name == 'limit' else 0} (got {value!r})")
    lm_eval_module()
    from lm_eval.tasks import TaskManager

    if task_dir is not None:
        # lm-eval's index of its own tasks reads ~15K YAMLs (about 20 s); tasks that are all in --task-dir
        # need only that folder's
        local = TaskManager(include_path=str(task_dir), include_defaults=False)
        if set(names) <= set(local.all_tasks):
            try:
                return TaskSpec(names, Path(task_dir), limit, num_fewshot, _loaded(local, names))
            except ConfigError:
                pass  # e.g. a local group over lm-eval's own tasks: the whole index below decides
    manager = TaskManager(include_path=str(task_dir) if task_dir else None)
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            import difflib

            near = difflib.get_close_matches(name, sorted(known), n=3)
            raise ConfigError(f"--tasks {name}: no such lm-eval task" + (f" (did you mean {', '.join(near)}?)" if near else "")
                              + ("; local task YAMLs go in --task-dir" if task_dir is None else f" in lm-eval or {task_dir}"))
    return TaskSpec(names, Path(task_dir) if task_dir else None, limit, num_fewshot, _loaded(manager, names))


def _loaded(manager, names: list[str]):
    """`manager` once every task is built and its data loaded: now, not after the KL rows."""
    try:
        if hasattr(manager, "load"):  # lm-eval 0.4.10+
            manager.load(names)
        else:
            from lm_eval.tasks import get_task_dict

            get_task_dict(names, manager)
    except Exception as e:  # lm-eval raises anything from a YAML error to a dataset download failure
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"--tasks {','.join(names)}: lm-eval could not load the task data ({type(e).__name__}: {first}); "
                          "offline, point the task YAML at local files (dataset_path: json, data_files) in --task-dir") from None
    return manager


def batch_bytes(budget_bytes: int, kept_bytes: int) -> int:
    """Activation bytes one pass over the layers may hold (quantkit.validation.lmmodel.activation_bytes):
    a quarter of what the budget leaves beside the kept weights (the layer loop's weights have the
    rest), at least 256 MB."""
    return int(max(max(budget_bytes - kept_bytes, 0) // 4, 256 << 20))


def run_tasks(spec: TaskSpec, ckpts: dict, tokenizer: Path, kv: dict, dev: torch.device, dtype, plan: dict,
              progress=None) -> dict:
    """validation.json's `tasks`: every task on every checkpoint row, scores and paired deltas vs the source."""
    lm_eval = lm_eval_module()
    from quantkit.validation.lmmodel import QuantkitLM

    runs = {row: (ckpts[row], None) for row in ckpts}
    if "" in kv and "decode" in ckpts:
        runs["decode_kv"] = (ckpts["decode"], kv[""])
    bb = batch_bytes(plan.get("budget_bytes", 0), plan.get("kept_on_device_bytes") or plan.get("kept_bytes", 0))
    raw, cost = {}, {}
    for row, (ck, cache) in runs.items():
        lm = QuantkitLM(ck, tokenizer=tokenizer, device=dev, dtype=dtype, batch_bytes=bb, chunk=plan.get("chunk", 16),
                        kv=cache, progress=progress)
        raw[row] = lm_eval.simple_evaluate(model=lm, tasks=spec.names, task_manager=spec.manager, limit=spec.limit,
                                           num_fewshot=spec.num_fewshot, log_samples=True, bootstrap_iters=1000,
                                           random_seed=0, numpy_random_seed=1234, torch_random_seed=1234,
                                           fewshot_random_seed=1234)
        cost[row] = {"passes": lm.passes, "tokens_generated": lm.tokens_generated}
    from importlib.metadata import version

    return {"lm_eval_version": version("lm_eval"), "task_dir": str(spec.task_dir) if spec.task_dir else None,
            "limit": spec.limit, "batch_bytes": bb, "rows": list(runs), "cost": cost,
            "kv_note": ("decode_kv: the decode checkpoint with the KV cache stored as " + kv[""].dtype +
                        "; a log-likelihood is one prefill pass (fresh keys), so only generation reads the stored cache")
            if "decode_kv" in runs else None,
            "tasks": {name: summarize_task(name, raw) for name in _leaf_tasks(raw["reference"])}}


def _leaf_tasks(res: dict) -> list[str]:
    """The tasks that have per-item samples (a group's subtasks, not the group)."""
    return [t for t in res["results"] if t in (res.get("samples") or {})]


def summarize_task(name: str, raw: dict) -> dict:
    """One task across the rows: version, shots, items, the metric (under its first filter), each row's
    score and SE, and against the source the paired delta and flips."""
    ref = raw["reference"]
    samples = ref["samples"][name]
    metric = samples[0]["metrics"][0] if samples and samples[0].get("metrics") else None
    # the first filter lm-eval reports the metric under (gsm8k: strict-match, then flexible-extract)
    key = next((k for k in ref["results"][name] if k.startswith(f"{metric},") and "_stderr" not in k), f"{metric},none")
    filt = key.split(",", 1)[1]
    items = {row: _items(r["samples"][name], metric, filt) for row, r in raw.items()}
    out = {"version": ref["versions"].get(name), "num_fewshot": ref["n-shot"].get(name),
           "items": (ref.get("n-samples") or {}).get(name, {}).get("effective", len(samples)),
           "items_in_task": (ref.get("n-samples") or {}).get(name, {}).get("original"),
           "metric": metric, "filter": filt, "higher_is_better": (ref.get("higher_is_better") or {}).get(name, {}).get(metric),
           "rows": {}}
    for row, r in raw.items():
        res = r["results"][name]
        score, se = res.get(key), res.get(f"{metric}_stderr,{filt}")
        entry = {"score": _num(score), "stderr": _num(se),
                 "all": {k.split(",")[0]: _num(v) for k, v in res.items() if "," in k and "_stderr" not in k}}
        if row != "reference":
            entry.update(paired(items["reference"], items[row]))
        out["rows"][row] = entry
    return out


def _items(samples: list[dict], metric: str | None, filt: str) -> dict[int, float]:
    return {int(s["doc_id"]): float(s[metric]) for s in samples if metric in s and s.get("filter", filt) == filt}


def paired(ref: dict[int, float], other: dict[int, float]) -> dict:
    """The paired delta over the items both ran, its SE (of the per-item differences), and the flips."""
    ids = sorted(set(ref) & set(other))
    d = [other[i] - ref[i] for i in ids]
    n = len(d)
    mean = sum(d) / n if n else None
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else None
    flips = [{"doc_id": i, "reference": ref[i], "this": other[i]} for i in ids if other[i] != ref[i]]
    return {"delta": mean, "delta_stderr": se, "paired_items": n, "flipped": len(flips),
            "flipped_better": sum(1 for f in flips if f["this"] > f["reference"]),
            "flipped_worse": sum(1 for f in flips if f["this"] < f["reference"]), "flips": flips[:MAX_FLIPS]}


def _num(v):
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None  # lm-eval writes "N/A" for a stderr it could not compute
    return None if math.isnan(v) else v


# ---- what the reports show ------------------------------------------------------------------------
def _g(v, fmt: str = ".4f") -> str:
    return "—" if v is None else format(v, fmt)


def table_lines(t: dict) -> list[str]:
    """The markdown table of validation.json's `tasks` (validation.md and both model cards)."""
    lines = ["| task | version | shots | items | metric | row | score | ± SE | Δ vs source | ± SE (paired) | flipped (+/−) |",
             "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for name, task in t["tasks"].items():
        for row, r in task["rows"].items():
            delta = "—" if row == "reference" else _g(r["delta"], "+.4f")
            flips = "—" if row == "reference" else f"{r['flipped']} ({r['flipped_better']}/{r['flipped_worse']})"
            lines.append(f"| {name} | {task['version']} | {task['num_fewshot']} | {task['items']} | {task['metric']} "
                         f"| {ROWS.get(row, row)} | {_g(r['score'])} | {_g(r['stderr'])} | {delta} "
                         f"| {'—' if row == 'reference' else _g(r['delta_stderr'])} | {flips} |")
    return lines


def _rerun(t: dict) -> str:
    cmd = f"quantkit validate DIR --tasks {','.join(t['tasks'])}"
    cmd += f" --task-dir {t['task_dir']}" if t.get("task_dir") else ""
    cmd += f" --limit {t['limit']}" if t.get("limit") else ""
    return cmd


def tasks_markdown(d: dict) -> list[str]:
    """validation.md's task section (empty without --tasks)."""
    t = d.get("tasks")
    if not t:
        return []
    lines = ["", "## Task-level deltas (lm-evaluation-harness)", "",
             f"lm-eval {t['lm_eval_version']}, greedy, each checkpoint through quantkit's streaming forward; the "
             "paired delta is over the same items (SE of the per-item differences); flipped: items whose score "
             "changed (better/worse). Rerun: `" + _rerun(t) + "`.", "", *table_lines(t)]
    if t.get("kv_note"):
        lines += ["", t["kv_note"] + "."]
    return lines


def tasks_card(validation: dict) -> list[str]:
    """The model card's task section (empty without --tasks)."""
    t = validation.get("tasks")
    if not t:
        return []
    return ["## Task accuracy", "",
            f"Measured by `quantkit validate --tasks` through lm-evaluation-harness {t['lm_eval_version']} (greedy; "
            "paired delta and its standard error over the same items):", "", *table_lines(t), ""]


def tasks_caption(d: dict) -> str:
    """One line per task for the terminal table's caption."""
    t = d.get("tasks")
    if not t:
        return ""
    out = []
    for name, task in t["tasks"].items():
        rows = task["rows"]
        ref = rows["reference"]
        parts = [f"source {_g(ref['score'], '.3f')}±{_g(ref['stderr'], '.3f')}"]
        parts += [f"{row} Δ{_g(r['delta'], '+.3f')}±{_g(r['delta_stderr'], '.3f')} ({r['flipped']} flipped)"
                  for row, r in rows.items() if row != "reference"]
        out.append(f"\ntask {name} ({task['metric']}, {task['items']} items, {task['num_fewshot']}-shot): " + "; ".join(parts))
    return "".join(out)
