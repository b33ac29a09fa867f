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

This module is the pipeline: open the target, measure, check the gates, record and write. The
parts, each readable on its own:

    targets    the folders under test, the reference, the settings (call, else recipe), the notes
    weights    which experts each rank runs, what it reads and keeps in memory
    kvrows     the FP8 KV-cache variants and rows
    longctx    DSA models: windows past index_topk, KL there and the indexer's top-k overlap
    toolcalls  --tool-task: tool-call F1 (finish_reason tool_calls) and schema accuracy against the source
    measure    the lockstep passes and every number (metrics: the one KL, mean and SE)
    gates      the metrics and rows a gate can bound, gate files, the check
    report     the result object, validation.md, validation.png, the files written
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from quantkit import __version__
from quantkit.checkpoint.reader import Checkpoint
from quantkit.errors import ConfigError
from quantkit.model.numerics import NUMERICS, numerics_record
from quantkit.planner.budgets import long_len
from quantkit.runtime.device import resolve_device
from quantkit.runtime.progress import LayerProgress
from quantkit.validation.gates import GATES_FAILED_EXIT, METRICS, check_gates, identical_rows, load_gates
from quantkit.validation.kvrows import kv_variants
from quantkit.validation.measure import cross_phase_logits, measure
from quantkit.validation.report import ValidationResult, render_markdown, write_files
from quantkit.validation.targets import Settings, Target, config_sha256, settings, target, target_notes
from quantkit.validation.weights import WEIGHTS, expert_owners, weights_plan, weights_report

if TYPE_CHECKING:
    from quantkit.runtime.distributed import Group


# validate's names, and the ones scripts and tests have always imported from here (re-exported)
__all__ = ["validate", "ValidationResult", "METRICS", "load_gates", "check_gates", "cross_phase_logits", "render_markdown",
           "GATES_FAILED_EXIT", "measure", "target"]


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
    gate: str | Path | dict[str, float] | None = None,
    progress: bool = True,
    dtype: torch.dtype = torch.float32,
    write: bool = True,
    kv_cache_dtype: str = "bf16",
    max_host_memory: int | str | None = None,
    max_gpu_memory: int | str | None = None,
    weights: str = "auto",
    tasks: str | list[str] | None = None,
    task_dir: str | Path | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    long_context: int | None = None,
    numerics: str = "engine",
    tool_task: str | Path | None = None,
    gates: str | Path | dict[str, float] | None = None,
) -> ValidationResult:
    """Measure a converted pair (or one checkpoint) against its reference, layer by layer.

    Args:
        dir: a `quantkit convert` output (prefill/, decode/, convert-report.json) or a checkpoint folder.
        reference: the model to compare with (default: the source recorded in convert-report.json).
        eval_data: held-out data spec (default: the recorded recipe's `validate.dataset`).
        num_samples, seq_len: eval windows and tokens per window (default: the recipe's).
        gen_tokens: greedy tokens generated after each window (default: the recipe's).
        gate: a YAML/JSON gate file or a dict (`{"kl_max": 0.05}`); default: the recipe's gates
            (convert's `gate=`, the CLI's --gate; `gates=` is the same, its former name).
        write: write validation.json/.md/.png and the model cards (convert outputs only).
        kv_cache_dtype: `bf16` (the cache holds what attention computed), `fp8_e4m3` (the engines'
            static per-layer scale, run with the checkpoint's scales and with 1.0) or `fp8_ds_mla`
            (vLLM's DSA layout); FP8 adds the KV rows (quantkit.model.kvcache).
        max_host_memory, max_gpu_memory: budgets ("8GB", per rank); routed experts are streamed in
            chunks sized to them (quantkit.planner.budgets.validate_expert_chunk).
        weights: `auto` keeps as much of the checkpoints as fits the budget in memory, as stored,
            after its first read (this rank's share under torchrun), so greedy tokens re-read only
            the rest; `resident` insists on all of it; `stream` re-reads every layer for every pass
            (quantkit.validation.weights.weights_plan).
        tasks, task_dir, limit, num_fewshot: lm-eval tasks to run on every checkpoint (local task YAMLs
            in `task_dir`), items per task and shots: scores, paired deltas, flips (quantkit.validation.tasks).
        long_context: for a DSA model, the long windows' length (default 2 x index_topk, at most
            max_position_embeddings; 0: none): the long-context rows (quantkit.validation.longctx).
        numerics: `engine` computes every checkpoint as vLLM/SGLang do (FP8 block Linears W8A8 with
            activations quantized per token in 128-column groups, INT4 experts W4A16: the numbers a
            user of those engines gets; the default, and what convert's automatic validate and the cards
            use); `weights` on the dequantized weights alone, for a server that runs dequantized copies
            (quantkit.model.numerics). validation.json's `numerics` and every card say which.
        tool_task: a local tool task (JSON/JSONL chat prompts with OpenAI-style tool schemas; `default`:
            the shipped quantkit/validation/tooltask.json): each prompt rendered with its tools by the chat
            template, greedy on every checkpoint row, tool-call F1 (finish_reason tool_calls) and schema
            accuracy against the source (quantkit.validation.toolcalls).

    Under torchrun (`quantkit validate --nproc N`) each rank runs the attention half of every
    layer and the routed experts that convert's partition gives it, and receives the others'
    expert outputs; the numbers are the single process's, bit for bit on the same device type
    (docs/distributed.md). Rank 0 writes the files.
    Returns:
        ValidationResult; `passed` is False when any gate fails (nothing is raised for that).

    Example:
        >>> res = quantkit.validate("out/glm")
        >>> res.decode.kl, res.passed
    """
    from quantkit.planner.budgets import validate_exchange
    from quantkit.runtime import distributed

    t0 = time.time()
    if gate is not None and gates is not None:
        raise ConfigError("give gate= (or its former name gates=), not both")
    gates = gate if gate is not None else gates
    if weights not in WEIGHTS:
        raise ConfigError(f"--weights {weights}: one of {', '.join(WEIGHTS)}")
    if numerics not in NUMERICS:
        raise ConfigError(f"--numerics {numerics}: one of {', '.join(NUMERICS)}")
    from quantkit.validation.tasks import prepare, run_tasks

    spec = prepare(tasks, task_dir, limit, num_fewshot)  # before anything long: lm-eval there, the task names known
    from quantkit.validation.toolcalls import read_tool_task, run_tool_task

    tools = read_tool_task(tool_task)  # a bad tool task fails here, not after the KL rows
    inp = _inputs(dir, reference, eval_data, num_samples, seq_len, gen_tokens, gates)
    for ck in inp.ckpts.values():
        ck.numerics = numerics
    joined = distributed.joined()  # convert's ranks validate in the group they converted in
    group, dev = distributed.init(resolve_device(device))
    group = replace(group, after_failure="see the failing rank's log, then rerun the same command")
    if (spec is not None or tools is not None) and group.distributed:
        raise ConfigError("--tasks and --tool-task run in one process; drop --nproc for the task run")
    notes = target_notes(inp.t, inp.tokens)
    long_n = long_len(inp.ckpts["reference"].arch, long_context, inp.t.reference_path)  # a bad length fails here, not after

    arch = inp.ckpts["reference"].arch
    owners = expert_owners(arch, inp.t.report, group)
    plan = weights_plan(inp.ckpts, owners, group, dev, weights, max_host_memory, max_gpu_memory,
                        validate_exchange(arch, inp.tokens.ids.numel(), group.world), long_n)
    _refuse_what_cannot_fit(arch, inp.tokens.ids.shape, len(inp.ckpts), plan["budget_bytes"], dev.type)
    kv, kv_info = kv_variants(kv_cache_dtype, inp.ckpts, inp.t.pair, inp.s.gen_tokens)
    m = _measure(inp, dev, dtype, progress and group.leader, kv, kv_info, plan, group, owners)
    if spec is not None:
        m["tasks"] = run_tasks(spec, inp.ckpts, inp.t.reference_path, kv, dev, dtype, plan)
    if tools is not None:
        with torch.no_grad():
            m["tool_calls"] = run_tool_task(tools, inp.ckpts, inp.t.reference_path, kv, dev, dtype, plan["chunk"],
                                            progress=progress and group.leader)
    m["long_context"] = _long_context(inp, dev, dtype, plan, group, owners, long_n, kv.get(""))
    ranks = _gather_and_close(inp, plan, group, joined)

    gate_results = check_gates(inp.s.gates, m["rows"] | (m["long_context"] or {}).get("rows", {}),
                               identical_rows(inp.t.report))
    data = _record(inp, dev, dtype, ranks, group, m, kv_info, gate_results, notes, t0)
    result = ValidationResult(inp.t.out, data, {})
    if write and group.leader:
        result.files = write_files(inp.t, data)
    return result


@dataclass
class _Inputs:
    """What one validate run reads: the target, its checkpoints (the reference first), the settings
    and the eval tokens."""

    t: Target
    ckpts: dict[str, Checkpoint]
    s: Settings
    tokens: Any  # quantkit.inputs.tokens.load_tokens's result


def _inputs(dir, reference, eval_data, num_samples, seq_len, gen_tokens, gates) -> _Inputs:
    """Open the target and its reference, check they fit together, settle the settings, load the eval data."""
    from quantkit.inputs.modelspec import open_checkpoint
    from quantkit.inputs.tokens import load_tokens

    t = target(dir, reference)
    ckpts = {"reference": open_checkpoint(t.reference_source)} | {row: Checkpoint(p) for row, p in t.models.items()}
    _check_compatible(ckpts)
    s = settings(t, ckpts["reference"].arch, eval_data, num_samples, seq_len, gen_tokens, gates)
    tokens = load_tokens(s.dataset, tokenizer=t.reference_path, num_samples=s.num_samples, seq_len=s.seq_len)
    return _Inputs(t, ckpts, s, tokens)


def _refuse_what_cannot_fit(arch, shape, streams: int, budget: int, device: str) -> None:
    """Eval windows whose hidden states alone exceed the memory budget, refused before the first
    layer (100000 x 4096 tokens ended in the allocator's "can't allocate memory" traceback)."""
    from quantkit.planner.budgets import prompt_pass_bytes
    from quantkit.runtime.units import decimal_bytes

    held = prompt_pass_bytes(arch, shape[0] * shape[1], streams)
    if held > budget:
        flag = "--max-gpu-memory" if device == "cuda" else "--max-host-memory"
        raise ConfigError(f"validate: {shape[0]} x {shape[1]} eval tokens: the prompt pass holds their hidden states for "
                          f"{streams} checkpoints at once, at least {decimal_bytes(held)}, more than the "
                          f"{decimal_bytes(budget)} budget; lower --num-samples or --seq-len, or raise {flag}")


def _measure(inp: _Inputs, dev: torch.device, dtype, progress: bool, kv: dict, kv_info: dict, plan: dict, group: Group,
             owners) -> dict:
    """quantkit.validation.measure.measure under a progress bar of every checkpoint layer loaded."""
    L = inp.ckpts["reference"].arch.num_hidden_layers
    loads = len(inp.ckpts) * L * (1 + max(inp.s.gen_tokens - 1, 0))  # a pass loads each checkpoint's layers once
    # not in a terminal: one line per pass (each checkpoint's layers once), not per layer loaded
    with LayerProgress(progress, loads, "validate: layers", per_line=len(inp.ckpts) * L, unit="validate: pass") as bar, \
            torch.no_grad():
        return measure(inp.ckpts, inp.tokens.ids.to(dev), inp.s.gen_tokens, inp.t.pair, dev, dtype, bar, kv,
                       kv_info.get("calibrated", False), plan["chunk"], group, owners)


def _long_context(inp: _Inputs, dev: torch.device, dtype, plan: dict, group: Group, owners, n: int, kv) -> dict | None:
    """The long-context rows (quantkit.validation.longctx) on `n`-token windows past the DSA indexer's
    index_topk, with an FP8-KV decode row when `kv` is the FP8 cache; None when `n` is 0 (no indexer,
    or --long-context 0)."""
    from quantkit.inputs.tokens import load_tokens
    from quantkit.planner.budgets import LONG_SAMPLES
    from quantkit.validation.longctx import long_context

    if not n:
        return None
    tokens = load_tokens(inp.s.dataset, tokenizer=inp.t.reference_path, num_samples=min(inp.s.num_samples, LONG_SAMPLES),
                         seq_len=n)
    with torch.no_grad():
        out = long_context(inp.ckpts, tokens.ids.to(dev), dev, dtype, plan["chunk"], group, owners, kv)
    return out | {"sha256": tokens.sha256}


def _gather_and_close(inp: _Inputs, plan: dict, group: Group, joined: bool) -> list[dict]:
    """Every rank's weights plan with what it read and its peak memory; then the group (unless convert
    opened it) and the checkpoints are closed."""
    from quantkit.runtime import distributed
    from quantkit.runtime.machine import peak_rss

    plan["read_bytes"] = sum(ck.bytes_read for ck in inp.ckpts.values())
    plan["peak_rss_bytes"] = peak_rss()
    ranks = group.all_gather_object(plan, "after validating")
    if not joined:
        distributed.close(group)
    for ck in inp.ckpts.values():
        ck.close()
    return ranks


def _record(inp: _Inputs, dev: torch.device, dtype, ranks: list[dict], group: Group, m: dict, kv_info: dict,
            gate_results: list[dict], notes: list[str], t0: float) -> dict:
    """validation.json."""
    t, tokens = inp.t, inp.tokens
    return {
        "quantkit_version": __version__,
        "dir": str(t.out),
        "mode": "pair" if t.pair else "checkpoint",
        "reference": {"spec": t.reference, "path": str(t.reference_path.resolve()),
                      "config_sha256": config_sha256(t.reference_path)},
        "models": {row: str(p) for row, p in t.models.items()},
        "eval_data": {"spec": tokens.spec, "sha256": tokens.sha256, "num_samples": int(tokens.ids.shape[0]),
                      "seq_len": int(tokens.ids.shape[1]), "source": tokens.source},
        "gen_tokens": inp.s.gen_tokens,
        "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
        "dtype": str(dtype).removeprefix("torch."),
        "numerics": numerics_record(inp.ckpts["reference"].numerics),
        "order": "lockstep: layer i of every checkpoint before layer i+1; one layer's weights in memory at a time "
                 "beyond those kept as stored (`weights`)",
        "weights": weights_report(ranks, group),
        "num_layers": inp.ckpts["reference"].arch.num_hidden_layers,
        "reference_metrics": m["reference"],
        "rows": m["rows"],
        "mtp": m.get("mtp"),
        "continuations": m["continuations"],
        "kv_cache": kv_info,
        "tasks": m.get("tasks"),
        "tool_calls": m.get("tool_calls"),
        "long_context": m.get("long_context"),
        "gates_from": inp.s.gates_from,
        "gates": gate_results,
        "passed": all(g["passed"] is not False for g in gate_results),
        "notes": notes,
        "metrics": METRICS,
        "seconds": round(time.time() - t0, 3),
    }


def _check_compatible(ckpts: dict[str, Checkpoint]) -> None:
    ref = ckpts["reference"].arch
    for row, ck in ckpts.items():
        a = ck.arch
        for attr in ("num_hidden_layers", "hidden_size", "vocab_size", "n_routed_experts"):
            if getattr(a, attr) != getattr(ref, attr):
                raise ConfigError(f"{row} ({ck.folder}): {attr} {getattr(a, attr)} differs from the reference's "
                                  f"{getattr(ref, attr)}; is --reference the model this was converted from?")
        mine, theirs = a.definition.attention_shapes(a), ref.definition.attention_shapes(ref)
        if mine != theirs:  # the attention's sizes, whichever kind it is
            diff = sorted(p for p in mine.keys() | theirs.keys() if mine.get(p) != theirs.get(p))
            raise ConfigError(f"{row} ({ck.folder}): attention projection shapes differ from the reference's "
                              f"({', '.join(diff)}); is --reference the model this was converted from?")
